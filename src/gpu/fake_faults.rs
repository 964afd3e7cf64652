//! Fault injection of the fake backend: faults written into the profile file become health events
//! (`wait_event`) when they appear, and `Recovered` when they are removed, as the NVML backend reports
//! XIDs, ECC errors, memory health and lost GPUs.

use super::fake::{lock, FakeBackend, ProfileSource};
use super::fake_gpus::gpu_instance_id;
use super::mig::MigPlacement;
use super::profiles::{FakeFault, FakeFaultKind, FakeProfile};
use super::{GpuError, GpuEvent, GpuEventKind};

/// A fault as events report it: the GPU, the MIG device's GPU instance (if any), what happened.
type FaultKey = (String, Option<u32>, FakeFaultKind, Option<u64>);

/// What `wait_event` has reported so far, to turn edits of the profile's faults into events.
#[derive(Debug, Default)]
pub(super) struct FaultWatch {
    reported: std::collections::BTreeSet<FaultKey>,
    pending: std::collections::VecDeque<GpuEvent>,
    /// The profile file's modification time and length when last read.
    last_seen: Option<(std::time::SystemTime, u64)>,
    primed: bool,
}

/// How often `wait_event` looks at the profile file for changed faults.
const FAULT_POLL: std::time::Duration = std::time::Duration::from_millis(10);

impl FakeBackend {
    /// Reports the profile's faults as events: each fault when it appears (faults present at start
    /// included), and `Recovered` for a GPU or MIG device when its last fault is removed from the file.
    pub(super) fn next_fault_event(
        &self,
        timeout: std::time::Duration,
    ) -> Result<Option<GpuEvent>, GpuError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            {
                let mut watch = lock(&self.faults);
                if watch.pending.is_empty() && self.faults_changed(&mut watch) {
                    // A profile that cannot be read keeps the faults as they were.
                    if let Ok(profile) = self.profile() {
                        self.queue_fault_events(&profile, &mut watch);
                    }
                }
                if let Some(event) = watch.pending.pop_front() {
                    return Ok(Some(event));
                }
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            std::thread::sleep(FAULT_POLL.min(deadline - now));
        }
    }

    /// Whether the profile may have new faults since the last look: always the first time, then
    /// when the file's modification time or length changed (built-in profiles never change).
    fn faults_changed(&self, watch: &mut FaultWatch) -> bool {
        let first = !watch.primed;
        watch.primed = true;
        let ProfileSource::File(path) = &self.source else {
            return first;
        };
        let seen = std::fs::metadata(path)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())));
        let changed = seen != watch.last_seen;
        watch.last_seen = seen;
        first || changed
    }

    fn queue_fault_events(&self, profile: &FakeProfile, watch: &mut FaultWatch) {
        let current: std::collections::BTreeSet<FaultKey> = profile
            .gpus
            .iter()
            .enumerate()
            .flat_map(|(index, spec)| {
                let uuid = self.gpu_uuid(spec, spec.minor.unwrap_or(index as u32));
                spec.faults.iter().map(move |fault| fault_key(&uuid, fault))
            })
            .collect();
        for key in current.difference(&watch.reported) {
            watch.pending.push_back(fault_event(key));
        }
        let targets = |set: &std::collections::BTreeSet<FaultKey>| {
            set.iter()
                .map(|(uuid, gi, _, _)| (uuid.clone(), *gi))
                .collect::<std::collections::BTreeSet<_>>()
        };
        for (uuid, gpu_instance_id) in targets(&watch.reported).difference(&targets(&current)) {
            watch.pending.push_back(GpuEvent {
                gpu_uuid: uuid.clone(),
                gpu_instance_id: *gpu_instance_id,
                compute_instance_id: gpu_instance_id.map(|_| 0),
                kind: GpuEventKind::Recovered,
            });
        }
        watch.reported = current;
    }
}

fn fault_key(uuid: &str, fault: &FakeFault) -> FaultKey {
    let gpu_instance = fault
        .mig_start
        .map(|start| gpu_instance_id(MigPlacement { start, size: 1 }));
    (uuid.to_string(), gpu_instance, fault.kind, fault.xid)
}

fn fault_event((uuid, gpu_instance_id, kind, xid): &FaultKey) -> GpuEvent {
    GpuEvent {
        gpu_uuid: uuid.clone(),
        gpu_instance_id: *gpu_instance_id,
        compute_instance_id: gpu_instance_id.map(|_| 0),
        kind: match kind {
            FakeFaultKind::Xid => GpuEventKind::Xid(xid.unwrap_or(0)),
            FakeFaultKind::DoubleBitEcc => GpuEventKind::DoubleBitEcc,
            FakeFaultKind::RetirementPending => GpuEventKind::RetirementPending,
            FakeFaultKind::RowRemapFailure => GpuEventKind::RowRemapFailure,
            FakeFaultKind::Lost => GpuEventKind::Lost,
        },
    }
}

#[cfg(test)]
mod fault_tests {
    use super::*;
    use crate::gpu::{builtin_profile, GpuBackend};

    fn write(path: &std::path::Path, profile: &FakeProfile) {
        std::fs::write(path, serde_yaml::to_string(profile).unwrap()).unwrap();
    }

    fn next(backend: &FakeBackend) -> Option<GpuEvent> {
        backend
            .wait_event(std::time::Duration::from_millis(300))
            .unwrap()
    }

    #[test]
    fn faults_in_the_profile_become_events_and_removing_them_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        let mut profile = builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(2);
        profile.gpus[1].faults = vec![FakeFault {
            kind: FakeFaultKind::Xid,
            xid: Some(79),
            mig_start: None,
        }];
        write(&path, &profile);
        let backend = FakeBackend::new("n", path.to_str().unwrap()).unwrap();
        let gpus = backend.inventory().unwrap().gpus;

        // A fault present at start is reported.
        let event = next(&backend).unwrap();
        assert_eq!(event.gpu_uuid, gpus[1].uuid);
        assert_eq!(event.kind, GpuEventKind::Xid(79));
        assert_eq!(next(&backend), None);

        // A new fault on a MIG device, then the whole-GPU fault cleared.
        profile.gpus[0].faults = vec![FakeFault {
            kind: FakeFaultKind::DoubleBitEcc,
            xid: None,
            mig_start: Some(4),
        }];
        profile.gpus[1].faults.clear();
        write(&path, &profile);
        let mut events = [next(&backend).unwrap(), next(&backend).unwrap()];
        events.sort_by_key(|e| e.gpu_uuid == gpus[1].uuid);
        assert_eq!(events[0].gpu_uuid, gpus[0].uuid);
        assert_eq!(events[0].gpu_instance_id, Some(5));
        assert_eq!(events[0].kind, GpuEventKind::DoubleBitEcc);
        assert_eq!(events[1].kind, GpuEventKind::Recovered);
        assert_eq!(events[1].gpu_instance_id, None);

        profile.gpus[0].faults[0].xid = Some(1);
        write(&path, &profile);
        let err = backend.inventory().unwrap_err().to_string();
        assert!(err.contains("faults[0]") && err.contains("xid"), "{err}");
    }
}
