//! Why a claim cannot be allocated: the errors the scheduler reports, and for a claim that does not
//! fit, which request lacks usable devices and why (in use, tainted, counters, capacity).

use std::fmt;

use thiserror::Error;

use super::capacity;
use super::constraints::ConstraintState;
use super::counters::counter_shortage;
use super::request::Mode;
use super::search::{selectable, Plan, State};
use super::taints::untolerated_taint;
use super::{Candidate, SkippedPool, MAX_RESULTS};
use crate::cel::CelError;

/// Reasons listed in a "not enough devices" error before the rest are counted.
const MAX_NOTES: usize = 8;

#[derive(Debug, Error)]
pub enum AllocationError {
    #[error("the claim has no requests")]
    NoRequests,
    #[error("request {request}: {reason}")]
    InvalidRequest { request: String, reason: String },
    #[error("constraint #{index}: {reason}")]
    InvalidConstraint { index: usize, reason: String },
    #[error("request {request}: DeviceClass {class} does not exist")]
    UnknownDeviceClass { request: String, class: String },
    /// A selector that failed to compile or to evaluate on a device. As in the scheduler, this aborts
    /// allocation instead of counting as "no match"; the text follows the scheduler's
    /// (`class <name>: selector #<i> on device <driver/pool/device>: CEL runtime error: …`).
    #[error("{origin}: selector #{index}{}: CEL {error}", on_device(.device.as_deref()))]
    Selector {
        origin: SelectorOrigin,
        index: usize,
        expression: String,
        /// None for a compile error.
        device: Option<Box<Candidate>>,
        error: CelError,
    },
    #[error("request {request}: not enough devices: {matched} match the selectors, {free} of them usable, {wanted} wanted{notes}")]
    NotEnoughDevices {
        request: String,
        matched: usize,
        free: usize,
        wanted: usize,
        /// Why matching devices are not usable, and pools left out; empty or starting with ": ".
        notes: String,
    },
    /// An `All` alternative while a pool of the node is incomplete or invalid: which devices "all" are
    /// is not known, so the scheduler refuses (an error, not "does not fit").
    #[error(
        "request {request}: asks for all devices, but resource pool {driver}/{pool} is currently {}",
        pool_state(*.invalid, .reason)
    )]
    PoolNotReady {
        request: String,
        driver: String,
        pool: String,
        reason: String,
        invalid: bool,
    },
    /// Nothing fits, and the node has invalid pools: the scheduler's error for the node (1.35+), with
    /// each pool and what is wrong with it.
    #[error("invalid resource pools were encountered: {}", describe_pools(.pools))]
    InvalidPools { pools: Vec<SkippedPool> },
    /// A device an `All` alternative must take breaks a constraint: an error, as in the scheduler.
    #[error("request {request}: cannot add device {device} because constraint #{constraint} would not be satisfied")]
    AllModeConstraint {
        request: String,
        device: Box<Candidate>,
        constraint: usize,
    },
    #[error("the claim asks for at least {wanted} devices, more than the {MAX_RESULTS} an allocation holds")]
    TooManyDevices { wanted: usize },
    #[error("no combination of devices satisfies all requests together: {reason}")]
    Unsatisfiable { reason: String },
    #[error("allocation search stopped after {limit} steps without a result")]
    StepLimit { limit: u64 },
}

/// Where a selector comes from: the DeviceClass or the request (`req` or `req/sub`) of the claim.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(tag = "kind", content = "name", rename_all = "camelCase")]
pub enum SelectorOrigin {
    Class(String),
    Request(String),
}

impl fmt::Display for SelectorOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SelectorOrigin::Class(name) => write!(f, "class {name}"),
            SelectorOrigin::Request(name) => write!(f, "request {name}"),
        }
    }
}

fn pool_state(invalid: bool, reason: &str) -> String {
    if invalid {
        format!("invalid: {reason}")
    } else {
        format!("being updated ({reason})")
    }
}

fn describe_pools(pools: &[SkippedPool]) -> String {
    let pools: Vec<String> = pools
        .iter()
        .map(|p| format!("pool {}/{}: {}", p.driver, p.pool, p.reason))
        .collect();
    pools.join("; ")
}

