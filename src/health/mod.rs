//! The health monitor's pure core: which faults the backend reported on which GPU or MIG device,
//! how they clear, and (in [`taints`]) how they become DRA device taints and kubelet health reports.
//! No I/O; the caller feeds it [`GpuEvent`]s and publishes what it computes.

pub mod persist;
pub mod policy;
pub mod taints;
pub mod xid;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use crate::gpu::{GpuEvent, GpuEventKind, Inventory};

pub use persist::{FaultFile, FaultFileError};
pub use policy::{HealthPolicy, PolicyError, TaintEffect};
pub use taints::DeviceStatus;
pub use xid::XidClass;

/// What a fault was reported on: a whole GPU (`gpu_instance_id` is `None`) or one MIG device of it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FaultTarget {
    pub gpu_uuid: String,
    pub gpu_instance_id: Option<u32>,
}

/// A fault the backend reported; each one stays until a recovery clears it (see [`HealthState`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    Xid(u64),
    DoubleBitEcc,
    /// Pages wait to be retired or rows to be remapped at the next reset.
    RetirementPending,
    RowRemapFailure,
    /// The GPU fell off the bus or stopped answering.
    Lost,
}

impl Fault {
    /// The fault for an event, `None` for events that are not faults (single-bit ECC errors, which
    /// the hardware corrected; MIG reconfiguration; recovery; anything else NVML reports).
    pub fn from_event(kind: &GpuEventKind) -> Option<Fault> {
        match kind {
            GpuEventKind::Xid(xid) => Some(Fault::Xid(*xid)),
            GpuEventKind::DoubleBitEcc => Some(Fault::DoubleBitEcc),
            GpuEventKind::RetirementPending => Some(Fault::RetirementPending),
            GpuEventKind::RowRemapFailure => Some(Fault::RowRemapFailure),
            GpuEventKind::Lost => Some(Fault::Lost),
            GpuEventKind::SingleBitEcc
            | GpuEventKind::Recovered
            | GpuEventKind::MigConfigChange
            | GpuEventKind::Other(_) => None,
        }
    }

    /// How severe the fault is: XIDs by the policy's table; uncorrectable memory, failed repair and a
    /// lost GPU are fatal; memory waiting for a reset needs that reset.
    pub fn class(&self, policy: &HealthPolicy) -> XidClass {
        match self {
            Fault::Xid(xid) => policy.classify(*xid),
            Fault::DoubleBitEcc | Fault::RowRemapFailure | Fault::Lost => XidClass::Fatal,
            Fault::RetirementPending => XidClass::ResetRequired,
        }
    }

    /// One line for people, e.g. `XID 79: GPU has fallen off the bus`.
    pub fn describe(&self) -> String {
        match self {
            Fault::Xid(xid) => format!("XID {xid}: {}", xid::describe(*xid)),
            Fault::DoubleBitEcc => "double-bit ECC error".to_string(),
            Fault::RetirementPending => {
                "memory page retirement or row remapping pending a GPU reset".to_string()
            }
            Fault::RowRemapFailure => "memory row remapping failed".to_string(),
            Fault::Lost => "GPU is lost (fallen off the bus or not answering)".to_string(),
        }
    }
}

/// One fault as recorded: `seq` orders arrivals (a repeat moves the fault to the latest), and
/// `recovered` marks a fault the backend reported over; whether that clears it is the policy's call,
/// made when taints and reports are computed, so a policy change applies to faults already seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) fault: Fault,
    pub(crate) seq: u64,
    pub(crate) recovered: bool,
}

impl Seen {
    /// Whether the fault still counts: not recovered, or recovered while the policy keeps
    /// non-informational faults until restart.
    pub(crate) fn active(&self, policy: &HealthPolicy) -> bool {
        !self.recovered
            || (!policy.clear_on_recovery && self.fault.class(policy) != XidClass::Informational)
    }
}

/// The faults of the node's GPUs and MIG devices, as the backend's events reported them.
#[derive(Debug, Clone, Default)]
pub struct HealthState {
    pub(crate) faults: BTreeMap<FaultTarget, Vec<Seen>>,
    next_seq: u64,
}

