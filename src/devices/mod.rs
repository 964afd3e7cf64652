//! Inventory → DRA devices: device names, attributes and capacities as the scheduler and CEL selectors
//! see them. Pure functions, no I/O.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::gpu::{Gpu, Inventory};

/// The standard attribute domain of Kubernetes itself (`resource.kubernetes.io/pciBusID`, ...).
const KUBERNETES_DOMAIN: &str = "resource.kubernetes.io";

/// What a DRA device name stands for; names are stable across restarts and parse back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceName {
    /// A whole GPU, `gpu-<minor>`.
    Gpu { minor: u32 },
}

impl DeviceName {
    pub fn parse(name: &str) -> Option<DeviceName> {
        let minor = name.strip_prefix("gpu-")?;
        // Reject forms like `gpu-007` or `gpu-+1` that would not print back to the same name.
        if minor.is_empty()
            || !minor.bytes().all(|b| b.is_ascii_digit())
            || (minor.len() > 1 && minor.starts_with('0'))
        {
            return None;
        }
        minor.parse().ok().map(|minor| DeviceName::Gpu { minor })
    }
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceName::Gpu { minor } => write!(f, "gpu-{minor}"),
        }
    }
}

/// The DRA devices of a node: one per whole GPU, ordered by minor number.
pub fn devices(inventory: &Inventory) -> Vec<Device> {
    let mut gpus: Vec<&Gpu> = inventory.gpus.iter().collect();
    gpus.sort_by_key(|gpu| gpu.minor);
    gpus.into_iter()
        .map(|gpu| whole_gpu(inventory, gpu))
        .collect()
}

fn whole_gpu(inventory: &Inventory, gpu: &Gpu) -> Device {
    let mut attributes = BTreeMap::new();
    attributes.insert("type".to_string(), string("gpu"));
    attributes.insert("uuid".to_string(), string(&gpu.uuid));
    attributes.insert("productName".to_string(), string(&gpu.product_name));
    attributes.insert("brand".to_string(), string(&gpu.brand));
    attributes.insert("architecture".to_string(), string(&gpu.architecture));
    attributes.insert("minor".to_string(), int(i64::from(gpu.minor)));
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

fn string(value: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.to_string()),
        ..Default::default()
    }
}

fn int(value: i64) -> DeviceAttribute {
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
            .and_then(|m| crate::slices::parse_quantity(&m.value.0))
            .map(|nanos| format!("{:.1}", nanos as f64 / 1e9 / f64::from(1u32 << 30)))
            .unwrap_or_else(|| "-".to_string())
    };
    let mut text = format!(
        "{:<10} {:<5} {:<24} {:>9} {:>4} {:<14} {:<38} UUID\n",
        "NAME", "TYPE", "PRODUCT", "MEM(GiB)", "NUMA", "PCI BUS", "NVLINK DOMAIN"
    );
    for device in devices {
        text.push_str(&format!(
            "{:<10} {:<5} {:<24} {:>9} {:>4} {:<14} {:<38} {}\n",
            device.name,
            attribute(device, "type"),
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
}