fn on_device(device: Option<&Candidate>) -> String {
    device
        .map(|d| format!(" on device {d}"))
        .unwrap_or_default()
}

/// Why the search found nothing: the first request that lacks usable devices on its own, or else the
/// combination (constraints, devices or counters wanted by several requests).
pub(super) fn explain_failure(plan: &Plan<'_>, state: &mut State) -> AllocationError {
    for (r, request) in plan.requests.iter().enumerate() {
        let mut shortfalls = Vec::new();
        for (a, alternative) in request.alternatives.iter().enumerate() {
            let shortfall = shortfall(plan, state, r, a);
            if shortfall.free >= shortfall.wanted && shortfall.wanted > 0 {
                shortfalls.clear();
                break;
            }
            shortfalls.push((alternative.label.clone(), shortfall));
        }
        let Some((label, last)) = shortfalls.pop() else {
            continue;
        };
        let mut notes = last.notes;
        for (earlier, shortfall) in shortfalls.iter().rev() {
            notes.insert(
                0,
                format!(
                    "alternative {earlier} also short ({} usable of {} wanted)",
                    shortfall.free, shortfall.wanted
                ),
            );
        }
        notes.extend(
            plan.pools
                .skipped
                .iter()
                .map(|p| format!("pool {}/{} skipped: {}", p.driver, p.pool, p.reason)),
        );
        return AllocationError::NotEnoughDevices {
            request: label,
            matched: last.matched,
            free: last.free,
            wanted: last.wanted,
            notes: format_notes(notes),
        };
    }
    let reason = if state.constraints.is_empty() {
        "the requests need the same devices or more shared counters than are left".to_string()
    } else {
        let constraints: Vec<String> = state
            .constraints
            .iter()
            .map(ConstraintState::describe)
            .collect();
        format!(
            "no choice of usable devices meets {}",
            constraints.join("; ")
        )
    };
    AllocationError::Unsatisfiable { reason }
}

struct Shortfall {
    matched: usize,
    free: usize,
    wanted: usize,
    notes: Vec<String>,
}

/// How alternative `a` of request `r` fares alone, against the devices in use before the claim.
fn shortfall(plan: &Plan<'_>, state: &mut State, r: usize, a: usize) -> Shortfall {
    let alternative = &plan.requests[r].alternatives[a];
    let mut result = Shortfall {
        matched: 0,
        free: 0,
        wanted: 0,
        notes: Vec::new(),
    };
    for (entry, device) in plan.pools.entries.iter().enumerate() {
        match selectable(plan, state, r, a, entry) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(error) => {
                result.notes.push(error.to_string());
                continue;
            }
        }
        result.matched += 1;
        let name = &device.candidate.device;
        let blocked = if !alternative.admin && state.in_use[entry] {
            Some(format!("{name} is in use"))
        } else if let Some(taint) = untolerated_taint(&device.device, &alternative.tolerations) {
            Some(format!(
                "{name} has taint {}={}:{} that the request does not tolerate",
                taint.key,
                taint.value.as_deref().unwrap_or_default(),
                taint.effect
            ))
        } else if let Err(reason) = capacity::demand(plan, state, r, a, entry) {
            Some(format!("{name} {reason}"))
        } else if alternative.admin || (device.multiple() && state.shares.held(entry)) {
            None
        } else {
            counter_shortage(plan.pools, &state.consumed, &device.consumes)
                .map(|shortage| format!("{name} needs {shortage}"))
        };
        match blocked {
            Some(note) => result.notes.push(note),
            None => result.free += 1,
        }
    }
    result.wanted = match alternative.mode {
        Mode::Count(count) => count,
        Mode::All => result.matched.max(1),
    };
    result
}

fn format_notes(notes: Vec<String>) -> String {
    if notes.is_empty() {
        return String::new();
    }
    let more = notes.len().saturating_sub(MAX_NOTES);
    let mut shown: Vec<String> = notes.into_iter().take(MAX_NOTES).collect();
    if more > 0 {
        shown.push(format!("and {more} more"));
    }
    format!(": {}", shown.join("; "))
}
