//! The real GPU backend: the NVIDIA driver's management library (libnvidia-ml) through nvml-wrapper,
//! plus the raw NVML calls the wrapper lacks (MIG instances and their ids, fabric info, event GI/CI
//! ids). All `unsafe` code of gpu-dra lives in this file; each block says why it is sound. The
//! inventory (`nvml_inventory`), the event loop (`nvml_events`) and MIG (`nvml_mig`) build on it.

use std::collections::HashMap;
use std::ffi::c_uint;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use nvml_wrapper::error::{nvml_sym, nvml_try, nvml_try_count, NvmlError};
use nvml_wrapper::{Device, EventSet, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t, nvmlComputeInstance_t,
    nvmlDeviceAddressingMode_t, nvmlEventData_t, nvmlGpuFabricInfoV_t, nvmlGpuFabricInfo_v2_t,
    nvmlGpuFabricInfo_v3_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstance_t,
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH, nvmlReturn_t,
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
};

use super::caps::MigMinors;
pub use super::mig::NO_COMPUTE_INSTANCE;
use super::nvml_events::EventState;
pub use super::nvml_probe::probe;
use super::nvml_support as support;
use super::{GpuBackend, GpuError, GpuEvent, GpuLocks, GpuSharingMode, Inventory};
use super::{MigDestroyed, MigInstance, MigPlacement, MigRequest};

/// The soname the NVIDIA driver installs; found through the dynamic loader's search path.
const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";
/// sysfs is read from the plugin's own `/sys`, which is the host's in every container runtime.
pub(super) const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// How to reach NVML.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlOptions {
    /// An explicit libnvidia-ml.so.1; by default the loader's search path, or the driver root's
    /// library directories when the driver root is not `/`.
    pub library_path: Option<PathBuf>,
    /// The host root the NVIDIA driver is installed under (where `/proc/driver/nvidia` lives).
    pub driver_root: PathBuf,
}

impl Default for NvmlOptions {
    fn default() -> Self {
        Self {
            library_path: None,
            driver_root: PathBuf::from("/"),
        }
    }
}

/// The NVML backend. `Nvml` is leaked on open so that `Device<'static>` handles and the event set
/// can be kept; open it once per process.
pub struct NvmlBackend {
    pub(super) nvml: &'static Nvml,
    pub(super) driver_root: PathBuf,
    /// `EventSet` is Send but not Sync; one health thread waits on it.
    pub(super) events: Mutex<EventState>,
    /// Kept apart from `events` so that reading it does not wait for a blocked `wait_event`.
    pub(super) unmonitored: Mutex<Vec<(String, String)>>,
    /// MIG operations on one GPU run one at a time (see `locks`).
    pub(super) mig_locks: GpuLocks,
    /// Sharing changes on one GPU (compute mode, then time-slice interval) run one at a time.
    pub(super) sharing_locks: GpuLocks,
    /// GPU UUID → why switching MIG mode off failed after its last MIG device was destroyed; the
    /// inventory reports it so that the whole GPU is not offered while it stays in MIG mode.
    pub(super) disable_failed: Mutex<HashMap<String, String>>,
    /// The driver's MIG capability table, once read: fixed while the driver is loaded, and thousands
    /// of lines, so not read again for every MIG device of every rescan.
    pub(super) mig_minors: OnceLock<MigMinors>,
}

/// An NVML failure together with the C function that returned it.
pub(super) struct Failed {
    pub call: &'static str,
    pub error: NvmlError,
}

impl From<Failed> for GpuError {
    fn from(f: Failed) -> Self {
        GpuError::Nvml {
            call: f.call.to_string(),
            reason: support::describe_nvml_error(&f.error),
        }
    }
}

