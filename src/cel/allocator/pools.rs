//! The pools a node can allocate from, as upstream's `GatherPools` builds them: per pool the newest
//! complete generation the node sees, with its devices for the node and the shared counters of the pool.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use super::capacity::{Capacities, InUse};
use super::counters::{consumption, pool_counters, Consumption, CounterInfo};
use super::{Candidate, Node};
use crate::cel::DeviceView;
use crate::quantity::Quantity;

/// A pool of the node left out of the candidates, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedPool {
    pub driver: String,
    pub pool: String,
    /// For an incomplete pool `incomplete: 1 of 2 slices at generation 3`; for an invalid one what is
    /// wrong, in upstream's words (`duplicate device name gpu-0`, `counter set gpu-0 not found`).
    pub reason: String,
    /// Invalid (its slices contradict each other or the API), not merely incomplete. If a claim
    /// cannot be allocated, an invalid pool of the node turns that into an error, as in the scheduler.
    pub invalid: bool,
}

/// Candidate devices and shared counters of the pools of a node that are complete and valid at their
/// newest generation.
#[derive(Debug, Clone, Default)]
pub struct Pools {
    pub(super) entries: Vec<Entry>,
    /// Capacity of every counter, indexed by `Consumption::counter`.
    pub(super) counters: Vec<CounterInfo>,
    /// What each device of a usable pool consumes, including devices of other nodes, by device.
    consumers: HashMap<Candidate, Vec<Consumption>>,
    pub(super) skipped: Vec<SkippedPool>,
}

#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) candidate: Candidate,
    pub(super) device: Device,
    /// The device as selectors see it, converted once.
    pub(super) view: DeviceView,
    /// Counters the device takes.
    pub(super) consumes: Vec<Consumption>,
    /// Its capacities and request policies, or why they cannot be read.
    pub(super) capacities: Result<Capacities, String>,
}

impl Entry {
    /// `allowMultipleAllocations`: several claims (and requests) may get the device.
    pub(super) fn multiple(&self) -> bool {
        self.capacities.as_ref().is_ok_and(|c| c.multiple)
    }
}

/// What one pool is for the node.
enum Gathered<'a> {
    /// No slice of it is for the node, or those that are belong to a generation being replaced.
    NotTheNodes,
    Skipped {
        reason: String,
        invalid: bool,
    },
    /// The generation the node allocates from, complete, by slice name: the node's own slices, or
    /// every slice of the pool at that generation where the node's alone are not complete.
    Current(Vec<&'a ResourceSlice>),
}

impl Pools {
    /// The node's view of the slices, as the scheduler gathers pools for a node ([`gather`]): per
    /// (driver, pool) the newest generation of the slices for the node, which is the pool when those
    /// alone are complete, even if the pool's slices for other nodes are at a newer generation; where
    /// they are not, all slices of the pool decide (obsolete, complete or incomplete). A pool counts
    /// when it is complete (as many slices at that generation as their `resourceSliceCount`) and
    /// valid: device names unique among the slices for the node, counter set
    /// names unique in the pool, and every device of the pool, the node's or not, consuming only
    /// counters its pool publishes. Other pools of the node are [`Pools::skipped`].
    ///
    /// With `node`, only devices the node can use are candidates: those of slices whose `nodeName`,
    /// `allNodes` or `nodeSelector` selects it, and with `perDeviceNodeSelection` the devices that
    /// select it themselves; counters are shared across the whole pool. Without `node`, every device
    /// is. Pools come in (driver, pool) order, slices by name.
    pub fn from_slices(slices: &[ResourceSlice], node: Option<&Node>) -> Pools {
        let mut by_pool: BTreeMap<(&str, &str), Vec<&ResourceSlice>> = BTreeMap::new();
        for slice in slices {
            let key = (slice.spec.driver.as_str(), slice.spec.pool.name.as_str());
            by_pool.entry(key).or_default().push(slice);
        }
        let mut pools = Pools::default();
        for ((driver, pool), all) in by_pool {
            let (reason, invalid) = match gather(all, node) {
                Gathered::NotTheNodes => continue,
                Gathered::Skipped { reason, invalid } => (reason, invalid),
                Gathered::Current(current) => match pools.add_pool(driver, pool, &current, node) {
                    Ok(()) => continue,
                    Err(reason) => (reason, true),
                },
            };
            pools.skipped.push(SkippedPool {
                driver: driver.to_string(),
                pool: pool.to_string(),
                reason,
                invalid,
            });
        }
        pools
    }

    /// Adds the pool's devices for the node and its counters, or says why the pool is invalid.
    fn add_pool(
        &mut self,
        driver: &str,
        pool: &str,
        slices: &[&ResourceSlice],
        node: Option<&Node>,
    ) -> Result<(), String> {
        let counters = pool_counters(driver, pool, slices, self.counters.len())?;
        let mut names = BTreeSet::new();
        let mut entries = Vec::new();
        let mut consumers = HashMap::new();
        for slice in slices {
            // Names are checked where the scheduler checks them: among the slices for the node.
            let for_node = slice_targets_node(slice, node)?;
            for device in slice.spec.devices.iter().flatten() {
                if for_node && !names.insert(device.name.as_str()) {
                    return Err(format!("duplicate device name {}", device.name));
                }
                let consumes = consumption(device, &counters)
                    .map_err(|e| format!("device {}: {e}", device.name))?;
                let candidate = Candidate {
                    driver: driver.to_string(),
                    pool: pool.to_string(),
                    device: device.name.clone(),
                };
                if for_node && device_targets_node(slice, device, node)? {
                    entries.push(Entry {
                        view: DeviceView::new(&candidate.driver, device),
                        candidate: candidate.clone(),
                        device: device.clone(),
                        consumes: consumes.clone(),
                        capacities: Capacities::of(device),
                    });
                }
                consumers.insert(candidate, consumes);
            }
        }
        self.counters.extend(counters.infos);
        self.entries.extend(entries);
        self.consumers.extend(consumers);
        Ok(())
    }

