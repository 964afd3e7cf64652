//! Feature gates of the API server double. A real kube-apiserver with a DRA gate off does not reject
//! the gate's fields in a ResourceSlice: its registry strategy drops them before validation, on create
//! and on update, unless the object being updated already uses them. This models that for the gates the
//! driver meets (`pkg/registry/resource/resourceslice/strategy.go`, `dropDisabledFields`), and for
//! `DRAExtendedResource` a DeviceClass's `extendedResourceName` (`.../deviceclass/strategy.go`) and a pod's
//! `status.extendedResourceClaimStatus` (`pkg/api/pod/util.go`, `dropDisabledPodStatusFields`).
//!
//! Not modelled: the gated fields of ResourceClaims and of the other gates of DeviceClasses and pods, gates the driver never
//! meets (list-type attributes, node-allocatable resources, pool status), and binding conditions also
//! needing `DRAResourceClaimDeviceStatus` (on by default since 1.33, so taken as on).

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use super::{ResourceDef, ServerVersion};

/// A feature gate of kube-apiserver that decides which ResourceSlice fields are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FeatureGate {
    /// `sharedCounters`, `perDeviceNodeSelection`, and per device `consumesCounters`, `nodeName`,
    /// `nodeSelector`, `allNodes`.
    DRAPartitionableDevices,
    /// Per device `taints`.
    DRADeviceTaints,
    /// Per device `allowMultipleAllocations` and each capacity's `requestPolicy`.
    DRAConsumableCapacity,
    /// Per device `bindingConditions`, `bindingFailureConditions`, `bindsToNode`.
    DRADeviceBindingConditions,
    /// A DeviceClass's `spec.extendedResourceName` and a pod's `status.extendedResourceClaimStatus`.
    DRAExtendedResource,
}

impl FeatureGate {
    pub const ALL: [FeatureGate; 5] = [
        FeatureGate::DRAPartitionableDevices,
        FeatureGate::DRADeviceTaints,
        FeatureGate::DRAConsumableCapacity,
        FeatureGate::DRADeviceBindingConditions,
        FeatureGate::DRAExtendedResource,
    ];
}

/// Which gates are off. The default has every gate on: a cluster set up for this driver.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FeatureGates {
    disabled: BTreeSet<FeatureGate>,
}

impl FeatureGates {
    /// Every gate on.
    pub fn all_enabled() -> FeatureGates {
        FeatureGates::default()
    }

    /// Every gate on except `disabled`.
    pub fn disabling(disabled: impl IntoIterator<Item = FeatureGate>) -> FeatureGates {
        FeatureGates {
            disabled: disabled.into_iter().collect(),
        }
    }

    /// The gates as a kube-apiserver of `version` starts without `--feature-gates`: all five are alpha
    /// (off) in 1.34 and 1.35 and beta (on) from 1.36 (KEP-5004's beta is planned for 1.36).
    pub fn defaults_of(version: ServerVersion) -> FeatureGates {
        match version {
            ServerVersion::V1_34 | ServerVersion::V1_35 => {
                FeatureGates::disabling(FeatureGate::ALL)
            }
            ServerVersion::V1_36 => FeatureGates::all_enabled(),
        }
    }

    pub fn enabled(&self, gate: FeatureGate) -> bool {
        !self.disabled.contains(&gate)
    }
}

