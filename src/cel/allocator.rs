//! The scheduler's DRA allocation step as a pure function: which devices of complete, current pools a
//! ResourceClaim gets, with selectors, shared counters, consumable capacity (`capacity`), taints,
//! constraints and first-fit backtracking as in the Kubernetes allocator, so tests can check that what
//! gpu-dra publishes is allocatable.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use k8s_openapi::api::resource::v1::{
    CapacityRequirements, Device, DeviceClass, DeviceRequest, DeviceRequestAllocationResult,
    DeviceSelector, DeviceTaint, DeviceToleration, ResourceClaimSpec, ResourceSlice,
};
use thiserror::Error;

use super::quantity::Quantity;
use super::{CelError, DeviceView, Selector};

mod capacity;
mod constraints;
mod node;
pub use capacity::{in_use, InUse};
pub use node::Node;

use capacity::{Amount, Capacities, Requests, Shares};
use constraints::{ConstraintKind, ConstraintState};

/// Search steps (devices tried) before `allocate` gives up, so a pathological claim cannot hang a test.
pub const DEFAULT_STEP_LIMIT: u64 = 1_000_000;
/// Devices one allocation may hold (`AllocationResultsMaxSize`).
pub const MAX_RESULTS: usize = 32;
/// Reasons listed in a "not enough devices" error before the rest are counted.
const MAX_NOTES: usize = 8;

/// A device of a published, complete pool.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct Candidate {
    pub driver: String,
    pub pool: String,
    pub device: String,
}

impl Candidate {
    /// The device an allocation result names.
    pub fn of_result(result: &DeviceRequestAllocationResult) -> Candidate {
        Candidate {
            driver: result.driver.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
        }
    }
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.driver, self.pool, self.device)
    }
}

/// Class name → selector expressions, the form `allocate` takes. A selector without `cel` becomes an
/// empty expression, which `allocate` refuses as unsupported.
pub fn class_selectors(classes: &[DeviceClass]) -> BTreeMap<String, Vec<String>> {
    classes
        .iter()
        .filter_map(|class| {
            let name = class.metadata.name.clone()?;
            let expressions = class
                .spec
                .iter()
                .flat_map(|spec| spec.selectors.iter().flatten())
                .map(|s| {
                    s.cel
                        .as_ref()
                        .map(|c| c.expression.clone())
                        .unwrap_or_default()
                })
                .collect();
            Some((name, expressions))
        })
        .collect()
}

/// A pool left out of the candidates, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedPool {
    pub driver: String,
    pub pool: String,
    pub reason: String,
}

/// Candidate devices and shared counters of the pools that are complete at their newest generation.
#[derive(Debug, Clone, Default)]
pub struct Pools {
    entries: Vec<Entry>,
    /// Capacity of every counter, indexed by `Consumption::counter`.
    counters: Vec<CounterInfo>,
    /// What each device of a usable pool consumes, including devices of other nodes, by device.
    consumers: HashMap<Candidate, Vec<Consumption>>,
    skipped: Vec<SkippedPool>,
}

#[derive(Debug, Clone)]
struct Entry {
    candidate: Candidate,
    device: Device,
    /// The device as selectors see it, converted once.
    view: DeviceView,
    /// Counters the device takes, or why it cannot take them.
    consumes: Result<Vec<Consumption>, String>,
    /// Its capacities and request policies, or why they cannot be read.
    capacities: Result<Capacities, String>,
}

impl Entry {
    /// `allowMultipleAllocations`: several claims (and requests) may get the device.
    fn multiple(&self) -> bool {
        self.capacities.as_ref().is_ok_and(|c| c.multiple)
    }
}

#[derive(Debug, Clone)]
struct CounterInfo {
    driver: String,
    pool: String,
    set: String,
    name: String,
    capacity: Quantity,
}

#[derive(Debug, Clone)]
struct Consumption {
    counter: usize,
    amount: Quantity,
}

