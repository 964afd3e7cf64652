//! Inventory → DRA devices: device names, attributes, capacities, counter sets and what each device
//! consumes of them. Pure functions, no I/O. Whole GPUs are `gpu-<minor>`; MIG devices
//! `gpu-<minor>-mig-<profile>-<start>[-ci<id>]` (see [`names`] and [`mig`]). Whole GPUs can be
//! published for MPS sharing by memory ([`sharing`]).

pub mod mig;
pub mod names;
pub mod node_labels;
#[cfg(test)]
mod nvidia_table_tests;
pub mod passthrough;
pub mod sharing;

pub use names::DeviceName;
pub use sharing::{share_for_mps, MemoryShares};

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{CounterSet, Device, DeviceAttribute, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::gpu::{Gpu, Inventory};

/// The standard attribute domain of Kubernetes itself (`resource.kubernetes.io/pciBusID`, ...).
const KUBERNETES_DOMAIN: &str = "resource.kubernetes.io";

/// resource.k8s.io/v1 allows a device at most 32 attributes and capacities together.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;

/// What a device that would pass [`MAX_ATTRIBUTES_AND_CAPACITIES`] gives up, first to last, in
/// NVIDIA's own order of importance: `pcieBusID` (NVIDIA replaced it with the standard
/// `resource.kubernetes.io/pciBusID`, which has the same value), `gpuModuleID` (NVIDIA publishes it
/// only behind an alpha feature gate, off by default), then `index` and `parentIndex` (published up
/// to v25.3 only). Only a static MIG device spanning all eight memory slices comes near the limit
/// (its `memorySliceN` capacities); the table "Attributes and capacities, side by side" in
/// docs/nvidia-compatibility.md says which devices lose what.
pub const GIVEN_UP_OVER_THE_LIMIT: [&str; 4] = ["pcieBusID", "gpuModuleID", "index", "parentIndex"];

/// How MIG-capable GPUs are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MigMode {
    /// Whole GPUs only; GPUs with MIG mode on are not published.
    None,
    /// GPUs with MIG mode on publish the MIG devices an admin created; others publish the whole GPU.
    #[default]
    Static,
    /// Every MIG profile at every placement is published as a partitionable device and created on
    /// demand when a claim is prepared; the whole GPU is published beside them where it can be used.
    Dynamic,
}

impl std::fmt::Display for MigMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MigMode::None => "none",
            MigMode::Static => "static",
            MigMode::Dynamic => "dynamic",
        })
    }
}

/// What one GPU publishes: its devices and, when they are partitionable, the counter set they share.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GpuDevices {
    pub minor: u32,
    pub counter_set: Option<CounterSet>,
    pub devices: Vec<Device>,
}

/// What a node publishes, GPU by GPU in minor order, then its IMEX channels (on nodes of an NVLink
/// clique; see [`crate::domains::channels`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeDevices {
    pub gpus: Vec<GpuDevices>,
    pub channels: Vec<Device>,
}

impl NodeDevices {
    /// Every device, in publishing order.
    pub fn devices(&self) -> impl Iterator<Item = &Device> {
        self.gpus
            .iter()
            .flat_map(|g| g.devices.iter())
            .chain(self.channels.iter())
    }

    pub fn device_count(&self) -> usize {
        self.gpus.iter().map(|g| g.devices.len()).sum::<usize>() + self.channels.len()
    }
}

/// The DRA devices of a node under the given MIG mode.
pub fn node_devices(inventory: &Inventory, mig_mode: MigMode) -> NodeDevices {
    let mut gpus: Vec<&Gpu> = inventory.gpus.iter().collect();
    gpus.sort_by_key(|gpu| gpu.minor);
    NodeDevices {
        gpus: gpus
            .into_iter()
            .map(|gpu| gpu_devices(inventory, gpu, mig_mode))
            .collect(),
        channels: Vec::new(),
    }
}

