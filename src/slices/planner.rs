//! The slice planner: splits a node's devices and counter sets into ResourceSlices that stay within the
//! API limits of the server's version. Pure; the publisher turns the plan into API objects.
//!
//! Layouts: up to Kubernetes 1.34 a partitionable GPU's counter set must sit in the same slice as the
//! devices that consume it, so each such GPU gets one combined slice. From 1.35 a slice holds devices
//! or counter sets, not both: counter sets go into their own slices (at most 8 each) and each GPU's
//! devices into another. Devices without counters share slices, up to 128 each (64 with taints).

use k8s_openapi::api::resource::v1::{CounterSet, Device};

use crate::devices::NodeDevices;

/// `ResourceSliceMaxDevices`.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// `ResourceSliceMaxDevicesWithTaintsOrConsumesCounters` (1.35+): the lower limit that applies as soon as
/// any device of the slice has taints or consumes counters.
pub const MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS: usize = 64;
/// `ResourceSliceMaxCounterSets` (1.35+).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
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

    if version.splits_counters() {
        let sets: Vec<CounterSet> = partitionable
            .iter()
            .filter_map(|g| g.counter_set.clone())
            .collect();
        for chunk in sets.chunks(MAX_COUNTER_SETS_PER_SLICE) {
            slices.push(PlannedSlice {
                devices: Vec::new(),
                shared_counters: chunk.to_vec(),
            });
        }
        for gpu in &partitionable {
            slices.extend(device_slices(&fitted(&gpu.devices, version)));
        }
    } else {
        for gpu in &partitionable {
            // A combined slice: the counter set stays with the devices that consume it.
            let mut chunks = device_slices(&fitted(&gpu.devices, version));
            if let Some(first) = chunks.first_mut() {
                first.shared_counters = gpu.counter_set.clone().into_iter().collect();
            }
            slices.extend(chunks);
        }
    }
    let plain_devices: Vec<Device> = plain.iter().flat_map(|g| g.devices.clone()).collect();
    slices.extend(device_slices(&fitted(&plain_devices, version)));
    if slices.is_empty() {
        slices.push(PlannedSlice::default());
    }
    slices
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

/// Device-only slices for `devices`, cut at the limit that applies to them.
fn device_slices(devices: &[Device]) -> Vec<PlannedSlice> {
    let advanced = devices.iter().any(|d| {
        d.taints.as_ref().is_some_and(|t| !t.is_empty())
            || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
    });
    let limit = if advanced {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    devices
        .chunks(limit)
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

    #[test]
    fn from_1_35_counter_sets_get_their_own_slice_and_each_gpu_a_device_slice() {
        let node = dynamic("dgx-h100");
        let slices = plan(&node, V1_35);
        // One counters-only slice with the 8 sets, then one device slice per GPU.
        assert_eq!(slices.len(), 9);
        assert_eq!(sizes(&slices[..1]), vec![(0, 8)]);
        for (gpu, slice) in node.gpus.iter().zip(&slices[1..]) {
            assert_eq!(slice.devices, gpu.devices);
            assert!(slice.shared_counters.is_empty());
            assert!(slice.devices.len() <= MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS);
        }
    }

    #[test]
    fn on_1_34_each_partitionable_gpu_gets_one_combined_slice() {
        let node = dynamic("dgx-h100");
        let slices = plan(&node, V1_34);
        assert_eq!(slices.len(), 8);
        for (gpu, slice) in node.gpus.iter().zip(&slices) {
            assert_eq!(slice.devices, gpu.devices);
            assert_eq!(
                slice.shared_counters,
                gpu.counter_set.clone().into_iter().collect::<Vec<_>>()
            );
        }
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
        assert_eq!(slices.len(), 2 + 10);
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