impl Pools {
    /// Keeps, per (driver, pool), only the slices at the newest generation, and only pools whose count
    /// of such slices equals `resourceSliceCount`. With `node`, only devices the node can use are
    /// candidates: slices whose `nodeName`, `allNodes` or `nodeSelector` selects it, and with
    /// `perDeviceNodeSelection` the devices that select it themselves; counters are shared across the
    /// whole pool. Without `node`, every device is. Pools come in (driver, pool) order, slices by name.
    pub fn from_slices(slices: &[ResourceSlice], node: Option<&Node>) -> Pools {
        let mut by_pool: BTreeMap<(String, String), Vec<&ResourceSlice>> = BTreeMap::new();
        for slice in slices {
            let key = (slice.spec.driver.clone(), slice.spec.pool.name.clone());
            by_pool.entry(key).or_default().push(slice);
        }
        let mut pools = Pools::default();
        for ((driver, pool), all) in by_pool {
            let skip = |reason: String| SkippedPool {
                driver: driver.clone(),
                pool: pool.clone(),
                reason,
            };
            let mut targeted = false;
            let mut invalid = None;
            for slice in &all {
                match targets_node(slice, node) {
                    Ok(yes) => targeted |= yes,
                    Err(reason) => invalid = Some(reason),
                }
            }
            if let Some(reason) = invalid {
                pools.skipped.push(skip(reason));
                continue;
            }
            if !targeted {
                continue; // Another node's pool.
            }
            let generation = all
                .iter()
                .map(|s| s.spec.pool.generation)
                .max()
                .unwrap_or_default();
            let mut current: Vec<&ResourceSlice> = all
                .into_iter()
                .filter(|s| s.spec.pool.generation == generation)
                .collect();
            current.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
            let wanted = current
                .first()
                .map(|s| s.spec.pool.resource_slice_count)
                .unwrap_or_default();
            if i64::try_from(current.len()).ok() != Some(wanted) {
                pools.skipped.push(skip(format!(
                    "incomplete: {} of {wanted} slices at generation {generation}",
                    current.len()
                )));
                continue;
            }
            if let Err(reason) = pools.add_pool(&driver, &pool, &current, node) {
                pools.skipped.push(skip(reason));
            }
        }
        pools
    }

    fn add_pool(
        &mut self,
        driver: &str,
        pool: &str,
        slices: &[&ResourceSlice],
        node: Option<&Node>,
    ) -> Result<(), String> {
        // Counter sets may sit beside devices (1.34) or in a slice of their own (1.35+).
        let mut counters: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        let mut sets = BTreeSet::new();
        let mut new_counters = Vec::new();
        for set in slices
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
        {
            if !sets.insert(set.name.as_str()) {
                return Err(format!("invalid: duplicate counter set name {}", set.name));
            }
            for (name, counter) in &set.counters {
                let capacity = Quantity::parse(&counter.value.0).map_err(|e| {
                    format!("invalid: counter set {} counter {name}: {e}", set.name)
                })?;
                counters.insert((&set.name, name), self.counters.len() + new_counters.len());
                new_counters.push(CounterInfo {
                    driver: driver.to_string(),
                    pool: pool.to_string(),
                    set: set.name.clone(),
                    name: name.clone(),
                    capacity,
                });
            }
        }

        let mut names = BTreeSet::new();
        let mut entries = Vec::new();
        let mut consumers = HashMap::new();
        for slice in slices {
            for device in slice.spec.devices.iter().flatten() {
                if !names.insert(device.name.as_str()) {
                    return Err(format!("invalid: duplicate device name {}", device.name));
                }
                let candidate = Candidate {
                    driver: driver.to_string(),
                    pool: pool.to_string(),
                    device: device.name.clone(),
                };
                let consumes = consumption(device, pool, &sets, &counters);
                if let Ok(consumes) = &consumes {
                    consumers.insert(candidate.clone(), consumes.clone());
                }
                if device_targets_node(slice, device, node)? {
                    entries.push(Entry {
                        view: DeviceView::new(&candidate.driver, device),
                        candidate,
                        device: device.clone(),
                        consumes,
                        capacities: Capacities::of(device),
                    });
                }
            }
        }
        self.counters.extend(new_counters);
        self.entries.extend(entries);
        self.consumers.extend(consumers);
        Ok(())
    }

    /// Candidate devices in the order the scheduler tries them.
    pub fn devices(&self) -> impl Iterator<Item = (&Candidate, &Device)> {
        self.entries.iter().map(|e| (&e.candidate, &e.device))
    }

