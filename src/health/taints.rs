//! Faults → DRA device taints in the driver's own ResourceSlices, and per-device health reports for
//! the kubelet. A whole-GPU fault affects every device of that GPU; a MIG fault only the MIG device
//! at the placement of the MIG instance it was reported on.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::DeviceTaint;

use super::{Fault, HealthPolicy, HealthState, Seen, TaintEffect, XidClass};
use crate::devices::{DeviceName, NodeDevices};
use crate::gpu::Inventory;

/// `DeviceTaintsMaxLength` up to Kubernetes 1.34, and from 1.35.
const MAX_TAINTS_1_34: usize = 4;
const MAX_TAINTS: usize = 16;
/// The kubelet's limit on a health message.
pub const MAX_MESSAGE_LEN: usize = 1024;
/// The first Kubernetes minor version whose API accepts the `None` taint effect.
const FIRST_MINOR_WITH_NONE_EFFECT: u32 = 35;

/// The taint keys (after `<driver>/`) this module owns; other taints on a device are kept.
const KEYS: [&str; 4] = ["xid", "ecc", "memory", "gpu-lost"];

/// The health of one published device, for the kubelet's resource-health stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceStatus {
    /// The DRA device name, e.g. `gpu-0-mig-1g10gb-6`.
    pub device: String,
    /// False when any fault that is not informational affects the device.
    pub healthy: bool,
    /// The faults affecting the device, most severe first (empty when there are none); at most
    /// [`MAX_MESSAGE_LEN`] bytes.
    pub message: String,
}

impl Fault {
    /// The taint key (after `<driver>/`) and value; one taint per key and device.
    fn taint_key_value(&self) -> (&'static str, Option<String>) {
        match self {
            Fault::Xid(xid) => ("xid", Some(xid.to_string())),
            Fault::DoubleBitEcc => ("ecc", Some("double-bit".to_string())),
            Fault::RetirementPending => ("memory", Some("retirement-pending".to_string())),
            Fault::RowRemapFailure => ("memory", Some("row-remap-failure".to_string())),
            Fault::Lost => ("gpu-lost", None),
        }
    }
}

impl HealthState {
    /// Sets the health taints on the devices of `node`: per key the most severe fault (the latest of
    /// that severity gives the value), with the policy's effect for its class. Taints with effect
    /// `None` are left out for servers older than 1.35, which reject them. Taints of other keys that
    /// the devices already carry are kept; when the total exceeds the server's limit (4 up to 1.34, 16
    /// from 1.35), the most severe effects stay. `time_added` is left to the API server.
    pub fn taint(
        &self,
        node: &mut NodeDevices,
        inventory: &Inventory,
        driver: &str,
        policy: &HealthPolicy,
        server_minor: u32,
    ) {
        let owned: Vec<String> = KEYS.iter().map(|k| format!("{driver}/{k}")).collect();
        let cap = if server_minor < FIRST_MINOR_WITH_NONE_EFFECT {
            MAX_TAINTS_1_34
        } else {
            MAX_TAINTS
        };
        for device in node.gpus.iter_mut().flat_map(|g| g.devices.iter_mut()) {
            let faults = DeviceName::parse(&device.name)
                .map(|name| self.affecting(&name, inventory, policy))
                .unwrap_or_default();
            let mut best: BTreeMap<&'static str, (XidClass, u64, &Fault)> = BTreeMap::new();
            for seen in faults {
                let (key, _) = seen.fault.taint_key_value();
                let rank = (seen.fault.class(policy), seen.seq);
                let wins = best.get(key).is_none_or(|(c, s, _)| rank > (*c, *s));
                if wins {
                    best.insert(key, (rank.0, rank.1, &seen.fault));
                }
            }
            let ours = best.into_iter().filter_map(|(key, (class, _, fault))| {
                let effect = policy.effect(class);
                if effect == TaintEffect::None && server_minor < FIRST_MINOR_WITH_NONE_EFFECT {
                    return None;
                }
                Some(DeviceTaint {
                    key: format!("{driver}/{key}"),
                    value: fault.taint_key_value().1,
                    effect: effect.as_str().to_string(),
                    time_added: None,
                })
            });
            let mut taints: Vec<DeviceTaint> = device
                .taints
                .take()
                .unwrap_or_default()
                .into_iter()
                .filter(|t| !owned.contains(&t.key))
                .chain(ours)
                .collect();
            // Stable: among equal effects, the taints the device already had come first.
            taints.sort_by_key(|t| std::cmp::Reverse(TaintEffect::rank(&t.effect)));
            taints.truncate(cap);
            device.taints = (!taints.is_empty()).then_some(taints);
        }
    }

    /// A report for every device of `node`, in publishing order. Informational faults leave a device
    /// healthy but are named in its message.
    pub fn device_health(
        &self,
        node: &NodeDevices,
        inventory: &Inventory,
        policy: &HealthPolicy,
    ) -> Vec<DeviceStatus> {
        node.devices()
            .map(|device| {
                let mut faults = DeviceName::parse(&device.name)
                    .map(|name| self.affecting(&name, inventory, policy))
                    .unwrap_or_default();
                // Most severe first, then newest first; a fault seen on both the GPU and the MIG
                // device is named once.
                faults.sort_by_key(|s| std::cmp::Reverse((s.fault.class(policy), s.seq)));
                let mut named: Vec<&Fault> = Vec::new();
                for seen in &faults {
                    if !named.contains(&&seen.fault) {
                        named.push(&seen.fault);
                    }
                }
                let healthy = named
                    .iter()
                    .all(|f| f.class(policy) == XidClass::Informational);
                let parts: Vec<String> = named
                    .iter()
                    .map(|f| match f.class(policy) {
                        XidClass::Informational => format!("{} (informational)", f.describe()),
                        _ => f.describe(),
                    })
                    .collect();
                DeviceStatus {
                    device: device.name.clone(),
                    healthy,
                    message: bounded(parts.join("; ")),
                }
            })
            .collect()
    }

    /// The active faults that affect a device: those of its GPU and, for a MIG device, those of the
    /// MIG instance that sits at its placement.
    fn affecting(
        &self,
        name: &DeviceName,
        inventory: &Inventory,
        policy: &HealthPolicy,
    ) -> Vec<&Seen> {
        let Some(gpu) = inventory.gpus.iter().find(|g| g.minor == name.minor()) else {
            return Vec::new();
        };
        let mut targets = vec![(gpu.uuid.as_str(), None)];
        if let (DeviceName::Mig { profile, start, .. }, Some(mig)) = (name, gpu.mig.as_ref()) {
            let instance = mig.instances.iter().find(|i| {
                i.placement.start == *start
                    && mig
                        .profile(i.profile_id)
                        .is_some_and(|p| p.dns_name() == *profile)
            });
            if let Some(instance) = instance {
                targets.push((gpu.uuid.as_str(), Some(instance.gpu_instance_id)));
            }
        }
        self.faults
            .iter()
            .filter(|(target, _)| {
                targets
                    .iter()
                    .any(|(uuid, gi)| target.gpu_uuid == *uuid && target.gpu_instance_id == *gi)
            })
            .flat_map(|(_, seen)| seen.iter().filter(|s| s.active(policy)))
            .collect()
    }
}

/// Cuts a message to the kubelet's limit on a character boundary, marking the cut.
fn bounded(mut message: String) -> String {
    if message.len() <= MAX_MESSAGE_LEN {
        return message;
    }
    let mut end = MAX_MESSAGE_LEN - 3;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.truncate(end);
    message.push_str("...");
    message
}
