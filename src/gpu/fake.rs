//! The fake GPU backend: a node described by a built-in profile or a YAML file. The file is read again
//! on every inventory call, so editing it changes what the plugin publishes without a restart. MIG
//! devices created at run time and the GPUs' sharing modes live in the fake "hardware" state, kept in a
//! file when one is given so that it outlives plugin restarts as real GPU state does. The GPUs read from
//! the profile and that state (`fake_gpus`), MIG operations (`fake_mig`), sharing (`fake_sharing`),
//! fault events (`fake_faults`) and the profile checks (`fake_check`) live beside this file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

pub use super::fake_mig::physically_fits;

use super::caps::{CapsError, MigMinors};
use super::device_files::{control_device_files, DeviceNumber};
use super::fake_check::check_profile;
use super::fake_faults::FaultWatch;
use super::fake_pci::FakeSys;
use super::fake_proc::FakeProc;
use super::mig::{MigDestroyed, MigInstance, MigRequest};
use super::profiles::{builtin_profile, builtin_profile_names, FakeGpuSpec, FakeProfile};
use super::{GpuBackend, GpuError, GpuEvent, GpuLocks, GpuSharingMode, Inventory};

/// The namespace of the name-based UUIDs the fake backend derives, so they are stable per node.
const FAKE_UUID_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6a1d_5f0e_8f4c_4b7e_9d7e_2f1a_0c3b_5e41);

#[derive(Debug, Clone)]
pub(super) enum ProfileSource {
    Builtin(FakeProfile),
    File(PathBuf),
}

/// What changed on the fake GPUs since the profile was written: MIG mode switched on, MIG devices
/// created, pre-created (profile) MIG devices destroyed, and MIG mode that could not be switched off.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct FakeHardware {
    pub mig_enabled: BTreeSet<String>,
    pub created: BTreeMap<String, Vec<MigInstance>>,
    /// `(parent UUID, GPU instance id)` of profile MIG devices that were destroyed.
    pub destroyed: BTreeSet<(String, u32)>,
    /// Parent UUID → why switching MIG mode off failed (the GPU stays in MIG mode).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub disable_failed: BTreeMap<String, String>,
    /// GPU UUID → its sharing mode, for GPUs not in `GpuSharingMode::Default`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sharing: BTreeMap<String, GpuSharingMode>,
    /// The node's boot when this state was written: a reboot loses what a real GPU loses then.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
}

impl FakeHardware {
    /// What a node reboot leaves of the GPUs' state: MIG mode (kept by the GPU across reboots), but no
    /// MIG device made at run time, no sharing mode, and the profile's own MIG devices back.
    fn after_reboot(self, boot_id: String) -> FakeHardware {
        FakeHardware {
            mig_enabled: self.mig_enabled,
            boot_id,
            ..FakeHardware::default()
        }
    }
}

#[derive(Debug)]
pub struct FakeBackend {
    node_name: String,
    pub(super) source: ProfileSource,
    pub(super) hardware: Mutex<FakeHardware>,
    /// Where the hardware state is kept across restarts; `None` keeps it in memory.
    state_file: Option<PathBuf>,
    /// The driver's `/proc` files of the fake node (device majors, MIG capability minors).
    pub(super) proc: FakeProc,
    /// The fake node's `/sys` (PCI bus, drivers, IOMMU groups) and its kernel.
    sys: FakeSys,
    /// The numbers every fake device file gets: `/dev/null`'s, so containers open them harmlessly.
    stand_in: DeviceNumber,
    pub(super) faults: Mutex<FaultWatch>,
    /// MIG operations on one GPU run one at a time, as in the NVML backend.
    pub(super) mig_locks: GpuLocks,
    /// So do sharing changes.
    pub(super) sharing_locks: GpuLocks,
}

impl FakeBackend {
    /// `profile` is a built-in profile name or the path of a YAML profile file. A file is checked now,
    /// so a typo fails at start rather than at the first rescan.
    pub fn new(node_name: &str, profile: &str) -> Result<Self, GpuError> {
        Self::with_state_file(node_name, profile, None)
    }

    /// Like [`FakeBackend::new`], keeping the fake GPUs' MIG state in `state_file` (created if absent).
    pub fn with_state_file(
        node_name: &str,
        profile: &str,
        state_file: Option<PathBuf>,
    ) -> Result<Self, GpuError> {
        let source = match builtin_profile(profile) {
            Some(builtin) => ProfileSource::Builtin(builtin),
            None if looks_like_path(profile) => ProfileSource::File(PathBuf::from(profile)),
            None => {
                return Err(GpuError::UnknownProfile(
                    profile.to_string(),
                    builtin_profile_names().join(", "),
                ))
            }
        };
        let stand_in = DeviceNumber::of_character_device(std::path::Path::new("/dev/null"))
            .map_err(|e| GpuError::Unavailable {
                backend: "fake".into(),
                reason: format!("its device files get /dev/null's numbers: {e}"),
            })?;
        let backend = FakeBackend {
            node_name: node_name.to_string(),
            source,
            hardware: Mutex::new(FakeHardware::default()),
            proc: FakeProc::beside(state_file.as_deref())?,
            sys: FakeSys::beside(state_file.as_deref())?,
            stand_in,
            state_file,
            faults: Mutex::new(FaultWatch::default()),
            mig_locks: GpuLocks::default(),
            sharing_locks: GpuLocks::default(),
        };
        backend.load_hardware()?;
        backend.inventory()?;
        Ok(backend)
    }

