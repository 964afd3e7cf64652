//! The MIG side of the NVML backend: reading a GPU's profiles, placements and existing MIG devices
//! (one per compute instance), and creating / adopting / destroying MIG devices (a GPU instance with
//! one compute instance spanning it). Callers hold the GPU's MIG lock. Safe code only; the raw NVML
//! calls it makes live, with all `unsafe`, in `nvml.rs`.

use std::collections::HashMap;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProfileInfo;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstance_t, NVML_COMPUTE_INSTANCE_PROFILE_COUNT, NVML_DEVICE_MIG_ENABLE,
    NVML_GPU_INSTANCE_PROFILE_COUNT,
};

use super::mig::mig_enable_failed;
use super::nvml::{
    ci_info, ci_profile_info, compute_instances, create_ci, create_gi, destroy_ci, destroy_gi,
    gi_by_id, gi_info, gi_placements, gpu_instances, is, mig_ids, profile_info_v2, Failed, Named,
    NvmlBackend, NO_COMPUTE_INSTANCE,
};
use super::nvml_inventory::architecture_code;
use super::nvml_support::{self as support, RawProfile};
use super::{
    ComputeShare, DriverProc, GpuError, MigDestroyed, MigInfo, MigInstance, MigPlacement,
    MigRequest,
};

impl NvmlBackend {
    pub(super) fn read_mig(
        &self,
        device: &Device,
        minor: u32,
        product_name: &str,
        memory_bytes: u64,
        arch: Option<u32>,
    ) -> Result<Option<MigInfo>, GpuError> {
        let mode = match device.mig_mode() {
            Ok(mode) => mode,
            Err(NvmlError::NotSupported) => return Ok(None),
            Err(e) => {
                return Err(Failed {
                    call: "nvmlDeviceGetMigMode",
                    error: e,
                }
                .into())
            }
        };
        let enabled = mode.current == NVML_DEVICE_MIG_ENABLE;
        let profiles = read_profiles(device)?;
        // NOT_SUPPORTED placements fall back to the model table; any other failure is real.
        for profile in &profiles {
            if let Err(e) = &profile.placements {
                if !matches!(e, NvmlError::NotSupported) {
                    return Err(GpuError::Nvml {
                        call: "nvmlDeviceGetGpuInstancePossiblePlacements_v2".to_string(),
                        reason: support::describe_nvml_error(e),
                    });
                }
            }
        }
        let instances = if enabled {
            self.read_instances(device, minor, &profiles)?
        } else {
            Vec::new()
        };
        let toggles = arch.is_some_and(support::toggles_without_reset);
        let mut info = support::mig_info(
            enabled,
            toggles,
            &profiles,
            memory_bytes,
            product_name,
            instances,
        )
        .map_err(|reason| GpuError::Nvml {
            call: "nvmlDeviceGetGpuInstanceProfileInfo".to_string(),
            reason,
        })?;
        if enabled {
            info.disable_failed = device
                .uuid()
                .ok()
                .and_then(|uuid| lock(&self.disable_failed).get(&uuid).cloned());
        }
        Ok(Some(info))
    }

