//! The slice planner: splits a node's devices and counter sets into ResourceSlices that stay within the
//! API limits of the server's version. Pure; the publisher turns the plan into API objects.
//!
//! Layouts: up to Kubernetes 1.34 a partitionable GPU's counter set must sit in the same slice as the
//! devices that consume it, so its devices and counter set go into one combined slice, shared with
//! further GPUs as far as 1.34's limits allow. From 1.35 a slice holds devices or counter sets, not
//! both: counter sets go into their own slices (at most 8 each) and the GPUs' devices into others, as
//! many whole GPUs to a slice as fit. Devices without counters share slices, up to 128 each (64 with
//! taints).
//!
//! Few slices matter at scale: for every pod, the scheduler's DRA filter walks every slice of the
//! cluster once per node it tries (upstream `GatherPools`), so its time per pod grows with the number
//! of nodes times slices per node (BENCHMARKS.md, "At cluster scale"). A GPU is never split between
//! slices where it fits one, so a change to one GPU still rewrites one slice.

use k8s_openapi::api::resource::v1::{CounterSet, Device};

use crate::devices::{DeviceName, NodeDevices};

/// `ResourceSliceMaxDevices`.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// `ResourceSliceMaxDevicesWithTaintsOrConsumesCounters` (1.35+): the lower limit that applies as soon as
/// any device of the slice has taints or consumes counters.
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS: usize = 64;
/// `ResourceSliceMaxCounterSets` (1.35+).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// `ResourceSliceMaxSharedCounters` (1.34): counters of all counter sets of a slice together.
pub const MAX_SHARED_COUNTERS_1_34: usize = 32;
/// `ResourceSliceMaxDeviceCountersPerSlice` (1.34): counters consumed by all devices of a slice together.
pub const MAX_DEVICE_COUNTERS_1_34: usize = 1024;
/// `DeviceTaintsMaxLength`: 4 in 1.34, 16 from 1.35.
const MAX_TAINTS_1_34: usize = 4;
const MAX_TAINTS: usize = 16;

/// The Kubernetes minor version the API server reports, which decides the slice layout and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServerVersion {
    pub minor: u32,
}

impl ServerVersion {
    /// The oldest version the driver supports.
    pub const OLDEST: ServerVersion = ServerVersion { minor: 34 };

    /// From the `minor` field of `/version`, which some distributions suffix (`35+`).
    pub fn from_minor(minor: &str) -> Option<ServerVersion> {
        let digits: String = minor.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok().map(|minor| ServerVersion { minor })
    }

    /// Whether counter sets live in slices of their own (1.35+).
    pub fn splits_counters(&self) -> bool {
        self.minor >= 35
    }

    /// Whether taints may have effect `None` (1.35+).
    pub fn allows_none_effect(&self) -> bool {
        self.minor >= 35
    }
}

/// One slice to publish.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlannedSlice {
    pub devices: Vec<Device>,
    pub shared_counters: Vec<CounterSet>,
}

/// The slices of the pool, in publishing order. A pool always has at least one slice, empty if the node
/// has no devices, so that consumers see the pool exists and is empty.
pub fn plan(node: &NodeDevices, version: ServerVersion) -> Vec<PlannedSlice> {
    let mut slices = Vec::new();
    let (partitionable, plain): (Vec<_>, Vec<_>) =
        node.gpus.iter().partition(|g| g.counter_set.is_some());
    let partitionable: Vec<PlannedSlice> = partitionable
        .iter()
        .map(|gpu| PlannedSlice {
            devices: fitted(&gpu.devices, version),
            shared_counters: gpu.counter_set.clone().into_iter().collect(),
        })
        .collect();

    if version.splits_counters() {
        let sets: Vec<CounterSet> = partitionable
            .iter()
            .flat_map(|gpu| gpu.shared_counters.clone())
            .collect();
        for chunk in sets.chunks(MAX_COUNTER_SETS_PER_SLICE) {
            slices.push(PlannedSlice {
                devices: Vec::new(),
                shared_counters: chunk.to_vec(),
            });
        }
        let device_only = partitionable.into_iter().map(|gpu| PlannedSlice {
            devices: gpu.devices,
            shared_counters: Vec::new(),
        });
        for mut group in pack(device_only, fits_device_slice) {
            whole_gpus_first(&mut group.devices);
            slices.extend(device_slices(&group.devices));
        }
    } else {
        for mut group in pack(partitionable, fits_combined_slice_1_34) {
            // A combined slice: the counter sets stay with the devices that consume them.
            if fits_combined_slice_1_34(&group) {
                whole_gpus_first(&mut group.devices);
                slices.push(group);
                continue;
            }
            let mut chunks = device_slices(&group.devices);
            if let Some(first) = chunks.first_mut() {
                first.shared_counters = group.shared_counters;
            }
            slices.extend(chunks);
        }
    }
    let plain_devices: Vec<Device> = plain.iter().flat_map(|g| g.devices.clone()).collect();
    slices.extend(device_slices(&fitted(&plain_devices, version)));
    // IMEX channels in slices of their own: they share no counters, and a GPU's slice stays as it was.
    slices.extend(device_slices(&fitted(&node.channels, version)));
    if slices.is_empty() {
        slices.push(PlannedSlice::default());
    }
    slices
}

