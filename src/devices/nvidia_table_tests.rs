//! Keeps the table of NVIDIA's and gpu-dra's attributes in docs/nvidia-compatibility.md ("Attributes and capacities, side by side") true: every attribute and capacity the table says gpu-dra
//! publishes is published, with that type, on that kind of device, and every one gpu-dra publishes
//! on the fake DGX A100 and H100 nodes has its row. Also checks the API's limit of 32 attributes and
//! capacities per device on the fullest devices those nodes can have.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::Device;

use super::{node_devices, MigMode, MAX_ATTRIBUTES_AND_CAPACITIES};
use crate::gpu::{builtin_profile, FakeBackend, GpuBackend};

/// The table of docs/nvidia-compatibility.md, between its markers.
fn table() -> &'static str {
    const PAGE: &str = include_str!("../../docs/nvidia-compatibility.md");
    let start = PAGE
        .find("<!-- nvidia-attributes -->")
        .expect("docs/nvidia-compatibility.md marks the start of the table");
    let end = PAGE
        .find("<!-- /nvidia-attributes -->")
        .expect("docs/nvidia-compatibility.md marks the end of the table");
    &PAGE[start..end]
}

/// (device kind, name, type) as the table writes them.
type Row = (String, String, String);

/// The table's rows: kind, name, type and whether gpu-dra publishes it (its column starts `yes`).
fn table_rows() -> BTreeMap<Row, bool> {
    let mut rows = BTreeMap::new();
    for line in table().lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | kind | name | type | NVIDIA releases | gpu-dra | example |
        if cells.len() != 8 || !["GPU", "MIG (static)", "MIG (dynamic)"].contains(&cells[1]) {
            continue;
        }
        let name = cells[2].trim_matches('`').to_string();
        let row = (cells[1].to_string(), name, cells[3].to_string());
        let ours = cells[5].starts_with("yes");
        assert!(
            rows.insert(row.clone(), ours).is_none(),
            "row {row:?} appears twice"
        );
    }
    assert!(
        rows.len() > 20,
        "the table was not parsed: {} rows",
        rows.len()
    );
    rows
}

/// `memorySlice3` → `memorySlice<N>`, as the table names the family.
fn family(name: &str) -> String {
    match name.strip_prefix("memorySlice") {
        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            "memorySlice<N>".to_string()
        }
        _ => name.to_string(),
    }
}

fn kind(device: &Device) -> &'static str {
    let attributes = device.attributes.as_ref().expect("attributes");
    match attributes["type"].string.as_deref() {
        Some("gpu") => "GPU",
        Some("mig") if device.consumes_counters.is_some() => "MIG (dynamic)",
        Some("mig") => "MIG (static)",
        other => panic!("{}: type {other:?}", device.name),
    }
}

/// Every (kind, name, type) the devices publish.
fn published(devices: &[Device]) -> BTreeSet<Row> {
    let mut out = BTreeSet::new();
    for device in devices {
        let kind = kind(device).to_string();
        for (name, value) in device.attributes.iter().flatten() {
            let ty = if value.string.is_some() {
                "string"
            } else if value.int.is_some() {
                "int"
            } else if value.bool.is_some() {
                "bool"
            } else if value.version.is_some() {
                "version"
            } else {
                panic!("{}: {name} has no value", device.name)
            };
            out.insert((kind.clone(), family(name), ty.to_string()));
        }
        for name in device.capacity.iter().flatten().map(|(n, _)| n) {
            out.insert((kind.clone(), family(name), "quantity".to_string()));
        }
    }
    out
}

