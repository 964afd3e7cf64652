//! MIG devices. Dynamic MIG publishes every profile at every placement as a partitionable device that
//! consumes a per-GPU counter set (memory slices, compute slices, engines), so the scheduler can never
//! allocate two MIG devices that overlap, or a whole GPU together with one of its partitions. Static MIG
//! publishes the MIG devices an admin already created, as plain devices: one per compute instance
//! (several compute instances of one GPU instance are several devices, each with its own UUID), none for
//! a GPU instance without compute instance, which CUDA cannot use.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceCapacity, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{common_attributes, int, string, DeviceName};
use crate::gpu::{Gpu, Inventory, MigInfo, MigInstance, MigPlacement, MigProfile};

/// The counter set of a GPU: `gpu-<minor>-counters`.
pub fn counter_set_name(minor: u32) -> String {
    format!("gpu-{minor}-counters")
}

fn memory_slice_counter(slice: u32) -> String {
    format!("memory-slice-{slice}")
}

/// What a MIG profile (or the whole GPU) takes from the GPU's counter set, by counter name.
fn profile_counters(profile: &MigProfile) -> BTreeMap<String, u64> {
    BTreeMap::from([
        (
            "multiprocessors".to_string(),
            u64::from(profile.multiprocessors),
        ),
        ("copy-engines".to_string(), u64::from(profile.copy_engines)),
        ("decoders".to_string(), u64::from(profile.decoders)),
        ("encoders".to_string(), u64::from(profile.encoders)),
        ("jpeg-engines".to_string(), u64::from(profile.jpeg_engines)),
        ("ofa-engines".to_string(), u64::from(profile.ofa_engines)),
        (
            "compute-slices".to_string(),
            u64::from(profile.compute_slices),
        ),
        ("memory".to_string(), profile.memory_bytes()),
    ])
}

/// The profile that spans the whole GPU (7g): its engines are the GPU's totals.
fn full_profile(mig: &MigInfo) -> Option<&MigProfile> {
    mig.profiles
        .iter()
        .max_by_key(|p| (p.compute_slices, p.memory_mib))
}

/// The GPU's counter set: what all its MIG devices together may use. Its memory slices keep
/// placements apart; of the engine, compute and memory totals only those that some set of
/// non-overlapping placements would exceed are published (see [`binding_counters`]).
pub fn counter_set(gpu: &Gpu, mig: &MigInfo) -> Option<CounterSet> {
    let totals = gpu_totals(gpu, mig)?;
    let binding = binding_counters(mig, &totals);
    let mut counters: BTreeMap<String, Counter> = totals
        .into_iter()
        .filter(|(name, _)| binding.contains(name))
        .map(|(name, value)| (name, counter(value)))
        .collect();
    for slice in 0..mig.memory_slices {
        counters.insert(memory_slice_counter(slice), counter(1));
    }
    Some(CounterSet {
        name: counter_set_name(gpu.minor),
        counters,
    })
}

/// The GPU's engine, compute and memory totals, by counter name: the full (7g) profile's engines,
/// all compute slices and the GPU's whole memory, not the 7g profile's (NVIDIA rounds each profile's
/// memory on its own, and on H200 a valid set of small devices adds up to more than the 7g profile has).
fn gpu_totals(gpu: &Gpu, mig: &MigInfo) -> Option<BTreeMap<String, u64>> {
    let mut totals = profile_counters(full_profile(mig)?);
    totals.insert("compute-slices".into(), u64::from(mig.compute_slices));
    totals.insert("memory".into(), gpu.memory_bytes);
    Some(totals)
}

/// Sets of placements looked at before [`binding_counters`] gives up and keeps every counter.
const BINDING_SEARCH_BUDGET: usize = 1_000_000;