/// Joins consecutive GPUs' slices as long as `fits` accepts the joined slice. A GPU that does not fit
/// a slice on its own stays alone (and is cut by [`device_slices`]).
fn pack(
    gpus: impl IntoIterator<Item = PlannedSlice>,
    fits: fn(&PlannedSlice) -> bool,
) -> Vec<PlannedSlice> {
    let mut groups: Vec<PlannedSlice> = Vec::new();
    for gpu in gpus {
        if let Some(last) = groups.last_mut() {
            let mut joined = last.clone();
            joined.devices.extend(gpu.devices.iter().cloned());
            joined
                .shared_counters
                .extend(gpu.shared_counters.iter().cloned());
            if fits(&joined) {
                *last = joined;
                continue;
            }
        }
        groups.push(gpu);
    }
    groups
}

/// Puts a slice's whole GPUs before its MIG devices, each kind in its order. The scheduler tries a
/// slice's devices in order and skips those in use before it evaluates any selector: a whole-GPU claim
/// then passes over allocated GPUs at the cost of a lookup, where MIG devices in between would each cost
/// a CEL evaluation (25 for every allocated H100); a MIG claim pays one evaluation per whole GPU.
fn whole_gpus_first(devices: &mut [Device]) {
    devices.sort_by_key(|d| !matches!(DeviceName::parse(&d.name), Some(DeviceName::Gpu { .. })));
}

/// Whether a slice of devices only is within the device limit that applies to it.
fn fits_device_slice(slice: &PlannedSlice) -> bool {
    slice.devices.len() <= device_limit(&slice.devices)
}

/// Whether a combined slice is within 1.34's limits: 128 devices, 32 shared counters, 1024 counters
/// consumed.
fn fits_combined_slice_1_34(slice: &PlannedSlice) -> bool {
    let shared: usize = slice.shared_counters.iter().map(|s| s.counters.len()).sum();
    let consumed: usize = slice
        .devices
        .iter()
        .flat_map(|d| d.consumes_counters.iter().flatten())
        .map(|c| c.counters.len())
        .sum();
    slice.devices.len() <= MAX_DEVICES_PER_SLICE
        && shared <= MAX_SHARED_COUNTERS_1_34
        && consumed <= MAX_DEVICE_COUNTERS_1_34
}

/// Fits device taints to what the server accepts: 1.34 knows no effect `None` (those taints, which
/// only inform, are left out) and takes 4 taints per device, later versions 16; the most severe stay.
fn fit_taints(devices: &mut [Device], version: ServerVersion) {
    let limit = if version.allows_none_effect() {
        MAX_TAINTS
    } else {
        MAX_TAINTS_1_34
    };
    for device in devices.iter_mut() {
        let Some(taints) = device.taints.as_mut() else {
            continue;
        };
        if !version.allows_none_effect() {
            taints.retain(|t| t.effect != "None");
        }
        let severity = |effect: &str| match effect {
            "NoExecute" => 0,
            "NoSchedule" => 1,
            _ => 2,
        };
        taints.sort_by_key(|t| severity(&t.effect));
        taints.truncate(limit);
        if taints.is_empty() {
            device.taints = None;
        }
    }
}

fn fitted(devices: &[Device], version: ServerVersion) -> Vec<Device> {
    let mut devices = devices.to_vec();
    fit_taints(&mut devices, version);
    devices
}

/// The most devices a slice holding `devices` may have: 64 once any has taints or consumes counters.
fn device_limit(devices: &[Device]) -> usize {
    let advanced = devices.iter().any(|d| {
        d.taints.as_ref().is_some_and(|t| !t.is_empty())
            || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
    });
    if advanced {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
    } else {
        MAX_DEVICES_PER_SLICE
    }
}

