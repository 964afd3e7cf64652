//! The search: a depth-first walk over the claim's requests, their alternatives and the devices of
//! each, first fit with backtracking as the scheduler's allocator does. Devices of one request are
//! picked in candidate order, so each set of devices is tried once, not in every order; once a branch
//! has failed, `prune` cuts branches that cannot succeed (see there).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaimSpec};

use super::capacity::{self, Amount, Shares};
use super::constraints::{ConstraintKind, ConstraintState};
use super::counters::{counters_fit, Consumption};
use super::errors::explain_failure;
use super::prune::hopeless;
use super::request::{prepare_request, Mode, PreparedRequest};
use super::taints::untolerated_taint;
use super::{first_mismatch, AllocationError, InUse, Pools, SelectorOrigin, MAX_RESULTS};
use crate::cel::CelError;
use crate::quantity::Quantity;

/// What the search works from; fixed for one `allocate` call.
pub(super) struct Plan<'a> {
    pub(super) pools: &'a Pools,
    pub(super) requests: Vec<PreparedRequest>,
    pub(super) step_limit: u64,
    /// For each request, the first request from there on with an `All` alternative (or the number of
    /// requests): how far `prune` may look ahead.
    pub(super) next_all: Vec<usize>,
}

/// What the search changes as it picks and drops devices.
pub(super) struct State {
    /// Held whole by another claim.
    pub(super) in_use: Vec<bool>,
    /// Taken whole by this claim.
    pub(super) in_claim: Vec<bool>,
    pub(super) consumed: Vec<Quantity>,
    /// Shares of devices that allow multiple allocations (other claims' and this claim's).
    pub(super) shares: Shares,
    pub(super) picked: Vec<Pick>,
    /// Selector results by request, alternative and device entry.
    pub(super) matches: Vec<Vec<Vec<Match>>>,
    pub(super) steps: u64,
    /// Some branch has failed: from then on `prune` looks for branches that cannot succeed (a claim
    /// that fits at the first try costs no more selector evaluations than upstream's search).
    pub(super) failed: bool,
    pub(super) constraints: Vec<ConstraintState>,
}

/// What the selectors of an alternative say about a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Match {
    Unknown,
    Yes,
    No,
    /// A CEL error; the search reports it when it reaches the device.
    Error,
}

pub(super) struct Pick {
    entry: usize,
    request: usize,
    alternative: usize,
    /// For a share of a device that allows multiple allocations: what it consumes.
    consumed: Option<BTreeMap<String, Amount>>,
    /// Whether this pick took the device's counters (a shared device's first share does).
    took_counters: bool,
}

/// [`super::allocate_with_step_limit`], and the steps the search took (for tests of its pruning).
pub(super) fn run(
    pools: &Pools,
    classes: &BTreeMap<String, Vec<String>>,
    in_use: &InUse,
    claim: &ResourceClaimSpec,
    step_limit: u64,
) -> (
    Result<Vec<DeviceRequestAllocationResult>, AllocationError>,
    u64,
) {
    let mut steps = 0;
    let result = search(pools, classes, in_use, claim, step_limit, &mut steps);
    (result, steps)
}