/// Which of `totals` can refuse something the memory slices allow: those that some set of devices
/// (the whole GPU or MIG placements) with no memory slice in common would exceed. A counter that no
/// such set exceeds refuses nothing, so leaving it out changes no allocation, and the scheduler checks
/// every counter of every device of the node for every pod (BENCHMARKS.md, "At cluster scale"): on an
/// H100 only `ofa-engines` binds (one `+me` device at a time), and a 1g device consumes 1 counter
/// instead of 7. Exhaustive over the sets; past [`BINDING_SEARCH_BUDGET`] of them, or with more memory
/// slices than a mask holds, every counter stays.
fn binding_counters(mig: &MigInfo, totals: &BTreeMap<String, u64>) -> BTreeSet<String> {
    let everything = || totals.keys().cloned().collect();
    if mig.memory_slices > 64 {
        return everything();
    }
    let names: Vec<&String> = totals.keys().collect();
    let capacity: Vec<u64> = names.iter().map(|name| totals[*name]).collect();
    let amounts = |consumed: &BTreeMap<String, u64>| -> Vec<u64> {
        names
            .iter()
            .map(|name| consumed.get(*name).copied().unwrap_or(0))
            .collect()
    };
    let all_slices = if mig.memory_slices == 64 {
        u64::MAX
    } else {
        (1u64 << mig.memory_slices) - 1
    };
    // The whole GPU takes every slice and every total; each placement its slices and its profile.
    let mut candidates: Vec<(u64, Vec<u64>)> = vec![(all_slices, capacity.clone())];
    for (profile, placement) in packing_order(mig) {
        let mask = placement
            .slices()
            .fold(0u64, |mask, slice| mask | 1u64 << slice.min(63));
        candidates.push((mask, amounts(&profile_counters(profile))));
    }
    let mut search = BindingSearch {
        candidates: &candidates,
        capacity: &capacity,
        binding: vec![false; names.len()],
        visited: 0,
    };
    if !search.walk(0, 0, &mut vec![0; names.len()]) {
        return everything();
    }
    names
        .into_iter()
        .zip(search.binding)
        .filter(|(_, binding)| *binding)
        .map(|(name, _)| name.clone())
        .collect()
}

/// The depth-first walk of [`binding_counters`] over sets of devices with disjoint memory slices.
struct BindingSearch<'a> {
    candidates: &'a [(u64, Vec<u64>)],
    capacity: &'a [u64],
    binding: Vec<bool>,
    visited: usize,
}

impl BindingSearch<'_> {
    /// Extends the set (its slices `used`, its sums `sums`) by each candidate from `from` on; false
    /// once the budget is spent.
    fn walk(&mut self, from: usize, used: u64, sums: &mut [u64]) -> bool {
        for index in from..self.candidates.len() {
            let (mask, amounts) = &self.candidates[index];
            if used & mask != 0 {
                continue;
            }
            self.visited += 1;
            if self.visited > BINDING_SEARCH_BUDGET {
                return false;
            }
            for (counter, amount) in amounts.iter().enumerate() {
                sums[counter] += amount;
                if sums[counter] > self.capacity[counter] {
                    self.binding[counter] = true;
                }
            }
            let finished = self.walk(index + 1, used | mask, sums);
            for (counter, amount) in amounts.iter().enumerate() {
                sums[counter] -= amount;
            }
            if !finished {
                return false;
            }
        }
        true
    }
}

/// What a MIG device at `placement` consumes from `set`: its memory slices and its profile's share of
/// the totals the set holds. Zero amounts are left out; they constrain nothing.
fn consumption(
    set: &CounterSet,
    profile: &MigProfile,
    placement: MigPlacement,
) -> DeviceCounterConsumption {
    let mut counters: BTreeMap<String, Counter> = profile_counters(profile)
        .into_iter()
        .filter(|(name, value)| *value > 0 && set.counters.contains_key(name))
        .map(|(name, value)| (name, counter(value)))
        .collect();
    for slice in placement.slices() {
        counters.insert(memory_slice_counter(slice), counter(1));
    }
    DeviceCounterConsumption {
        counter_set: set.name.clone(),
        counters,
        ..Default::default()
    }
}

