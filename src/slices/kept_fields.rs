//! What the API server keeps of a ResourceSlice. A kube-apiserver with `DRAPartitionableDevices`,
//! `DRADeviceTaints` or `DRAConsumableCapacity` off (all alpha in 1.34 and 1.35) silently drops counters,
//! taints or the fields of shared devices from every slice it stores. This module tells from a write's
//! answer which fields were dropped, and decides (purely) what the node publishes then: nothing that
//! could overlap, nothing faulty that cannot carry a taint, no GPU shared by memory.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet, Device, DeviceCapacity,
    DeviceCounterConsumption, DeviceTaint, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::devices::{GpuDevices, MigMode, NodeDevices, Shares};

/// The name of the device and counter set in the dry-run probe slice (a valid DNS label).
const PROBE_NAME: &str = "dry-run-probe";

/// A part of a ResourceSlice that only a server with a feature gate on stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GatedField {
    /// `sharedCounters` and each device's `consumesCounters`: partitionable devices.
    Counters,
    /// Each device's `taints`.
    Taints,
    /// Each device's `allowMultipleAllocations` and each capacity's `requestPolicy`: shared devices.
    ConsumableCapacity,
}

impl GatedField {
    pub const ALL: [GatedField; 3] = [
        GatedField::Counters,
        GatedField::Taints,
        GatedField::ConsumableCapacity,
    ];

    /// The kube-apiserver feature gate that must be on for the server to store this field.
    pub fn feature_gate(self) -> &'static str {
        match self {
            GatedField::Counters => "DRAPartitionableDevices",
            GatedField::Taints => "DRADeviceTaints",
            GatedField::ConsumableCapacity => "DRAConsumableCapacity",
        }
    }

    /// What the node publishes instead, and what the admin can do, for the Event and the log.
    pub fn consequence(self) -> &'static str {
        match self {
            GatedField::Counters => {
                "the API server drops the shared counters of partitionable devices, so dynamic MIG \
                 devices could be allocated overlapping each other; this node publishes whole GPUs only \
                 on its MIG-capable GPUs and prepares no MIG devices. Enable the DRAPartitionableDevices \
                 feature gate (kube-apiserver, kube-scheduler, kubelet) and restart this plugin, or use \
                 --mig-mode static"
            }
            GatedField::Taints => {
                "the API server drops device taints, so a faulty GPU cannot be kept from new pods with a \
                 taint; this node leaves faulty devices out of its ResourceSlices until they recover. \
                 Enable the DRADeviceTaints feature gate (kube-apiserver, kube-scheduler) and restart this \
                 plugin to publish them with taints instead"
            }
            GatedField::ConsumableCapacity => {
                "the API server drops allowMultipleAllocations and the request policies of device \
                 capacities, so a device cannot be published for sharing among claims; this node publishes its \
                 devices for exclusive use, also where a GpuNodePolicy sets spec.sharing (shares or \
                 mpsMemoryShares) or --consumable-shares is set. \
                 Enable the DRAConsumableCapacity feature gate (kube-apiserver, kube-scheduler, kubelet) \
                 and restart this plugin to share them"
            }
        }
    }
}

/// Whether the API server stores counters, taints and the fields of shared devices. All are assumed
/// kept until a write or a dry run shows otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptFields {
    pub counters: bool,
    pub taints: bool,
    pub consumable_capacity: bool,
}

impl Default for KeptFields {
    fn default() -> Self {
        KeptFields {
            counters: true,
            taints: true,
            consumable_capacity: true,
        }
    }
}

impl KeptFields {
    pub fn keeps(&self, field: GatedField) -> bool {
        match field {
            GatedField::Counters => self.counters,
            GatedField::Taints => self.taints,
            GatedField::ConsumableCapacity => self.consumable_capacity,
        }
    }