    /// Pools of the node that are not used, with the reason (incomplete, invalid).
    pub fn skipped(&self) -> &[SkippedPool] {
        &self.skipped
    }

    /// Counters left in each counter set after what `in_use` devices consume: (driver, pool, set,
    /// counter) → remaining. Negative when the in-use devices overcommit a counter.
    pub fn remaining_counters(
        &self,
        in_use: &InUse,
    ) -> BTreeMap<(String, String, String, String), Quantity> {
        let consumed = self.base_consumption(in_use);
        self.counters
            .iter()
            .zip(consumed)
            .map(|(info, consumed)| {
                let key = (
                    info.driver.clone(),
                    info.pool.clone(),
                    info.set.clone(),
                    info.name.clone(),
                );
                (key, info.capacity.sub(&consumed))
            })
            .collect()
    }

    /// What devices held by other claims consume; a device held in shares takes its counters once.
    fn base_consumption(&self, in_use: &InUse) -> Vec<Quantity> {
        let mut consumed = vec![Quantity::zero(); self.counters.len()];
        let held: BTreeSet<&Candidate> =
            in_use.devices.iter().chain(in_use.shares.keys()).collect();
        for candidate in held {
            for c in self.consumers.get(candidate).into_iter().flatten() {
                consumed[c.counter] = consumed[c.counter].add(&c.amount);
            }
        }
        consumed
    }
}

/// Whether the slice has devices for `node` (every slice has without a node filter). A slice of
/// counters only does not make a pool the node's. Errors name the slice and its invalid selector.
fn targets_node(slice: &ResourceSlice, node: Option<&Node>) -> Result<bool, String> {
    if node.is_none() {
        return Ok(true);
    }
    let mut any = false;
    for device in slice.spec.devices.iter().flatten() {
        any |= device_targets_node(slice, device, node)?;
    }
    Ok(any)
}

/// `NodeMatches` on the slice's node selection, or on the device's with `perDeviceNodeSelection`.
fn device_targets_node(
    slice: &ResourceSlice,
    device: &Device,
    node: Option<&Node>,
) -> Result<bool, String> {
    let Some(node) = node else { return Ok(true) };
    let spec = &slice.spec;
    let slice_name = slice.metadata.name.as_deref().unwrap_or("(unnamed)");
    let result = if spec.per_device_node_selection == Some(true) {
        node.matches(
            device.node_name.as_deref(),
            device.all_nodes,
            device.node_selector.as_ref(),
        )
        .map_err(|e| {
            format!(
                "invalid: ResourceSlice {slice_name} device {}: node selector: {e}",
                device.name
            )
        })
    } else {
        node.matches(
            spec.node_name.as_deref(),
            spec.all_nodes,
            spec.node_selector.as_ref(),
        )
        .map_err(|e| format!("invalid: ResourceSlice {slice_name}: node selector: {e}"))
    };
    result
}

fn consumption(
    device: &Device,
    pool: &str,
    sets: &BTreeSet<&str>,
    counters: &BTreeMap<(&str, &str), usize>,
) -> Result<Vec<Consumption>, String> {
    let mut result = Vec::new();
    for consumes in device.consumes_counters.iter().flatten() {
        let set = consumes.counter_set.as_str();
        if !sets.contains(set) {
            return Err(format!(
                "consumes counter set {set}, which pool {pool} does not publish"
            ));
        }
        for (name, counter) in &consumes.counters {
            let index = *counters.get(&(set, name.as_str())).ok_or_else(|| {
                format!("consumes counter {name}, which counter set {set} does not have")
            })?;
            let amount = Quantity::parse(&counter.value.0)
                .map_err(|e| format!("consumes counter {set}/{name}: {e}"))?;
            result.push(Consumption {
                counter: index,
                amount,
            });
        }
    }
    Ok(result)
}

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
    #[error(
        "request {request} asks for all devices, but pool {driver}/{pool} cannot be used: {reason}"
    )]
    PoolNotReady {
        request: String,
        driver: String,
        pool: String,
        reason: String,
    },
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

