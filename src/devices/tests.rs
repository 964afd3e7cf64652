//! Unit tests of the device model: names, attributes, MIG modes, the attribute limit.

use super::*;
use crate::gpu::{FakeBackend, GpuBackend};

fn devices(inventory: &Inventory) -> Vec<Device> {
    node_devices(inventory, MigMode::Static)
        .devices()
        .cloned()
        .collect()
}

fn h100() -> Vec<Device> {
    devices(
        &FakeBackend::new("node-a", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap(),
    )
}

fn attr<'a>(device: &'a Device, name: &str) -> &'a DeviceAttribute {
    device
        .attributes
        .as_ref()
        .unwrap()
        .get(name)
        .unwrap_or_else(|| panic!("no attribute {name}"))
}

#[test]
fn whole_gpus_carry_the_design_attributes() {
    let devices = h100();
    assert_eq!(devices.len(), 8);
    assert_eq!(devices[0].name, "gpu-0");
    assert_eq!(devices[7].name, "gpu-7");
    let gpu = &devices[3];
    assert_eq!(attr(gpu, "type").string.as_deref(), Some("gpu"));
    assert_eq!(
        attr(gpu, "productName").string.as_deref(),
        Some("NVIDIA H100 80GB HBM3")
    );
    assert_eq!(attr(gpu, "architecture").string.as_deref(), Some("Hopper"));
    assert_eq!(
        attr(gpu, "cudaComputeCapability").version.as_deref(),
        Some("9.0.0")
    );
    assert_eq!(
        attr(gpu, "driverVersion").version.as_deref(),
        Some("550.90.7")
    );
    assert_eq!(
        attr(gpu, "cudaDriverVersion").version.as_deref(),
        Some("12.4.0")
    );
    assert!(attr(gpu, "uuid")
        .string
        .as_deref()
        .unwrap()
        .starts_with("GPU-"));
    assert_eq!(
        attr(gpu, "resource.kubernetes.io/pciBusID")
            .string
            .as_deref(),
        Some("0000:5d:00.0")
    );
    assert_eq!(attr(gpu, "resource.kubernetes.io/numaNode").int, Some(0));
    assert_eq!(
        attr(&devices[4], "resource.kubernetes.io/numaNode").int,
        Some(1)
    );
    let domain = attr(gpu, "nvlinkDomain").string.clone();
    assert!(domain.is_some());
    assert!(devices
        .iter()
        .all(|d| attr(d, "nvlinkDomain").string == domain));
    let memory = &gpu.capacity.as_ref().unwrap()["memory"].value.0;
    assert_eq!(memory, &(81559u64 * 1024 * 1024).to_string());
    for device in &devices {
        let count =
            device.attributes.as_ref().unwrap().len() + device.capacity.as_ref().unwrap().len();
        assert!(count <= 32, "API limit of 32 attributes + capacities");
    }
}