/// The devices of a built-in profile's first GPUs, changed so that they publish everything they
/// can: a coherent-memory addressing mode and module ids, an admin's static MIG devices including
/// one of several compute instances and one spanning the whole GPU, in static and in dynamic mode.
fn fullest_devices(name: &str, full_profile: &str) -> Vec<Device> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.yaml");
    let mut profile = builtin_profile(name).unwrap();
    profile.gpus.truncate(3);
    for (i, gpu) in profile.gpus.iter_mut().enumerate() {
        gpu.addressing_mode = Some("ATS".into());
        gpu.module_id = Some(i as u32 + 1);
    }
    profile.gpus[1].mig_enabled = true;
    profile.gpus[1].mig_instances = serde_yaml::from_str(
        "[{profile: 3g.20gb, start: 0, computeInstances: [1, 2]}, {profile: 1g.5gb, start: 6}]"
            .replace("3g.20gb", &format!("3g.{}", small(full_profile, 3)))
            .replace("1g.5gb", &format!("1g.{}", small(full_profile, 1)))
            .as_str(),
    )
    .unwrap();
    profile.gpus[2].mig_enabled = true;
    profile.gpus[2].mig_instances = serde_yaml::from_str(&format!(
        "[{{profile: {full_profile}, start: 0, computeInstances: [3, 4]}}]"
    ))
    .unwrap();
    std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
    let inventory = FakeBackend::new("n", path.to_str().unwrap())
        .unwrap()
        .inventory()
        .unwrap();
    let mut devices: Vec<Device> = node_devices(&inventory, MigMode::Static)
        .devices()
        .cloned()
        .collect();
    devices.extend(
        node_devices(&inventory, MigMode::Dynamic)
            .devices()
            .cloned(),
    );
    // NVIDIA's --consumable-shares=4 adds the capacity `shares` to every GPU and MIG device.
    let shares = super::Shares::nvidia_flag("4").unwrap().unwrap();
    for mode in [MigMode::Static, MigMode::Dynamic] {
        let mut shared = node_devices(&inventory, mode);
        super::share_devices(&mut shared, &shares);
        devices.extend(shared.devices().cloned());
    }
    devices
}

/// The memory part of the `slices`g profile name of a GPU whose full profile is `full` (`7g.80gb`).
fn small(full: &str, slices: u32) -> &'static str {
    match (full, slices) {
        ("7g.80gb", 3) => "40gb",
        ("7g.80gb", _) => "10gb",
        ("7g.40gb", 3) => "20gb",
        _ => "5gb",
    }
}

#[test]
fn the_nvidia_attribute_table_matches_what_gpu_dra_publishes() {
    let rows = table_rows();
    let mut seen = BTreeSet::new();
    for (name, full) in [("dgx-h100", "7g.80gb"), ("dgx-a100", "7g.40gb")] {
        let devices = fullest_devices(name, full);
        for device in &devices {
            let count = device.attributes.as_ref().map_or(0, BTreeMap::len)
                + device.capacity.as_ref().map_or(0, BTreeMap::len);
            assert!(
                count <= MAX_ATTRIBUTES_AND_CAPACITIES,
                "{name} {}: {count} attributes and capacities",
                device.name
            );
        }
        for row in published(&devices) {
            assert_eq!(
                rows.get(&row),
                Some(&true),
                "{name}: gpu-dra publishes {row:?}; the table lacks it or says gpu-dra does not"
            );
            seen.insert(row);
        }
    }
    for (row, ours) in &rows {
        if *ours {
            assert!(
                seen.contains(row),
                "the table says gpu-dra publishes {row:?}, but no device of the fake nodes has it"
            );
        }
    }
}

#[test]
fn a_static_mig_device_over_the_limit_gives_up_nvidias_legacy_names_only() {
    let devices = fullest_devices("dgx-h100", "7g.80gb");
    let full = devices
        .iter()
        .find(|d| d.name.starts_with("gpu-2-mig-7g80gb-0"))
        .expect("the 7g device");
    let attributes = full.attributes.as_ref().unwrap();
    for kept in [
        "uuid",
        "parentUUID",
        "profile",
        "addressingMode",
        "minor",
        "computeProfile",
    ] {
        assert!(attributes.contains_key(kept), "{kept}");
    }
    for given_up in super::GIVEN_UP_OVER_THE_LIMIT {
        assert!(!attributes.contains_key(given_up), "{given_up}");
    }
    let slices = full
        .capacity
        .as_ref()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("memorySlice"))
        .count();
    assert_eq!(slices, 8);
    // A small one keeps them all.
    let small = devices
        .iter()
        .find(|d| d.name == "gpu-1-mig-1g10gb-6")
        .expect("the 1g device");
    let attributes = small.attributes.as_ref().unwrap();
    assert_eq!(
        attributes["index"].int,
        Some(2),
        "after the 3g's two compute instances"
    );
    assert_eq!(attributes["parentIndex"].int, Some(1));
    assert_eq!(
        attributes["pcieBusID"].string,
        attributes["resource.kubernetes.io/pciBusID"].string
    );
    assert_eq!(
        small.capacity.as_ref().unwrap()["memorySlice6"].value.0,
        "1"
    );
}