fn on_device(device: Option<&Candidate>) -> String {
    device
        .map(|d| format!(" on device {d}"))
        .unwrap_or_default()
}

/// Allocates `claim` from `pools` like the scheduler, with the default step limit.
///
/// `classes` maps DeviceClass names to their selector expressions; `in_use` holds what other claims
/// were allocated (see [`in_use`]). Results come in request order, then pick order; a share of a device
/// that allows multiple allocations carries a new `shareID` and its `consumedCapacity`.
pub fn allocate(
    pools: &Pools,
    classes: &BTreeMap<String, Vec<String>>,
    in_use: &InUse,
    claim: &ResourceClaimSpec,
) -> Result<Vec<DeviceRequestAllocationResult>, AllocationError> {
    allocate_with_step_limit(pools, classes, in_use, claim, DEFAULT_STEP_LIMIT)
}

/// [`allocate`] with an explicit bound on search steps (devices tried).
pub fn allocate_with_step_limit(
    pools: &Pools,
    classes: &BTreeMap<String, Vec<String>>,
    in_use: &InUse,
    claim: &ResourceClaimSpec,
    step_limit: u64,
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
        matches: HashMap::new(),
        steps: 0,
        constraints: Vec::new(),
    };
    let mut plan = Plan {
        pools,
        requests: Vec::new(),
        step_limit,
    };
    let mut minimum = 0;
    for request in requests {
        let prepared = prepare_request(request, classes)?;
        plan.requests.push(prepared);
        let r = plan.requests.len() - 1;
        for a in 0..plan.requests[r].alternatives.len() {
            if plan.requests[r].alternatives[a].mode == Mode::All {
                let all = all_devices(&plan, &mut state, r, a)?;
                plan.requests[r].alternatives[a].all = all;
            }
        }
        minimum += plan.requests[r]
            .alternatives
            .iter()
            .map(Alternative::wanted)
            .min()
            .unwrap_or_default();
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

    if solve(&plan, &mut state, 0)? {
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
    Err(explain_failure(&plan, &mut state))
}

/// What the search works from; fixed for one `allocate` call.
struct Plan<'a> {
    pools: &'a Pools,
    requests: Vec<PreparedRequest>,
    step_limit: u64,
}

struct PreparedRequest {
    /// One alternative for `exactly`, the subrequests in order for `firstAvailable`.
    alternatives: Vec<Alternative>,
}

struct Alternative {
    /// `req` or `req/sub`, as written into the result.
    label: String,
    /// The request's name, which constraints may name instead of `label`.
    base: String,
    class: String,
    class_selectors: Vec<CompiledSelector>,
    selectors: Vec<CompiledSelector>,
    mode: Mode,
    admin: bool,
    tolerations: Vec<DeviceToleration>,
    /// `capacity.requests`.
    capacity: Requests,
    /// For `All`: every matching device, fixed before the search as the scheduler does.
    all: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Count(usize),
    All,
}

impl Alternative {
    fn wanted(&self) -> usize {
        match self.mode {
            Mode::Count(count) => count,
            Mode::All => self.all.len(),
        }
    }
}

/// What the search changes as it picks and drops devices.
struct State {
    /// Held whole by another claim.
    in_use: Vec<bool>,
    /// Taken whole by this claim.
    in_claim: Vec<bool>,
    consumed: Vec<Quantity>,
    /// Shares of devices that allow multiple allocations (other claims' and this claim's).
    shares: Shares,
    picked: Vec<Pick>,
    /// Selector results by (request, alternative, device entry).
    matches: HashMap<(usize, usize, usize), bool>,
    steps: u64,
    constraints: Vec<ConstraintState>,
}

/// A selector expression and what compiling it gave; a compile error surfaces when the selector is
/// first evaluated, as in the scheduler.
#[derive(Debug)]
pub(crate) struct CompiledSelector {
    pub(crate) expression: String,
    pub(crate) compiled: Result<Selector, CelError>,
}

impl CompiledSelector {
    pub(crate) fn new(expression: &str) -> CompiledSelector {
        CompiledSelector {
            expression: expression.to_string(),
            compiled: Selector::compile(expression),
        }
    }
}