#[test]
fn gpus_without_nvlink_have_no_domain() {
    let l40s = devices(
        &FakeBackend::new("n", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap(),
    );
    assert!(l40s
        .iter()
        .all(|d| !d.attributes.as_ref().unwrap().contains_key("nvlinkDomain")));
}

#[test]
fn device_names_parse_back() {
    for device in h100() {
        let parsed = DeviceName::parse(&device.name).unwrap();
        assert_eq!(parsed.to_string(), device.name);
    }
    for bad in [
        "gpu-",
        "gpu-07",
        "gpu-+1",
        "gpu-1x",
        "mig-1",
        "GPU-1",
        "gpu-99999999999",
    ] {
        assert_eq!(DeviceName::parse(bad), None, "{bad}");
    }
}

#[test]
fn versions_become_semver() {
    assert_eq!(normalize_version("12.4").as_deref(), Some("12.4.0"));
    assert_eq!(normalize_version("550.90.07").as_deref(), Some("550.90.7"));
    assert_eq!(normalize_version("9").as_deref(), Some("9.0.0"));
    assert_eq!(normalize_version("1.2.3.4"), None);
    assert_eq!(normalize_version("12.x"), None);
    assert_eq!(normalize_version(""), None);
}

fn node(profile: &str, mode: MigMode) -> NodeDevices {
    node_devices(
        &FakeBackend::new("node-a", profile)
            .unwrap()
            .inventory()
            .unwrap(),
        mode,
    )
}

#[test]
fn dynamic_mig_publishes_every_profile_at_every_placement_with_counters() {
    let node = node("dgx-h100", MigMode::Dynamic);
    assert_eq!(node.gpus.len(), 8);
    let gpu = &node.gpus[2];
    // The whole GPU plus 7 + 7 + 4 + 3 + 2 + 1 + 1 MIG placements.
    assert_eq!(gpu.devices.len(), 26);
    assert_eq!(gpu.devices[0].name, "gpu-2");
    let set = gpu.counter_set.as_ref().unwrap();
    assert_eq!(set.name, "gpu-2-counters");
    assert_eq!(set.counters["memory-slice-7"].value.0, "1");
    // Totals no set of placements can exceed are left out (mig.rs tests that nothing changes).
    assert!(!set.counters.contains_key("compute-slices"));
    assert!(set.counters.len() <= 32);
    for device in &gpu.devices {
        let parsed = DeviceName::parse(&device.name).unwrap();
        assert_eq!(parsed.to_string(), device.name);
        assert_eq!(parsed.minor(), 2);
        let consumed = device.consumes_counters.as_ref().unwrap();
        assert_eq!(consumed.len(), 1);
        assert_eq!(consumed[0].counter_set, set.name);
        for name in consumed[0].counters.keys() {
            assert!(set.counters.contains_key(name), "{name}");
        }
        let count =
            device.attributes.as_ref().unwrap().len() + device.capacity.as_ref().unwrap().len();
        assert!(count <= 32, "{}: {count}", device.name);
    }
    let mig = gpu
        .devices
        .iter()
        .find(|d| d.name == "gpu-2-mig-3g40gb-4")
        .unwrap();
    assert_eq!(attr(mig, "type").string.as_deref(), Some("mig"));
    assert_eq!(attr(mig, "profile").string.as_deref(), Some("3g.40gb"));
    assert_eq!(
        attr(mig, "parentUUID").string,
        attr(&gpu.devices[0], "uuid").string
    );
    assert!(!mig.attributes.as_ref().unwrap().contains_key("uuid"));
    assert_eq!(
        mig.capacity.as_ref().unwrap()["multiprocessors"].value.0,
        "60"
    );
    let consumed = &mig.consumes_counters.as_ref().unwrap()[0].counters;
    let slices: Vec<_> = consumed
        .keys()
        .filter(|k| k.starts_with("memory-slice-"))
        .cloned()
        .collect();
    assert_eq!(
        slices,
        vec![
            "memory-slice-4",
            "memory-slice-5",
            "memory-slice-6",
            "memory-slice-7"
        ]
    );
    // The whole GPU takes every memory slice, so it excludes all its MIG devices.
    let whole = &gpu.devices[0].consumes_counters.as_ref().unwrap()[0].counters;
    assert_eq!(
        whole
            .keys()
            .filter(|k| k.starts_with("memory-slice-"))
            .count(),
        8
    );
}

#[test]
fn small_partitions_are_offered_where_they_leave_large_placements_whole() {
    let node = node("dgx-h100", MigMode::Dynamic);
    let names: Vec<&str> = node.gpus[0]
        .devices
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    let order = |prefix: &str| -> Vec<&str> {
        names
            .iter()
            .filter(|n| {
                n.starts_with(prefix) && n[prefix.len()..].bytes().all(|b| b.is_ascii_digit())
            })
            .map(|n| &n[prefix.len()..])
            .collect()
    };
    // 1g devices fill the top half first, keeping the 4g placement at slice 0 free longest.
    assert_eq!(
        order("gpu-0-mig-1g10gb-"),
        vec!["6", "4", "5", "0", "1", "2", "3"]
    );
    assert_eq!(order("gpu-0-mig-2g20gb-"), vec!["4", "0", "2"]);
    assert_eq!(order("gpu-0-mig-3g40gb-"), vec!["4", "0"]);
    // Smaller profiles come before larger ones.
    let first = |p: &str| names.iter().position(|n| n.starts_with(p)).unwrap();
    assert!(first("gpu-0-mig-1g10gb-") < first("gpu-0-mig-1g20gb-"));
    assert!(first("gpu-0-mig-3g40gb-") < first("gpu-0-mig-7g80gb-"));
}

#[test]
fn ampere_with_mig_on_offers_only_mig_devices_and_off_only_the_whole_gpu() {
    let mut inventory = FakeBackend::new("n", "dgx-a100")
        .unwrap()
        .inventory()
        .unwrap();
    let off = node_devices(&inventory, MigMode::Dynamic);
    assert_eq!(off.gpus[0].devices.len(), 1);
    assert!(off.gpus[0].counter_set.is_none());
    for gpu in inventory.gpus.iter_mut() {
        gpu.mig.as_mut().unwrap().enabled = true;
    }
    let on = node_devices(&inventory, MigMode::Dynamic);
    assert!(on.gpus[0].devices.iter().all(|d| d.name.contains("-mig-")));
    assert_eq!(on.gpus[0].devices.len(), 25);
}

#[test]
fn static_mig_publishes_existing_devices_with_uuids() {
    let mut inventory = FakeBackend::new("n", "dgx-h100")
        .unwrap()
        .inventory()
        .unwrap();
    let backend = FakeBackend::new("n", "dgx-h100").unwrap();
    let gpu = inventory.gpus[1].clone();
    let profile = gpu.mig.as_ref().unwrap().profiles[4].clone(); // 3g.40gb
    let made = backend
        .create_mig(&crate::gpu::MigRequest {
            parent_uuid: gpu.uuid.clone(),
            profile_id: profile.id,
            placement: profile.placements[1],
        })
        .unwrap();
    inventory = backend.inventory().unwrap();
    let node = node_devices(&inventory, MigMode::Static);
    assert_eq!(node.gpus[0].devices[0].name, "gpu-0");
    let devices = &node.gpus[1].devices;
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].name, "gpu-1-mig-3g40gb-4");
    assert_eq!(
        attr(&devices[0], "uuid").string.as_deref(),
        Some(made.uuid.as_str())
    );
    assert!(devices[0].consumes_counters.is_none());
    assert!(node.gpus[1].counter_set.is_none());

    // MIG mode none leaves the MIG-enabled GPU out rather than offer a GPU CUDA cannot use whole.
    let none = node_devices(&inventory, MigMode::None);
    assert!(none.gpus[1].devices.is_empty());
    assert_eq!(none.gpus[0].devices.len(), 1);
}