    pub(super) fn profile(&self) -> Result<FakeProfile, GpuError> {
        match &self.source {
            ProfileSource::Builtin(profile) => Ok(profile.clone()),
            ProfileSource::File(path) => {
                let shown = path.display().to_string();
                let text =
                    std::fs::read_to_string(path).map_err(|source| GpuError::ReadProfile {
                        path: shown.clone(),
                        source,
                    })?;
                let profile: FakeProfile =
                    serde_yaml::from_str(&text).map_err(|e| GpuError::MalformedProfile {
                        path: shown.clone(),
                        message: e.to_string(),
                    })?;
                check_profile(&profile).map_err(|message| GpuError::MalformedProfile {
                    path: shown,
                    message,
                })?;
                Ok(profile)
            }
        }
    }

    pub(super) fn derived_uuid(&self, what: &str) -> uuid::Uuid {
        uuid::Uuid::new_v5(
            &FAKE_UUID_NAMESPACE,
            format!("{}/{what}", self.node_name).as_bytes(),
        )
    }

    pub(super) fn gpu_uuid(&self, spec: &FakeGpuSpec, minor: u32) -> String {
        spec.uuid
            .clone()
            .unwrap_or_else(|| format!("GPU-{}", self.derived_uuid(&format!("gpu/{minor}"))))
    }

