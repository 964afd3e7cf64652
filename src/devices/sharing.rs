//! Devices published for sharing among claims (consumable shares): the device allows multiple
//! allocations, and its capacities carry request policies, so the scheduler hands one GPU or MIG
//! device to several claims while what they consume fits. Three ways to count: by `memory` (a claim
//! asks for some, rounded up to `minimum + n × step`), by a fixed number of `shares` per device, or
//! unlimited. [`Shares`] is what a GpuNodePolicy's `spec.sharing` or NVIDIA's `--consumable-shares`
//! asks for; [`share_devices`] applies it. The prepare side enforces it (`claims/sharing.rs`). Pure.

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceCapacity,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{string, DeviceName, NodeDevices};
use crate::gpu::TimeSliceInterval;

/// The attribute that marks a device published for sharing, so a DeviceClass can select (or avoid)
/// it; its value is the enforcement (`MPS`, `TimeSlicing`, `None`). Not published under NVIDIA's
/// `--consumable-shares`, whose devices carry NVIDIA's attributes only.
pub const SHARING_ATTRIBUTE: &str = "sharing";
/// Its value for MPS sharing.
pub const SHARING_MPS: &str = "MPS";
/// The capacity a device shared by count publishes: how many claims it takes.
pub const SHARES_CAPACITY: &str = "shares";
/// NVIDIA's step for memory shares: 1Mi.
pub const MEBIBYTE: u64 = 1 << 20;

/// The share sizes, in bytes (both positive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryShares {
    pub minimum_bytes: u64,
    pub step_bytes: u64,
}

/// How a shared device is counted out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareCapacity {
    /// By memory in sizes the admin chose: default and minimum `minimum`, steps of `step`.
    Memory(MemoryShares),
    /// NVIDIA's `--consumable-shares=memory`: steps of 1Mi, and a claim that names no memory takes
    /// all of it.
    NvidiaMemory,
    /// At most this many claims per device (each takes one `shares` by default); memory may still be
    /// asked for, and is counted, but takes nothing by default.
    Count(u64),
    /// Any number of claims; memory as for `Count`.
    Unlimited,
}

/// What keeps the claims on one shared device apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforcement {
    /// Each claim runs its own MPS control daemon, its memory share its pinned-memory limit.
    Mps,
    /// Whole GPUs are time-sliced with this interval (MIG devices take turns as the driver does).
    TimeSlicing(TimeSliceInterval),
    /// Nothing beyond what a claim's own config asks (NVIDIA's `--consumable-shares`).
    None,
}

impl Enforcement {
    /// The value of the `sharing` attribute.
    pub fn as_str(self) -> &'static str {
        match self {
            Enforcement::Mps => SHARING_MPS,
            Enforcement::TimeSlicing(_) => "TimeSlicing",
            Enforcement::None => "None",
        }
    }
}

/// What the node publishes for sharing, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    pub capacity: ShareCapacity,
    /// Whole GPUs are shared.
    pub gpus: bool,
    /// MIG devices (static and dynamic) are shared.
    pub mig_devices: bool,
    pub enforcement: Enforcement,
    /// NVIDIA's `--consumable-shares` (compatibility mode): NVIDIA's capacity shapes exactly, on every
    /// GPU and MIG device, and no `sharing` attribute.
    pub nvidia: bool,
}

impl Shares {
    /// `spec.sharing.mpsMemoryShares`: whole GPUs by memory, with MPS.
    pub fn mps_memory(sizes: MemoryShares) -> Shares {
        Shares {
            capacity: ShareCapacity::Memory(sizes),
            gpus: true,
            mig_devices: false,
            enforcement: Enforcement::Mps,
            nvidia: false,
        }
    }

    /// NVIDIA's `--consumable-shares` (env `CONSUMABLE_SHARES`): `disabled` (or empty) is `None`;
    /// `memory`, `unlimited` or a whole number of shares per device. The message of a bad value is
    /// NVIDIA's. A count of 1 is refused: a `shares` capacity of 1 has no room for a step above the
    /// minimum, which the API server requires of a request policy.
    pub fn nvidia_flag(text: &str) -> Result<Option<Shares>, String> {
        let text = text.trim();
        let capacity = match text {
            "" | "disabled" => return Ok(None),
            "memory" => ShareCapacity::NvidiaMemory,
            "unlimited" => ShareCapacity::Unlimited,
            other => match other.parse::<i64>() {
                Ok(1) => {
                    return Err(
                        "invalid value for --consumable-shares: \"1\" (one share per \
                         device is not sharing, and the API server refuses a shares capacity of 1; \
                         use 2 or more, or 'disabled')"
                            .into(),
                    )
                }
                Ok(n) if n > 0 => ShareCapacity::Count(n.unsigned_abs()),
                _ => {
                    return Err(format!(
                        "invalid value for --consumable-shares: {other:?} (must be 'disabled', \
                         'memory', 'unlimited', or a positive integer)"
                    ))
                }
            },
        };
        Ok(Some(Shares {
            capacity,
            gpus: true,
            mig_devices: true,
            enforcement: Enforcement::None,
            nvidia: true,
        }))
    }
}