    pub(super) fn read_instances(
        &self,
        device: &Device,
        minor: u32,
        profiles: &[RawProfile],
    ) -> Result<Vec<MigInstance>, GpuError> {
        let uuids = mig_uuids(device);
        let mut instances = Vec::new();
        for profile in profiles {
            let gis = match gpu_instances(device, profile.info.id, profile.info.instance_count) {
                Ok(gis) => gis,
                Err(f) if is(&f, &[NvmlError::NotSupported, NvmlError::NotFound]) => continue,
                Err(f) => return Err(f.into()),
            };
            for gi in gis {
                let info = gi_info(self.nvml, gi)?;
                let cis = compute_instances_of(self.nvml, gi)?;
                if cis.is_empty() {
                    instances.push(mig_instance(
                        &info,
                        NO_COMPUTE_INSTANCE,
                        String::new(),
                        vec![],
                    ));
                }
                for (_, ci, ci_profile) in cis {
                    let gpu = format!("gpu-{minor} GPU instance {} compute instance {ci}", info.id);
                    let mig_err = |reason| GpuError::Mig {
                        gpu: gpu.clone(),
                        reason,
                    };
                    let (uuid, index) = uuids.get(&(info.id, ci)).cloned().ok_or_else(|| {
                        mig_err("NVML lists the compute instance but no MIG device for it".into())
                    })?;
                    let files = self.device_files(minor, info.id, ci).map_err(mig_err)?;
                    let mut instance = mig_instance(&info, ci, uuid, files);
                    instance.index = Some(index);
                    // A compute instance smaller than its GPU instance shares it with others.
                    if ci_profile.sliceCount < profile.info.slice_count {
                        instance.compute = Some(ComputeShare {
                            slices: ci_profile.sliceCount,
                            multiprocessors: ci_profile.multiprocessorCount,
                        });
                    }
                    instances.push(instance);
                }
            }
        }
        instances.sort_by_key(|i| (i.placement.start, i.gpu_instance_id, i.compute_instance_id));
        Ok(instances)
    }

    /// The capability files of a MIG device, from the driver's MIG table (through the driver root).
    /// The table is read once it can be; a failed read is tried again next time.
    fn device_files(&self, minor: u32, gi: u32, ci: u32) -> Result<Vec<String>, String> {
        let table = match self.mig_minors.get() {
            Some(table) => table,
            None => {
                let read = DriverProc::new(&self.driver_root)
                    .mig_minors()
                    .map_err(|e| e.to_string())?;
                self.mig_minors.get_or_init(|| read)
            }
        };
        table.device_files(minor, gi, ci).map_err(|e| e.to_string())
    }

