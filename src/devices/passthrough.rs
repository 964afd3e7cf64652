//! GPUs published for VFIO passthrough (an admin's GpuNodePolicy `spec.passthrough`): such a GPU is
//! published only as a passthrough device, `gpu-vfio-<n>` (NVIDIA's name: `n` is the GPU's rank in PCI
//! address order among the node's NVIDIA GPUs, whatever driver holds them), with `type: vfio` and
//! its IOMMU group; its whole-GPU and MIG devices are left out, so no GPU is offered both ways at
//! once. A GPU the node has no IOMMU group for cannot be passed through and stays a GPU.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceCapacity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{int, string, GpuDevices, NodeDevices, KUBERNETES_DOMAIN};
use crate::gpu::{Inventory, PciGpu};

/// The `type` attribute of passthrough devices, as NVIDIA's.
pub const VFIO_TYPE: &str = "vfio";

/// GPUs (by PCI address) that prepared claims hold one way or the other: a GPU keeps being published
/// the way a claim holds it until that claim is gone, whatever the policy says meanwhile, so that a
/// switch never offers it the new way while the old way is in use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldWays {
    /// Held as a GPU or MIG device.
    pub as_gpu: std::collections::BTreeSet<String>,
    /// Held as a passthrough device.
    pub as_vfio: std::collections::BTreeSet<String>,
}

impl HeldWays {
    /// Whether the GPU at `address` is published for passthrough, when the policy would choose so
    /// (`chosen`): the policy's choice, unless a claim holds the GPU the other way.
    pub fn passthrough(&self, chosen: bool, address: &str) -> bool {
        let address = address.to_ascii_lowercase();
        if self.as_vfio.contains(&address) {
            return true;
        }
        chosen && !self.as_gpu.contains(&address)
    }
}

/// Whether a DeviceClass with these CEL expressions selects passthrough devices (`type == "vfio"`, in
/// either quote). Only nodes a GpuNodePolicy chose GPUs on publish any, so such a class matching nothing
/// elsewhere is expected.
pub fn is_passthrough_class<'a>(expressions: impl IntoIterator<Item = &'a str>) -> bool {
    let (double, single) = (format!("\"{VFIO_TYPE}\""), format!("'{VFIO_TYPE}'"));
    expressions
        .into_iter()
        .any(|e| e.contains(&double) || e.contains(&single))
}

/// `gpu-vfio-<n>`.
pub fn device_name(rank: usize) -> String {
    format!("gpu-vfio-{rank}")
}

/// The rank in a `gpu-vfio-<n>` name.
pub fn parse_device_name(name: &str) -> Option<usize> {
    let rank = name.strip_prefix("gpu-vfio-")?;
    if rank.is_empty()
        || !rank.bytes().all(|b| b.is_ascii_digit())
        || (rank.len() > 1 && rank.starts_with('0'))
    {
        return None;
    }
    rank.parse().ok()
}

/// The PCI GPU a `gpu-vfio-<n>` name stands for in `inventory`.
pub fn find<'a>(inventory: &'a Inventory, name: &str) -> Option<&'a PciGpu> {
    inventory.pci_gpus.get(parse_device_name(name)?)
}

/// The passthrough device `name` as this node publishes it.
pub fn device(inventory: &Inventory, name: &str) -> Option<Device> {
    let rank = parse_device_name(name)?;
    let pci = inventory.pci_gpus.get(rank)?;
    Some(passthrough_device(rank, pci, pci.iommu_group?, inventory))
}

/// The passthrough device of `address`, as a name, if it has one on this node.
pub fn name_of(inventory: &Inventory, address: &str) -> Option<String> {
    inventory
        .pci_gpus
        .iter()
        .position(|p| p.address.eq_ignore_ascii_case(address))
        .map(device_name)
}

/// Replaces what each GPU that `selected(minor, pci address)` chooses publishes by its passthrough
/// device. `minor` is known while NVML sees the GPU (bound to the NVIDIA driver).
pub fn publish(
    node: &mut NodeDevices,
    inventory: &Inventory,
    selected: impl Fn(Option<u32>, &str) -> bool,
) {
    for (rank, pci) in inventory.pci_gpus.iter().enumerate() {
        let Some(group) = pci.iommu_group else {
            continue;
        };
        let gpu = inventory
            .gpus
            .iter()
            .find(|g| g.pci_bus_id.eq_ignore_ascii_case(&pci.address));
        if !selected(gpu.map(|g| g.minor), &pci.address) {
            continue;
        }
        let device = passthrough_device(rank, pci, group, inventory);
        match gpu.and_then(|g| node.gpus.iter_mut().find(|d| d.minor == g.minor)) {
            Some(entry) => {
                entry.devices = vec![device];
                entry.counter_set = None;
            }
            None => node.gpus.push(GpuDevices {
                // NVML does not see it (vfio-pci holds it): no minor, so one no GPU has.
                minor: u32::MAX - rank as u32,
                counter_set: None,
                devices: vec![device],
            }),
        }
    }
}