/// Device-only slices for `devices`, cut at the limit that applies to them.
fn device_slices(devices: &[Device]) -> Vec<PlannedSlice> {
    devices
        .chunks(device_limit(devices))
        .map(|chunk| PlannedSlice {
            devices: chunk.to_vec(),
            shared_counters: Vec::new(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{node_devices, GpuDevices, MigMode};
    use crate::gpu::{FakeBackend, GpuBackend};
    use k8s_openapi::api::resource::v1::DeviceTaint;

    const V1_34: ServerVersion = ServerVersion { minor: 34 };
    const V1_35: ServerVersion = ServerVersion { minor: 35 };

    fn plain(n: usize) -> NodeDevices {
        NodeDevices {
            gpus: (0..n)
                .map(|i| GpuDevices {
                    minor: i as u32,
                    counter_set: None,
                    devices: vec![Device {
                        name: format!("gpu-{i}"),
                        ..Default::default()
                    }],
                })
                .collect(),
            channels: Vec::new(),
        }
    }

    fn dynamic(profile: &str) -> NodeDevices {
        let inventory = FakeBackend::new("node-a", profile)
            .unwrap()
            .inventory()
            .unwrap();
        node_devices(&inventory, MigMode::Dynamic)
    }

    fn sizes(slices: &[PlannedSlice]) -> Vec<(usize, usize)> {
        slices
            .iter()
            .map(|s| (s.devices.len(), s.shared_counters.len()))
            .collect()
    }

    #[test]
    fn small_pools_fit_one_slice_and_empty_pools_publish_one_empty_slice() {
        assert_eq!(sizes(&plan(&plain(8), V1_35)), vec![(8, 0)]);
        assert_eq!(
            plan(&NodeDevices::default(), V1_35),
            vec![PlannedSlice::default()]
        );
    }

    #[test]
    fn large_pools_split_at_the_device_limit_keeping_order() {
        let node = plain(300);
        let slices = plan(&node, V1_35);
        assert_eq!(sizes(&slices), vec![(128, 0), (128, 0), (44, 0)]);
        let names: Vec<_> = slices
            .iter()
            .flat_map(|s| &s.devices)
            .map(|d| &d.name)
            .collect();
        let want: Vec<_> = node.devices().map(|d| &d.name).collect();
        assert_eq!(names, want);
    }

    #[test]
    fn tainted_devices_lower_the_limit_to_64() {
        let mut node = plain(100);
        node.gpus[5].devices[0].taints = Some(vec![DeviceTaint {
            key: "gpu.dra.dev/xid".into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        }]);
        assert_eq!(sizes(&plan(&node, V1_35)), vec![(64, 0), (36, 0)]);
    }

    /// The GPUs whose devices a slice holds, by minor.
    fn gpus_in(slice: &PlannedSlice, node: &NodeDevices) -> Vec<u32> {
        node.gpus
            .iter()
            .filter(|gpu| gpu.devices.iter().any(|d| slice.devices.contains(d)))
            .map(|gpu| gpu.minor)
            .collect()
    }

    /// Each GPU's devices sit in exactly one slice, nothing is lost or repeated, and within a slice
    /// its whole GPUs come first, then the MIG devices, each in the node's order.
    fn assert_whole_gpus(slices: &[PlannedSlice], node: &NodeDevices) {
        let mut published: Vec<&str> = slices
            .iter()
            .flat_map(|s| &s.devices)
            .map(|d| d.name.as_str())
            .collect();
        let mut want: Vec<&str> = node.devices().map(|d| d.name.as_str()).collect();
        published.sort();
        want.sort();
        assert_eq!(published, want);
        for slice in slices {
            let (whole, parts): (Vec<&Device>, Vec<&Device>) = node
                .devices()
                .filter(|d| slice.devices.contains(d))
                .partition(|d| !d.name.contains("-mig-"));
            let ordered: Vec<&Device> = whole.into_iter().chain(parts).collect();
            assert_eq!(slice.devices.iter().collect::<Vec<_>>(), ordered);
        }
        for gpu in &node.gpus {
            let holding = slices
                .iter()
                .filter(|s| gpu.devices.iter().any(|d| s.devices.contains(d)))
                .count();
            assert_eq!(holding, 1, "gpu-{} is split", gpu.minor);
        }
    }

    #[test]
    fn from_1_35_counter_sets_get_their_own_slice_and_devices_as_many_whole_gpus_as_fit() {
        let node = dynamic("dgx-h100");
        let slices = plan(&node, V1_35);
        // One counters-only slice with the 8 sets, then 26 + 26 devices to a slice (64 at most).
        assert_eq!(
            sizes(&slices),
            vec![(0, 8), (52, 0), (52, 0), (52, 0), (52, 0)]
        );
        assert_whole_gpus(&slices, &node);
        assert_eq!(gpus_in(&slices[1], &node), vec![0, 1]);
        for slice in &slices[1..] {
            assert!(slice.devices.len() <= MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS);
        }
    }

    #[test]
    fn on_1_34_partitionable_gpus_share_combined_slices_within_its_limits() {
        let node = dynamic("dgx-h100");
        let slices = plan(&node, V1_34);
        // 9 shared counters per GPU: 3 sets fit 32; 78 devices fit 128.
        assert_eq!(sizes(&slices), vec![(78, 3), (78, 3), (52, 2)]);
        assert_whole_gpus(&slices, &node);
        for slice in &slices {
            assert!(fits_combined_slice_1_34(slice));
            // Each slice carries the counter sets of exactly its own GPUs.
            let sets: Vec<String> = slice
                .shared_counters
                .iter()
                .map(|s| s.name.clone())
                .collect();
            let want: Vec<String> = gpus_in(slice, &node)
                .into_iter()
                .map(crate::devices::mig::counter_set_name)
                .collect();
            assert_eq!(sets, want);
        }

        // 16 counters a set (as before they were pruned): two sets reach 32, a third would not fit.
        let mut wide = node.clone();
        for gpu in &mut wide.gpus {
            let set = gpu.counter_set.as_mut().unwrap();
            for i in 0..7 {
                set.counters
                    .insert(format!("extra-{i}"), Default::default());
            }
        }
        assert_eq!(sizes(&plan(&wide, V1_34)), vec![(52, 2); 4]);

        // 1024 counters consumed at most: with 20 more a device, two GPUs consume over 1,100.
        let mut heavy = node.clone();
        for device in heavy.gpus.iter_mut().flat_map(|g| g.devices.iter_mut()) {
            let consumed = &mut device.consumes_counters.as_mut().unwrap()[0].counters;
            for i in 0..20 {
                consumed.insert(format!("extra-{i}"), Default::default());
            }
        }
        assert_eq!(sizes(&plan(&heavy, V1_34)), vec![(26, 1); 8]);
    }

    #[test]
    fn more_than_eight_counter_sets_spill_into_another_counter_slice() {
        let mut node = dynamic("dgx-h100");
        let mut more = node.gpus.clone();
        for (i, gpu) in more.iter_mut().enumerate() {
            gpu.minor = 8 + i as u32;
            if let Some(set) = gpu.counter_set.as_mut() {
                set.name = format!("gpu-{}-counters", gpu.minor);
            }
        }
        node.gpus.extend(more.into_iter().take(2));
        let slices = plan(&node, V1_35);
        assert_eq!(sizes(&slices[..2]), vec![(0, 8), (0, 2)]);
        assert_eq!(slices.len(), 2 + 5, "10 GPUs, two to a device slice");
    }

    #[test]
    fn taints_fit_the_server_version() {
        let taint = |key: &str, effect: &str| DeviceTaint {
            key: key.into(),
            effect: effect.into(),
            ..Default::default()
        };
        let mut node = plain(1);
        node.gpus[0].devices[0].taints = Some(vec![
            taint("gpu.dra.dev/xid", "None"),
            taint("gpu.dra.dev/a", "NoSchedule"),
            taint("gpu.dra.dev/b", "NoSchedule"),
            taint("gpu.dra.dev/c", "NoSchedule"),
            taint("gpu.dra.dev/d", "NoSchedule"),
            taint("gpu.dra.dev/gpu-lost", "NoExecute"),
        ]);
        let old = plan(&node, V1_34);
        let kept = old[0].devices[0].taints.clone().unwrap();
        assert_eq!(kept.len(), 4);
        assert_eq!(kept[0].key, "gpu.dra.dev/gpu-lost");
        assert!(kept.iter().all(|t| t.effect != "None"));
        let new = plan(&node, V1_35);
        assert_eq!(new[0].devices[0].taints.as_ref().unwrap().len(), 6);

        // Only an informational taint: nothing at all on 1.34.
        node.gpus[0].devices[0].taints = Some(vec![taint("gpu.dra.dev/xid", "None")]);
        assert_eq!(plan(&node, V1_34)[0].devices[0].taints, None);
    }

    #[test]
    fn versions_parse_with_distribution_suffixes() {
        assert_eq!(ServerVersion::from_minor("35+"), Some(V1_35));
        assert_eq!(ServerVersion::from_minor("34"), Some(V1_34));
        assert_eq!(ServerVersion::from_minor("x"), None);
        assert!(!V1_34.splits_counters() && V1_35.splits_counters());
    }
}