fn gpu_devices(inventory: &Inventory, gpu: &Gpu, mig_mode: MigMode) -> GpuDevices {
    let mut out = GpuDevices {
        minor: gpu.minor,
        ..Default::default()
    };
    let mig = gpu.mig.as_ref();
    let mig_on = mig.is_some_and(|m| m.enabled);
    match (mig_mode, mig) {
        (MigMode::Dynamic, Some(mig)) if mig.enabled || mig.toggles_without_reset => {
            let set = mig::counter_set(gpu, mig);
            // The whole GPU can be handed out only where MIG mode can be switched off again without
            // a reset; on A100 with MIG mode on, only MIG devices are usable. Where switching it off
            // failed, the GPU stays in MIG mode and CUDA cannot use it whole.
            let can_switch_off = mig.toggles_without_reset && mig.disable_failed.is_none();
            if !mig.enabled || can_switch_off {
                let mut whole = whole_gpu(inventory, gpu);
                if let Some(set) = &set {
                    whole.consumes_counters = Some(vec![mig::whole_gpu_consumption(set)]);
                }
                // As NVIDIA's partitionable whole GPU: the largest of each MIG capacity. `memory`
                // stays the GPU's own, which is more than NVIDIA's (its largest MIG profile's).
                if let Some(capacity) = whole.capacity.as_mut() {
                    for (name, value) in mig::largest_capacities(mig) {
                        capacity.entry(name).or_insert(value);
                    }
                }
                out.devices.push(whole);
            }
            if let Some(set) = &set {
                out.devices
                    .extend(mig::dynamic_devices(inventory, gpu, mig, set));
            }
            out.counter_set = set;
        }
        (MigMode::Static, Some(mig)) if mig.enabled => {
            out.devices = mig::static_devices(inventory, gpu, mig);
        }
        _ if mig_on => {} // MIG mode on but not managed by this mode: the whole GPU is unusable.
        _ => out.devices.push(whole_gpu(inventory, gpu)),
    }
    for device in &mut out.devices {
        fit_the_limit(device);
    }
    out
}

/// Gives up attributes in the order of [`GIVEN_UP_OVER_THE_LIMIT`] until the device is within
/// [`MAX_ATTRIBUTES_AND_CAPACITIES`], so that the API server accepts its ResourceSlice.
fn fit_the_limit(device: &mut Device) {
    let count = |d: &Device| {
        d.attributes.as_ref().map_or(0, BTreeMap::len)
            + d.capacity.as_ref().map_or(0, BTreeMap::len)
    };
    for name in GIVEN_UP_OVER_THE_LIMIT {
        if count(device) <= MAX_ATTRIBUTES_AND_CAPACITIES {
            return;
        }
        if let Some(attributes) = device.attributes.as_mut() {
            attributes.remove(name);
        }
    }
}

/// The parent-GPU attributes whole GPUs and MIG devices share.
fn common_attributes(inventory: &Inventory, gpu: &Gpu) -> BTreeMap<String, DeviceAttribute> {
    let mut attributes = BTreeMap::new();
    attributes.insert("uuid".to_string(), string(&gpu.uuid));
    attributes.insert("productName".to_string(), string(&gpu.product_name));
    attributes.insert("brand".to_string(), string(&gpu.brand));
    attributes.insert("architecture".to_string(), string(&gpu.architecture));
    attributes.insert("minor".to_string(), int(i64::from(gpu.minor)));
    // NVIDIA's names up to v25.3 (`index`, `pcieBusID`) and since v25.12 (`addressingMode`; and
    // `gpuModuleID` behind its FabricManagerPartitioning gate), so that their selectors port.
    attributes.insert("index".to_string(), int(i64::from(gpu.index)));
    attributes.insert("pcieBusID".to_string(), string(&gpu.pci_bus_id));
    if let Some(mode) = &gpu.addressing_mode {
        attributes.insert("addressingMode".to_string(), string(mode));
    }
    if let Some(module) = gpu.module_id {
        attributes.insert("gpuModuleID".to_string(), int(i64::from(module)));
    }
    insert_version(
        &mut attributes,
        "cudaComputeCapability",
        &gpu.cuda_compute_capability,
    );
    insert_version(&mut attributes, "driverVersion", &inventory.driver_version);
    insert_version(
        &mut attributes,
        "cudaDriverVersion",
        &inventory.cuda_driver_version,
    );
    if let Some(domain) = &gpu.nvlink_domain {
        attributes.insert("nvlinkDomain".to_string(), string(domain));
    }
    attributes.insert(
        format!("{KUBERNETES_DOMAIN}/pciBusID"),
        string(&gpu.pci_bus_id),
    );
    if let Some(root) = &gpu.pcie_root {
        attributes.insert(format!("{KUBERNETES_DOMAIN}/pcieRoot"), string(root));
    }
    if let Some(numa) = gpu.numa_node {
        attributes.insert(format!("{KUBERNETES_DOMAIN}/numaNode"), int(numa));
    }
    attributes
}