/// Evaluates `selectors` in order on `device` and stops at the first that does not say true: `Ok(None)`
/// when all match, `Ok(Some(i))` when selector `i` said false, `Err((i, error))` on a CEL error.
pub(crate) fn first_mismatch(
    selectors: &[CompiledSelector],
    device: &DeviceView,
) -> Result<Option<usize>, (usize, CelError)> {
    for (index, selector) in selectors.iter().enumerate() {
        let compiled = selector
            .compiled
            .as_ref()
            .map_err(|error| (index, error.clone()))?;
        match compiled.matches(device) {
            Ok(true) => {}
            Ok(false) => return Ok(Some(index)),
            Err(error) => return Err((index, error)),
        }
    }
    Ok(None)
}

struct Pick {
    entry: usize,
    request: usize,
    alternative: usize,
    /// For a share of a device that allows multiple allocations: what it consumes.
    consumed: Option<BTreeMap<String, Amount>>,
    /// Whether this pick took the device's counters (a shared device's first share does).
    took_counters: bool,
}

fn prepare_request(
    request: &DeviceRequest,
    classes: &BTreeMap<String, Vec<String>>,
) -> Result<PreparedRequest, AllocationError> {
    let invalid = |reason: &str| AllocationError::InvalidRequest {
        request: request.name.clone(),
        reason: reason.to_string(),
    };
    let alternatives = match (&request.exactly, &request.first_available) {
        (Some(exactly), None) => vec![prepare_alternative(
            request.name.clone(),
            &request.name,
            AlternativeSpec {
                class: &exactly.device_class_name,
                selectors: exactly.selectors.as_deref().unwrap_or_default(),
                mode: exactly.allocation_mode.as_deref(),
                count: exactly.count,
                admin: exactly.admin_access == Some(true),
                tolerations: exactly.tolerations.as_deref().unwrap_or_default(),
                capacity: exactly.capacity.as_ref(),
            },
            classes,
        )?],
        (None, Some(subrequests)) if !subrequests.is_empty() => subrequests
            .iter()
            .map(|sub| {
                prepare_alternative(
                    format!("{}/{}", request.name, sub.name),
                    &request.name,
                    AlternativeSpec {
                        class: &sub.device_class_name,
                        selectors: sub.selectors.as_deref().unwrap_or_default(),
                        mode: sub.allocation_mode.as_deref(),
                        count: sub.count,
                        admin: false,
                        tolerations: sub.tolerations.as_deref().unwrap_or_default(),
                        capacity: sub.capacity.as_ref(),
                    },
                    classes,
                )
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(invalid(
                "needs exactly one of exactly and a non-empty firstAvailable",
            ))
        }
    };
    Ok(PreparedRequest { alternatives })
}

struct AlternativeSpec<'a> {
    class: &'a str,
    selectors: &'a [DeviceSelector],
    mode: Option<&'a str>,
    count: Option<i64>,
    admin: bool,
    tolerations: &'a [DeviceToleration],
    capacity: Option<&'a CapacityRequirements>,
}

