//! The counters a dynamic-MIG GPU publishes must allow exactly the sets of MIG devices the GPU can hold:
//! every set the counters allow is physically placeable (checked with the fake backend's hardware
//! model, which knows nothing of counters), and every placeable set is allowed by the counters. The
//! search walks every set of devices of one GPU for each model with NVIDIA's real geometry.

use std::collections::BTreeMap;

use gpu_dra::devices::{node_devices, DeviceName, MigMode};
use gpu_dra::gpu::fake::physically_fits;
use gpu_dra::gpu::{FakeBackend, GpuBackend, MigInfo, MigInstance, MigPlacement};
use gpu_dra::quantity::parse_nanos;
use k8s_openapi::api::resource::v1::{CounterSet, Device};

/// What the scheduler checks: the summed consumption of the chosen devices fits every counter.
fn counters_allow(set: &CounterSet, chosen: &[&Device]) -> bool {
    let mut used: BTreeMap<&str, i128> = BTreeMap::new();
    for device in chosen {
        for consumption in device.consumes_counters.iter().flatten() {
            assert_eq!(consumption.counter_set, set.name);
            for (name, amount) in &consumption.counters {
                *used.entry(name).or_default() += parse_nanos(&amount.value.0).unwrap();
            }
        }
    }
    used.iter().all(|(name, amount)| {
        let available = parse_nanos(&set.counters[*name].value.0).unwrap();
        *amount <= available
    })
}

/// What the hardware model says: each MIG device added in turn must fit next to the ones before; a
/// whole GPU cannot be used together with any MIG device.
fn physically_placeable(mig: &MigInfo, chosen: &[&Device]) -> bool {
    let whole = chosen.iter().filter(|d| !d.name.contains("-mig-")).count();
    if whole > 0 {
        return chosen.len() == 1;
    }
    let mut state = MigInfo {
        instances: Vec::new(),
        ..mig.clone()
    };
    for device in chosen {
        let Some(DeviceName::Mig { profile, start, .. }) = DeviceName::parse(&device.name) else {
            panic!("unexpected device {}", device.name)
        };
        let profile = state.profile_by_dns_name(&profile).unwrap().clone();
        let placement: MigPlacement = *profile
            .placements
            .iter()
            .find(|p| p.start == start)
            .unwrap();
        if physically_fits(&state, &profile, placement).is_err() {
            return false;
        }
        state.instances.push(MigInstance {
            uuid: device.name.clone(),
            profile_id: profile.id,
            placement,
            gpu_instance_id: start + 1,
            compute_instance_id: 0,
            device_files: Vec::new(),
            compute: None,
            index: None,
        });
    }
    true
}

/// Depth-first over sets of devices in index order; both models are monotone (a superset of a refused
/// set is refused), so the walk stops where both refuse and fails where they disagree.
fn walk(
    set: &CounterSet,
    mig: &MigInfo,
    devices: &[Device],
    chosen: &mut Vec<usize>,
    next: usize,
    accepted: &mut usize,
) {
    for index in next..devices.len() {
        chosen.push(index);
        let picked: Vec<&Device> = chosen.iter().map(|&i| &devices[i]).collect();
        let by_counters = counters_allow(set, &picked);
        let by_hardware = physically_placeable(mig, &picked);
        let names: Vec<&str> = picked.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            by_counters, by_hardware,
            "counters say {by_counters}, hardware says {by_hardware} for {names:?}"
        );
        if by_counters {
            *accepted += 1;
            walk(set, mig, devices, chosen, index + 1, accepted);
        }
        chosen.pop();
    }
}

fn check_model(profile: &str) -> usize {
    let inventory = FakeBackend::new("node-a", profile)
        .unwrap()
        .inventory()
        .unwrap();
    let node = node_devices(&inventory, MigMode::Dynamic);
    let gpu = &node.gpus[0];
    let set = gpu.counter_set.as_ref().expect("a partitionable GPU");
    let mut mig = inventory.gpus[0].mig.clone().unwrap();
    mig.enabled = true;
    let mut accepted = 0;
    walk(set, &mig, &gpu.devices, &mut Vec::new(), 0, &mut accepted);
    accepted
}

#[test]
fn h100_counters_allow_exactly_the_placeable_sets() {
    let sets = check_model("dgx-h100");
    assert!(sets > 100, "only {sets} sets explored");
}

#[test]
fn h200_counters_allow_exactly_the_placeable_sets() {
    assert!(check_model("dgx-h200") > 100);
}

#[test]
fn a100_counters_allow_exactly_the_placeable_sets() {
    // A100 with MIG mode on: only MIG devices are published (no whole GPU).
    let backend = FakeBackend::new("node-a", "dgx-a100").unwrap();
    let mut inventory = backend.inventory().unwrap();
    for gpu in inventory.gpus.iter_mut() {
        gpu.mig.as_mut().unwrap().enabled = true;
    }
    let node = node_devices(&inventory, MigMode::Dynamic);
    let gpu = &node.gpus[0];
    assert!(gpu.devices.iter().all(|d| d.name.contains("-mig-")));
    let mut accepted = 0;
    walk(
        gpu.counter_set.as_ref().unwrap(),
        inventory.gpus[0].mig.as_ref().unwrap(),
        &gpu.devices,
        &mut Vec::new(),
        0,
        &mut accepted,
    );
    assert!(accepted > 100);
}