    /// Everything after the GPU instance exists; on error the caller tears the instance down.
    fn finish_mig(
        &self,
        device: &Device,
        gi: nvmlGpuInstance_t,
        minor: u32,
        profile: &ProfileInfo,
        request: &MigRequest,
    ) -> Result<MigInstance, GpuError> {
        let mig_err = |reason: String| GpuError::Mig {
            gpu: request.parent_uuid.clone(),
            reason,
        };
        let info = gi_info(self.nvml, gi)?;
        // One compute instance spanning the whole GPU instance, sharing its engines.
        let ci_profile = (0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
            .filter_map(|index| ci_profile_info(self.nvml, gi, index).ok())
            .find(|p| p.sliceCount == profile.slice_count)
            .ok_or_else(|| {
                mig_err(format!(
                    "GPU instance {} offers no compute-instance profile of {} slices",
                    info.id, profile.slice_count
                ))
            })?;
        let ci = create_ci(self.nvml, gi, ci_profile.id)?;
        let ci_id = ci_info(self.nvml, ci)?.id;
        // The compute instance's own `device` field is the parent GPU, so find the MIG handle.
        let (uuid, index) = mig_uuids(device).remove(&(info.id, ci_id)).ok_or_else(|| {
            mig_err(format!(
                "NVML shows no MIG device for GPU instance {} / CI {ci_id}",
                info.id
            ))
        })?;
        let files = self.device_files(minor, info.id, ci_id).map_err(mig_err)?;
        let mut instance = mig_instance(&info, ci_id, uuid, files);
        instance.index = Some(index);
        Ok(instance)
    }

    /// Creates the MIG device; with `adopt`, one of the requested profile that already exists at the
    /// requested placement is returned instead (`true`), and a GPU instance there without compute
    /// instance (a create interrupted between the two) is finished.
    pub(super) fn create_mig_device(
        &self,
        request: &MigRequest,
        adopt: bool,
    ) -> Result<(MigInstance, bool), GpuError> {
        let gpu = request.parent_uuid.as_str();
        let mig_err = |reason: String| GpuError::Mig {
            gpu: gpu.to_string(),
            reason,
        };
        let mut device = self.device_by_uuid(gpu)?;
        let mode = match device.mig_mode() {
            Ok(mode) => mode,
            Err(NvmlError::NotSupported) => {
                return Err(mig_err("the GPU does not support MIG".into()))
            }
            Err(e) => {
                return Err(Failed {
                    call: "nvmlDeviceGetMigMode",
                    error: e,
                }
                .into())
            }
        };
        if mode.current != NVML_DEVICE_MIG_ENABLE {
            let arch = architecture_code(&device);
            if !arch.is_some_and(support::toggles_without_reset) {
                let pending = if mode.pending == NVML_DEVICE_MIG_ENABLE {
                    " (switching it on is pending until the next GPU reset)"
                } else {
                    ""
                };
                return Err(mig_err(format!(
                    "MIG mode is off{pending}; on {} GPUs switching it on needs a GPU reset, so \
                     enable it beforehand (`nvidia-smi -i {gpu} -mig 1`, then reset the GPU)",
                    support::architecture_name(arch.unwrap_or(u32::MAX))
                )));
            }
            let why = match device.set_mig_mode(true) {
                Ok(0) => None,
                Ok(status) => Some(format!(
                    "NVML nvmlDeviceSetMigMode activation status: {}",
                    support::return_code_text(status)
                )),
                Err(e) => Some(format!(
                    "NVML nvmlDeviceSetMigMode: {}",
                    support::describe_nvml_error(&e)
                )),
            };
            if let Some(why) = why {
                return Err(mig_err(mig_enable_failed(gpu, &why)));
            }
            // The driver may re-probe the GPU when the mode changes: take a fresh handle.
            device = self.device_by_uuid(gpu)?;
        }
        let minor = device.minor_number().named("nvmlDeviceGetMinorNumber")?;
        let profile = (0..NVML_GPU_INSTANCE_PROFILE_COUNT)
            .filter_map(|index| device.profile_info(index).ok())
            .find(|p| p.id == request.profile_id)
            .ok_or_else(|| {
                mig_err(format!(
                    "the GPU has no GPU-instance profile with id {}",
                    request.profile_id
                ))
            })?;
        let placement = request.placement;
        if adopt {
            if let Some(found) = self.adopt(&device, minor, &profile, request)? {
                return Ok((found, true));
            }
        }
        let gi = create_gi(&device, request.profile_id, placement).map_err(|f| GpuError::Nvml {
            call: f.call.to_string(),
            reason: format!(
                "profile {} at memory slices {}..{}: {}",
                request.profile_id,
                placement.start,
                placement.start + placement.size,
                support::describe_nvml_error(&f.error)
            ),
        })?;
        self.finish_mig(&device, gi, minor, &profile, request)
            .map(|made| (made, false))
            .map_err(|error| match tear_down(self.nvml, gi) {
                Ok(()) => error,
                Err(f) => mig_err(format!(
                    "{error}; removing the half-made GPU instance also failed: {}",
                    GpuError::from(f)
                )),
            })
    }

    /// The MIG device of the requested profile at exactly the requested placement, if there is one:
    /// its single compute instance, or a compute instance made now for a GPU instance without one.
    fn adopt(
        &self,
        device: &Device,
        minor: u32,
        profile: &ProfileInfo,
        request: &MigRequest,
    ) -> Result<Option<MigInstance>, GpuError> {
        let gis = match gpu_instances(device, profile.id, profile.instance_count) {
            Ok(gis) => gis,
            Err(f) if is(&f, &[NvmlError::NotSupported, NvmlError::NotFound]) => return Ok(None),
            Err(f) => return Err(f.into()),
        };
        for gi in gis {
            let info = gi_info(self.nvml, gi)?;
            if info.placement.start != request.placement.start
                || info.placement.size != request.placement.size
            {
                continue;
            }
            let cis = compute_instances_of(self.nvml, gi)?;
            return match cis.as_slice() {
                [] => self
                    .finish_mig(device, gi, minor, profile, request)
                    .map(Some),
                [(_, ci, ci_profile)] if ci_profile.sliceCount == profile.slice_count => {
                    let (uuid, _) = mig_uuids(device).remove(&(info.id, *ci)).ok_or_else(|| {
                        GpuError::Mig {
                            gpu: request.parent_uuid.clone(),
                            reason: format!(
                                "NVML shows no MIG device for GPU instance {} / CI {ci}",
                                info.id
                            ),
                        }
                    })?;
                    let files = self
                        .device_files(minor, info.id, *ci)
                        .map_err(|reason| GpuError::Mig {
                            gpu: request.parent_uuid.clone(),
                            reason,
                        })?;
                    Ok(Some(mig_instance(&info, *ci, uuid, files)))
                }
                _ => Err(GpuError::Mig {
                    gpu: request.parent_uuid.clone(),
                    reason: format!(
                        "the GPU instance at memory slice {} is split into other compute instances; \
                         it is not one this driver made",
                        request.placement.start
                    ),
                }),
            };
        }
        Ok(None)
    }

    /// Destroys the GPU instance `gpu_instance_id` if it still holds the MIG device `expected_uuid`
    /// (empty: no compute instance at all).
    pub(super) fn destroy_mig_device(
        &self,
        parent_uuid: &str,
        gpu_instance_id: u32,
        expected_uuid: &str,
    ) -> Result<MigDestroyed, GpuError> {
        let device = self.device_by_uuid(parent_uuid)?;
        let gone = [
            NvmlError::NotFound,
            NvmlError::InvalidArg,
            NvmlError::NotSupported,
        ];
        let gi = match gi_by_id(&device, gpu_instance_id) {
            Ok(gi) => gi,
            // Gone already (or MIG mode is off, so it cannot exist): retries converge.
            Err(f) if is(&f, &gone) => return Ok(MigDestroyed::Gone),
            Err(f) => return Err(f.into()),
        };
        // GPU instance ids are reused: check that this one still holds the device the caller means.
        let uuids = mig_uuids(&device);
        let holds: Vec<String> = compute_instances_of(self.nvml, gi)?
            .iter()
            .map(|(_, ci, _)| {
                uuids
                    .get(&(gpu_instance_id, *ci))
                    .map(|(uuid, _)| uuid.clone())
                    .unwrap_or_default()
            })
            .collect();
        let ours = if expected_uuid.is_empty() {
            holds.is_empty()
        } else {
            holds.iter().any(|uuid| uuid == expected_uuid)
        };
        if !ours {
            return Ok(MigDestroyed::Replaced {
                found: holds.first().cloned().unwrap_or_default(),
            });
        }
        tear_down(self.nvml, gi).map_err(|f| {
            if is(&f, &[NvmlError::InUse]) {
                GpuError::MigInUse {
                    gpu: parent_uuid.to_string(),
                    uuid: expected_uuid.to_string(),
                }
            } else {
                f.into()
            }
        })?;
        self.switch_mig_off_when_empty(&device, parent_uuid)?;
        Ok(MigDestroyed::Destroyed)
    }

    /// With the last MIG device gone, MIG mode is switched off again where that needs no reset, so the
    /// whole GPU, which dynamic MIG also publishes, runs CUDA again (a GPU in MIG mode shows no device
    /// to CUDA without an instance).
    /// A failure is remembered (and the whole GPU not offered) until a later switch succeeds.
    fn switch_mig_off_when_empty(
        &self,
        device: &Device<'static>,
        uuid: &str,
    ) -> Result<(), GpuError> {
        if !architecture_code(device).is_some_and(support::toggles_without_reset) {
            return Ok(());
        }
        for profile in read_profiles(device)? {
            let max = profile.info.instance_count;
            if !gpu_instances(device, profile.info.id, max)?.is_empty() {
                return Ok(());
            }
        }
        let failure = match device.set_mig_mode(false) {
            Ok(0) => None,
            Ok(status) => Some(support::return_code_text(status)),
            Err(e) => Some(support::describe_nvml_error(&e)),
        };
        match failure {
            None => {
                lock(&self.disable_failed).remove(uuid);
            }
            Some(reason) => {
                // The GPU still works in MIG mode; its MIG devices stay offered, the whole GPU not.
                tracing::warn!(gpu = %uuid, %reason, "switching MIG mode off failed; the whole GPU is not offered until it succeeds");
                lock(&self.disable_failed).insert(uuid.to_string(), reason);
            }
        }
        Ok(())
    }
}

fn mig_instance(
    info: &nvmlGpuInstanceInfo_t,
    ci: u32,
    uuid: String,
    files: Vec<String>,
) -> MigInstance {
    MigInstance {
        uuid,
        profile_id: info.profileId,
        placement: MigPlacement {
            start: info.placement.start,
            size: info.placement.size,
        },
        gpu_instance_id: info.id,
        compute_instance_id: ci,
        device_files: files,
        compute: None,
        index: None,
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(super) fn read_profiles(device: &Device) -> Result<Vec<RawProfile>, Failed> {
    let mut profiles = Vec::new();
    for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        let info = match device.profile_info(index) {
            Ok(info) => info,
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => continue,
            Err(e) => {
                return Err(Failed {
                    call: "nvmlDeviceGetGpuInstanceProfileInfo",
                    error: e,
                })
            }
        };
        let nvml_name = profile_info_v2(device, index)
            .ok()
            .map(|v2| support::c_chars_to_string(&v2.name));
        let placements = gi_placements(device, info.id).map_err(|f| f.error);
        profiles.push(RawProfile {
            index,
            info,
            nvml_name,
            placements,
        });
    }
    Ok(profiles)
}

/// (GPU instance id, compute instance id) → MIG device UUID and NVML's index of its handle, from the
/// GPU's MIG device handles.
fn mig_uuids(device: &Device) -> HashMap<(u32, u32), (String, u32)> {
    let mut uuids = HashMap::new();
    for index in 0..device.mig_device_count().unwrap_or(0) {
        // NVML answers NOT_FOUND for empty slots.
        let Ok(mig) = device.mig_device_by_index(index) else {
            continue;
        };
        if let (Ok(ids), Ok(uuid)) = (mig_ids(&mig), mig.uuid()) {
            uuids.insert(ids, (uuid, index));
        }
    }
    uuids
}

/// A compute instance: its handle, its id, and the profile it was made with.
type ComputeInstance = (nvmlComputeInstance_t, u32, nvmlComputeInstanceProfileInfo_t);

/// The compute instances of a GPU instance with their ids, across all compute-instance profiles.
fn compute_instances_of(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
) -> Result<Vec<ComputeInstance>, Failed> {
    let mut found: Vec<ComputeInstance> = Vec::new();
    for index in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let profile = match ci_profile_info(nvml, gi, index) {
            Ok(profile) => profile,
            Err(f) if is(&f, &[NvmlError::NotSupported, NvmlError::InvalidArg]) => continue,
            Err(f) => return Err(f),
        };
        for ci in compute_instances(nvml, gi, profile.id, profile.instanceCount)? {
            let id = ci_info(nvml, ci)?.id;
            if !found.iter().any(|(_, known, _)| *known == id) {
                found.push((ci, id, profile));
            }
        }
    }
    Ok(found)
}

/// Destroys every compute instance of a GPU instance, then the GPU instance.
fn tear_down(nvml: &Nvml, gi: nvmlGpuInstance_t) -> Result<(), Failed> {
    for (ci, _, _) in compute_instances_of(nvml, gi)? {
        match destroy_ci(nvml, ci) {
            Err(f) if !is(&f, &[NvmlError::NotFound, NvmlError::InvalidArg]) => return Err(f),
            _ => {}
        }
    }
    destroy_gi(nvml, gi)
}