    /// Reads the state file into memory (a missing file is a fresh node).
    fn load_hardware(&self) -> Result<(), GpuError> {
        let Some(path) = &self.state_file else {
            return Ok(());
        };
        let state = match std::fs::read(path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|e| GpuError::MalformedProfile {
                    path: path.display().to_string(),
                    message: format!("fake GPU state: {e}"),
                })?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => FakeHardware::default(),
            Err(source) => {
                return Err(GpuError::ReadProfile {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        let this_boot = crate::boot::current_boot_id();
        let state = if state.boot_id.is_empty() || state.boot_id == this_boot {
            FakeHardware {
                boot_id: this_boot,
                ..state
            }
        } else {
            tracing::info!(
                state = %path.display(),
                "the fake GPUs' state is of an earlier boot: their MIG devices and sharing modes are gone, as after a reboot"
            );
            let state = state.after_reboot(this_boot);
            self.store_hardware(&state)?;
            state
        };
        *lock(&self.hardware) = state;
        Ok(())
    }

    pub(super) fn store_hardware(&self, state: &FakeHardware) -> Result<(), GpuError> {
        let Some(path) = &self.state_file else {
            return Ok(());
        };
        let bytes = serde_json::to_vec_pretty(state).map_err(|e| GpuError::Mig {
            gpu: "fake".into(),
            reason: e.to_string(),
        })?;
        crate::fsutil::write_atomically(path, &bytes, 0o600).map_err(|source| {
            GpuError::ReadProfile {
                path: path.display().to_string(),
                source,
            }
        })
    }

    /// The driver's MIG capability table of the fake node.
    pub(super) fn mig_minors(&self) -> Result<MigMinors, CapsError> {
        self.proc.mig_minors()
    }
}

impl GpuBackend for FakeBackend {
    fn name(&self) -> &str {
        "fake"
    }

    fn inventory(&self) -> Result<Inventory, GpuError> {
        let profile = self.profile()?;
        let hardware = lock(&self.hardware).clone();
        let (gpus, unreadable) = self.gpus(&profile, &hardware);
        let pci_gpus =
            self.sys
                .sync(&profile)?
                .nvidia_gpus()
                .map_err(|e| GpuError::Unavailable {
                    backend: "fake".into(),
                    reason: e.to_string(),
                })?;
        Ok(Inventory {
            driver_version: profile.driver_version.clone(),
            cuda_driver_version: profile.cuda_driver_version.clone(),
            gpus,
            // A fake node looks like a GPU node with the nvidia-modeset module loaded, so that specs
            // written with the fake backend show the file as NVIDIA's do on such a node.
            control_device_files: control_device_files(true),
            device_majors: self.proc.device_majors(),
            stand_in_device: Some(self.stand_in),
            unreadable,
            pci_gpus,
        })
    }

    fn create_mig(&self, request: &MigRequest) -> Result<MigInstance, GpuError> {
        self.mig_locks.with(&request.parent_uuid, || {
            let made = self.create_locked(request, false).map(|(made, _)| made);
            self.hang_while_mig_hangs(&request.parent_uuid, "creating a MIG device")?;
            made
        })
    }

    fn create_or_adopt_mig(&self, request: &MigRequest) -> Result<(MigInstance, bool), GpuError> {
        self.mig_locks.with(&request.parent_uuid, || {
            let made = self.create_locked(request, true);
            self.hang_while_mig_hangs(&request.parent_uuid, "creating a MIG device")?;
            made
        })
    }

    fn destroy_mig(
        &self,
        parent_uuid: &str,
        gpu_instance_id: u32,
        expected_uuid: &str,
    ) -> Result<MigDestroyed, GpuError> {
        self.mig_locks.with(parent_uuid, || {
            let destroyed = self.destroy_locked(parent_uuid, gpu_instance_id, expected_uuid);
            self.hang_while_mig_hangs(parent_uuid, "destroying a MIG device")?;
            destroyed
        })
    }

    fn set_sharing(&self, gpu_uuid: &str, mode: &GpuSharingMode) -> Result<(), GpuError> {
        self.set_sharing_mode(gpu_uuid, *mode)
    }

    fn sharing(&self, gpu_uuid: &str) -> Result<GpuSharingMode, GpuError> {
        self.sharing_mode(gpu_uuid)
    }

    fn pci(&self) -> Result<Option<super::PciSysfs>, GpuError> {
        self.sys.sync(&self.profile()?).map(Some)
    }

    fn wait_event(&self, timeout: std::time::Duration) -> Result<Option<GpuEvent>, GpuError> {
        self.next_fault_event(timeout)
    }
}

fn looks_like_path(profile: &str) -> bool {
    profile.contains('/') || profile.ends_with(".yaml") || profile.ends_with(".yml")
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_look_like_real_nodes() {
        let node = FakeBackend::new("node-a", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        assert_eq!(node.gpus.len(), 8);
        assert!(node
            .gpus
            .iter()
            .all(|g| g.product_name == "NVIDIA H100 80GB HBM3"));
        assert!(node.gpus.iter().all(|g| g.mig.is_some()));
        let domains: std::collections::BTreeSet<_> =
            node.gpus.iter().map(|g| g.nvlink_domain.clone()).collect();
        assert_eq!(domains.len(), 1, "one NVLink domain on a DGX");
        assert!(domains.iter().all(Option::is_some));
        let l40s = FakeBackend::new("node-a", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        assert_eq!(l40s.gpus.len(), 4);
        assert!(l40s
            .gpus
            .iter()
            .all(|g| g.nvlink_domain.is_none() && g.mig.is_none()));
        assert_eq!(
            FakeBackend::new("n", "dgx-a100")
                .unwrap()
                .inventory()
                .unwrap()
                .gpus
                .len(),
            8
        );
    }

    #[test]
    fn uuids_are_stable_per_node_and_differ_between_nodes() {
        let a1 = FakeBackend::new("node-a", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        let a2 = FakeBackend::new("node-a", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        let b = FakeBackend::new("node-b", "dgx-h100")
            .unwrap()
            .inventory()
            .unwrap();
        assert_eq!(a1, a2);
        assert_ne!(a1.gpus[0].uuid, b.gpus[0].uuid);
        let uuids: std::collections::BTreeSet<_> = a1.gpus.iter().map(|g| &g.uuid).collect();
        assert_eq!(uuids.len(), 8);
        assert!(a1.gpus[0].uuid.starts_with("GPU-"));
    }

    #[test]
    fn unknown_profile_names_the_builtins() {
        let err = FakeBackend::new("n", "dgx-b200").unwrap_err().to_string();
        assert!(
            err.contains("dgx-b200") && err.contains("dgx-h100"),
            "{err}"
        );
    }

    #[test]
    fn yaml_profile_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        let mut profile = builtin_profile("l40s-4").unwrap();
        profile.gpus.truncate(2);
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let backend = FakeBackend::new("n", path.to_str().unwrap()).unwrap();
        assert_eq!(backend.inventory().unwrap().gpus.len(), 2);

        // Edits are picked up by the next inventory call.
        profile.gpus.truncate(1);
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        assert_eq!(backend.inventory().unwrap().gpus.len(), 1);

        std::fs::write(&path, "name: x\ngpus: [{productName: 1}]\n").unwrap();
        let err = backend.inventory().unwrap_err().to_string();
        assert!(
            err.contains("malformed") && err.contains("node.yaml"),
            "{err}"
        );

        profile.gpus.push(profile.gpus[0].clone());
        profile.gpus[1].minor = Some(0);
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        let err = backend.inventory().unwrap_err().to_string();
        assert!(err.contains("minor 0 is used twice"), "{err}");
    }
}