/// Names the NVML function behind a failed call; `?` then turns it into `GpuError::Nvml`.
pub(super) trait Named<T> {
    fn named(self, call: &'static str) -> Result<T, Failed>;
}

impl<T> Named<T> for Result<T, NvmlError> {
    fn named(self, call: &'static str) -> Result<T, Failed> {
        self.map_err(|error| Failed { call, error })
    }
}

pub(super) fn is(result: &Failed, errors: &[NvmlError]) -> bool {
    errors
        .iter()
        .any(|e| std::mem::discriminant(e) == std::mem::discriminant(&result.error))
}

/// Resolves a raw NVML symbol by name and checks the return code of `$call`, naming the function
/// in any failure. The `unsafe` block inside `$call` carries its own SAFETY comment.
macro_rules! raw {
    ($lib:expr, $sym:ident, |$f:ident| $call:expr) => {{
        let $f = nvml_sym($lib.$sym.as_ref()).named(stringify!($sym))?;
        nvml_try($call).named(stringify!($sym))
    }};
}

impl NvmlBackend {
    pub fn open(options: NvmlOptions) -> Result<Self, GpuError> {
        let library = match &options.library_path {
            Some(path) => path.clone(),
            None if options.driver_root != Path::new("/") => {
                support::library_candidates(&options.driver_root)
                    .into_iter()
                    .find(|candidate| candidate.exists())
                    .unwrap_or_else(|| PathBuf::from(DEFAULT_LIBRARY))
            }
            None => PathBuf::from(DEFAULT_LIBRARY),
        };
        let nvml = Nvml::builder()
            .lib_path(library.as_os_str())
            .init()
            .map_err(|e| GpuError::Unavailable {
                backend: "nvml".to_string(),
                reason: support::unavailable_reason(&e, &library.display().to_string()),
            })?;
        Ok(Self {
            nvml: Box::leak(Box::new(nvml)),
            driver_root: options.driver_root,
            events: Mutex::new(EventState::default()),
            unmonitored: Mutex::new(Vec::new()),
            mig_locks: GpuLocks::default(),
            sharing_locks: GpuLocks::default(),
            disable_failed: Mutex::new(HashMap::new()),
            mig_minors: OnceLock::new(),
        })
    }

    pub(super) fn device_by_uuid(&self, uuid: &str) -> Result<Device<'static>, GpuError> {
        match self.nvml.device_by_uuid(uuid) {
            Ok(device) => Ok(device),
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => Err(GpuError::Mig {
                gpu: uuid.to_string(),
                reason: "NVML knows no GPU with this UUID on this node".to_string(),
            }),
            Err(e) => Err(Failed {
                call: "nvmlDeviceGetHandleByUUID",
                error: e,
            }
            .into()),
        }
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &str {
        "nvml"
    }

    fn inventory(&self) -> Result<Inventory, GpuError> {
        self.read_inventory()
    }

    fn create_mig(&self, request: &MigRequest) -> Result<MigInstance, GpuError> {
        let gpu = &request.parent_uuid;
        self.mig_locks.with(gpu, || {
            self.create_mig_device(request, false)
                .map(|(made, _)| made)
                .map_err(|e| support::on_gpu(gpu, e))
        })
    }

    fn create_or_adopt_mig(&self, request: &MigRequest) -> Result<(MigInstance, bool), GpuError> {
        let gpu = &request.parent_uuid;
        self.mig_locks.with(gpu, || {
            self.create_mig_device(request, true)
                .map_err(|e| support::on_gpu(gpu, e))
        })
    }

    fn destroy_mig(
        &self,
        parent_uuid: &str,
        gpu_instance_id: u32,
        expected_uuid: &str,
    ) -> Result<MigDestroyed, GpuError> {
        self.mig_locks.with(parent_uuid, || {
            self.destroy_mig_device(parent_uuid, gpu_instance_id, expected_uuid)
                .map_err(|e| support::on_gpu(parent_uuid, e))
        })
    }

    fn set_sharing(&self, gpu_uuid: &str, mode: &GpuSharingMode) -> Result<(), GpuError> {
        self.sharing_locks
            .with(gpu_uuid, || self.apply_sharing(gpu_uuid, *mode))
    }

