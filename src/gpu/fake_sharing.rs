//! GPU sharing on the fake backend: each GPU's mode (compute mode and time-slice interval) is kept in
//! the fake hardware state, so it outlives plugin restarts as a real GPU's setting does (until the
//! next reboot). As with NVML, only the compute mode can be read back: a time-sliced GPU reads as
//! `Default` ([`FakeBackend::sharing_modes`] shows what the hardware holds, for tests). GPUs that are
//! unknown, unreadable or lost are refused, as NVML refuses them; the profile's `sharingFails` makes
//! setting the mode fail, and `sharingHangs` makes it take effect and then hang until removed.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::fake::{lock, FakeBackend};
use super::profiles::{FakeFaultKind, FakeGpuSpec, FakeProfile};
use super::{GpuError, GpuSharingMode};

/// How often a hanging change looks whether `sharingHangs` was removed.
const HANG_POLL: Duration = Duration::from_millis(20);

/// A hang ends with an error after this long, so that a test that forgets the knob still ends.
const MAX_HANG: Duration = Duration::from_secs(120);

impl FakeBackend {
    /// What each GPU's hardware holds, by UUID, for GPUs not in `Default`: the time-slice interval
    /// too, which [`GpuBackend::sharing`](super::GpuBackend::sharing) cannot read.
    pub fn sharing_modes(&self) -> BTreeMap<String, GpuSharingMode> {
        lock(&self.hardware).sharing.clone()
    }

    pub(super) fn set_sharing_mode(
        &self,
        gpu_uuid: &str,
        mode: GpuSharingMode,
    ) -> Result<(), GpuError> {
        self.sharing_locks
            .with(gpu_uuid, || self.set_sharing_locked(gpu_uuid, mode))
    }

    fn set_sharing_locked(&self, gpu_uuid: &str, mode: GpuSharingMode) -> Result<(), GpuError> {
        let profile = self.profile()?;
        let spec = self.sharing_gpu(&profile, gpu_uuid)?;
        if let Some(reason) = spec.sharing_fails {
            return Err(GpuError::Sharing {
                gpu: gpu_uuid.to_string(),
                reason: format!("setting {mode} failed: {reason}"),
            });
        }
        {
            let mut hardware = lock(&self.hardware);
            let mut next = hardware.clone();
            match mode {
                GpuSharingMode::Default => next.sharing.remove(gpu_uuid),
                other => next.sharing.insert(gpu_uuid.to_string(), other),
            };
            if next != *hardware {
                self.store_hardware(&next)?;
                *hardware = next;
            }
        }
        if spec.sharing_hangs {
            self.hang_while_sharing_hangs(gpu_uuid, mode)?;
        }
        Ok(())
    }

    /// Returns once the profile no longer says `sharingHangs` for the GPU (or after [`MAX_HANG`]).
    fn hang_while_sharing_hangs(
        &self,
        gpu_uuid: &str,
        mode: GpuSharingMode,
    ) -> Result<(), GpuError> {
        let hung = Instant::now();
        loop {
            std::thread::sleep(HANG_POLL);
            // A profile that cannot be read for a moment (being written) leaves the hang as it is.
            let hangs = self
                .profile()
                .ok()
                .and_then(|profile| self.sharing_gpu(&profile, gpu_uuid).ok())
                .is_none_or(|spec| spec.sharing_hangs);
            if !hangs {
                return Ok(());
            }
            if hung.elapsed() >= MAX_HANG {
                return Err(GpuError::Sharing {
                    gpu: gpu_uuid.to_string(),
                    reason: format!(
                        "setting {mode} did not return for {}s (sharingHangs)",
                        MAX_HANG.as_secs()
                    ),
                });
            }
        }
    }

    /// The compute mode as a sharing mode: as on NVML, a time-sliced GPU reads as `Default`.
    pub(super) fn sharing_mode(&self, gpu_uuid: &str) -> Result<GpuSharingMode, GpuError> {
        let profile = self.profile()?;
        self.sharing_gpu(&profile, gpu_uuid)?;
        Ok(match lock(&self.hardware).sharing.get(gpu_uuid) {
            Some(GpuSharingMode::ExclusiveProcess) => GpuSharingMode::ExclusiveProcess,
            _ => GpuSharingMode::Default,
        })
    }

    /// The profile's GPU with this UUID, if it can be reached.
    fn sharing_gpu(&self, profile: &FakeProfile, gpu_uuid: &str) -> Result<FakeGpuSpec, GpuError> {
        let refuse = |reason: String| GpuError::Sharing {
            gpu: gpu_uuid.to_string(),
            reason,
        };
        let spec = profile
            .gpus
            .iter()
            .enumerate()
            .find(|(index, spec)| {
                self.gpu_uuid(spec, spec.minor.unwrap_or(*index as u32)) == gpu_uuid
            })
            .map(|(_, spec)| spec)
            .ok_or_else(|| refuse("no such GPU on this node".into()))?;
        if let Some(reason) = &spec.unreadable {
            return Err(refuse(format!("the GPU cannot be read: {reason}")));
        }
        let lost = spec
            .faults
            .iter()
            .any(|f| f.kind == FakeFaultKind::Lost && f.mig_start.is_none());
        if lost {
            return Err(refuse("the GPU is lost (it fell off the bus)".into()));
        }
        Ok(spec.clone())
    }
}