/// Drops what disabled gates cover from a ResourceSlice about to be created (`old` is `None`) or to
/// replace `old`, as `PrepareForCreate` / `PrepareForUpdate` do before validation. Other kinds pass.
pub(super) fn drop_disabled_fields(
    gates: &FeatureGates,
    def: &ResourceDef,
    obj: &mut Value,
    old: Option<&Value>,
) {
    let extended_resource = !gates.enabled(FeatureGate::DRAExtendedResource);
    let in_use = |pointer: &str| {
        old.and_then(|o| o.pointer(pointer))
            .is_some_and(|v| !v.is_null())
    };
    match def.plural {
        "deviceclasses" if extended_resource && !in_use("/spec/extendedResourceName") => {
            if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) {
                spec.remove("extendedResourceName");
            }
            return;
        }
        "pods" if extended_resource && !in_use("/status/extendedResourceClaimStatus") => {
            if let Some(status) = obj.get_mut("status").and_then(Value::as_object_mut) {
                status.remove("extendedResourceClaimStatus");
            }
            return;
        }
        "resourceslices" => {}
        _ => return,
    }
    let drop_unless_used = |gate: FeatureGate, in_use: fn(&Value) -> bool| {
        !gates.enabled(gate) && !old.is_some_and(in_use)
    };
    let taints = drop_unless_used(FeatureGate::DRADeviceTaints, taints_in_use);
    let partitionable =
        drop_unless_used(FeatureGate::DRAPartitionableDevices, partitionable_in_use);
    let binding = drop_unless_used(
        FeatureGate::DRADeviceBindingConditions,
        binding_conditions_in_use,
    );
    let consumable = drop_unless_used(FeatureGate::DRAConsumableCapacity, consumable_in_use);
    if partitionable {
        if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) {
            spec.remove("sharedCounters");
            spec.remove("perDeviceNodeSelection");
        }
    }
    let Some(devices) = obj
        .pointer_mut("/spec/devices")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for device in devices.iter_mut().filter_map(Value::as_object_mut) {
        if taints {
            device.remove("taints");
        }
        if partitionable {
            for field in ["consumesCounters", "nodeName", "nodeSelector", "allNodes"] {
                device.remove(field);
            }
        }
        if binding {
            for field in [
                "bindingConditions",
                "bindingFailureConditions",
                "bindsToNode",
            ] {
                device.remove(field);
            }
        }
        if consumable {
            device.remove("allowMultipleAllocations");
            if let Some(capacity) = device.get_mut("capacity").and_then(Value::as_object_mut) {
                for value in capacity.values_mut().filter_map(Value::as_object_mut) {
                    value.remove("requestPolicy");
                }
            }
        }
    }
}

/// The stored slice's devices, as JSON objects.
fn devices(slice: &Value) -> impl Iterator<Item = &Map<String, Value>> {
    slice
        .pointer("/spec/devices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object)
}

/// Set and not `null`: what a Go pointer field that is non-nil looks like.
fn present(map: &Map<String, Value>, field: &str) -> bool {
    map.get(field).is_some_and(|v| !v.is_null())
}

/// A non-empty list: what `len(x) > 0` sees.
fn non_empty(map: &Map<String, Value>, field: &str) -> bool {
    map.get(field)
        .and_then(Value::as_array)
        .is_some_and(|list| !list.is_empty())
}

fn taints_in_use(slice: &Value) -> bool {
    devices(slice).any(|d| non_empty(d, "taints"))
}

fn partitionable_in_use(slice: &Value) -> bool {
    let spec = slice.get("spec").and_then(Value::as_object);
    spec.is_some_and(|s| non_empty(s, "sharedCounters") || present(s, "perDeviceNodeSelection"))
        || devices(slice).any(|d| {
            non_empty(d, "consumesCounters")
                || ["nodeName", "nodeSelector", "allNodes"]
                    .iter()
                    .any(|f| present(d, f))
        })
}

fn binding_conditions_in_use(slice: &Value) -> bool {
    devices(slice).any(|d| {
        non_empty(d, "bindingConditions")
            || non_empty(d, "bindingFailureConditions")
            || present(d, "bindsToNode")
    })
}

fn consumable_in_use(slice: &Value) -> bool {
    devices(slice).any(|d| {
        present(d, "allowMultipleAllocations")
            || d.get("capacity")
                .and_then(Value::as_object)
                .is_some_and(|c| {
                    c.values()
                        .filter_map(Value::as_object)
                        .any(|v| present(v, "requestPolicy"))
                })
    })
}