impl HealthState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records an event; returns whether anything that taints or reports depend on changed.
    ///
    /// `Recovered` on a whole GPU marks the faults of the GPU and of all its MIG devices recovered;
    /// on a MIG device only that device's faults.
    pub fn apply(&mut self, event: &GpuEvent) -> bool {
        let target = FaultTarget {
            gpu_uuid: event.gpu_uuid.clone(),
            gpu_instance_id: event.gpu_instance_id,
        };
        if event.kind == GpuEventKind::Recovered {
            return self.recover(&target);
        }
        let Some(fault) = Fault::from_event(&event.kind) else {
            return false;
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let seen = self.faults.entry(target).or_default();
        let latest = seen.iter().map(|s| s.seq).max();
        match seen.iter_mut().find(|s| s.fault == fault) {
            Some(existing) => {
                // A repeat of the newest active fault changes nothing anyone sees.
                let changed = existing.recovered || Some(existing.seq) != latest;
                existing.seq = seq;
                existing.recovered = false;
                changed
            }
            None => {
                seen.push(Seen {
                    fault,
                    seq,
                    recovered: false,
                });
                true
            }
        }
    }

    fn recover(&mut self, target: &FaultTarget) -> bool {
        let mut changed = false;
        for (key, seen) in self.faults.iter_mut() {
            let covered = key == target
                || (target.gpu_instance_id.is_none() && key.gpu_uuid == target.gpu_uuid);
            if !covered {
                continue;
            }
            for entry in seen.iter_mut().filter(|s| !s.recovered) {
                entry.recovered = true;
                changed = true;
            }
        }
        changed
    }

    /// A state holding `faults`, as if reported in this order (what [`HealthState::unrecovered`] gave).
    pub fn with_faults(faults: impl IntoIterator<Item = (FaultTarget, Fault)>) -> Self {
        let mut state = HealthState::new();
        for (target, fault) in faults {
            let seq = state.next_seq;
            state.next_seq += 1;
            let seen = state.faults.entry(target).or_default();
            seen.retain(|s| s.fault != fault);
            seen.push(Seen {
                fault,
                seq,
                recovered: false,
            });
        }
        state
    }

    /// The faults the backend has not reported recovered, oldest first: what outlives a restart of
    /// the plugin. Recovered faults that the policy keeps (`clearOnRecovery: false`) are kept until
    /// a restart, as they always were, and so are not in here.
    pub fn unrecovered(&self) -> Vec<(FaultTarget, Fault)> {
        let mut out: Vec<(u64, FaultTarget, Fault)> = self
            .faults
            .iter()
            .flat_map(|(target, seen)| {
                seen.iter()
                    .filter(|s| !s.recovered)
                    .map(|s| (s.seq, target.clone(), s.fault.clone()))
            })
            .collect();
        out.sort();
        out.into_iter().map(|(_, t, f)| (t, f)).collect()
    }

    /// Forgets the faults of MIG devices that no longer exist, so that a new MIG device that gets the
    /// same GPU instance id does not inherit them. Call after a rescan that followed a MIG change.
    pub fn forget_vanished_mig_devices(&mut self, inventory: &Inventory) -> bool {
        let before = self.faults.len();
        self.faults.retain(|target, _| {
            let Some(gi) = target.gpu_instance_id else {
                return true;
            };
            inventory
                .gpus
                .iter()
                .filter(|gpu| gpu.uuid == target.gpu_uuid)
                .filter_map(|gpu| gpu.mig.as_ref())
                .any(|mig| mig.instances.iter().any(|i| i.gpu_instance_id == gi))
        });
        self.faults.len() != before
    }

    /// The faults in effect under the policy, target by target in arrival order (for metrics and
    /// logs). MIG faults whose MIG device is not in the inventory are listed here even though they
    /// taint no device.
    pub fn current_faults(&self, policy: &HealthPolicy) -> Vec<(FaultTarget, Fault)> {
        let mut out = Vec::new();
        for (target, seen) in &self.faults {
            let mut active: Vec<&Seen> = seen.iter().filter(|s| s.active(policy)).collect();
            active.sort_by_key(|s| s.seq);
            out.extend(
                active
                    .into_iter()
                    .map(|s| (target.clone(), s.fault.clone())),
            );
        }
        out
    }
}