#[cfg(test)]
mod sharing_tests {
    use super::*;
    use crate::gpu::{builtin_profile, FakeFault, GpuBackend, TimeSliceInterval};
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    /// A four-GPU L40S node from a profile file the test can edit, with its state in `state.json`.
    fn node(dir: &Path, edit: impl FnOnce(&mut FakeProfile)) -> (PathBuf, FakeBackend) {
        let path = dir.join("node.yaml");
        let mut profile = builtin_profile("l40s-4").unwrap();
        edit(&mut profile);
        write(&path, &profile);
        (path.clone(), reopen(dir, &path))
    }

    fn reopen(dir: &Path, profile: &Path) -> FakeBackend {
        FakeBackend::with_state_file(
            "node-a",
            profile.to_str().unwrap(),
            Some(dir.join("state.json")),
        )
        .unwrap()
    }

    fn write(path: &Path, profile: &FakeProfile) {
        std::fs::write(path, serde_yaml::to_string(profile).unwrap()).unwrap();
    }

    fn uuids(backend: &FakeBackend) -> Vec<String> {
        let inventory = backend.inventory().unwrap();
        let mut all: Vec<(u32, String)> = inventory
            .gpus
            .iter()
            .map(|g| (g.minor, g.uuid.clone()))
            .chain(
                inventory
                    .unreadable
                    .iter()
                    .map(|u| (u.minor.unwrap(), u.uuid.clone().unwrap())),
            )
            .collect();
        all.sort();
        all.into_iter().map(|(_, uuid)| uuid).collect()
    }

    #[test]
    fn modes_are_set_read_and_reset_per_gpu_and_setting_twice_is_harmless() {
        let dir = tempfile::tempdir().unwrap();
        let (_, backend) = node(dir.path(), |_| {});
        let gpu = uuids(&backend);
        let long = GpuSharingMode::TimeSlice(TimeSliceInterval::Long);
        backend.set_sharing(&gpu[0], &long).unwrap();
        backend
            .set_sharing(&gpu[1], &GpuSharingMode::ExclusiveProcess)
            .unwrap();
        let expected = BTreeMap::from([
            (gpu[0].clone(), long),
            (gpu[1].clone(), GpuSharingMode::ExclusiveProcess),
        ]);
        assert_eq!(backend.sharing_modes(), expected);
        // As on NVML, the interval cannot be read back: a time-sliced GPU reads as Default.
        assert_eq!(backend.sharing(&gpu[0]).unwrap(), GpuSharingMode::Default);
        assert_eq!(
            backend.sharing(&gpu[1]).unwrap(),
            GpuSharingMode::ExclusiveProcess
        );
        assert_eq!(backend.sharing(&gpu[2]).unwrap(), GpuSharingMode::Default);

        backend.set_sharing(&gpu[0], &long).unwrap();
        assert_eq!(backend.sharing_modes(), expected);

        // Another interval replaces the first; Default resets the GPU.
        let short = GpuSharingMode::TimeSlice(TimeSliceInterval::Short);
        backend.set_sharing(&gpu[0], &short).unwrap();
        assert_eq!(backend.sharing_modes().get(&gpu[0]), Some(&short));
        backend
            .set_sharing(&gpu[0], &GpuSharingMode::Default)
            .unwrap();
        backend
            .set_sharing(&gpu[0], &GpuSharingMode::Default)
            .unwrap();
        assert_eq!(backend.sharing(&gpu[0]).unwrap(), GpuSharingMode::Default);
        assert_eq!(
            backend.sharing_modes(),
            BTreeMap::from([(gpu[1].clone(), GpuSharingMode::ExclusiveProcess)])
        );
    }

    #[test]
    fn modes_outlive_the_backend_in_the_state_file_beside_mig_state() {
        let dir = tempfile::tempdir().unwrap();
        let (path, first) = node(dir.path(), |_| {});
        let gpu = uuids(&first);
        let medium = GpuSharingMode::TimeSlice(TimeSliceInterval::Medium);
        first.set_sharing(&gpu[3], &medium).unwrap();
        drop(first);
        let second = reopen(dir.path(), &path);
        assert_eq!(
            second.sharing_modes(),
            BTreeMap::from([(gpu[3].clone(), medium)])
        );
        // Reset, and a third start sees the GPU as it came.
        second
            .set_sharing(&gpu[3], &GpuSharingMode::Default)
            .unwrap();
        assert!(reopen(dir.path(), &path).sharing_modes().is_empty());

        // A state file from before sharing existed (MIG state only) still loads.
        let h100 = tempfile::tempdir().unwrap();
        let state = h100.path().join("state.json");
        std::fs::write(
            &state,
            r#"{"migEnabled": [], "created": {}, "destroyed": []}"#,
        )
        .unwrap();
        let old = FakeBackend::with_state_file("node-a", "dgx-h100", Some(state)).unwrap();
        assert!(old.sharing_modes().is_empty());
    }

