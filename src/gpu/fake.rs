//! The fake GPU backend: a node described by a built-in profile or a YAML file. The file is read again
//! on every inventory call, so editing it changes what the plugin publishes without a restart. MIG
//! devices created at run time live in the fake "hardware" state, kept in a file when one is given so
//! that it outlives plugin restarts as real GPU state does; creation checks the physical geometry
//! (memory slices, compute slices, media engines) the way the GPU would.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::mig::{
    builtin_profiles_for, MigInfo, MigInstance, MigPlacement, MigProfile, MigRequest,
};
use super::profiles::{
    builtin_profile, builtin_profile_names, FakeFault, FakeFaultKind, FakeGpuSpec, FakeProfile,
};
use super::{nvlink, Gpu, GpuBackend, GpuError, GpuEvent, GpuEventKind, Inventory};

/// The namespace of the name-based UUIDs the fake backend derives, so they are stable per node.
const FAKE_UUID_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6a1d_5f0e_8f4c_4b7e_9d7e_2f1a_0c3b_5e41);

#[derive(Debug, Clone)]
enum ProfileSource {
    Builtin(FakeProfile),
    File(PathBuf),
}

/// What changed on the fake GPUs since the profile was written: MIG mode switched on, MIG devices
/// created, and pre-created (profile) MIG devices destroyed.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FakeHardware {
    mig_enabled: BTreeSet<String>,
    created: BTreeMap<String, Vec<MigInstance>>,
    /// `(parent UUID, GPU instance id)` of profile MIG devices that were destroyed.
    destroyed: BTreeSet<(String, u32)>,
}

#[derive(Debug)]
pub struct FakeBackend {
    node_name: String,
    source: ProfileSource,
    hardware: Mutex<FakeHardware>,
    /// Where the hardware state is kept across restarts; `None` keeps it in memory.
    state_file: Option<PathBuf>,
    faults: Mutex<FaultWatch>,
}

/// A fault as events report it: the GPU, the MIG device's GPU instance (if any), what happened.
type FaultKey = (String, Option<u32>, FakeFaultKind, Option<u64>);

/// What `wait_event` has reported so far, to turn edits of the profile's faults into events.
#[derive(Debug, Default)]
struct FaultWatch {
    reported: std::collections::BTreeSet<FaultKey>,
    pending: std::collections::VecDeque<GpuEvent>,
    /// The profile file's modification time and length when last read.
    last_seen: Option<(std::time::SystemTime, u64)>,
    primed: bool,
}

