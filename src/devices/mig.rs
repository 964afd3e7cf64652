//! MIG devices. Dynamic MIG publishes every profile at every placement as a partitionable device that
//! consumes a per-GPU counter set (memory slices, compute slices, engines), so the scheduler can never
//! allocate two MIG devices that overlap, or a whole GPU together with one of its partitions. Static MIG
//! publishes the MIG devices an admin already created, as plain devices: one per compute instance
//! (several compute instances of one GPU instance are several devices, each with its own UUID), none for
//! a GPU instance without compute instance, which CUDA cannot use.

use std::collections::BTreeMap;

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

/// The GPU's counter set: what all its MIG devices together may use.
pub fn counter_set(gpu: &Gpu, mig: &MigInfo) -> Option<CounterSet> {
    let full = full_profile(mig)?;
    let mut counters: BTreeMap<String, Counter> = profile_counters(full)
        .into_iter()
        .map(|(name, value)| (name, counter(value)))
        .collect();
    counters.insert(
        "compute-slices".into(),
        counter(u64::from(mig.compute_slices)),
    );
    // The GPU's whole memory, not the 7g profile's: NVIDIA rounds each profile's memory on its own,
    // and on H200 a valid set of small devices adds up to more than the 7g profile has.
    counters.insert("memory".into(), counter(gpu.memory_bytes));
    for slice in 0..mig.memory_slices {
        counters.insert(memory_slice_counter(slice), counter(1));
    }
    Some(CounterSet {
        name: counter_set_name(gpu.minor),
        counters,
    })
}

/// What a MIG device at `placement` consumes: its profile's engines and its memory slices. Zero
/// amounts are left out; they constrain nothing.
fn consumption(
    gpu: &Gpu,
    profile: &MigProfile,
    placement: MigPlacement,
) -> DeviceCounterConsumption {
    let mut counters: BTreeMap<String, Counter> = profile_counters(profile)
        .into_iter()
        .filter(|(_, value)| *value > 0)
        .map(|(name, value)| (name, counter(value)))
        .collect();
    for slice in placement.slices() {
        counters.insert(memory_slice_counter(slice), counter(1));
    }
    DeviceCounterConsumption {
        counter_set: counter_set_name(gpu.minor),
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
pub fn dynamic_devices(inventory: &Inventory, gpu: &Gpu, mig: &MigInfo) -> Vec<Device> {
    packing_order(mig)
        .into_iter()
        .map(|(profile, placement)| {
            let mut device = mig_device(inventory, gpu, profile, placement, None);
            device.consumes_counters = Some(vec![consumption(gpu, profile, placement)]);
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
