//! MIG operations of the fake backend, checked against the GPU's physical geometry (memory slices,
//! compute slices, media engines) as the hardware checks them, and run in steps as NVML runs them:
//! MIG mode on, then the GPU instance and its compute instance; destroy, then MIG mode off when the
//! GPU is empty. The profile can slow the steps down (`migOperationDelayMs`), hold a MIG device in
//! use (`migInUse`), make switching MIG mode off fail (`migDisableFails`) and make an operation hang
//! after it took effect until the knob is removed (`migHangs`).

use std::time::{Duration, Instant};

use super::fake::{lock, FakeBackend};
use super::fake_gpus::{device_files, gpu_instance_id};
use super::mig::{
    mig_enable_failed, MigDestroyed, MigInfo, MigInstance, MigPlacement, MigProfile, MigRequest,
};
use super::profiles::{FakeGpuSpec, FakeProfile};
use super::{Gpu, GpuError};

/// How often a hanging MIG operation looks whether `migHangs` was removed.
const HANG_POLL: Duration = Duration::from_millis(20);

/// A hang ends with an error after this long, so that a test that forgets the knob still ends.
const MAX_HANG: Duration = Duration::from_secs(120);

impl FakeBackend {
    /// Returns once the profile no longer says `migHangs` for the GPU (at once where it never did,
    /// or after [`MAX_HANG`]); the caller holds the GPU's MIG lock, as a stuck NVML call holds it.
    pub(super) fn hang_while_mig_hangs(&self, gpu_uuid: &str, doing: &str) -> Result<(), GpuError> {
        let hangs = |unreadable: bool| match self.profile() {
            Ok(profile) => spec_of(self, &profile, gpu_uuid).is_some_and(|s| s.mig_hangs),
            Err(_) => unreadable,
        };
        if !hangs(false) {
            return Ok(());
        }
        let hung = Instant::now();
        // A profile that cannot be read for a moment (being written) leaves the hang as it is.
        while hangs(true) {
            if hung.elapsed() >= MAX_HANG {
                return Err(GpuError::Mig {
                    gpu: gpu_uuid.to_string(),
                    reason: format!(
                        "{doing} did not return for {}s (migHangs)",
                        MAX_HANG.as_secs()
                    ),
                });
            }
            std::thread::sleep(HANG_POLL);
        }
        Ok(())
    }

    /// The pause between an operation's steps: half the profile's delay, so a whole operation takes
    /// about the delay.
    fn step_pause(profile: &FakeProfile) -> Duration {
        Duration::from_millis(profile.mig_operation_delay_ms.unwrap_or(0) / 2)
    }

    /// The GPU of a request as the hardware is now, or why no MIG device can be made on it.
    fn mig_gpu(&self, profile: &FakeProfile, parent_uuid: &str) -> Result<Gpu, GpuError> {
        let hardware = lock(&self.hardware).clone();
        let (gpus, unreadable) = self.gpus(profile, &hardware);
        let refuse = |reason: String| GpuError::Mig {
            gpu: parent_uuid.to_string(),
            reason,
        };
        if let Some(bad) = unreadable
            .iter()
            .find(|u| u.uuid.as_deref() == Some(parent_uuid))
        {
            return Err(refuse(format!("the GPU cannot be read: {}", bad.reason)));
        }
        gpus.into_iter()
            .find(|g| g.uuid == parent_uuid)
            .ok_or_else(|| refuse("no such GPU on this node".into()))
    }