fn search(
    pools: &Pools,
    classes: &BTreeMap<String, Vec<String>>,
    in_use: &InUse,
    claim: &ResourceClaimSpec,
    step_limit: u64,
    steps: &mut u64,
) -> Result<Vec<DeviceRequestAllocationResult>, AllocationError> {
    let devices = claim.devices.as_ref();
    let requests = devices
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default();
    if requests.is_empty() {
        return Err(AllocationError::NoRequests);
    }
    let mut state = State {
        in_use: pools
            .entries
            .iter()
            .map(|e| in_use.devices.contains(&e.candidate))
            .collect(),
        in_claim: vec![false; pools.entries.len()],
        consumed: pools.base_consumption(in_use),
        shares: Shares::new(pools.entries.iter().map(|e| &e.candidate), in_use),
        picked: Vec::new(),
        matches: Vec::new(),
        steps: 0,
        failed: false,
        constraints: Vec::new(),
    };
    let mut plan = Plan {
        pools,
        requests: Vec::new(),
        step_limit,
        next_all: Vec::new(),
    };
    let mut minimum: usize = 0;
    for request in requests {
        let prepared = prepare_request(request, classes)?;
        state.matches.push(vec![
            vec![Match::Unknown; pools.entries.len()];
            prepared.alternatives.len()
        ]);
        plan.requests.push(prepared);
        let r = plan.requests.len() - 1;
        for a in 0..plan.requests[r].alternatives.len() {
            if plan.requests[r].alternatives[a].mode == Mode::All {
                let all = all_devices(&plan, &mut state, r, a)?;
                plan.requests[r].alternatives[a].all = all;
            }
        }
        minimum = minimum.saturating_add(plan.requests[r].minimum());
    }
    plan.next_all = vec![plan.requests.len(); plan.requests.len() + 1];
    for r in (0..plan.requests.len()).rev() {
        let all = plan.requests[r]
            .alternatives
            .iter()
            .any(|a| a.mode == Mode::All);
        plan.next_all[r] = if all { r } else { plan.next_all[r + 1] };
    }
    if minimum > MAX_RESULTS {
        return Err(AllocationError::TooManyDevices { wanted: minimum });
    }
    for (index, constraint) in devices
        .and_then(|d| d.constraints.as_ref())
        .into_iter()
        .flatten()
        .enumerate()
    {
        let kind = match (&constraint.match_attribute, &constraint.distinct_attribute) {
            (Some(name), None) => ConstraintKind::Match(name.clone()),
            (None, Some(name)) => ConstraintKind::Distinct(name.clone()),
            _ => {
                return Err(AllocationError::InvalidConstraint {
                    index,
                    reason: "needs exactly one of matchAttribute and distinctAttribute".into(),
                })
            }
        };
        state.constraints.push(ConstraintState {
            kind,
            requests: constraint.requests.clone().unwrap_or_default(),
            values: Vec::new(),
        });
    }

    let solved = solve(&plan, &mut state, 0);
    *steps = state.steps;
    if solved? {
        return Ok(state
            .picked
            .iter()
            .map(|pick| {
                let alternative = &plan.requests[pick.request].alternatives[pick.alternative];
                let shared = pick.consumed.as_ref();
                DeviceRequestAllocationResult {
                    share_id: shared.map(|_| capacity::new_share_id()),
                    consumed_capacity: shared
                        .filter(|c| !c.is_empty())
                        .map(|c| c.iter().map(|(k, v)| (k.clone(), v.to_api())).collect()),
                    request: alternative.label.clone(),
                    driver: pools.entries[pick.entry].candidate.driver.clone(),
                    pool: pools.entries[pick.entry].candidate.pool.clone(),
                    device: pools.entries[pick.entry].candidate.device.clone(),
                    admin_access: alternative.admin.then_some(true),
                    tolerations: (!alternative.tolerations.is_empty())
                        .then(|| alternative.tolerations.clone()),
                    ..Default::default()
                }
            })
            .collect());
    }
    // As in the scheduler (1.35+), an invalid pool is skipped while other devices may do, and is the
    // error when none do: allocating around it might be wrong.
    let invalid: Vec<_> = pools
        .skipped
        .iter()
        .filter(|p| p.invalid)
        .cloned()
        .collect();
    if !invalid.is_empty() {
        return Err(AllocationError::InvalidPools { pools: invalid });
    }
    Err(explain_failure(&plan, &mut state))
}

/// The devices an `All` alternative must get: every device its selectors match, in every pool; an
/// incomplete or invalid pool makes "all" unknowable, so that is an error as in the scheduler.
fn all_devices(
    plan: &Plan<'_>,
    state: &mut State,
    r: usize,
    a: usize,
) -> Result<Vec<usize>, AllocationError> {
    let alternative = &plan.requests[r].alternatives[a];
    if let Some(pool) = plan.pools.skipped.first() {
        return Err(AllocationError::PoolNotReady {
            request: alternative.label.clone(),
            driver: pool.driver.clone(),
            pool: pool.pool.clone(),
            reason: pool.reason.clone(),
            invalid: pool.invalid,
        });
    }
    let mut all = Vec::new();
    for entry in 0..plan.pools.entries.len() {
        // As upstream, a device whose capacity cannot serve the request is not part of "all".
        if selectable(plan, state, r, a, entry)?
            && capacity::demand(plan, state, r, a, entry).is_ok()
        {
            all.push(entry);
        }
    }
    Ok(all)
}