fn whole_gpu(inventory: &Inventory, gpu: &Gpu) -> Device {
    let mut attributes = common_attributes(inventory, gpu);
    attributes.insert("type".to_string(), string("gpu"));
    let mut capacity = BTreeMap::new();
    capacity.insert(
        "memory".to_string(),
        DeviceCapacity {
            value: Quantity(gpu.memory_bytes.to_string()),
            ..Default::default()
        },
    );
    Device {
        name: DeviceName::Gpu { minor: gpu.minor }.to_string(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        ..Default::default()
    }
}

pub(crate) fn string(value: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.to_string()),
        ..Default::default()
    }
}

pub(crate) fn int(value: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(value),
        ..Default::default()
    }
}

/// Version attributes must be strict semver; a value that cannot be made one is left out rather than
/// published as something the API server would reject.
fn insert_version(attributes: &mut BTreeMap<String, DeviceAttribute>, name: &str, raw: &str) {
    if let Some(version) = normalize_version(raw) {
        attributes.insert(
            name.to_string(),
            DeviceAttribute {
                version: Some(version),
                ..Default::default()
            },
        );
    }
}

/// Turns NVIDIA's version strings into semver: `12.4` → `12.4.0`, `550.90.07` → `550.90.7`
/// (semver forbids leading zeros), `9.0` → `9.0.0`.
pub fn normalize_version(raw: &str) -> Option<String> {
    let parts: Vec<&str> = raw.trim().split('.').collect();
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let mut numbers = Vec::with_capacity(3);
    for part in &parts {
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        numbers.push(part.parse::<u64>().ok()?);
    }
    numbers.resize(3, 0);
    Some(format!("{}.{}.{}", numbers[0], numbers[1], numbers[2]))
}

/// A human-readable table of devices for `gpu-dra devices -o table`.
pub fn table(devices: &[Device]) -> String {
    let attribute = |device: &Device, name: &str| -> String {
        device
            .attributes
            .as_ref()
            .and_then(|a| a.get(name))
            .map(|a| {
                a.string
                    .clone()
                    .or_else(|| a.version.clone())
                    .or_else(|| a.int.map(|i| i.to_string()))
                    .or_else(|| a.bool.map(|b| b.to_string()))
                    .unwrap_or_default()
            })
            .unwrap_or_else(|| "-".to_string())
    };
    let memory = |device: &Device| -> String {
        device
            .capacity
            .as_ref()
            .and_then(|c| c.get("memory"))
            .and_then(|m| crate::quantity::parse_nanos(&m.value.0))
            .map(|nanos| format!("{:.1}", nanos as f64 / 1e9 / f64::from(1u32 << 30)))
            .unwrap_or_else(|| "-".to_string())
    };
    let width = devices
        .iter()
        .map(|d| d.name.len())
        .max()
        .unwrap_or(0)
        .max(10);
    // `imex-channel` is wider than `gpu` and `mig`.
    let type_width = devices
        .iter()
        .map(|d| attribute(d, "type").len())
        .max()
        .unwrap_or(0)
        .max(5);
    let mut text = format!(
        "{:<width$} {:<type_width$} {:<10} {:<24} {:>9} {:>4} {:<14} {:<38} UUID\n",
        "NAME", "TYPE", "PROFILE", "PRODUCT", "MEM(GiB)", "NUMA", "PCI BUS", "NVLINK DOMAIN"
    );
    for device in devices {
        text.push_str(&format!(
            "{:<width$} {:<type_width$} {:<10} {:<24} {:>9} {:>4} {:<14} {:<38} {}\n",
            device.name,
            attribute(device, "type"),
            attribute(device, "profile"),
            attribute(device, "productName"),
            memory(device),
            attribute(device, &format!("{KUBERNETES_DOMAIN}/numaNode")),
            attribute(device, &format!("{KUBERNETES_DOMAIN}/pciBusID")),
            attribute(device, "nvlinkDomain"),
            attribute(device, "uuid"),
        ));
    }
    text
}

#[cfg(test)]
mod tests {
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
}