/// Compatibility for callers of the memory-only form: [`share_devices`] with
/// [`Shares::mps_memory`].
pub fn share_for_mps(node: &mut NodeDevices, shares: MemoryShares) -> Vec<String> {
    share_devices(node, &Shares::mps_memory(shares))
}

/// Publishes the devices of `node` that `shares` names for sharing. Whole GPUs of dynamic MIG take
/// shared counters: their shares take them once, so while one claim holds a share no MIG device of
/// that GPU can be made, as the scheduler counts it. A device without room for the shares (memory
/// smaller than the minimum plus one step, which the API server requires, or no room left within
/// the API's 32 attributes and capacities) stays exclusive; returns their names.
pub fn share_devices(node: &mut NodeDevices, shares: &Shares) -> Vec<String> {
    let mut too_small = Vec::new();
    for device in node.gpus.iter_mut().flat_map(|g| g.devices.iter_mut()) {
        let wanted = match DeviceName::parse(&device.name) {
            Some(DeviceName::Gpu { .. }) => shares.gpus,
            Some(DeviceName::Mig { .. }) => shares.mig_devices,
            None => false,
        };
        if wanted && !share(device, shares) {
            too_small.push(device.name.clone());
        }
    }
    too_small
}

/// Makes `device` shareable; false (and unchanged) when it has no room for `shares`.
fn share(device: &mut Device, shares: &Shares) -> bool {
    let before = device.clone();
    let Some(capacities) = device.capacity.as_mut() else {
        return false;
    };
    let Some(total) = capacities
        .get("memory")
        .and_then(|m| crate::quantity::parse_nanos(&m.value.0))
        .and_then(|nanos| u64::try_from(nanos / 1_000_000_000).ok())
    else {
        return false;
    };
    // Max and default must be multiples of the step: NVIDIA rounds the value down to 1Mi.
    let rounded = total / MEBIBYTE * MEBIBYTE;
    let memory_policy = match shares.capacity {
        ShareCapacity::Memory(sizes) => {
            // `validRange.min + step` must not exceed the capacity (ResourceSlice validation).
            if u128::from(sizes.minimum_bytes) + u128::from(sizes.step_bytes) > u128::from(total) {
                return false;
            }
            policy(
                sizes.minimum_bytes,
                sizes.minimum_bytes,
                None,
                sizes.step_bytes,
            )
        }
        ShareCapacity::NvidiaMemory => policy(rounded, MEBIBYTE, Some(rounded), MEBIBYTE),
        ShareCapacity::Count(_) | ShareCapacity::Unlimited => policy(0, 0, Some(rounded), MEBIBYTE),
    };
    if rounded < MEBIBYTE {
        return false;
    }
    let memory = capacities
        .get_mut("memory")
        .expect("read above: the device has a memory capacity");
    if !matches!(shares.capacity, ShareCapacity::Memory(_)) {
        memory.value = bytes(rounded);
    }
    memory.request_policy = Some(memory_policy);
    if !shares.nvidia {
        // Without a policy a claim takes all of a capacity it does not name (a MIG device's
        // multiprocessors, engines): the others take nothing unless asked for. A capacity of 0 (a
        // small profile's encoders) keeps none: all of nothing is nothing, and the API server
        // refuses a range whose one step above `min` exceeds the capacity.
        for (name, capacity) in capacities.iter_mut() {
            let empty = crate::quantity::parse_nanos(&capacity.value.0) == Some(0);
            if name != "memory" && name != SHARES_CAPACITY && !empty {
                capacity.request_policy = Some(CapacityRequestPolicy {
                    default: Some(Quantity("0".into())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: Quantity("0".into()),
                        step: Some(Quantity("1".into())),
                        max: None,
                    }),
                    valid_values: None,
                });
            }
        }
    }
    if let ShareCapacity::Count(count) = shares.capacity {
        let one = Quantity("1".into());
        capacities.insert(
            SHARES_CAPACITY.to_string(),
            DeviceCapacity {
                value: Quantity(count.to_string()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(one.clone()),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: one.clone(),
                        max: Some(Quantity(count.to_string())),
                        step: Some(one),
                    }),
                    valid_values: None,
                }),
            },
        );
    }
    device.allow_multiple_allocations = Some(true);
    if !shares.nvidia {
        device
            .attributes
            .get_or_insert_with(Default::default)
            .insert(
                SHARING_ATTRIBUTE.to_string(),
                string(shares.enforcement.as_str()),
            );
    }
    // `shares` and `sharing` count against the API's limit of attributes and capacities too: a
    // device that cannot give up enough (a static MIG device spanning the GPU, with its memory
    // slices) stays exclusive rather than make its ResourceSlice invalid.
    super::fit_the_limit(device);
    if super::attributes_and_capacities(device) > super::MAX_ATTRIBUTES_AND_CAPACITIES {
        *device = before;
        return false;
    }
    true
}