/// Whether the class's and then the request's selectors all match (first false wins), cached; a CEL
/// error is an error, as in the scheduler.
pub(super) fn selectable(
    plan: &Plan<'_>,
    state: &mut State,
    r: usize,
    a: usize,
    entry: usize,
) -> Result<bool, AllocationError> {
    match match_state(plan, state, r, a, entry) {
        Match::Yes => Ok(true),
        Match::No => Ok(false),
        Match::Unknown | Match::Error => evaluate(plan, r, a, entry),
    }
}

/// What the selectors say, cached, without failing on a CEL error (for `prune`).
pub(super) fn match_state(
    plan: &Plan<'_>,
    state: &mut State,
    r: usize,
    a: usize,
    entry: usize,
) -> Match {
    let known = state.matches[r][a][entry];
    if known != Match::Unknown {
        return known;
    }
    let result = match evaluate(plan, r, a, entry) {
        Ok(true) => Match::Yes,
        Ok(false) => Match::No,
        Err(_) => Match::Error,
    };
    state.matches[r][a][entry] = result;
    result
}

fn evaluate(plan: &Plan<'_>, r: usize, a: usize, entry: usize) -> Result<bool, AllocationError> {
    let alternative = &plan.requests[r].alternatives[a];
    let device = &plan.pools.entries[entry];
    let groups = [
        (
            SelectorOrigin::Class(alternative.class.clone()),
            &alternative.class_selectors,
        ),
        (
            SelectorOrigin::Request(alternative.label.clone()),
            &alternative.selectors,
        ),
    ];
    for (origin, selectors) in groups {
        match first_mismatch(selectors, &device.view) {
            Ok(None) => {}
            // The request's selectors are not evaluated when the class says no.
            Ok(Some(_)) => return Ok(false),
            Err((index, error)) => {
                let device = matches!(error, CelError::Runtime(_))
                    .then(|| Box::new(device.candidate.clone()));
                return Err(AllocationError::Selector {
                    origin,
                    index,
                    expression: selectors[index].expression.clone(),
                    device,
                    error,
                });
            }
        }
    }
    Ok(true)
}