/// How often `wait_event` looks at the profile file for changed faults.
const FAULT_POLL: std::time::Duration = std::time::Duration::from_millis(10);

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
        let backend = FakeBackend {
            node_name: node_name.to_string(),
            source,
            hardware: Mutex::new(FakeHardware::default()),
            state_file,
            faults: Mutex::new(FaultWatch::default()),
        };
        backend.load_hardware()?;
        backend.inventory()?;
        Ok(backend)
    }

    fn profile(&self) -> Result<FakeProfile, GpuError> {
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

    fn gpu_uuid(&self, spec: &FakeGpuSpec, minor: u32) -> String {
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
        *lock(&self.hardware) = state;
        Ok(())
    }

    fn store_hardware(&self, state: &FakeHardware) -> Result<(), GpuError> {
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

    /// The GPUs of the profile with the hardware state applied (MIG devices, MIG mode).
    fn gpus(&self, profile: &FakeProfile, hardware: &FakeHardware) -> Vec<Gpu> {
        let groups = nvlink_groups(profile);
        let bus_ids: Vec<String> = profile.gpus.iter().map(|g| g.pci_bus_id.clone()).collect();
        let mut gpus: Vec<Gpu> = profile
            .gpus
            .iter()
            .enumerate()
            .map(|(index, spec)| {
                let minor = spec.minor.unwrap_or(index as u32);
                let uuid = self.gpu_uuid(spec, minor);
                let nvlink_peers = match &groups[index] {
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
                    .map(|profiles| self.mig_info(spec, minor, &uuid, profiles, hardware));
                Gpu {
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
                }
            })
            .collect();
        nvlink::assign_domains(&mut gpus);
        gpus
    }

    fn mig_info(
        &self,
        spec: &FakeGpuSpec,
        minor: u32,
        uuid: &str,
        profiles: Vec<MigProfile>,
        hardware: &FakeHardware,
    ) -> MigInfo {
        let mut instances: Vec<MigInstance> = spec
            .mig_instances
            .iter()
            .filter_map(|wanted| {
                let profile = profiles.iter().find(|p| p.name == wanted.profile)?;
                let placement = *profile
                    .placements
                    .iter()
                    .find(|p| p.start == wanted.start)?;
                let gpu_instance_id = gpu_instance_id(placement);
                if hardware
                    .destroyed
                    .contains(&(uuid.to_string(), gpu_instance_id))
                {
                    return None;
                }
                Some(MigInstance {
                    uuid: format!(
                        "MIG-{}",
                        self.derived_uuid(&format!("mig/{minor}/{}", placement.start))
                    ),
                    profile_id: profile.id,
                    placement,
                    gpu_instance_id,
                    compute_instance_id: 0,
                    device_files: fake_device_files(minor, gpu_instance_id, 0),
                })
            })
            .collect();
        instances.extend(hardware.created.get(uuid).cloned().unwrap_or_default());
        instances.sort_by_key(|i| i.placement);
        MigInfo {
            enabled: spec.mig_enabled || hardware.mig_enabled.contains(uuid),
            toggles_without_reset: toggles_without_reset(&spec.architecture),
            memory_slices: 8,
            compute_slices: 7,
            profiles,
            instances,
        }
    }
}

impl GpuBackend for FakeBackend {
    fn name(&self) -> &str {
        "fake"
    }

    fn inventory(&self) -> Result<Inventory, GpuError> {
        let profile = self.profile()?;
        let hardware = lock(&self.hardware).clone();
        Ok(Inventory {
            driver_version: profile.driver_version.clone(),
            cuda_driver_version: profile.cuda_driver_version.clone(),
            gpus: self.gpus(&profile, &hardware),
            control_device_files: vec![
                "/dev/nvidiactl".to_string(),
                "/dev/nvidia-uvm".to_string(),
                "/dev/nvidia-uvm-tools".to_string(),
            ],
            stand_in_device_file: Some("/dev/null".to_string()),
        })
    }

    /// Checks the request against the GPU's geometry as the hardware would: the placement must be one
    /// the profile allows, its memory slices free, and the GPU's compute slices and media engines
    /// sufficient for everything on it.
    fn create_mig(&self, request: &MigRequest) -> Result<MigInstance, GpuError> {
        let profile = self.profile()?;
        let mut hardware = lock(&self.hardware);
        let gpus = self.gpus(&profile, &hardware);
        let refuse = |reason: String| GpuError::Mig {
            gpu: request.parent_uuid.clone(),
            reason,
        };
        let gpu = gpus
            .iter()
            .find(|g| g.uuid == request.parent_uuid)
            .ok_or_else(|| refuse("no such GPU on this node".into()))?;
        let mig = gpu
            .mig
            .as_ref()
            .ok_or_else(|| refuse("the GPU does not support MIG".into()))?;
        if !mig.enabled && !mig.toggles_without_reset {
            return Err(refuse(format!(
                "MIG mode is off and a {} GPU needs a reset to turn it on; enable MIG mode first",
                gpu.architecture
            )));
        }
        let wanted = mig
            .profile(request.profile_id)
            .ok_or_else(|| refuse(format!("no MIG profile with id {}", request.profile_id)))?;
        if !wanted.placements.contains(&request.placement) {
            return Err(refuse(format!(
                "profile {} cannot be placed at {}:{}",
                wanted.name, request.placement.start, request.placement.size
            )));
        }
        physically_fits(mig, wanted, request.placement).map_err(refuse)?;
        let gpu_instance_id = gpu_instance_id(request.placement);
        let instance = MigInstance {
            uuid: format!("MIG-{}", uuid::Uuid::new_v4()),
            profile_id: wanted.id,
            placement: request.placement,
            gpu_instance_id,
            compute_instance_id: 0,
            device_files: fake_device_files(gpu.minor, gpu_instance_id, 0),
        };
        let mut next = hardware.clone();
        next.mig_enabled.insert(gpu.uuid.clone());
        next.created
            .entry(gpu.uuid.clone())
            .or_default()
            .push(instance.clone());
        self.store_hardware(&next)?;
        *hardware = next;
        Ok(instance)
    }

    /// Reports the profile's faults as events: each fault when it appears (faults present at start
    /// included), and `Recovered` for a GPU or MIG device when its last fault is removed from the file.
    fn wait_event(&self, timeout: std::time::Duration) -> Result<Option<GpuEvent>, GpuError> {
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

    fn destroy_mig(&self, parent_uuid: &str, gpu_instance_id: u32) -> Result<(), GpuError> {
        let mut hardware = lock(&self.hardware);
        let mut next = hardware.clone();
        let created = next.created.entry(parent_uuid.to_string()).or_default();
        let before = created.len();
        created.retain(|i| i.gpu_instance_id != gpu_instance_id);
        if created.len() == before {
            // Not one we created: a profile (admin-made) device, or already gone.
            next.destroyed
                .insert((parent_uuid.to_string(), gpu_instance_id));
        }
        next.created.retain(|_, list| !list.is_empty());
        // As the NVML backend does: with the last MIG device gone, MIG mode goes off again where it
        // was switched on at run time, so the whole GPU can be used.
        if !next.created.contains_key(parent_uuid) {
            next.mig_enabled.remove(parent_uuid);
        }
        if next != *hardware {
            self.store_hardware(&next)?;
            *hardware = next;
        }
        Ok(())
    }
}

impl FakeBackend {
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
    let existing: Vec<&MigProfile> = mig
        .instances
        .iter()
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

/// GPU instance ids as the fake hands them out: one per start slice, so they are unique on a GPU.
fn gpu_instance_id(placement: MigPlacement) -> u32 {
    placement.start + 1
}

/// The capability files of a fake MIG device, numbered the way the driver numbers them (one block per
/// GPU); they map onto the stand-in device file like every fake device file.
fn fake_device_files(minor: u32, gpu_instance: u32, compute_instance: u32) -> Vec<String> {
    let base = 3 + minor * 128 + gpu_instance * 9;
    vec![
        format!("/dev/nvidia-caps/nvidia-cap{base}"),
        format!("/dev/nvidia-caps/nvidia-cap{}", base + 1 + compute_instance),
    ]
}

fn toggles_without_reset(architecture: &str) -> bool {
    !matches!(architecture, "Ampere")
}

/// Each GPU's NVLink group: its own group name, `all` for `nvlink: true`, none otherwise.
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

/// Rejects profiles that would make devices the API server refuses or that collide on the node.
fn check_profile(profile: &FakeProfile) -> Result<(), String> {
    let mut minors = std::collections::BTreeSet::new();
    for (index, gpu) in profile.gpus.iter().enumerate() {
        let minor = gpu.minor.unwrap_or(index as u32);
        if !minors.insert(minor) {
            return Err(format!("gpus[{index}]: minor {minor} is used twice"));
        }
        if gpu.product_name.is_empty() || gpu.product_name.len() > 64 {
            return Err(format!(
                "gpus[{index}].productName must be 1 to 64 characters"
            ));
        }
        if gpu.memory_bytes == 0 {
            return Err(format!("gpus[{index}].memoryBytes must be positive"));
        }
        check_mig(index, gpu)?;
        for (i, fault) in gpu.faults.iter().enumerate() {
            if (fault.kind == FakeFaultKind::Xid) != fault.xid.is_some() {
                return Err(format!(
                    "gpus[{index}].faults[{i}]: `xid` is required for kind xid and only for it"
                ));
            }
            if fault.mig_start.is_some() && !gpu.mig_capable {
                return Err(format!(
                    "gpus[{index}].faults[{i}]: migStart on a GPU without MIG"
                ));
            }
        }
    }
    Ok(())
}

fn check_mig(index: usize, gpu: &FakeGpuSpec) -> Result<(), String> {
    if !gpu.mig_capable {
        if gpu.mig_enabled || !gpu.mig_instances.is_empty() {
            return Err(format!(
                "gpus[{index}]: migEnabled and migInstances need migCapable: true"
            ));
        }
        return Ok(());
    }
    let profiles = builtin_profiles_for(&gpu.product_name).ok_or_else(|| {
        format!(
            "gpus[{index}]: no MIG profile table for {:?} (known models: A100 40GB, H100 80GB, H200)",
            gpu.product_name
        )
    })?;
    if !gpu.mig_instances.is_empty() && !gpu.mig_enabled {
        return Err(format!("gpus[{index}]: migInstances need migEnabled: true"));
    }
    let mut mig = MigInfo {
        enabled: true,
        toggles_without_reset: true,
        memory_slices: 8,
        compute_slices: 7,
        profiles: profiles.clone(),
        instances: Vec::new(),
    };
    for (i, wanted) in gpu.mig_instances.iter().enumerate() {
        let field = format!("gpus[{index}].migInstances[{i}]");
        let profile = profiles
            .iter()
            .find(|p| p.name == wanted.profile)
            .ok_or_else(|| {
                let names: Vec<&str> = profiles.iter().map(|p| p.name.as_str()).collect();
                format!(
                    "{field}: unknown profile {:?} (this model has {})",
                    wanted.profile,
                    names.join(", ")
                )
            })?;
        let placement = *profile
            .placements
            .iter()
            .find(|p| p.start == wanted.start)
            .ok_or_else(|| {
                let starts: Vec<String> = profile
                    .placements
                    .iter()
                    .map(|p| p.start.to_string())
                    .collect();
                format!(
                    "{field}: {} cannot start at memory slice {} (possible: {})",
                    profile.name,
                    wanted.start,
                    starts.join(", ")
                )
            })?;
        physically_fits(&mig, profile, placement).map_err(|e| format!("{field}: {e}"))?;
        mig.instances.push(MigInstance {
            uuid: format!("#{i}"),
            profile_id: profile.id,
            placement,
            gpu_instance_id: gpu_instance_id(placement),
            compute_instance_id: 0,
            device_files: Vec::new(),
        });
    }
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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

#[cfg(test)]
mod mig_tests {
    use super::*;

    fn h100(state: Option<PathBuf>) -> FakeBackend {
        FakeBackend::with_state_file("node-a", "dgx-h100", state).unwrap()
    }

    fn request(backend: &FakeBackend, profile: &str, start: u32) -> MigRequest {
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

        backend
            .destroy_mig(&gpu.uuid, made.gpu_instance_id)
            .unwrap();
        // Destroying again converges.
        backend
            .destroy_mig(&gpu.uuid, made.gpu_instance_id)
            .unwrap();
        let left = backend.inventory().unwrap().gpus[0].mig.clone().unwrap();
        assert_eq!(left.instances.len(), 1);
        assert_eq!(left.instances[0].placement.start, 0);
        assert!(left.enabled);
        // With the last MIG device gone, MIG mode goes off so the whole GPU works again.
        backend
            .destroy_mig(&gpu.uuid, left.instances[0].gpu_instance_id)
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
            },
            super::super::profiles::FakeMigInstance {
                profile: "1g.10gb".into(),
                start: 4,
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

#[cfg(test)]
mod fault_tests {
    use super::*;

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
