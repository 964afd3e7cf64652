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
pub use sharing::{share_devices, share_for_mps, Enforcement, MemoryShares, ShareCapacity, Shares};

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
pub(super) fn fit_the_limit(device: &mut Device) {
    for name in GIVEN_UP_OVER_THE_LIMIT {
        if attributes_and_capacities(device) <= MAX_ATTRIBUTES_AND_CAPACITIES {
            return;
        }
        if let Some(attributes) = device.attributes.as_mut() {
            attributes.remove(name);
        }
    }
}

/// How many attributes and capacities `device` has: what the API's limit counts.
pub(super) fn attributes_and_capacities(device: &Device) -> usize {
    device.attributes.as_ref().map_or(0, BTreeMap::len)
        + device.capacity.as_ref().map_or(0, BTreeMap::len)
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
mod tests;