    #[test]
    fn unknown_unreadable_and_lost_gpus_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let (_, backend) = node(dir.path(), |p| {
            p.gpus[1].unreadable = Some("GPU is lost".into());
            p.gpus[2].faults = vec![FakeFault {
                kind: FakeFaultKind::Lost,
                xid: None,
                mig_start: None,
            }];
        });
        let gpu = uuids(&backend);
        let mode = GpuSharingMode::ExclusiveProcess;
        let err = backend.set_sharing("GPU-nope", &mode).unwrap_err();
        assert!(matches!(err, GpuError::Sharing { .. }), "{err}");
        assert_eq!(err.to_string(), "GPU GPU-nope: no such GPU on this node");
        let err = backend.set_sharing(&gpu[1], &mode).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("GPU {}: the GPU cannot be read: GPU is lost", gpu[1])
        );
        let err = backend.set_sharing(&gpu[2], &mode).unwrap_err().to_string();
        assert!(err.starts_with(&format!("GPU {}: ", gpu[2])), "{err}");
        assert!(err.contains("lost"), "{err}");
        for bad in ["GPU-nope", &gpu[1], &gpu[2]] {
            assert!(backend.sharing(bad).is_err(), "{bad}");
        }
        assert!(backend.sharing_modes().is_empty());
        backend.set_sharing(&gpu[0], &mode).unwrap();
    }

    #[test]
    fn the_sharing_fails_knob_makes_setting_fail_until_it_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (path, backend) = node(dir.path(), |_| {});
        let gpu = uuids(&backend);
        let long = GpuSharingMode::TimeSlice(TimeSliceInterval::Long);
        backend.set_sharing(&gpu[0], &long).unwrap();

        let mut profile: FakeProfile =
            serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        profile.gpus[0].sharing_fails = Some("Insufficient Permissions".into());
        write(&path, &profile);
        let err = backend
            .set_sharing(&gpu[0], &GpuSharingMode::Default)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "GPU {}: setting compute mode DEFAULT with the default time-slice interval failed: \
                 Insufficient Permissions",
                gpu[0]
            )
        );
        // The GPU keeps the mode it had, reading it works, and other GPUs are not affected.
        assert_eq!(backend.sharing_modes().get(&gpu[0]), Some(&long));
        backend.sharing(&gpu[0]).unwrap();
        backend
            .set_sharing(&gpu[1], &GpuSharingMode::ExclusiveProcess)
            .unwrap();

        profile.gpus[0].sharing_fails = None;
        write(&path, &profile);
        backend
            .set_sharing(&gpu[0], &GpuSharingMode::Default)
            .unwrap();
        assert_eq!(backend.sharing(&gpu[0]).unwrap(), GpuSharingMode::Default);

        // The knob wants a reason.
        profile.gpus[0].sharing_fails = Some(" ".into());
        write(&path, &profile);
        let err = backend.inventory().unwrap_err().to_string();
        assert!(err.contains("gpus[0].sharingFails"), "{err}");
    }

    #[test]
    fn the_sharing_hangs_knob_holds_the_change_until_it_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (path, backend) = node(dir.path(), |p| p.gpus[0].sharing_hangs = true);
        let backend = std::sync::Arc::new(backend);
        let gpu = uuids(&backend);
        let long = GpuSharingMode::TimeSlice(TimeSliceInterval::Long);
        let hung = {
            let (backend, uuid) = (backend.clone(), gpu[0].clone());
            std::thread::spawn(move || backend.set_sharing(&uuid, &long))
        };
        std::thread::sleep(Duration::from_millis(300));
        assert!(!hung.is_finished(), "the change hangs");
        assert_eq!(
            backend.sharing_modes().get(&gpu[0]),
            Some(&long),
            "it took effect"
        );
        // Other GPUs change, and the hung GPU can be read.
        backend
            .set_sharing(&gpu[1], &GpuSharingMode::ExclusiveProcess)
            .unwrap();
        assert_eq!(backend.sharing(&gpu[0]).unwrap(), GpuSharingMode::Default);

        let mut profile: FakeProfile =
            serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        profile.gpus[0].sharing_hangs = false;
        write(&path, &profile);
        hung.join().unwrap().unwrap();
        assert_eq!(backend.sharing_modes().get(&gpu[0]), Some(&long));
        backend
            .set_sharing(&gpu[0], &GpuSharingMode::Default)
            .unwrap();
    }
}