/// A whole GPU on a partitionable GPU consumes every counter, so it excludes all its MIG devices.
pub fn whole_gpu_consumption(set: &CounterSet) -> DeviceCounterConsumption {
    DeviceCounterConsumption {
        counter_set: set.name.clone(),
        counters: set
            .counters
            .iter()
            .filter(|(_, c)| c.value.0 != "0")
            .map(|(name, c)| (name.clone(), c.clone()))
            .collect(),
        ..Default::default()
    }
}

/// Every profile at every placement, in packing order (see [`packing_order`]).
pub fn dynamic_devices(
    inventory: &Inventory,
    gpu: &Gpu,
    mig: &MigInfo,
    set: &CounterSet,
) -> Vec<Device> {
    packing_order(mig)
        .into_iter()
        .map(|(profile, placement)| {
            let mut device = mig_device(inventory, gpu, profile, placement, None);
            device.consumes_counters = Some(vec![consumption(set, profile, placement)]);
            device
        })
        .collect()
}

/// The MIG devices that exist on a GPU in static MIG mode, with their UUIDs: one per compute
/// instance. GPU instances without compute instance are left out (the plugin reports them).
pub fn static_devices(inventory: &Inventory, gpu: &Gpu, mig: &MigInfo) -> Vec<Device> {
    mig.instances
        .iter()
        .filter(|instance| instance.has_compute_instance())
        .filter_map(|instance| {
            let profile = mig.profile(instance.profile_id)?;
            Some(mig_device(
                inventory,
                gpu,
                profile,
                instance.placement,
                Some(instance),
            ))
        })
        .collect()
}

/// The order the scheduler should try a GPU's MIG devices in. It takes the first device that fits, so:
/// smaller profiles before larger ones (a request that several profiles satisfy gets the least it
/// needs), and for each profile the placements that block the least of the larger profiles' placements
/// first (small devices go where they leave 4g/3g/7g placements whole; on A100/H100/H200 that is the
/// top memory slices, keeping the 4g placement at slice 0 free longest).
pub fn packing_order(mig: &MigInfo) -> Vec<(&MigProfile, MigPlacement)> {
    let mut profiles: Vec<&MigProfile> = mig.profiles.iter().collect();
    profiles.sort_by_key(|p| (p.memory_mib, p.compute_slices, p.name.clone()));
    let mut order = Vec::new();
    for profile in profiles {
        let mut placements = profile.placements.clone();
        placements
            .sort_by_key(|placement| (blocked_weight(mig, profile, placement), placement.start));
        order.extend(placements.into_iter().map(|placement| (profile, placement)));
    }
    order
}

/// How much of the other profiles' placements (in memory slices) a device at `placement` would block.
fn blocked_weight(mig: &MigInfo, profile: &MigProfile, placement: &MigPlacement) -> u32 {
    mig.profiles
        .iter()
        .filter(|other| other.id != profile.id)
        .flat_map(|other| other.placements.iter())
        .filter(|other| other.overlaps(placement))
        .map(|other| other.size)
        .sum()
}