fn passthrough_device(rank: usize, pci: &PciGpu, group: u32, inventory: &Inventory) -> Device {
    let gpu = inventory
        .gpus
        .iter()
        .find(|g| g.pci_bus_id.eq_ignore_ascii_case(&pci.address));
    let mut attributes: BTreeMap<String, DeviceAttribute> = BTreeMap::new();
    attributes.insert("type".into(), string(VFIO_TYPE));
    attributes.insert("vendorID".into(), string(&pci.vendor_id));
    attributes.insert("deviceID".into(), string(&pci.device_id));
    attributes.insert("iommuGroup".into(), int(i64::from(group)));
    // gpu-dra passes through by IOMMU group (legacy VFIO), never through iommufd.
    attributes.insert(
        "iommuFDEnabled".into(),
        DeviceAttribute {
            bool: Some(false),
            ..Default::default()
        },
    );
    attributes.insert(
        format!("{KUBERNETES_DOMAIN}/pciBusID"),
        string(&pci.address),
    );
    let mut capacity = BTreeMap::new();
    if let Some(gpu) = gpu {
        attributes.insert("uuid".into(), string(&gpu.uuid));
        attributes.insert("productName".into(), string(&gpu.product_name));
        if let Some(root) = &gpu.pcie_root {
            attributes.insert(format!("{KUBERNETES_DOMAIN}/pcieRoot"), string(root));
        }
        if let Some(numa) = gpu.numa_node {
            attributes.insert(format!("{KUBERNETES_DOMAIN}/numaNode"), int(numa));
        }
        capacity.insert(
            "addressableMemory".to_string(),
            DeviceCapacity {
                value: Quantity(gpu.memory_bytes.to_string()),
                ..Default::default()
            },
        );
    }
    Device {
        name: device_name(rank),
        attributes: Some(attributes),
        capacity: (!capacity.is_empty()).then_some(capacity),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{node_devices, MigMode};
    use crate::gpu::{FakeBackend, GpuBackend};

    #[test]
    fn passthrough_classes_are_told_by_their_type_in_either_quote() {
        let ours =
            r#"device.driver == "gpu.dra.dev" && device.attributes["gpu.dra.dev"].type == "vfio""#;
        let nvidias = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'vfio'";
        assert!(is_passthrough_class([ours]));
        assert!(is_passthrough_class([nvidias]));
        assert!(!is_passthrough_class([
            r#"device.attributes["gpu.dra.dev"].type == "gpu""#
        ]));
    }

    fn names(node: &NodeDevices) -> Vec<String> {
        node.devices().map(|d| d.name.clone()).collect()
    }

    #[test]
    fn a_chosen_gpu_is_published_only_as_its_passthrough_device() {
        let inventory = FakeBackend::new("n", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        let mut node = node_devices(&inventory, MigMode::Static);
        publish(&mut node, &inventory, |minor, address| {
            minor == Some(1) || address == "0000:c1:00.0"
        });
        assert_eq!(names(&node), ["gpu-0", "gpu-vfio-1", "gpu-2", "gpu-vfio-3"]);
        let device = node.devices().nth(1).unwrap();
        let attribute = |name: &str| device.attributes.as_ref().unwrap()[name].clone();
        assert_eq!(attribute("type").string.as_deref(), Some("vfio"));
        assert_eq!(attribute("iommuGroup").int, Some(11));
        assert_eq!(
            attribute("resource.kubernetes.io/pciBusID")
                .string
                .as_deref(),
            Some("0000:41:00.0")
        );
        assert_eq!(
            attribute("productName").string.as_deref(),
            Some("NVIDIA L40S")
        );
        assert_eq!(
            find(&inventory, "gpu-vfio-3").unwrap().address,
            "0000:c1:00.0"
        );
    }

    #[test]
    fn a_dynamic_mig_gpu_chosen_for_passthrough_loses_its_mig_devices_and_counters() {
        let inventory = FakeBackend::new("n", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        let mut node = node_devices(&inventory, MigMode::Dynamic);
        publish(&mut node, &inventory, |minor, _| minor == Some(0));
        assert_eq!(node.gpus[0].counter_set, None);
        assert_eq!(
            names(&node)
                .iter()
                .filter(|n| n.starts_with("gpu-0"))
                .count(),
            0
        );
        assert!(names(&node).contains(&"gpu-vfio-0".to_string()));
    }

    #[test]
    fn a_gpu_nvml_no_longer_sees_is_still_published_from_the_pci_bus() {
        let mut inventory = FakeBackend::new("n", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        inventory.gpus.retain(|g| g.pci_bus_id != "0000:41:00.0");
        let mut node = node_devices(&inventory, MigMode::Static);
        publish(&mut node, &inventory, |_, address| {
            address == "0000:41:00.0"
        });
        assert!(names(&node).contains(&"gpu-vfio-1".to_string()));
        // By name, such a GPU cannot be chosen: its minor is unknown.
        let mut node = node_devices(&inventory, MigMode::Static);
        publish(&mut node, &inventory, |minor, _| minor == Some(1));
        assert!(!names(&node).contains(&"gpu-vfio-1".to_string()));
    }

    #[test]
    fn names_parse_back() {
        assert_eq!(parse_device_name("gpu-vfio-12"), Some(12));
        for bad in ["gpu-vfio-", "gpu-vfio-01", "gpu-1", "gpu-vfio-1a"] {
            assert_eq!(parse_device_name(bad), None, "{bad}");
        }
    }
}