    /// These fields, with `dropped` no longer kept.
    pub fn without(mut self, dropped: &[GatedField]) -> KeptFields {
        for field in dropped {
            match field {
                GatedField::Counters => self.counters = false,
                GatedField::Taints => self.taints = false,
                GatedField::ConsumableCapacity => self.consumable_capacity = false,
            }
        }
        self
    }
}

/// Whether a slice uses the fields `DRAPartitionableDevices` covers (as the server tells "in use").
fn uses_counters(slice: &ResourceSlice) -> bool {
    let spec = &slice.spec;
    spec.shared_counters.as_ref().is_some_and(|s| !s.is_empty())
        || spec.per_device_node_selection.is_some()
        || spec.devices.iter().flatten().any(|d| {
            d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
                || d.node_name.is_some()
                || d.node_selector.is_some()
                || d.all_nodes.is_some()
        })
}

fn uses_taints(slice: &ResourceSlice) -> bool {
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
}

/// Whether a device uses the fields `DRAConsumableCapacity` covers.
fn shares_device(device: &Device) -> bool {
    device.allow_multiple_allocations.is_some()
        || device
            .capacity
            .iter()
            .flatten()
            .any(|(_, c)| c.request_policy.is_some())
}

fn uses_consumable_capacity(slice: &ResourceSlice) -> bool {
    slice.spec.devices.iter().flatten().any(shares_device)
}

/// The gated fields `sent` used that the server's answer `stored` no longer has.
pub fn dropped(sent: &ResourceSlice, stored: &ResourceSlice) -> Vec<GatedField> {
    let mut dropped = Vec::new();
    if uses_counters(sent) && !uses_counters(stored) {
        dropped.push(GatedField::Counters);
    }
    if uses_taints(sent) && !uses_taints(stored) {
        dropped.push(GatedField::Taints);
    }
    if uses_consumable_capacity(sent) && !uses_consumable_capacity(stored) {
        dropped.push(GatedField::ConsumableCapacity);
    }
    dropped
}

/// The MIG mode in force: dynamic MIG needs counters to keep partitions of one GPU apart, so without
/// them MIG-capable GPUs publish (and prepare) as `--mig-mode none` would. Static MIG devices do not
/// overlap and need no counters.
pub fn effective_mig_mode(requested: MigMode, kept: KeptFields) -> MigMode {
    match requested {
        MigMode::Dynamic if !kept.counters => MigMode::None,
        other => other,
    }
}

/// The shares in force: without the fields of shared devices, devices are published (and so
/// allocated) for exclusive use.
pub fn effective_shares(requested: Option<Shares>, kept: KeptFields) -> Option<Shares> {
    requested.filter(|_| kept.consumable_capacity)
}

/// Whether a device's taints would keep new pods off it (effect `None` only informs).
fn keeps_pods_off(device: &Device) -> bool {
    device
        .taints
        .iter()
        .flatten()
        .any(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
}

/// Fits the node's devices to a server that drops taints: a device whose taints keep pods off is left
/// out (withdrawing it is the only way to keep new pods off it), the remaining taints, which only
/// inform, are cleared so the stored slices equal the desired ones. Returns the names left out.
/// Counters are handled upstream of this by [`effective_mig_mode`].
pub fn withhold_faulty(node: &mut NodeDevices, kept: KeptFields) -> Vec<String> {
    let mut withheld = Vec::new();
    if kept.taints {
        return withheld;
    }
    for gpu in &mut node.gpus {
        gpu.devices.retain(|device| {
            let faulty = keeps_pods_off(device);
            if faulty {
                withheld.push(device.name.clone());
            }
            !faulty
        });
        for device in &mut gpu.devices {
            device.taints = None;
        }
    }
    withheld
}

/// Whether `node` was computed for a server that keeps `kept`: it uses no field the server drops.
/// The publisher waits for the devices to be recomputed rather than write what would be dropped.
pub fn fits(node: &NodeDevices, kept: KeptFields) -> bool {
    let counters = node.gpus.iter().any(|g| {
        g.counter_set.is_some()
            || g.devices
                .iter()
                .any(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()))
    });
    let taints = node
        .devices()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()));
    let shared = node.devices().any(shares_device);
    (kept.counters || !counters)
        && (kept.taints || !taints)
        && (kept.consumable_capacity || !shared)
}