fn mig_device(
    inventory: &Inventory,
    gpu: &Gpu,
    profile: &MigProfile,
    placement: MigPlacement,
    instance: Option<&MigInstance>,
) -> Device {
    let mut attributes = common_attributes(inventory, gpu);
    attributes.insert("type".into(), string("mig"));
    attributes.insert("parentUUID".into(), string(&gpu.uuid));
    // NVIDIA (up to v25.3): `parentIndex` is the GPU's NVML index, `index` the MIG device's own.
    attributes.insert("parentIndex".into(), int(i64::from(gpu.index)));
    match instance.and_then(|i| i.index) {
        Some(index) => attributes.insert("index".into(), int(i64::from(index))),
        None => attributes.remove("index"),
    };
    attributes.insert("profile".into(), string(&profile.name));
    match instance {
        Some(instance) => attributes.insert("uuid".into(), string(&instance.uuid)),
        None => attributes.remove("uuid"),
    };
    // One of several compute instances: its own share of the GPU instance's multiprocessors; memory
    // and engines are the GPU instance's, shared with its sibling compute instances.
    let share = instance.and_then(|i| i.compute);
    if let Some(share) = share {
        attributes.insert(
            "computeProfile".into(),
            string(&format!("{}c.{}", share.slices, profile.name)),
        );
    }
    let mut capacity = profile_capacities(profile);
    if let Some(share) = share {
        capacity.insert(
            "multiprocessors".into(),
            quantity(share.multiprocessors.into()),
        );
    }
    // An existing MIG device names the memory slices it holds, as NVIDIA's static MIG devices do.
    if instance.is_some() {
        for slice in placement.slices() {
            capacity.insert(format!("memorySlice{slice}"), quantity(1));
        }
    }
    Device {
        name: DeviceName::Mig {
            minor: gpu.minor,
            profile: profile.dns_name(),
            start: placement.start,
            compute_instance: share.and(instance.map(|i| i.compute_instance_id)),
        }
        .to_string(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        ..Default::default()
    }
}

/// A MIG profile's capacities, by NVIDIA's names; `memory` in bytes (NVML's MiB × 2^20).
fn profile_amounts(profile: &MigProfile) -> [(&'static str, u64); 7] {
    [
        ("memory", profile.memory_bytes()),
        ("multiprocessors", profile.multiprocessors.into()),
        ("copyEngines", profile.copy_engines.into()),
        ("decoders", profile.decoders.into()),
        ("encoders", profile.encoders.into()),
        ("jpegEngines", profile.jpeg_engines.into()),
        ("ofaEngines", profile.ofa_engines.into()),
    ]
}

fn profile_capacities(profile: &MigProfile) -> BTreeMap<String, DeviceCapacity> {
    profile_amounts(profile)
        .into_iter()
        .map(|(name, value)| (name.to_string(), quantity(value)))
        .collect()
}

/// Each MIG capacity's largest value over the GPU's profiles: what NVIDIA's driver publishes as the
/// capacity of a partitionable whole GPU.
pub fn largest_capacities(mig: &MigInfo) -> BTreeMap<String, DeviceCapacity> {
    let mut largest: BTreeMap<String, u64> = BTreeMap::new();
    for (name, value) in mig.profiles.iter().flat_map(profile_amounts) {
        let entry = largest.entry(name.to_string()).or_insert(0);
        *entry = (*entry).max(value);
    }
    largest
        .into_iter()
        .map(|(name, value)| (name, quantity(value)))
        .collect()
}

fn counter(value: u64) -> Counter {
    Counter {
        value: Quantity(value.to_string()),
    }
}

fn quantity(value: u64) -> DeviceCapacity {
    DeviceCapacity {
        value: Quantity(value.to_string()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::{node_devices, DeviceName, MigMode};
    use super::Device;
    use crate::gpu::{builtin_profile, FakeBackend, GpuBackend};

    fn attr(device: &Device, name: &str) -> Option<String> {
        let a = device.attributes.as_ref()?.get(name)?;
        a.string.clone().or(a.int.map(|i| i.to_string()))
    }

    #[test]
    fn static_mig_publishes_one_device_per_compute_instance_and_none_without() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        let mut profile = builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(1);
        profile.gpus[0].mig_enabled = true;
        profile.gpus[0].mig_instances = serde_yaml::from_str(
            "[{profile: 3g.40gb, start: 0, computeInstances: [2, 1]}, \
              {profile: 2g.20gb, start: 4, computeInstances: []}, \
              {profile: 1g.10gb, start: 6}]",
        )
        .unwrap();
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let inventory = FakeBackend::new("n", path.to_str().unwrap())
            .unwrap()
            .inventory()
            .unwrap();
        let node = node_devices(&inventory, MigMode::Static);
        let names: Vec<&str> = node.devices().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "gpu-0-mig-3g40gb-0-ci0",
                "gpu-0-mig-3g40gb-0-ci1",
                "gpu-0-mig-1g10gb-6"
            ]
        );
        for device in node.devices() {
            assert_eq!(
                DeviceName::parse(&device.name).unwrap().to_string(),
                device.name
            );
        }
        let devices: Vec<&Device> = node.devices().collect();
        let uuids: std::collections::BTreeSet<_> =
            devices.iter().map(|d| attr(d, "uuid").unwrap()).collect();
        assert_eq!(uuids.len(), 3, "each device has its own UUID");
        let mig = inventory.gpus[0].mig.as_ref().unwrap();
        for device in &devices[..2] {
            let name = DeviceName::parse(&device.name).unwrap();
            let DeviceName::Mig {
                compute_instance: Some(ci),
                ..
            } = name
            else {
                panic!("{name:?}")
            };
            let instance = mig
                .instances
                .iter()
                .find(|i| i.placement.start == 0 && i.compute_instance_id == ci)
                .unwrap();
            assert_eq!(attr(device, "uuid").unwrap(), instance.uuid);
        }
        assert_eq!(
            attr(devices[0], "computeProfile").as_deref(),
            Some("2c.3g.40gb")
        );
        assert_eq!(
            devices[1].capacity.as_ref().unwrap()["multiprocessors"]
                .value
                .0,
            "20"
        );
        assert_eq!(attr(devices[2], "computeProfile"), None);
    }

    /// Whether `devices` fit `set` together: the sum of what they consume stays within each counter.
    fn fit(set: &BTreeMap<String, u64>, devices: &[&BTreeMap<String, u64>]) -> bool {
        set.iter().all(|(name, total)| {
            devices
                .iter()
                .map(|d| d.get(name).copied().unwrap_or(0))
                .sum::<u64>()
                <= *total
        })
    }

    /// Every subset of `devices` whose memory slices are disjoint, depth first. Subsets whose slices
    /// overlap fit under no counters that keep the slices, so they need no comparing.
    fn disjoint_subsets<'a>(
        devices: &'a [BTreeMap<String, u64>],
        from: usize,
        chosen: &mut Vec<usize>,
        visit: &mut dyn FnMut(&[usize]),
    ) {
        visit(chosen);
        for index in from..devices.len() {
            let overlaps = devices[index].keys().any(|name| {
                name.starts_with("memory-slice-")
                    && chosen.iter().any(|&c| devices[c].contains_key(name))
            });
            if overlaps {
                continue;
            }
            chosen.push(index);
            disjoint_subsets(devices, index + 1, chosen, visit);
            chosen.pop();
        }
    }

    /// A device's consumption as a map of numbers.
    fn consumed(device: &Device) -> BTreeMap<String, u64> {
        device.consumes_counters.as_ref().unwrap()[0]
            .counters
            .iter()
            .map(|(name, c)| (name.clone(), c.value.0.parse().unwrap()))
            .collect()
    }

    #[test]
    fn counters_that_refuse_nothing_are_left_out_and_every_allocation_stays_as_it_was() {
        for profile in ["dgx-h100", "dgx-a100", "dgx-h200"] {
            let mut inventory = FakeBackend::new("n", profile).unwrap().inventory().unwrap();
            // An A100 offers its MIG devices only with MIG mode on.
            inventory.gpus[0].mig.as_mut().unwrap().enabled = true;
            let gpu = &inventory.gpus[0];
            let mig = gpu.mig.as_ref().unwrap();
            let node = node_devices(&inventory, MigMode::Dynamic);
            let published = &node.gpus[0];
            let set: BTreeMap<String, u64> = published
                .counter_set
                .as_ref()
                .unwrap()
                .counters
                .iter()
                .map(|(name, c)| (name.clone(), c.value.0.parse().unwrap()))
                .collect();
            // Every counter as before: all totals, each device its whole profile (the whole GPU
            // all of it) and its memory slices.
            let mut full_set = super::gpu_totals(gpu, mig).unwrap();
            full_set.extend((0..mig.memory_slices).map(|s| (format!("memory-slice-{s}"), 1)));
            let full: Vec<BTreeMap<String, u64>> = published
                .devices
                .iter()
                .map(|device| match DeviceName::parse(&device.name).unwrap() {
                    DeviceName::Gpu { .. } => full_set.clone(),
                    DeviceName::Mig { profile, start, .. } => {
                        let profile = mig
                            .profiles
                            .iter()
                            .find(|p| p.dns_name() == profile)
                            .unwrap();
                        let placement = profile
                            .placements
                            .iter()
                            .find(|p| p.start == start)
                            .unwrap();
                        let mut counters = super::profile_counters(profile);
                        counters.retain(|_, v| *v > 0);
                        counters
                            .extend(placement.slices().map(|s| (format!("memory-slice-{s}"), 1)));
                        counters
                    }
                })
                .collect();
            let pruned: Vec<BTreeMap<String, u64>> =
                published.devices.iter().map(consumed).collect();
            assert!(set.len() < full_set.len(), "{profile}: nothing left out");
            // Every set of devices with disjoint memory slices fits the published counters exactly
            // when it fits all of them.
            let mut compared = 0;
            disjoint_subsets(&full, 0, &mut Vec::new(), &mut |chosen| {
                compared += 1;
                let all: Vec<&BTreeMap<String, u64>> = chosen.iter().map(|&i| &full[i]).collect();
                let kept: Vec<&BTreeMap<String, u64>> =
                    chosen.iter().map(|&i| &pruned[i]).collect();
                assert_eq!(
                    fit(&full_set, &all),
                    fit(&set, &kept),
                    "{profile}: {chosen:?}"
                );
            });
            assert!(compared > 100, "{profile}: {compared}");
        }
    }

    #[test]
    fn a_counter_that_some_placements_exceed_is_kept() {
        let inventory = FakeBackend::new("n", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        let node = node_devices(&inventory, MigMode::Dynamic);
        let set = node.gpus[0].counter_set.as_ref().unwrap();
        let names: Vec<&str> = set.counters.keys().map(String::as_str).collect();
        // Two +me devices would need two optical-flow engines; the H100 has one.
        assert_eq!(
            names,
            [
                "memory-slice-0",
                "memory-slice-1",
                "memory-slice-2",
                "memory-slice-3",
                "memory-slice-4",
                "memory-slice-5",
                "memory-slice-6",
                "memory-slice-7",
                "ofa-engines"
            ]
        );
        // A GPU with one decoder for all: two 1g devices would exceed it, so it binds.
        let mut inventory = inventory;
        let mig = inventory.gpus[0].mig.as_mut().unwrap();
        for profile in &mut mig.profiles {
            if profile.compute_slices == 7 {
                profile.decoders = 1;
            }
        }
        let node = node_devices(&inventory, MigMode::Dynamic);
        let set = node.gpus[0].counter_set.as_ref().unwrap();
        assert_eq!(set.counters["decoders"].value.0, "1");
        let small = node.gpus[0]
            .devices
            .iter()
            .find(|d| d.name == "gpu-0-mig-1g10gb-6")
            .unwrap();
        assert_eq!(consumed(small)["decoders"], 1);
    }

    #[test]
    fn dynamic_mig_leaves_the_whole_gpu_out_when_mig_mode_cannot_be_switched_off() {
        let mut inventory = FakeBackend::new("n", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        let before = node_devices(&inventory, MigMode::Dynamic);
        assert_eq!(before.gpus[0].devices[0].name, "gpu-0");
        let mig = inventory.gpus[0].mig.as_mut().unwrap();
        mig.enabled = true;
        let on = node_devices(&inventory, MigMode::Dynamic);
        assert_eq!(on.gpus[0].devices[0].name, "gpu-0", "Hopper switches back");
        inventory.gpus[0].mig.as_mut().unwrap().disable_failed = Some("in use".into());
        let stuck = node_devices(&inventory, MigMode::Dynamic);
        assert!(stuck.gpus[0].devices.iter().all(|d| d.name != "gpu-0"));
        assert_eq!(
            stuck.gpus[0].devices.len(),
            before.gpus[0].devices.len() - 1
        );
        assert_eq!(stuck.gpus[1].devices[0].name, "gpu-1");
    }
}