/// Allocates requests `r..`; the first alternative of a request that leads to a full solution wins.
fn solve(plan: &Plan<'_>, state: &mut State, r: usize) -> Result<bool, AllocationError> {
    if r == plan.requests.len() {
        return Ok(true);
    }
    for a in 0..plan.requests[r].alternatives.len() {
        if fill(plan, state, r, a, 0, 0)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Picks device `k` of alternative `a` of request `r`, trying devices from `start` on (devices of one
/// request are picked in candidate order, so each set is tried once), then the rest of the claim.
fn fill(
    plan: &Plan<'_>,
    state: &mut State,
    r: usize,
    a: usize,
    k: usize,
    start: usize,
) -> Result<bool, AllocationError> {
    state.steps += 1;
    if state.steps > plan.step_limit {
        return Err(AllocationError::StepLimit {
            limit: plan.step_limit,
        });
    }
    let alternative = &plan.requests[r].alternatives[a];
    if alternative.mode == Mode::All && alternative.all.is_empty() {
        return Ok(false); // "All" needs at least one device.
    }
    let wanted = alternative.wanted();
    if k == wanted {
        return solve(plan, state, r + 1);
    }
    if state.picked.len().saturating_add(wanted - k) > MAX_RESULTS {
        // As upstream: too many for one allocation, so the next subrequest is tried.
        state.failed = true;
        return Ok(false);
    }
    if alternative.mode == Mode::All {
        let entry = alternative.all[k];
        if !take(plan, state, r, a, entry, true)? {
            return Ok(false);
        }
        if fill(plan, state, r, a, k + 1, 0)? {
            return Ok(true);
        }
        drop_last(plan, state);
        return Ok(false);
    }
    if state.failed && hopeless(plan, state, r, a, k, start) {
        return Ok(false);
    }
    for entry in start..plan.pools.entries.len() {
        // Cheap checks first; selectors are only evaluated on devices that could be taken, as upstream.
        if state.in_claim[entry] || (!alternative.admin && state.in_use[entry]) {
            continue;
        }
        if !selectable(plan, state, r, a, entry)? {
            continue;
        }
        if !take(plan, state, r, a, entry, false)? {
            continue;
        }
        if fill(plan, state, r, a, k + 1, entry + 1)? {
            return Ok(true);
        }
        drop_last(plan, state);
        state.failed = true;
        // The devices after this one may not be enough for this slot and the rest.
        if hopeless(plan, state, r, a, k, entry + 1) {
            return Ok(false);
        }
    }
    state.failed = true;
    Ok(false)
}

/// Takes `entry` for the alternative if it is free, its counters fit, its taints are tolerated and the
/// constraints allow it. `must` (allocation mode All) turns a constraint violation into an error.
fn take(
    plan: &Plan<'_>,
    state: &mut State,
    r: usize,
    a: usize,
    entry: usize,
    must: bool,
) -> Result<bool, AllocationError> {
    let alternative = &plan.requests[r].alternatives[a];
    let device = &plan.pools.entries[entry];
    // Only exclusive picks mark a device taken in this claim; a shared one serves other requests too.
    if state.in_claim[entry] || (!alternative.admin && state.in_use[entry]) {
        return Ok(false);
    }
    // Admin access neither needs nor consumes counters (kubernetes/kubernetes#140729 tracks the
    // scheduler still checking them). A shared device's counters are taken by its first share only.
    let shared = device.multiple();
    let consumes: &[Consumption] = if alternative.admin || (shared && state.shares.held(entry)) {
        &[]
    } else {
        &device.consumes
    };
    if !counters_fit(&plan.pools.counters, &state.consumed, consumes) {
        return Ok(false);
    }
    let Ok(demand) = capacity::demand(plan, state, r, a, entry) else {
        return Ok(false);
    };
    if untolerated_taint(&device.device, &alternative.tolerations).is_some() {
        return Ok(false);
    }
    for i in 0..state.constraints.len() {
        if !state.constraints[i].add(alternative, device) {
            for earlier in state.constraints[..i].iter_mut().rev() {
                earlier.remove(alternative);
            }
            if must {
                return Err(AllocationError::AllModeConstraint {
                    request: alternative.label.clone(),
                    device: Box::new(device.candidate.clone()),
                    constraint: i,
                });
            }
            return Ok(false);
        }
    }
    for c in consumes {
        state.consumed[c.counter] = state.consumed[c.counter].add(&c.amount);
    }
    let consumed = if shared {
        state.shares.add(entry, &demand, !alternative.admin);
        Some(demand)
    } else {
        state.in_claim[entry] = true;
        None
    };
    state.picked.push(Pick {
        entry,
        request: r,
        alternative: a,
        consumed,
        took_counters: !consumes.is_empty(),
    });
    Ok(true)
}

/// Undoes the last `take`.
fn drop_last(plan: &Plan<'_>, state: &mut State) {
    let Some(pick) = state.picked.pop() else {
        return;
    };
    let alternative = &plan.requests[pick.request].alternatives[pick.alternative];
    for constraint in state.constraints.iter_mut().rev() {
        constraint.remove(alternative);
    }
    match &pick.consumed {
        Some(consumed) => state
            .shares
            .remove(pick.entry, consumed, !alternative.admin),
        None => state.in_claim[pick.entry] = false,
    }
    if pick.took_counters {
        for c in &plan.pools.entries[pick.entry].consumes {
            state.consumed[c.counter] = state.consumed[c.counter].sub(&c.amount);
        }
    }
}

#[cfg(test)]
#[path = "search_tests.rs"]
mod tests;
