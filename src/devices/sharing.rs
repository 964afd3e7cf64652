//! Whole GPUs published for MPS sharing: the device allows multiple allocations, and its `memory`
//! capacity carries a request policy, so the scheduler hands one GPU to several claims, each with a share
//! of its memory (what a claim asks for, rounded up to `minimum + n × step`; `minimum` when it asks none).
//! The prepare side caps each claim's MPS pinned memory at its share. Pure.

use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, CapacityRequestPolicyRange, Device};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{string, DeviceName, NodeDevices};

/// The attribute that marks a GPU published for sharing, so a DeviceClass can select (or avoid) it.
pub const SHARING_ATTRIBUTE: &str = "sharing";
/// Its value for MPS sharing by memory.
pub const SHARING_MPS: &str = "MPS";

/// The share sizes, in bytes (both positive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryShares {
    pub minimum_bytes: u64,
    pub step_bytes: u64,
}

/// Publishes every whole GPU of `node` for MPS sharing with `shares`. Left exclusive: MIG devices, a
/// whole GPU that takes shared counters (dynamic MIG: it cannot be split by memory while its MIG
/// devices may be created), and a GPU too small for the API's rule that one step above the minimum
/// fits in the capacity. Returns the names of the whole GPUs left exclusive for their size.
pub fn share_for_mps(node: &mut NodeDevices, shares: MemoryShares) -> Vec<String> {
    let mut too_small = Vec::new();
    for device in node.gpus.iter_mut().flat_map(|g| g.devices.iter_mut()) {
        let whole = matches!(
            DeviceName::parse(&device.name),
            Some(DeviceName::Gpu { .. })
        );
        let partitionable = device
            .consumes_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty());
        if !whole || partitionable {
            continue;
        }
        if !share(device, shares) {
            too_small.push(device.name.clone());
        }
    }
    too_small
}

/// Makes `device` shareable by memory; false (and unchanged) when it has no room for `shares`.
fn share(device: &mut Device, shares: MemoryShares) -> bool {
    let Some(memory) = device.capacity.as_mut().and_then(|c| c.get_mut("memory")) else {
        return false;
    };
    let Some(total) = crate::quantity::parse_nanos(&memory.value.0) else {
        return false;
    };
    // `validRange.min + step` must not exceed the capacity (ResourceSlice validation).
    let needed = i128::from(shares.minimum_bytes) + i128::from(shares.step_bytes);
    if needed * 1_000_000_000 > total {
        return false;
    }
    let minimum = bytes(shares.minimum_bytes);
    memory.request_policy = Some(CapacityRequestPolicy {
        default: Some(minimum.clone()),
        valid_range: Some(CapacityRequestPolicyRange {
            min: minimum,
            step: Some(bytes(shares.step_bytes)),
            max: None,
        }),
        valid_values: None,
    });
    device.allow_multiple_allocations = Some(true);
    device
        .attributes
        .get_or_insert_with(Default::default)
        .insert(SHARING_ATTRIBUTE.to_string(), string(SHARING_MPS));
    true
}

/// A number of bytes as a quantity, with the largest binary suffix that keeps it exact (`1Gi`,
/// `1536Mi`), as the API server's canonical form writes it.
pub fn bytes(value: u64) -> Quantity {
    const SUFFIXES: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let (mut mantissa, mut suffix) = (value, "");
    for next in SUFFIXES {
        if mantissa == 0 || mantissa % 1024 != 0 {
            break;
        }
        mantissa /= 1024;
        suffix = next;
    }
    Quantity(format!("{mantissa}{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{node_devices, MigMode};
    use crate::gpu::{FakeBackend, GpuBackend};

    const GIB: u64 = 1 << 30;

    fn node(profile: &str, mode: MigMode) -> NodeDevices {
        let inventory = FakeBackend::new("n", profile).unwrap().inventory().unwrap();
        node_devices(&inventory, mode)
    }

    fn shares(minimum_gib: u64, step_gib: u64) -> MemoryShares {
        MemoryShares {
            minimum_bytes: minimum_gib * GIB,
            step_bytes: step_gib * GIB,
        }
    }

    #[test]
    fn whole_gpus_allow_multiple_allocations_with_a_memory_request_policy() {
        let mut node = node("dgx-h100", MigMode::Static);
        assert!(share_for_mps(&mut node, shares(2, 1)).is_empty());
        for device in node.devices() {
            assert_eq!(
                device.allow_multiple_allocations,
                Some(true),
                "{}",
                device.name
            );
            let memory = &device.capacity.as_ref().unwrap()["memory"];
            let policy = memory.request_policy.as_ref().unwrap();
            assert_eq!(policy.default, Some(Quantity("2Gi".into())));
            let range = policy.valid_range.as_ref().unwrap();
            assert_eq!(range.min, Quantity("2Gi".into()));
            assert_eq!(range.step, Some(Quantity("1Gi".into())));
            assert_eq!(range.max, None);
            let sharing = &device.attributes.as_ref().unwrap()[SHARING_ATTRIBUTE];
            assert_eq!(sharing.string.as_deref(), Some("MPS"));
        }
    }

    #[test]
    fn mig_devices_and_partitionable_gpus_stay_exclusive() {
        let mut dynamic = node("dgx-h100", MigMode::Dynamic);
        let before = dynamic.clone();
        assert!(share_for_mps(&mut dynamic, shares(1, 1)).is_empty());
        assert_eq!(dynamic, before, "dynamic MIG GPUs take counters");

        // A100 with MIG mode on offers only MIG devices, which stay exclusive; with it off (and no way
        // to switch it without a reset) the whole GPU takes no counters and is shared.
        let mut inventory = FakeBackend::new("n", "dgx-a100")
            .unwrap()
            .inventory()
            .unwrap();
        inventory.gpus[0].mig.as_mut().unwrap().enabled = true;
        let mut node = node_devices(&inventory, MigMode::Dynamic);
        share_for_mps(&mut node, shares(1, 1));
        assert!(node.gpus[0].devices.len() > 1);
        assert!(node.gpus[0]
            .devices
            .iter()
            .all(|d| d.allow_multiple_allocations.is_none()));
        assert_eq!(node.gpus[1].devices.len(), 1);
        assert_eq!(
            node.gpus[1].devices[0].allow_multiple_allocations,
            Some(true)
        );
    }

    #[test]
    fn a_gpu_without_room_for_one_step_above_the_minimum_stays_exclusive() {
        let mut node = node("dgx-h100", MigMode::None);
        // 81559 MiB (79.6 GiB): 78 GiB + 1 GiB fits, 79 + 1 does not.
        let mut fits = node.clone();
        assert!(share_for_mps(&mut fits, shares(78, 1)).is_empty());
        let too_small = share_for_mps(&mut node, shares(79, 1));
        assert_eq!(too_small.len(), 8);
        assert!(node
            .devices()
            .all(|d| d.allow_multiple_allocations.is_none()));
    }

    #[test]
    fn byte_counts_take_the_largest_exact_binary_suffix() {
        assert_eq!(bytes(GIB).0, "1Gi");
        assert_eq!(bytes(1536 << 20).0, "1536Mi");
        assert_eq!(bytes(2_000_000_000).0, "1953125Ki");
        assert_eq!(bytes(1000).0, "1000");
        assert_eq!(bytes(0).0, "0");
        assert_eq!(bytes(8 << 60).0, "8Ei");
    }
}