/// A request policy for memory: `default`, a range from `min` (to `max`) in `step`s, in bytes.
fn policy(default: u64, min: u64, max: Option<u64>, step: u64) -> CapacityRequestPolicy {
    CapacityRequestPolicy {
        default: Some(bytes(default)),
        valid_range: Some(CapacityRequestPolicyRange {
            min: bytes(min),
            step: Some(bytes(step)),
            max: max.map(bytes),
        }),
        valid_values: None,
    }
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
    fn mig_devices_stay_exclusive_unless_named_and_dynamic_gpus_are_shared_too() {
        // Dynamic MIG: whole GPUs take counters, and their shares take them once.
        let mut dynamic = node("dgx-h100", MigMode::Dynamic);
        assert!(share_for_mps(&mut dynamic, shares(1, 1)).is_empty());
        for device in dynamic.devices() {
            let whole = matches!(
                DeviceName::parse(&device.name),
                Some(DeviceName::Gpu { .. })
            );
            assert_eq!(
                device.allow_multiple_allocations == Some(true),
                whole,
                "{}",
                device.name
            );
        }
        let mut both = node("dgx-h100", MigMode::Dynamic);
        let everything = Shares {
            mig_devices: true,
            ..Shares::mps_memory(shares(1, 1))
        };
        let too_small = share_devices(&mut both, &everything);
        // 1g.10gb MIG devices (9.75Gi) have room for 1Gi + 1Gi; every device is shared.
        assert!(too_small.is_empty(), "{too_small:?}");
        assert!(both
            .devices()
            .all(|d| d.allow_multiple_allocations == Some(true)));
        // Other capacities of a MIG device take nothing by default, or a second claim would not fit.
        let mig = both
            .devices()
            .find(|d| d.name.contains("-mig-1g10gb-"))
            .expect("a 1g.10gb device");
        let sms = &mig.capacity.as_ref().unwrap()["multiprocessors"];
        let policy = sms.request_policy.as_ref().expect("a policy");
        assert_eq!(policy.default, Some(Quantity("0".into())));
    }

    fn nvidia(flag: &str) -> Shares {
        Shares::nvidia_flag(flag).unwrap().unwrap()
    }

    fn policy_json(device: &Device, capacity: &str) -> serde_json::Value {
        serde_json::to_value(&device.capacity.as_ref().unwrap()[capacity]).unwrap()
    }

    #[test]
    fn nvidias_flag_gives_nvidias_capacity_shapes() {
        // 81559Mi of memory: already a whole number of Mi.
        let total = "81559Mi";
        let mut memory = node("dgx-h100", MigMode::None);
        assert!(share_devices(&mut memory, &nvidia("memory")).is_empty());
        let gpu = memory.devices().next().unwrap();
        assert_eq!(gpu.allow_multiple_allocations, Some(true));
        assert_eq!(
            policy_json(gpu, "memory"),
            serde_json::json!({"value": total, "requestPolicy": {"default": total,
                "validRange": {"min": "1Mi", "max": total, "step": "1Mi"}}})
        );
        assert!(
            !gpu.attributes
                .as_ref()
                .unwrap()
                .contains_key(SHARING_ATTRIBUTE),
            "NVIDIA's devices carry NVIDIA's attributes only"
        );

        let mut unlimited = node("dgx-h100", MigMode::None);
        share_devices(&mut unlimited, &nvidia("unlimited"));
        let gpu = unlimited.devices().next().unwrap();
        let zero_default = serde_json::json!({"value": total, "requestPolicy": {"default": "0",
            "validRange": {"min": "0", "max": total, "step": "1Mi"}}});
        assert_eq!(policy_json(gpu, "memory"), zero_default);
        assert!(!gpu.capacity.as_ref().unwrap().contains_key(SHARES_CAPACITY));

        let mut four = node("dgx-h100", MigMode::None);
        share_devices(&mut four, &nvidia("4"));
        let gpu = four.devices().next().unwrap();
        assert_eq!(policy_json(gpu, "memory"), zero_default);
        assert_eq!(
            policy_json(gpu, SHARES_CAPACITY),
            serde_json::json!({"value": "4", "requestPolicy": {"default": "1",
                "validRange": {"min": "1", "max": "4", "step": "1"}}})
        );
    }

    #[test]
    fn nvidias_flag_rounds_memory_down_to_a_mebibyte_and_reads_its_values() {
        let mut inventory = FakeBackend::new("n", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        inventory.gpus[0].memory_bytes = (4 << 30) + 12345;
        let mut node = node_devices(&inventory, MigMode::None);
        share_devices(&mut node, &nvidia("memory"));
        let memory = &node.gpus[0].devices[0].capacity.as_ref().unwrap()["memory"];
        assert_eq!(memory.value.0, "4Gi");
        assert_eq!(Shares::nvidia_flag("disabled"), Ok(None));
        assert_eq!(Shares::nvidia_flag(""), Ok(None));
        assert_eq!(
            Shares::nvidia_flag("half"),
            Err("invalid value for --consumable-shares: \"half\" (must be 'disabled', 'memory', 'unlimited', or a positive integer)".into())
        );
        assert_eq!(
            Shares::nvidia_flag("0").unwrap_err(),
            Shares::nvidia_flag("-3").unwrap_err().replace("-3", "0")
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