    fn sharing(&self, gpu_uuid: &str) -> Result<GpuSharingMode, GpuError> {
        self.read_sharing(gpu_uuid)
    }

    fn pci(&self) -> Result<Option<super::PciSysfs>, GpuError> {
        Ok(Some(super::PciSysfs::host(std::path::Path::new("/sys"))))
    }

    fn wait_event(&self, timeout: Duration) -> Result<Option<GpuEvent>, GpuError> {
        self.next_event(timeout)
    }
}

/// (rows waiting to be remapped at the next reset, a remap failed), Ampere and later.
pub(super) fn remapped_rows(device: &Device) -> Result<(bool, bool), Failed> {
    let (mut correctable, mut uncorrectable, mut pending, mut failed) = (0, 0, 0, 0);
    // SAFETY: all four out-pointers are valid for the duration of the call.
    raw!(device.nvml().lib(), nvmlDeviceGetRemappedRows, |f| unsafe {
        f(
            device.handle(),
            &mut correctable,
            &mut uncorrectable,
            &mut pending,
            &mut failed,
        )
    })?;
    Ok((pending != 0, failed != 0))
}

// ---- Raw NVML calls. Handles come from NVML and stay valid while `Nvml` lives (it is leaked);
// ---- out-pointers point at locals, or at buffers sized as NVML documents.

pub(super) fn handle_key(device: &Device) -> usize {
    // SAFETY: reads the handle only; it serves as a map key and is never dereferenced here.
    unsafe { device.handle() as usize }
}

/// The raw fabric record; `None` when the driver lacks the call or the GPU has no fabric support.
/// Drivers that predate the v3 struct answer ARGUMENT_VERSION_MISMATCH; v2 is v3's prefix, so the
/// same buffer is asked again with the v2 tag.
pub(super) fn fabric_raw(device: &Device) -> Result<Option<nvmlGpuFabricInfoV_t>, Failed> {
    let Ok(f) = nvml_sym(device.nvml().lib().nvmlDeviceGetGpuFabricInfoV.as_ref()) else {
        return Ok(None);
    };
    let versions = [
        support::struct_version(std::mem::size_of::<nvmlGpuFabricInfo_v3_t>(), 3),
        support::struct_version(std::mem::size_of::<nvmlGpuFabricInfo_v2_t>(), 2),
    ];
    let mut code = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    // SAFETY: all-integer struct, so zeroed is valid.
    let mut info: nvmlGpuFabricInfoV_t = unsafe { std::mem::zeroed() };
    for version in versions {
        if code != nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH {
            break;
        }
        info.version = version;
        // SAFETY: live device handle; `info` is writable and at least as large as the version
        // tag says (v3 is the largest and v2 its prefix).
        code = unsafe { f(device.handle(), &mut info) };
    }
    match nvml_try(code) {
        Ok(()) => Ok(Some(info)),
        Err(NvmlError::NotSupported) => Ok(None),
        Err(e) => Err(Failed {
            call: "nvmlDeviceGetGpuFabricInfoV",
            error: e,
        }),
    }
}

/// The raw memory addressing mode (`NVML_DEVICE_ADDRESSING_MODE_*`); `None` where the driver lacks
/// the call or the platform does not support it (no coherent CPU-GPU memory).
pub(super) fn addressing_mode_raw(device: &Device) -> Result<Option<u32>, Failed> {
    let Ok(f) = nvml_sym(device.nvml().lib().nvmlDeviceGetAddressingMode.as_ref()) else {
        return Ok(None);
    };
    let mut mode = nvmlDeviceAddressingMode_t {
        version: support::struct_version(std::mem::size_of::<nvmlDeviceAddressingMode_t>(), 1),
        value: 0,
    };
    // SAFETY: live device handle; `mode` is writable and carries its struct version.
    match nvml_try(unsafe { f(device.handle(), &mut mode) }) {
        Ok(()) => Ok(Some(mode.value)),
        Err(NvmlError::NotSupported) => Ok(None),
        Err(e) => Err(Failed {
            call: "nvmlDeviceGetAddressingMode",
            error: e,
        }),
    }
}

/// The GPU's module id on its baseboard; `None` where the driver lacks the call or the GPU has none.
pub(super) fn module_id_raw(device: &Device) -> Option<u32> {
    let f = nvml_sym(device.nvml().lib().nvmlDeviceGetModuleId.as_ref()).ok()?;
    let mut id: c_uint = 0;
    // SAFETY: live device handle; `id` is a valid out-pointer for the call.
    nvml_try(unsafe { f(device.handle(), &mut id) }).ok()?;
    (id != 0).then_some(id)
}

pub(super) fn profile_info_v2(
    device: &Device,
    index: u32,
) -> Result<nvmlGpuInstanceProfileInfo_v2_t, Failed> {
    const SIZE: usize = std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>();
    // SAFETY: integers and a char array, so zeroed is valid.
    let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    info.version = support::struct_version(SIZE, 2);
    // SAFETY: live device handle; `info` is writable and tagged as the v2 struct it is.
    raw!(
        device.nvml().lib(),
        nvmlDeviceGetGpuInstanceProfileInfoV,
        |f| unsafe { f(device.handle(), index, &mut info) }
    )?;
    Ok(info)
}

/// Raw because nvml-wrapper 0.13's `possible_placements` never sets its Vec's length and so
/// always returns an empty list.
pub(super) fn gi_placements(device: &Device, profile_id: u32) -> Result<Vec<MigPlacement>, Failed> {
    const CALL: &str = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
    let lib = device.nvml().lib();
    let f = nvml_sym(lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2.as_ref()).named(CALL)?;
    let mut count: c_uint = 0;
    // SAFETY: a null buffer asks only for the count, which NVML writes to `count`.
    nvml_try_count(unsafe { f(device.handle(), profile_id, ptr::null_mut(), &mut count) })
        .named(CALL)?;
    let mut buf = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    if count > 0 {
        // SAFETY: `buf` has room for the `count` placements NVML said it would write.
        nvml_try(unsafe { f(device.handle(), profile_id, buf.as_mut_ptr(), &mut count) })
            .named(CALL)?;
    }
    buf.truncate(count as usize);
    Ok(buf
        .iter()
        .map(|p| MigPlacement {
            start: p.start,
            size: p.size,
        })
        .collect())
}

pub(super) fn gpu_instances(
    device: &Device,
    profile: u32,
    max: u32,
) -> Result<Vec<nvmlGpuInstance_t>, Failed> {
    let mut buf: Vec<nvmlGpuInstance_t> = vec![ptr::null_mut(); max.max(8) as usize];
    let mut count = buf.len() as c_uint;
    // SAFETY: `buf` holds at least the profile's maximum instance count, as NVML requires.
    raw!(device.nvml().lib(), nvmlDeviceGetGpuInstances, |f| unsafe {
        f(device.handle(), profile, buf.as_mut_ptr(), &mut count)
    })?;
    buf.truncate(count as usize);
    Ok(buf)
}

pub(super) fn gi_by_id(device: &Device, id: u32) -> Result<nvmlGpuInstance_t, Failed> {
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: live device handle; `gi` is a writable handle slot.
    raw!(
        device.nvml().lib(),
        nvmlDeviceGetGpuInstanceById,
        |f| unsafe { f(device.handle(), id, &mut gi) }
    )?;
    Ok(gi)
}

pub(super) fn create_gi(
    device: &Device,
    profile: u32,
    at: MigPlacement,
) -> Result<nvmlGpuInstance_t, Failed> {
    let placement = nvmlGpuInstancePlacement_t {
        start: at.start,
        size: at.size,
    };
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: `placement` is only read and outlives the call; `gi` is a writable handle slot.
    raw!(
        device.nvml().lib(),
        nvmlDeviceCreateGpuInstanceWithPlacement,
        |f| unsafe { f(device.handle(), profile, &placement, &mut gi) }
    )?;
    Ok(gi)
}

pub(super) fn gi_info(nvml: &Nvml, gi: nvmlGpuInstance_t) -> Result<nvmlGpuInstanceInfo_t, Failed> {
    // SAFETY: integers and a handle, for which all-zero (null) is valid.
    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `gi` came from NVML; `info` is writable.
    raw!(nvml.lib(), nvmlGpuInstanceGetInfo, |f| unsafe {
        f(gi, &mut info)
    })?;
    Ok(info)
}

pub(super) fn ci_profile_info(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    index: u32,
) -> Result<nvmlComputeInstanceProfileInfo_t, Failed> {
    const SHARED: u32 = NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED;
    // SAFETY: all-integer struct, so zeroed is valid.
    let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `gi` came from NVML; `info` is writable.
    raw!(
        nvml.lib(),
        nvmlGpuInstanceGetComputeInstanceProfileInfo,
        |f| unsafe { f(gi, index, SHARED, &mut info) }
    )?;
    Ok(info)
}

pub(super) fn compute_instances(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    profile: u32,
    max: u32,
) -> Result<Vec<nvmlComputeInstance_t>, Failed> {
    let mut buf: Vec<nvmlComputeInstance_t> = vec![ptr::null_mut(); max.max(8) as usize];
    let mut count = buf.len() as c_uint;
    // SAFETY: `buf` holds at least the profile's maximum instance count, as NVML requires.
    raw!(nvml.lib(), nvmlGpuInstanceGetComputeInstances, |f| unsafe {
        f(gi, profile, buf.as_mut_ptr(), &mut count)
    })?;
    buf.truncate(count as usize);
    Ok(buf)
}

pub(super) fn create_ci(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    profile: u32,
) -> Result<nvmlComputeInstance_t, Failed> {
    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    // SAFETY: `gi` came from NVML; `ci` is a writable handle slot.
    raw!(
        nvml.lib(),
        nvmlGpuInstanceCreateComputeInstance,
        |f| unsafe { f(gi, profile, &mut ci) }
    )?;
    Ok(ci)
}

pub(super) fn ci_info(
    nvml: &Nvml,
    ci: nvmlComputeInstance_t,
) -> Result<nvmlComputeInstanceInfo_t, Failed> {
    // SAFETY: integers and handles, for which all-zero (null) is valid.
    let mut info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `ci` came from NVML; `info` is writable.
    raw!(nvml.lib(), nvmlComputeInstanceGetInfo_v2, |f| unsafe {
        f(ci, &mut info)
    })?;
    Ok(info)
}

pub(super) fn destroy_ci(nvml: &Nvml, ci: nvmlComputeInstance_t) -> Result<(), Failed> {
    // SAFETY: `ci` came from NVML and is not used after this call.
    raw!(nvml.lib(), nvmlComputeInstanceDestroy, |f| unsafe { f(ci) })
}

pub(super) fn destroy_gi(nvml: &Nvml, gi: nvmlGpuInstance_t) -> Result<(), Failed> {
    // SAFETY: `gi` came from NVML and is not used after this call.
    raw!(nvml.lib(), nvmlGpuInstanceDestroy, |f| unsafe { f(gi) })
}

/// The GPU and compute instance ids of a MIG device handle.
pub(super) fn mig_ids(mig: &Device) -> Result<(u32, u32), Failed> {
    let (mut gi, mut ci): (c_uint, c_uint) = (0, 0);
    // SAFETY: live MIG device handle; the id is written to a local.
    raw!(mig.nvml().lib(), nvmlDeviceGetGpuInstanceId, |f| unsafe {
        f(mig.handle(), &mut gi)
    })?;
    // SAFETY: as above.
    raw!(
        mig.nvml().lib(),
        nvmlDeviceGetComputeInstanceId,
        |f| unsafe { f(mig.handle(), &mut ci) }
    )?;
    Ok((gi, ci))
}

/// Raw because nvml-wrapper's `register_events` frees the whole set when one GPU fails.
pub(super) fn register_events(device: &Device, bits: u64, set: &EventSet) -> Result<(), Failed> {
    // SAFETY: both handles are live; the set stays owned by its `EventSet`.
    raw!(device.nvml().lib(), nvmlDeviceRegisterEvents, |f| unsafe {
        f(device.handle(), bits, set.handle())
    })
}

/// Raw `_v2` wait, because nvml-wrapper's `EventData` drops the GPU / compute instance ids.
pub(super) fn wait_raw(
    set: &EventSet,
    timeout_ms: u32,
) -> Result<(nvmlReturn_t, nvmlEventData_t), Failed> {
    let f = nvml_sym(set.nvml.lib().nvmlEventSetWait_v2.as_ref()).named("nvmlEventSetWait_v2")?;
    // SAFETY: integers and a handle, so zeroed is valid; the set is live and `data` writable.
    Ok(unsafe {
        let mut data: nvmlEventData_t = std::mem::zeroed();
        (f(set.handle(), &mut data, timeout_ms), data)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect_unavailable(options: NvmlOptions) -> String {
        match NvmlBackend::open(options) {
            Err(GpuError::Unavailable { backend, reason }) if backend == "nvml" => reason,
            Err(other) => panic!("expected Unavailable from the nvml backend, got {other}"),
            Ok(_) => panic!("NVML opened, but this test needs a machine without libnvidia-ml"),
        }
    }

    fn has_nvidia_driver() -> bool {
        Path::new("/proc/driver/nvidia").exists()
    }

    #[test]
    fn a_missing_library_says_what_to_do() {
        let path = PathBuf::from("/nonexistent/libnvidia-ml.so.1");
        let reason = expect_unavailable(NvmlOptions {
            library_path: Some(path),
            ..NvmlOptions::default()
        });
        assert!(
            reason.contains("libnvidia-ml.so.1 could not be loaded"),
            "{reason}"
        );
        assert!(
            reason.contains("/nonexistent/libnvidia-ml.so.1"),
            "{reason}"
        );
        assert!(reason.contains("install the NVIDIA driver"), "{reason}");
        assert!(reason.contains("--backend fake"), "{reason}");
    }

    #[test]
    fn the_default_library_is_absent_here() {
        if has_nvidia_driver() {
            return; // The library may well load on a GPU machine.
        }
        let reason = expect_unavailable(NvmlOptions::default());
        assert!(
            reason.contains("libnvidia-ml") && reason.contains("--backend fake"),
            "{reason}"
        );
        let error = probe(NvmlOptions::default()).unwrap_err().to_string();
        assert!(
            error.starts_with("GPU backend nvml is not available"),
            "{error}"
        );
    }

    #[test]
    fn a_driver_root_without_the_library_falls_back_to_the_loader() {
        if has_nvidia_driver() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let options = NvmlOptions {
            library_path: None,
            driver_root: dir.path().to_path_buf(),
        };
        let reason = expect_unavailable(options);
        assert!(reason.contains("from libnvidia-ml.so.1 "), "{reason}");
    }

    #[test]
    fn versioned_structs_have_the_layout_nvml_expects() {
        // nvml.h: version, clusterUuid[16], status, cliqueId, state (u8), healthMask, healthSummary.
        assert_eq!(std::mem::size_of::<nvmlGpuFabricInfoV_t>(), 40);
        assert_eq!(std::mem::size_of::<nvmlGpuFabricInfo_v2_t>(), 36);
        // 11 unsigned ints, an unsigned long long, char name[96].
        assert_eq!(std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>(), 152);
    }
}