    /// Creates (or, with `adopt`, finds) the MIG device; the caller holds the GPU's MIG lock.
    pub(super) fn create_locked(
        &self,
        request: &MigRequest,
        adopt: bool,
    ) -> Result<(MigInstance, bool), GpuError> {
        let profile = self.profile()?;
        let refuse = |reason: String| GpuError::Mig {
            gpu: request.parent_uuid.clone(),
            reason,
        };
        let gpu = self.mig_gpu(&profile, &request.parent_uuid)?;
        let mig = gpu
            .mig
            .as_ref()
            .ok_or_else(|| refuse("the GPU does not support MIG".into()))?;
        let wanted = mig
            .profile(request.profile_id)
            .ok_or_else(|| refuse(format!("no MIG profile with id {}", request.profile_id)))?;
        if adopt {
            let here: Vec<&MigInstance> = mig
                .instances
                .iter()
                .filter(|i| i.placement == request.placement && i.profile_id == wanted.id)
                .collect();
            match here.as_slice() {
                [only] if only.has_compute_instance() && only.compute.is_none() => {
                    return Ok(((*only).clone(), true))
                }
                [] => {}
                _ => {
                    return Err(refuse(format!(
                    "a {} GPU instance at memory slice {} is split into other compute instances; \
                         it is not one this driver made",
                    wanted.name, request.placement.start
                )))
                }
            }
        }
        if !mig.enabled && !mig.toggles_without_reset {
            return Err(refuse(format!(
                "MIG mode is off and a {} GPU needs a reset to turn it on; enable MIG mode first",
                gpu.architecture
            )));
        }
        if !wanted.placements.contains(&request.placement) {
            return Err(refuse(format!(
                "profile {} cannot be placed at {}:{}",
                wanted.name, request.placement.start, request.placement.size
            )));
        }
        physically_fits(mig, wanted, request.placement).map_err(refuse)?;
        // Step 1: MIG mode on, which the GPU may refuse as NVML does.
        if !mig.enabled {
            if let Some(why) = spec_of(self, &profile, &gpu.uuid).and_then(|s| s.mig_enable_fails) {
                return Err(refuse(mig_enable_failed(
                    &gpu.uuid,
                    &format!("NVML nvmlDeviceSetMigMode: {why}"),
                )));
            }
            let mut hardware = lock(&self.hardware);
            let mut next = hardware.clone();
            next.mig_enabled.insert(gpu.uuid.clone());
            next.disable_failed.remove(&gpu.uuid);
            self.store_hardware(&next)?;
            *hardware = next;
        }
        std::thread::sleep(Self::step_pause(&profile));
        // Step 2: the GPU instance and its compute instance, on the hardware as it is now.
        let now = self.mig_gpu(&profile, &request.parent_uuid)?;
        let mig = now
            .mig
            .as_ref()
            .ok_or_else(|| refuse("the GPU does not support MIG".into()))?;
        if !mig.enabled {
            return Err(refuse(
                "MIG mode was switched off while the MIG device was being created".into(),
            ));
        }
        physically_fits(mig, wanted, request.placement).map_err(refuse)?;
        let gpu_instance_id = gpu_instance_id(request.placement);
        let instance = MigInstance {
            uuid: format!("MIG-{}", uuid::Uuid::new_v4()),
            profile_id: wanted.id,
            placement: request.placement,
            gpu_instance_id,
            compute_instance_id: 0,
            device_files: device_files(&self.mig_minors(), gpu.minor, gpu_instance_id, 0)
                .map_err(refuse)?,
            compute: None,
            index: None,
        };
        let mut hardware = lock(&self.hardware);
        let mut next = hardware.clone();
        next.created
            .entry(gpu.uuid.clone())
            .or_default()
            .push(instance.clone());
        self.store_hardware(&next)?;
        *hardware = next;
        Ok((instance, false))
    }

    /// Destroys the GPU instance after checking it is the expected one; the caller holds the GPU's
    /// MIG lock.
    pub(super) fn destroy_locked(
        &self,
        parent_uuid: &str,
        gpu_instance_id: u32,
        expected_uuid: &str,
    ) -> Result<MigDestroyed, GpuError> {
        let profile = self.profile()?;
        let gpu = self.mig_gpu(&profile, parent_uuid)?;
        let Some(mig) = gpu.mig.as_ref() else {
            return Ok(MigDestroyed::Gone);
        };
        let here: Vec<&MigInstance> = mig
            .instances
            .iter()
            .filter(|i| i.gpu_instance_id == gpu_instance_id)
            .collect();
        let Some(first) = here.first() else {
            return Ok(MigDestroyed::Gone);
        };
        if !here.iter().any(|i| i.uuid == expected_uuid) {
            return Ok(MigDestroyed::Replaced {
                found: first.uuid.clone(),
            });
        }
        let spec = spec_of(self, &profile, &gpu.uuid);
        let held = spec
            .as_ref()
            .is_some_and(|s| s.mig_in_use.contains(&first.placement.start));
        if held {
            return Err(GpuError::MigInUse {
                gpu: parent_uuid.to_string(),
                uuid: expected_uuid.to_string(),
            });
        }
        // Step 1: the compute instances and the GPU instance.
        {
            let mut hardware = lock(&self.hardware);
            let mut next = hardware.clone();
            let created = next.created.entry(parent_uuid.to_string()).or_default();
            let before = created.len();
            created.retain(|i| i.gpu_instance_id != gpu_instance_id);
            if created.len() == before {
                // Not one we created: a profile (admin-made) device.
                next.destroyed
                    .insert((parent_uuid.to_string(), gpu_instance_id));
            }
            next.created.retain(|_, list| !list.is_empty());
            self.store_hardware(&next)?;
            *hardware = next;
        }
        std::thread::sleep(Self::step_pause(&profile));
        // Step 2: as the NVML backend does, with the last MIG device gone MIG mode goes off again where
        // it was switched on at run time, so the whole GPU can be used.
        let mut hardware = lock(&self.hardware);
        let mut next = hardware.clone();
        if next.mig_enabled.contains(parent_uuid) && !next.created.contains_key(parent_uuid) {
            match spec.and_then(|s| s.mig_disable_fails) {
                Some(reason) => {
                    next.disable_failed.insert(parent_uuid.to_string(), reason);
                }
                None => {
                    next.mig_enabled.remove(parent_uuid);
                    next.disable_failed.remove(parent_uuid);
                }
            }
        }
        if next != *hardware {
            self.store_hardware(&next)?;
            *hardware = next;
        }
        Ok(MigDestroyed::Destroyed)
    }
}

