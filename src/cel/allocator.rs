//! The scheduler's DRA allocation step as a pure function: which devices of complete, current pools a
//! ResourceClaim gets, with selectors, shared counters, consumable capacity (`capacity`), taints,
//! constraints and first-fit backtracking as in the Kubernetes allocator, so tests can check that what
//! gpu-dra publishes is allocatable.
//!
//! Split as upstream's `structured` allocator is: `pools` gathers and validates the node's pools,
//! `counters` keeps shared counters, `capacity` consumable capacity, `constraints` matchAttribute and
//! distinctAttribute, `taints` taints and tolerations, `request` prepares the claim's requests,
//! `search` is the backtracking search, `prune` cuts its hopeless branches and `errors` says why a
//! claim cannot be allocated.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceRequestAllocationResult, ResourceClaimSpec,
};

mod capacity;
mod constraints;
mod counters;
mod errors;
mod node;
mod pools;
mod prune;
mod request;
mod search;
mod taints;

pub use capacity::{in_use, share_shortfall, InUse};
pub use errors::{AllocationError, SelectorOrigin};
pub use node::Node;
pub use pools::{Pools, SkippedPool};
pub(crate) use request::{first_mismatch, CompiledSelector};
pub use taints::{toleration_matches, untolerated_taint};

/// Search steps (devices tried) before `allocate` gives up, so a pathological claim cannot hang a test.
pub const DEFAULT_STEP_LIMIT: u64 = 1_000_000;
/// Devices one allocation may hold (`AllocationResultsMaxSize`).
pub const MAX_RESULTS: usize = 32;

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
    search::run(pools, classes, in_use, claim, step_limit).0
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod upstream_cases;
