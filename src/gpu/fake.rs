//! The fake GPU backend: a node described by a built-in profile or a YAML file. The file is read again
//! on every inventory call, so editing it changes what the plugin publishes without a restart. MIG
//! devices created at run time and the GPUs' sharing modes live in the fake "hardware" state, kept in a
//! file when one is given so that it outlives plugin restarts as real GPU state does. MIG operations
//! (`fake_mig`), sharing (`fake_sharing`), fault events (`fake_faults`) and the profile checks
//! (`fake_check`) live beside this file.

use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

pub use super::fake_mig::physically_fits;

use super::caps::{CapsError, MigMinors};
use super::device_files::{control_device_files, DeviceNumber};
use super::fake_check::check_profile;
use super::fake_faults::FaultWatch;
use super::fake_proc::FakeProc;
use super::mig::{
    builtin_profiles_for, ComputeShare, MigDestroyed, MigInfo, MigInstance, MigPlacement,
    MigProfile, MigRequest, NO_COMPUTE_INSTANCE,
};
use super::profiles::{builtin_profile, builtin_profile_names, FakeGpuSpec, FakeProfile};
use super::{
    nvlink, Gpu, GpuBackend, GpuError, GpuEvent, GpuLocks, GpuSharingMode, Inventory, UnreadableGpu,
};

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
    proc: FakeProc,
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

    fn derived_uuid(&self, what: &str) -> uuid::Uuid {
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

    /// The readable GPUs of the profile with the hardware state applied (MIG devices, MIG mode), and
    /// the ones marked unreadable.
    pub(super) fn gpus(
        &self,
        profile: &FakeProfile,
        hardware: &FakeHardware,
    ) -> (Vec<Gpu>, Vec<UnreadableGpu>) {
        let groups = nvlink_groups(profile);
        // Read once, and only for a GPU with MIG devices of its profile.
        let minors = OnceCell::new();
        let bus_ids: Vec<String> = profile.gpus.iter().map(|g| g.pci_bus_id.clone()).collect();
        let mut gpus = Vec::new();
        let mut unreadable = Vec::new();
        for (index, spec) in profile.gpus.iter().enumerate() {
            let minor = spec.minor.unwrap_or(index as u32);
            let uuid = self.gpu_uuid(spec, minor);
            if let Some(reason) = &spec.unreadable {
                // What NVML still tells of a GPU it cannot read: its handle's index, and often the
                // minor number, UUID and PCI address.
                unreadable.push(UnreadableGpu {
                    index: index as u32,
                    minor: Some(minor),
                    uuid: Some(uuid),
                    pci_bus_id: Some(spec.pci_bus_id.clone()),
                    reason: reason.clone(),
                });
                continue;
            }
            let nvlink_peers = match &groups[index] {
                // Links to the node's NVSwitches: NVML names no switch, only the "invalid PCI"
                // sentinel, which all switched GPUs share.
                Some(_) if spec.nvlink_group.is_none() => vec![NVSWITCH_PEER.to_string()],
                // Direct links (bridges): the peer GPUs' bus ids.
                Some(group) => (0..profile.gpus.len())
                    .filter(|&j| j != index && groups[j].as_ref() == Some(group))
                    .map(|j| bus_ids[j].clone())
                    .collect(),
                None => Vec::new(),
            };
            let mig = spec
                .mig_capable
                .then(|| builtin_profiles_for(&spec.product_name))
                .flatten()
                .map(|profiles| self.mig_info(spec, minor, &uuid, profiles, hardware, &minors))
                .transpose();
            // As on the NVML backend: a GPU whose MIG devices' files cannot be found is not read.
            let mig = match mig {
                Ok(mig) => mig,
                Err(reason) => {
                    unreadable.push(UnreadableGpu {
                        index: index as u32,
                        minor: Some(minor),
                        uuid: Some(uuid),
                        pci_bus_id: Some(spec.pci_bus_id.clone()),
                        reason,
                    });
                    continue;
                }
            };
            gpus.push(Gpu {
                minor,
                uuid,
                product_name: spec.product_name.clone(),
                brand: spec.brand.clone(),
                architecture: spec.architecture.clone(),
                cuda_compute_capability: spec.cuda_compute_capability.clone(),
                memory_bytes: spec.memory_bytes,
                pci_bus_id: spec.pci_bus_id.clone(),
                pcie_root: spec.pcie_root.clone(),
                numa_node: spec.numa_node,
                nvlink_domain: None,
                fabric: spec.fabric.as_ref().map(|f| nvlink::FabricInfo {
                    cluster_uuid: f.cluster_uuid.clone(),
                    clique_id: f.clique_id,
                }),
                nvlink_peers,
                mig,
            });
        }
        nvlink::assign_domains(&mut gpus);
        (gpus, unreadable)
    }

    fn mig_info(
        &self,
        spec: &FakeGpuSpec,
        minor: u32,
        uuid: &str,
        profiles: Vec<MigProfile>,
        hardware: &FakeHardware,
        minors: &OnceCell<Result<MigMinors, CapsError>>,
    ) -> Result<MigInfo, String> {
        let mut instances: Vec<MigInstance> = Vec::new();
        for wanted in &spec.mig_instances {
            let Some(profile) = profiles.iter().find(|p| p.name == wanted.profile) else {
                continue;
            };
            let Some(placement) = profile.placements.iter().find(|p| p.start == wanted.start)
            else {
                continue;
            };
            let gpu_instance_id = gpu_instance_id(*placement);
            if hardware
                .destroyed
                .contains(&(uuid.to_string(), gpu_instance_id))
            {
                continue;
            }
            instances.extend(self.profile_instances(
                minor,
                profile,
                *placement,
                wanted.compute_instances.as_deref(),
                minors,
            )?);
        }
        instances.extend(hardware.created.get(uuid).cloned().unwrap_or_default());
        instances.sort_by_key(|i| (i.placement, i.compute_instance_id));
        Ok(MigInfo {
            enabled: spec.mig_enabled || hardware.mig_enabled.contains(uuid),
            toggles_without_reset: toggles_without_reset(&spec.architecture),
            memory_slices: 8,
            compute_slices: 7,
            profiles,
            instances,
            disable_failed: hardware.disable_failed.get(uuid).cloned(),
        })
    }

    /// The MIG devices of one GPU instance an admin made: one per compute instance, or one without
    /// compute instance (`[]`). A single compute instance spanning the GPU instance keeps the UUID
    /// derivation of earlier versions, so UUIDs stay the same across upgrades.
    fn profile_instances(
        &self,
        minor: u32,
        profile: &MigProfile,
        placement: MigPlacement,
        compute_instances: Option<&[u32]>,
        minors: &OnceCell<Result<MigMinors, CapsError>>,
    ) -> Result<Vec<MigInstance>, String> {
        let gpu_instance_id = gpu_instance_id(placement);
        let base = |uuid: String, ci: u32, files: Vec<String>, compute| MigInstance {
            uuid,
            profile_id: profile.id,
            placement,
            gpu_instance_id,
            compute_instance_id: ci,
            device_files: files,
            compute,
        };
        let files = |ci| {
            let table = minors.get_or_init(|| self.proc.mig_minors());
            device_files(table, minor, gpu_instance_id, ci)
        };
        let whole = format!("mig/{minor}/{}", placement.start);
        Ok(match compute_instances {
            None => vec![base(
                format!("MIG-{}", self.derived_uuid(&whole)),
                0,
                files(0)?,
                None,
            )],
            Some([]) => vec![base(String::new(), NO_COMPUTE_INSTANCE, Vec::new(), None)],
            Some([only]) if *only == profile.compute_slices => vec![base(
                format!("MIG-{}", self.derived_uuid(&whole)),
                0,
                files(0)?,
                None,
            )],
            Some(list) => list
                .iter()
                .enumerate()
                .map(|(ci, &slices)| {
                    let ci = ci as u32;
                    Ok(base(
                        format!("MIG-{}", self.derived_uuid(&format!("{whole}/ci{ci}"))),
                        ci,
                        files(ci)?,
                        Some(ComputeShare {
                            slices,
                            multiprocessors: profile.multiprocessors * slices
                                / profile.compute_slices.max(1),
                        }),
                    ))
                })
                .collect::<Result<_, String>>()?,
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
        Ok(Inventory {
            driver_version: profile.driver_version.clone(),
            cuda_driver_version: profile.cuda_driver_version.clone(),
            gpus,
            control_device_files: control_device_files(),
            device_majors: self.proc.device_majors(),
            stand_in_device: Some(self.stand_in),
            unreadable,
        })
    }

    fn create_mig(&self, request: &MigRequest) -> Result<MigInstance, GpuError> {
        self.mig_locks.with(&request.parent_uuid, || {
            self.create_locked(request, false).map(|(made, _)| made)
        })
    }

    fn create_or_adopt_mig(&self, request: &MigRequest) -> Result<(MigInstance, bool), GpuError> {
        self.mig_locks
            .with(&request.parent_uuid, || self.create_locked(request, true))
    }

    fn destroy_mig(
        &self,
        parent_uuid: &str,
        gpu_instance_id: u32,
        expected_uuid: &str,
    ) -> Result<MigDestroyed, GpuError> {
        self.mig_locks.with(parent_uuid, || {
            self.destroy_locked(parent_uuid, gpu_instance_id, expected_uuid)
        })
    }

    fn set_sharing(&self, gpu_uuid: &str, mode: &GpuSharingMode) -> Result<(), GpuError> {
        self.set_sharing_mode(gpu_uuid, *mode)
    }

    fn sharing(&self, gpu_uuid: &str) -> Result<GpuSharingMode, GpuError> {
        self.sharing_mode(gpu_uuid)
    }

    fn wait_event(&self, timeout: std::time::Duration) -> Result<Option<GpuEvent>, GpuError> {
        self.next_fault_event(timeout)
    }
}

/// GPU instance ids as the fake hands them out: one per start slice, so they are unique on a GPU.
pub(super) fn gpu_instance_id(placement: MigPlacement) -> u32 {
    placement.start + 1
}

/// The capability files of a fake MIG device, from the fake node's MIG table as NVML's backend takes
/// them from the real one's.
pub(super) fn device_files(
    minors: &Result<MigMinors, CapsError>,
    gpu_minor: u32,
    gpu_instance: u32,
    compute_instance: u32,
) -> Result<Vec<String>, String> {
    let table = minors.as_ref().map_err(|e| e.to_string())?;
    table
        .device_files(gpu_minor, gpu_instance, compute_instance)
        .map_err(|e| e.to_string())
}

fn toggles_without_reset(architecture: &str) -> bool {
    !matches!(architecture, "Ampere")
}

/// What NVML reports as the remote end of a link to an NVSwitch: the switch is not PCI-enumerable from
/// the GPU, so `nvmlDeviceGetNvLinkRemotePciInfo` fills every field with ones (`FFFFFFFF:FF:FF.0`), as
/// NVIDIA's mock NVML models HGX and GB200 baseboards; in sysfs form, as the inventory keeps peers.
const NVSWITCH_PEER: &str = "ffffffff:ff:ff.0";

/// Each GPU's NVLink group: its own group name, `all` for `nvlink: true` (the NVSwitches), none
/// otherwise.
fn nvlink_groups(profile: &FakeProfile) -> Vec<Option<String>> {
    profile
        .gpus
        .iter()
        .map(|g| {
            g.nvlink_group
                .clone()
                .or_else(|| g.nvlink.then(|| "all".to_string()))
        })
        .collect()
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