/// The profile's entry for the GPU with this UUID.
fn spec_of(backend: &FakeBackend, profile: &FakeProfile, uuid: &str) -> Option<FakeGpuSpec> {
    profile
        .gpus
        .iter()
        .enumerate()
        .find(|(index, spec)| backend.gpu_uuid(spec, spec.minor.unwrap_or(*index as u32)) == uuid)
        .map(|(_, spec)| spec.clone())
}

/// The physical check of one more MIG device on a GPU, independent of the counters the device model
/// publishes (the property test compares the two).
pub fn physically_fits(
    mig: &MigInfo,
    wanted: &MigProfile,
    placement: MigPlacement,
) -> Result<(), String> {
    if let Some(taken) = mig
        .instances
        .iter()
        .find(|i| i.placement.overlaps(&placement))
    {
        return Err(format!(
            "Insufficient Resources: memory slices {}..{} overlap MIG device {}",
            placement.start,
            placement.start + placement.size,
            taken.uuid
        ));
    }
    // One entry per GPU instance: its compute instances share its slices and engines.
    let gpu_instances: std::collections::BTreeMap<u32, &MigInstance> = mig
        .instances
        .iter()
        .map(|i| (i.gpu_instance_id, i))
        .collect();
    let existing: Vec<&MigProfile> = gpu_instances
        .values()
        .filter_map(|i| mig.profile(i.profile_id))
        .chain(std::iter::once(wanted))
        .collect();
    let full = mig
        .profiles
        .iter()
        .max_by_key(|p| p.compute_slices)
        .unwrap_or(wanted);
    let sum = |f: fn(&MigProfile) -> u32| existing.iter().map(|p| f(p)).sum::<u32>();
    let checks: [(&str, u32, u32); 4] = [
        (
            "compute slices",
            sum(|p| p.compute_slices),
            mig.compute_slices,
        ),
        ("video decoders", sum(|p| p.decoders), full.decoders),
        ("JPEG engines", sum(|p| p.jpeg_engines), full.jpeg_engines),
        (
            "optical flow engines",
            sum(|p| p.ofa_engines),
            full.ofa_engines,
        ),
    ];
    for (what, used, available) in checks {
        if used > available {
            return Err(format!(
                "Insufficient Resources: {used} {what} needed, the GPU has {available}"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod mig_tests {
    use super::*;
    use crate::gpu::{builtin_profile, GpuBackend};
    use std::path::PathBuf;

    fn h100(state: Option<PathBuf>) -> FakeBackend {
        FakeBackend::with_state_file("node-a", "dgx-h100", state).unwrap()
    }

    /// The request for `profile` at memory slice `start` on the backend's first GPU.
    pub(in crate::gpu) fn request(backend: &FakeBackend, profile: &str, start: u32) -> MigRequest {
        let gpu = backend.inventory().unwrap().gpus[0].clone();
        let mig = gpu.mig.unwrap();
        let profile = mig.profiles.iter().find(|p| p.name == profile).unwrap();
        MigRequest {
            parent_uuid: gpu.uuid,
            profile_id: profile.id,
            placement: *profile
                .placements
                .iter()
                .find(|p| p.start == start)
                .unwrap(),
        }
    }

    #[test]
    fn created_mig_devices_appear_and_overlaps_are_refused() {
        let backend = h100(None);
        let gpu = &backend.inventory().unwrap().gpus[0];
        assert!(!gpu.mig.as_ref().unwrap().enabled);

        let made = backend
            .create_mig(&request(&backend, "3g.40gb", 4))
            .unwrap();
        assert!(made.uuid.starts_with("MIG-"));
        assert_eq!(made.device_files.len(), 2);
        let mig = backend.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(mig.enabled, "Hopper switches MIG mode on without a reset");
        assert_eq!(mig.instances, vec![made.clone()]);

        let err = backend
            .create_mig(&request(&backend, "1g.10gb", 6))
            .unwrap_err()
            .to_string();
        assert!(err.contains("overlap") && err.contains(&made.uuid), "{err}");
        // 4g at 0 and 3g at 4 fill the GPU exactly.
        backend
            .create_mig(&request(&backend, "4g.40gb", 0))
            .unwrap();

        assert_eq!(
            backend
                .destroy_mig(&gpu.uuid, made.gpu_instance_id, &made.uuid)
                .unwrap(),
            MigDestroyed::Destroyed
        );
        // Destroying again converges.
        assert_eq!(
            backend
                .destroy_mig(&gpu.uuid, made.gpu_instance_id, &made.uuid)
                .unwrap(),
            MigDestroyed::Gone
        );
        let left = backend.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert_eq!(left.instances.len(), 1);
        assert_eq!(left.instances[0].placement.start, 0);
        assert!(left.enabled);
        // With the last MIG device gone, MIG mode goes off so the whole GPU works again.
        backend
            .destroy_mig(
                &gpu.uuid,
                left.instances[0].gpu_instance_id,
                &left.instances[0].uuid,
            )
            .unwrap();
        assert!(
            !backend.inventory().unwrap().gpus[0]
                .mig
                .clone()
                .unwrap()
                .enabled
        );
    }

    #[test]
    fn media_engines_limit_the_me_profile_to_one() {
        let backend = h100(None);
        backend
            .create_mig(&request(&backend, "1g.10gb+me", 0))
            .unwrap();
        let err = backend
            .create_mig(&request(&backend, "1g.10gb+me", 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("optical flow"), "{err}");
    }

    #[test]
    fn ampere_needs_mig_mode_on_before_creating() {
        let backend = FakeBackend::new("n", "dgx-a100").unwrap();
        let err = backend
            .create_mig(&request(&backend, "1g.5gb", 0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("reset"), "{err}");
    }

    #[test]
    fn the_state_file_outlives_the_backend_like_gpu_state_outlives_the_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        let first = h100(Some(state.clone()));
        let made = first.create_mig(&request(&first, "2g.20gb", 4)).unwrap();
        drop(first);
        let second = h100(Some(state));
        let instances = second.inventory().unwrap().gpus[0]
            .mig
            .clone()
            .unwrap()
            .instances;
        assert_eq!(instances, vec![made]);
    }

    #[test]
    fn profile_mig_instances_are_checked_like_hardware() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        let mut profile = builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(1);
        profile.gpus[0].mig_enabled = true;
        profile.gpus[0].mig_instances = vec![
            super::super::profiles::FakeMigInstance {
                profile: "3g.40gb".into(),
                start: 0,
                compute_instances: None,
            },
            super::super::profiles::FakeMigInstance {
                profile: "1g.10gb".into(),
                start: 4,
                compute_instances: None,
            },
        ];
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let backend = FakeBackend::new("n", path.to_str().unwrap()).unwrap();
        let mig = backend.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert!(mig.enabled);
        assert_eq!(mig.instances.len(), 2);

        profile.gpus[0].mig_instances[1].start = 3;
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let err = backend.inventory().unwrap_err().to_string();
        assert!(
            err.contains("migInstances[1]") && err.contains("overlap"),
            "{err}"
        );

        profile.gpus[0].mig_instances[1].profile = "9g.1gb".into();
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let err = backend.inventory().unwrap_err().to_string();
        assert!(
            err.contains("unknown profile") && err.contains("1g.10gb"),
            "{err}"
        );
    }

    #[test]
    fn bridged_pairs_make_two_nvlink_domains() {
        let gpus = FakeBackend::new("n", "a100-pcie-4")
            .unwrap()
            .inventory()
            .unwrap()
            .gpus;
        let d: Vec<_> = gpus
            .iter()
            .map(|g| g.nvlink_domain.clone().unwrap())
            .collect();
        assert_eq!(d[0], d[1]);
        assert_eq!(d[2], d[3]);
        assert_ne!(d[1], d[2]);
    }
}