/// A node with one device that uses every gated field: a counter set, a device consuming it, a taint,
/// and a capacity with a request policy on a device that allows multiple allocations. Written with
/// `dryRun=All`, the server's answer shows what it keeps without storing anything.
pub fn probe_devices(driver: &str) -> NodeDevices {
    let counters: BTreeMap<String, Counter> = [(
        "memory".to_string(),
        Counter {
            value: Quantity("1Gi".to_string()),
        },
    )]
    .into_iter()
    .collect();
    let device = Device {
        name: PROBE_NAME.to_string(),
        consumes_counters: Some(vec![DeviceCounterConsumption {
            counter_set: PROBE_NAME.to_string(),
            counters: counters.clone(),
            ..Default::default()
        }]),
        taints: Some(vec![DeviceTaint {
            key: format!("{driver}/{PROBE_NAME}"),
            effect: "NoSchedule".to_string(),
            ..Default::default()
        }]),
        allow_multiple_allocations: Some(true),
        // Valid as the API requires: default and min within the value, min + step not above it.
        capacity: Some(BTreeMap::from([(
            "memory".to_string(),
            DeviceCapacity {
                value: Quantity("2Gi".to_string()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(Quantity("1Gi".to_string())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: Quantity("1Gi".to_string()),
                        step: Some(Quantity("1Gi".to_string())),
                        max: None,
                    }),
                    valid_values: None,
                }),
            },
        )])),
        ..Default::default()
    };
    NodeDevices {
        gpus: vec![GpuDevices {
            minor: 0,
            counter_set: Some(CounterSet {
                name: PROBE_NAME.to_string(),
                counters,
            }),
            devices: vec![device],
        }],
        channels: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{self, MemoryShares};
    use crate::gpu::{FakeBackend, GpuBackend};
    use crate::slices::{desired_slices, ServerVersion};

    fn node(mig_mode: MigMode) -> NodeDevices {
        let inventory = FakeBackend::new("node-a", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        devices::node_devices(&inventory, mig_mode)
    }

    fn taint(effect: &str) -> DeviceTaint {
        DeviceTaint {
            key: "gpu.dra.dev/xid".into(),
            value: Some("79".into()),
            effect: effect.into(),
            ..Default::default()
        }
    }

    /// What a server with both gates off stores of `slice`.
    fn stripped(slice: &ResourceSlice) -> ResourceSlice {
        let mut slice = slice.clone();
        slice.spec.shared_counters = None;
        for device in slice.spec.devices.iter_mut().flatten() {
            device.consumes_counters = None;
            device.taints = None;
            device.allow_multiple_allocations = None;
            for capacity in device.capacity.iter_mut().flat_map(|c| c.values_mut()) {
                capacity.request_policy = None;
            }
        }
        slice
    }

    #[test]
    fn dropped_names_what_the_server_left_out_and_nothing_it_kept() {
        for version in [34, 35] {
            let version = ServerVersion { minor: version };
            let sent = desired_slices("d", "n", "u", &probe_devices("d"), version);
            let uses: Vec<Vec<GatedField>> = sent
                .iter()
                .map(|s| dropped(s, &stripped(s)))
                .filter(|d| !d.is_empty())
                .collect();
            let all: std::collections::BTreeSet<GatedField> = uses.into_iter().flatten().collect();
            assert_eq!(
                all.into_iter().collect::<Vec<_>>(),
                GatedField::ALL,
                "the probe uses every gated field on 1.{}",
                version.minor
            );
            for slice in &sent {
                assert!(dropped(slice, slice).is_empty());
            }
        }
        // Whole GPUs without taints lose nothing on any server.
        let plain = desired_slices("d", "n", "u", &node(MigMode::None), ServerVersion::OLDEST);
        assert!(dropped(&plain[0], &stripped(&plain[0])).is_empty());
    }

    #[test]
    fn without_counters_dynamic_mig_falls_back_to_whole_gpus() {
        let no_counters = KeptFields {
            counters: false,
            ..KeptFields::default()
        };
        assert_eq!(
            effective_mig_mode(MigMode::Dynamic, no_counters),
            MigMode::None
        );
        assert_eq!(
            effective_mig_mode(MigMode::Static, no_counters),
            MigMode::Static
        );
        assert_eq!(
            effective_mig_mode(MigMode::Dynamic, KeptFields::default()),
            MigMode::Dynamic
        );
        let fallback = node(effective_mig_mode(MigMode::Dynamic, no_counters));
        assert!(fits(&fallback, no_counters));
        assert!(fallback.gpus.iter().all(|g| g.counter_set.is_none()));
        let names: Vec<&str> = fallback.devices().map(|d| d.name.as_str()).collect();
        assert_eq!(names.len(), 8);
        assert!(names.iter().all(|n| !n.contains("-mig-")), "{names:?}");
        assert!(!fits(&node(MigMode::Dynamic), no_counters));
    }

    #[test]
    fn without_taints_faulty_devices_are_withheld_and_informational_taints_cleared() {
        let no_taints = KeptFields {
            taints: false,
            ..KeptFields::default()
        };
        let mut devices = node(MigMode::None);
        devices.gpus[2].devices[0].taints = Some(vec![taint("None"), taint("NoExecute")]);
        devices.gpus[5].devices[0].taints = Some(vec![taint("None")]);
        let full = devices.clone();
        assert!(!fits(&devices, no_taints));

        let withheld = withhold_faulty(&mut devices, no_taints);
        assert_eq!(withheld, vec!["gpu-2"]);
        assert_eq!(devices.device_count(), 7);
        assert!(devices.devices().all(|d| d.taints.is_none()));
        assert!(devices.devices().any(|d| d.name == "gpu-5"));
        assert!(fits(&devices, no_taints));

        // A server that keeps taints gets them all.
        let mut kept = full.clone();
        assert!(withhold_faulty(&mut kept, KeptFields::default()).is_empty());
        assert_eq!(kept, full);
    }

    #[test]
    fn without_applies_only_what_was_dropped() {
        let kept = KeptFields::default().without(&[GatedField::Taints]);
        assert!(kept.counters && !kept.taints);
        assert!(!kept
            .without(&[GatedField::Counters])
            .keeps(GatedField::Counters));
        assert_eq!(
            GatedField::Counters.feature_gate(),
            "DRAPartitionableDevices"
        );
        assert_eq!(GatedField::Taints.feature_gate(), "DRADeviceTaints");
        assert_eq!(
            GatedField::ConsumableCapacity.feature_gate(),
            "DRAConsumableCapacity"
        );
    }

    #[test]
    fn without_consumable_capacity_gpus_are_published_exclusive() {
        let no_sharing = KeptFields {
            consumable_capacity: false,
            ..KeptFields::default()
        };
        let shares = MemoryShares {
            minimum_bytes: 1 << 30,
            step_bytes: 1 << 30,
        };
        let general = Shares::mps_memory(shares);
        assert_eq!(effective_shares(Some(general), no_sharing), None);
        assert_eq!(
            effective_shares(Some(general), KeptFields::default()),
            Some(general)
        );
        let mut shared = node(MigMode::None);
        devices::share_for_mps(&mut shared, shares);
        assert!(fits(&shared, KeptFields::default()));
        assert!(!fits(&shared, no_sharing));
        assert!(fits(&node(MigMode::None), no_sharing));

        // A server that drops the fields answers with a slice that lacks them.
        let sent = desired_slices("d", "n", "u", &shared, ServerVersion::OLDEST);
        assert_eq!(
            dropped(&sent[0], &stripped(&sent[0])),
            [GatedField::ConsumableCapacity]
        );
    }
}