    /// Candidate devices in the order the scheduler tries them.
    pub fn devices(&self) -> impl Iterator<Item = (&Candidate, &Device)> {
        self.entries.iter().map(|e| (&e.candidate, &e.device))
    }

    /// [`Pools::devices`] with each device as selectors see it, converted once when the pools were
    /// gathered, so a caller that evaluates selectors need not convert again.
    pub fn device_views(&self) -> impl Iterator<Item = (&Candidate, &Device, &DeviceView)> {
        self.entries
            .iter()
            .map(|e| (&e.candidate, &e.device, &e.view))
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
    pub(super) fn base_consumption(&self, in_use: &InUse) -> Vec<Quantity> {
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

/// What the pool of `all` (its slices, every generation) is for the node, decided as upstream's
/// `GatherPools` decides it. Only the slices *for the node* are looked at first, and of those the
/// newest generation: when it is complete among them (as many as its `resourceSliceCount`), that is
/// the pool, even if slices for other nodes are at a newer generation (a pool moving between nodes
/// keeps the node's own complete generation, as the scheduler does). Otherwise all slices of the
/// pool decide: a newer generation elsewhere makes the node's slices obsolete (the pool is not the
/// node's), a complete generation over all nodes is the pool, and anything else is incomplete.
fn gather<'a>(all: Vec<&'a ResourceSlice>, node: Option<&Node>) -> Gathered<'a> {
    let mut relevant = Vec::new();
    for slice in &all {
        match slice_is_for_node(slice, node) {
            Ok(true) => relevant.push(*slice),
            Ok(false) => {}
            Err(reason) => {
                return Gathered::Skipped {
                    reason,
                    invalid: true,
                }
            }
        }
    }
    let Some(generation) = relevant.iter().map(|s| s.spec.pool.generation).max() else {
        return Gathered::NotTheNodes;
    };
    let at = |slices: Vec<&'a ResourceSlice>| -> Vec<&'a ResourceSlice> {
        let mut slices: Vec<&ResourceSlice> = slices
            .into_iter()
            .filter(|s| s.spec.pool.generation == generation)
            .collect();
        slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        slices
    };
    let current = at(relevant);
    let wanted = current[0].spec.pool.resource_slice_count;
    if i64::try_from(current.len()).ok() == Some(wanted) {
        return Gathered::Current(current);
    }
    if all.iter().any(|s| s.spec.pool.generation > generation) {
        // Being replaced by a generation with no slice for the node.
        return Gathered::NotTheNodes;
    }
    let whole = at(all);
    if i64::try_from(whole.len()).ok() == Some(wanted) {
        return Gathered::Current(whole);
    }
    Gathered::Skipped {
        reason: format!(
            "incomplete: {} of {wanted} slices at generation {generation}",
            whole.len()
        ),
        invalid: false,
    }
}

/// Whether upstream's `GatherPools` takes the slice for the node: its own node selection
/// (`nodeName`, `allNodes`, `nodeSelector`) selects the node, or with `perDeviceNodeSelection` one of
/// its devices' does. A slice with none of them is some future extension, taken for no node. Every
/// slice is for the node where there is no node filter.
fn slice_is_for_node(slice: &ResourceSlice, node: Option<&Node>) -> Result<bool, String> {
    let Some(node) = node else { return Ok(true) };
    let spec = &slice.spec;
    let slice_name = slice.metadata.name.as_deref().unwrap_or("(unnamed)");
    if spec.node_name.as_deref().is_some_and(|n| !n.is_empty())
        || spec.all_nodes == Some(true)
        || spec.node_selector.is_some()
    {
        return node
            .matches(
                spec.node_name.as_deref(),
                spec.all_nodes,
                spec.node_selector.as_ref(),
            )
            .map_err(|e| format!("ResourceSlice {slice_name}: node selector: {e}"));
    }
    if spec.per_device_node_selection == Some(true) {
        return slice_targets_node(slice, Some(node));
    }
    Ok(false)
}

/// Whether the slice has devices for `node` (every slice with devices has, without a node filter).
/// A slice of counters only does not make a pool the node's. Errors name the slice and its invalid
/// selector.
fn slice_targets_node(slice: &ResourceSlice, node: Option<&Node>) -> Result<bool, String> {
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
    if spec.per_device_node_selection == Some(true) {
        node.matches(
            device.node_name.as_deref(),
            device.all_nodes,
            device.node_selector.as_ref(),
        )
        .map_err(|e| {
            format!(
                "ResourceSlice {slice_name}: device {}: node selector: {e}",
                device.name
            )
        })
    } else {
        node.matches(
            spec.node_name.as_deref(),
            spec.all_nodes,
            spec.node_selector.as_ref(),
        )
        .map_err(|e| format!("ResourceSlice {slice_name}: node selector: {e}"))
    }
}