fn prepare_alternative(
    label: String,
    base: &str,
    spec: AlternativeSpec<'_>,
    classes: &BTreeMap<String, Vec<String>>,
) -> Result<Alternative, AllocationError> {
    let invalid = |reason: String| AllocationError::InvalidRequest {
        request: label.clone(),
        reason,
    };
    if spec.class.is_empty() {
        return Err(invalid("deviceClassName is empty".into()));
    }
    let class_expressions =
        classes
            .get(spec.class)
            .ok_or_else(|| AllocationError::UnknownDeviceClass {
                request: label.clone(),
                class: spec.class.to_string(),
            })?;
    let class_selectors = class_expressions
        .iter()
        .map(|expression| CompiledSelector::new(expression))
        .collect();
    let selectors = spec
        .selectors
        .iter()
        .enumerate()
        .map(|(index, selector)| match &selector.cel {
            Some(cel) => Ok(CompiledSelector::new(&cel.expression)),
            None => Err(invalid(format!(
                "selector #{index}: CEL expression empty (unsupported selector type?)"
            ))),
        })
        .collect::<Result<_, _>>()?;
    let mode = match spec.mode {
        None | Some("ExactCount") => {
            let count = spec.count.unwrap_or(1);
            if count < 1 {
                return Err(invalid(format!("count {count} is not positive")));
            }
            let count = usize::try_from(count)
                .ok()
                .filter(|c| *c <= MAX_RESULTS)
                .ok_or(AllocationError::TooManyDevices {
                    wanted: usize::try_from(count).unwrap_or(usize::MAX),
                })?;
            Mode::Count(count)
        }
        Some("All") => Mode::All,
        Some(other) => return Err(invalid(format!("unsupported allocationMode {other}"))),
    };
    let capacity = capacity::requests(spec.capacity).map_err(invalid)?;
    Ok(Alternative {
        label,
        base: base.to_string(),
        class: spec.class.to_string(),
        class_selectors,
        selectors,
        mode,
        admin: spec.admin,
        tolerations: spec.tolerations.to_vec(),
        capacity,
        all: Vec::new(),
    })
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

/// Whether the class's and then the request's selectors all match (first false wins), cached.
fn selectable(
    plan: &Plan<'_>,
    state: &mut State,
    r: usize,
    a: usize,
    entry: usize,
) -> Result<bool, AllocationError> {
    if let Some(known) = state.matches.get(&(r, a, entry)) {
        return Ok(*known);
    }
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
    let mut result = true;
    for (origin, selectors) in groups {
        match first_mismatch(selectors, &device.view) {
            Ok(None) => {}
            Ok(Some(_)) => {
                result = false;
                break; // The request's selectors are not evaluated when the class says no.
            }
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
    state.matches.insert((r, a, entry), result);
    Ok(result)
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
    if state.picked.len() + (wanted - k) > MAX_RESULTS {
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
    }
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
        match &device.consumes {
            Ok(consumes) => consumes,
            Err(_) => return Ok(false),
        }
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
        if let Ok(consumes) = &plan.pools.entries[pick.entry].consumes {
            for c in consumes {
                state.consumed[c.counter] = state.consumed[c.counter].sub(&c.amount);
            }
        }
    }
}

fn counters_fit(counters: &[CounterInfo], consumed: &[Quantity], consumes: &[Consumption]) -> bool {
    // A device may name a counter twice (in two consumption entries); sum per counter first.
    let mut wanted: BTreeMap<usize, Quantity> = BTreeMap::new();
    for c in consumes {
        let total = wanted.entry(c.counter).or_insert_with(Quantity::zero);
        *total = total.add(&c.amount);
    }
    wanted
        .iter()
        .all(|(counter, amount)| consumed[*counter].add(amount) <= counters[*counter].capacity)
}

/// The first NoSchedule / NoExecute taint that no toleration tolerates (`None` effects never block).
fn untolerated_taint<'a>(
    device: &'a Device,
    tolerations: &[DeviceToleration],
) -> Option<&'a DeviceTaint> {
    device.taints.iter().flatten().find(|taint| {
        matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !tolerations
                .iter()
                .any(|toleration| tolerates(toleration, taint))
    })
}

/// `resourceclaim.ToleratesTaint`: empty effect matches every effect, empty key every key.
fn tolerates(toleration: &DeviceToleration, taint: &DeviceTaint) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}

/// Why the search found nothing: the first request that lacks usable devices on its own, or else the
/// combination (constraints, devices or counters wanted by several requests).
fn explain_failure(plan: &Plan<'_>, state: &mut State) -> AllocationError {
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
            match &device.consumes {
                Err(reason) => Some(format!("{name} {reason}")),
                Ok(consumes) => counter_shortage(plan.pools, &state.consumed, consumes)
                    .map(|shortage| format!("{name} needs {shortage}")),
            }
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

fn counter_shortage(
    pools: &Pools,
    consumed: &[Quantity],
    consumes: &[Consumption],
) -> Option<String> {
    consumes.iter().find_map(|c| {
        let info = &pools.counters[c.counter];
        let left = info.capacity.sub(&consumed[c.counter]);
        (c.amount > left).then(|| {
            format!(
                "{} of counter {}/{}, which has {} left",
                c.amount, info.set, info.name, left
            )
        })
    })
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

#[cfg(test)]
mod tests;
