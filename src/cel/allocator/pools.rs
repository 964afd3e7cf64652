//! The pools a node can allocate from, as upstream's `GatherPools` builds them: the newest generation of
//! each pool, complete, with its devices for the node and the shared counters of the whole pool.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use super::capacity::{Capacities, InUse};
use super::counters::{consumption, Consumption, CounterInfo};
use super::{Candidate, Node};
use crate::cel::DeviceView;
use crate::quantity::Quantity;

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
    /// Counters the device takes, or why it cannot take them.
    pub(super) consumes: Result<Vec<Consumption>, String>,
    /// Its capacities and request policies, or why they cannot be read.
    pub(super) capacities: Result<Capacities, String>,
}

impl Entry {
    /// `allowMultipleAllocations`: several claims (and requests) may get the device.
    pub(super) fn multiple(&self) -> bool {
        self.capacities.as_ref().is_ok_and(|c| c.multiple)
    }
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
