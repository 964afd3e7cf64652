//! The real GPU backend: the NVIDIA driver's management library (libnvidia-ml) through nvml-wrapper,
//! plus the raw NVML calls the wrapper lacks (MIG instances and their ids, fabric info, event GI/CI
//! ids). All `unsafe` code of gpu-dra lives in this file; each block says why it is sound.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::ffi::c_uint;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use nvml_wrapper::error::{nvml_sym, nvml_try, nvml_try_count, NvmlError};
use nvml_wrapper::{Device, EventSet, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t, nvmlComputeInstance_t,
    nvmlEventData_t, nvmlGpuFabricInfoV_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfo_v3_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstance_t, nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH, nvmlReturn_t,
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_NVLINK_MAX_LINKS,
};

pub use super::nvml_probe::probe;
use super::nvml_support::{self as support, event_bits};
use super::{nvlink, Gpu, GpuBackend, GpuError, GpuEvent, GpuEventKind, Inventory};
use super::{MigInstance, MigPlacement, MigRequest};

/// The soname the NVIDIA driver installs; found through the dynamic loader's search path.
const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";
/// sysfs is read from the plugin's own `/sys`, which is the host's in every container runtime.
pub(super) const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";
/// `compute_instance_id` of a reported GPU instance without compute instance (left over by an
/// interrupted create); such an instance has an empty `uuid` and no device files.
pub const NO_COMPUTE_INSTANCE: u32 = u32::MAX;

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
    events: Mutex<EventState>,
    /// Kept apart from `events` so that reading it does not wait for a blocked `wait_event`.
    unmonitored: Mutex<Vec<(String, String)>>,
}

#[derive(Default)]
struct EventState {
    started: bool,
    set: Option<EventSet<'static>>,
    /// Registered GPUs: NVML device handle (as an address) → UUID.
    monitored: HashMap<usize, String>,
    /// GPUs whose events could not be registered, with the reason.
    unmonitored: Vec<(String, String)>,
    pending: VecDeque<GpuEvent>,
    lost: BTreeSet<String>,
    /// Memory health per GPU as last polled: (retirement or remap pending, remap failed).
    memory: HashMap<String, (bool, bool)>,
    last_memory_poll: Option<std::time::Instant>,
}

/// How often memory health (pending retirement, row remapping) and lost GPUs are polled: NVML has no
/// events for them.
const MEMORY_POLL: Duration = Duration::from_secs(10);

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
        })
    }

    /// GPUs whose health events are not watched, with the reason (known after the first
    /// `wait_event`), so that the health side can mark them unmonitored.
    pub fn unmonitored_gpus(&self) -> Vec<(String, String)> {
        match self.unmonitored.lock() {
            Ok(list) => list.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn lock_events(&self) -> MutexGuard<'_, EventState> {
        // A panic while waiting leaves the state usable (the set is still registered).
        self.events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
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

    fn read_gpu(&self, index: u32) -> Result<Gpu, GpuError> {
        let device = self
            .nvml
            .device_by_index(index)
            .named("nvmlDeviceGetHandleByIndex_v2")?;
        let uuid = device.uuid().named("nvmlDeviceGetUUID")?;
        let minor = device.minor_number().named("nvmlDeviceGetMinorNumber")?;
        let product_name = device.name().named("nvmlDeviceGetName")?;
        let memory_bytes = device
            .memory_info()
            .named("nvmlDeviceGetMemoryInfo_v2")?
            .total;
        let pci = device.pci_info().named("nvmlDeviceGetPciInfo_v3")?;
        let pci_bus_id = support::sysfs_bus_id(pci.domain, pci.bus, pci.device);
        let cc = device
            .cuda_compute_capability()
            .named("nvmlDeviceGetCudaComputeCapability")?;
        let arch = architecture_code(&device);
        let brand = device
            .brand()
            .map(|b| support::brand_name(&b))
            .unwrap_or("Unknown");
        let fabric = fabric_raw(&device).ok().flatten();
        Ok(Gpu {
            mig: self.read_mig(&device, minor, &product_name, memory_bytes, arch)?,
            minor,
            uuid,
            brand: brand.to_string(),
            architecture: support::architecture_name(arch.unwrap_or(u32::MAX)).to_string(),
            cuda_compute_capability: format!("{}.{}", cc.major, cc.minor),
            memory_bytes,
            pcie_root: pcie_root(&pci_bus_id),
            numa_node: numa_node(&device, &pci_bus_id),
            nvlink_domain: None,
            fabric: fabric
                .and_then(|f| support::fabric_info(f.state, f.status, f.clusterUuid, f.cliqueId)),
            nvlink_peers: nvlink_peers(&device),
            pci_bus_id,
            product_name,
        })
    }

    /// Creates the event set and registers every GPU for the health events it supports.
    fn start_events(&self, state: &mut EventState) -> Result<(), GpuError> {
        state.unmonitored.clear();
        let mut candidates = Vec::new();
        for index in 0..self.nvml.device_count().named("nvmlDeviceGetCount_v2")? {
            let device = self
                .nvml
                .device_by_index(index)
                .named("nvmlDeviceGetHandleByIndex_v2")?;
            let uuid = device.uuid().named("nvmlDeviceGetUUID")?;
            match device.supported_event_types() {
                Ok(types) if types.bits() & event_bits::HEALTH != 0 => {
                    candidates.push((device, uuid, types.bits() & event_bits::HEALTH))
                }
                Ok(_) => state
                    .unmonitored
                    .push((uuid, "supports no XID, ECC or MIG event".into())),
                Err(e) => state
                    .unmonitored
                    .push((uuid, support::describe_nvml_error(&e))),
            }
        }
        // NVML leaves a set undefined after an UNKNOWN registration error: start again without
        // that GPU.
        'sets: loop {
            let set = self.nvml.create_event_set().named("nvmlEventSetCreate")?;
            state.monitored.clear();
            for (device, uuid, bits) in &candidates {
                if state.unmonitored.iter().any(|(u, _)| u == uuid) {
                    continue;
                }
                match register_events(device, *bits, &set) {
                    Ok(()) => {
                        state.monitored.insert(handle_key(device), uuid.clone());
                    }
                    Err(f) => {
                        state
                            .unmonitored
                            .push((uuid.clone(), support::describe_nvml_error(&f.error)));
                        if matches!(f.error, NvmlError::Unknown) {
                            continue 'sets;
                        }
                    }
                }
            }
            state.set = Some(set);
            return Ok(());
        }
    }

    /// Lost-GPU events: the device NVML named, else every watched GPU that now answers "lost",
    /// else (NVML could not tell which) every watched GPU, as NVIDIA's own plugin does.
    /// Queues events for memory health changes: retirement or row remapping newly pending, a failed
    /// remap, and `Recovered` when pending work cleared without failure (the GPU was reset) or a lost
    /// GPU answers again.
    fn poll_memory_health(&self, state: &mut EventState) {
        let uuids: Vec<String> = state.monitored.values().cloned().collect();
        for uuid in uuids {
            let Ok(device) = self.nvml.device_by_uuid(uuid.as_str()) else {
                continue;
            };
            if state.lost.contains(&uuid) {
                if device.memory_info().is_ok() {
                    state.lost.remove(&uuid);
                    state
                        .pending
                        .push_back(event(&uuid, GpuEventKind::Recovered));
                }
                continue;
            }
            let (pending, failed) = match remapped_rows(&device) {
                Ok(rows) => rows,
                // Before Ampere: page retirement instead of row remapping.
                Err(_) => match device.are_pages_pending_retired() {
                    Ok(pending) => (pending, false),
                    Err(_) => continue,
                },
            };
            let before = state.memory.insert(uuid.clone(), (pending, failed));
            let (was_pending, was_failed) = before.unwrap_or((false, false));
            if failed && !was_failed {
                state
                    .pending
                    .push_back(event(&uuid, GpuEventKind::RowRemapFailure));
            } else if pending && !was_pending {
                state
                    .pending
                    .push_back(event(&uuid, GpuEventKind::RetirementPending));
            } else if was_pending && !pending && !failed {
                state
                    .pending
                    .push_back(event(&uuid, GpuEventKind::Recovered));
            }
        }
    }

    fn queue_lost(&self, state: &mut EventState, device_key: usize) {
        let answers_lost = |uuid: &&String| {
            let device = self.nvml.device_by_uuid(uuid.as_str());
            matches!(
                device.and_then(|d| d.memory_info()),
                Err(NvmlError::GpuLost)
            )
        };
        let lost: Vec<String> = match state.monitored.get(&device_key) {
            Some(uuid) => vec![uuid.clone()],
            None => {
                let found: Vec<String> = state
                    .monitored
                    .values()
                    .filter(answers_lost)
                    .cloned()
                    .collect();
                if found.is_empty() {
                    state.monitored.values().cloned().collect()
                } else {
                    found
                }
            }
        };
        for uuid in lost {
            if state.lost.insert(uuid.clone()) {
                state.pending.push_back(GpuEvent {
                    gpu_uuid: uuid,
                    gpu_instance_id: None,
                    compute_instance_id: None,
                    kind: GpuEventKind::Lost,
                });
            }
        }
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &str {
        "nvml"
    }

    fn inventory(&self) -> Result<Inventory, GpuError> {
        let driver_version = self
            .nvml
            .sys_driver_version()
            .named("nvmlSystemGetDriverVersion")?;
        let cuda = self
            .nvml
            .sys_cuda_driver_version()
            .named("nvmlSystemGetCudaDriverVersion_v2")?;
        let count = self.nvml.device_count().named("nvmlDeviceGetCount_v2")?;
        let mut gpus = (0..count)
            .map(|i| self.read_gpu(i))
            .collect::<Result<Vec<_>, _>>()?;
        gpus.sort_by_key(|gpu| gpu.minor);
        nvlink::assign_domains(&mut gpus);
        Ok(Inventory {
            driver_version,
            cuda_driver_version: support::cuda_version(cuda),
            gpus,
            control_device_files: control_device_files(),
            stand_in_device_file: None,
        })
    }

    fn create_mig(&self, request: &MigRequest) -> Result<MigInstance, GpuError> {
        self.create_mig_device(request)
    }

    fn destroy_mig(&self, parent_uuid: &str, gpu_instance_id: u32) -> Result<(), GpuError> {
        self.destroy_mig_device(parent_uuid, gpu_instance_id)
    }

    fn wait_event(&self, timeout: Duration) -> Result<Option<GpuEvent>, GpuError> {
        let mut state = self.lock_events();
        if let Some(event) = state.pending.pop_front() {
            return Ok(Some(event));
        }
        if !state.started {
            if let Err(e) = self.start_events(&mut state) {
                // Retried on the next call; the sleep keeps a caller's loop from spinning.
                drop(state);
                std::thread::sleep(timeout);
                return Err(e);
            }
            state.started = true;
            if let Ok(mut list) = self.unmonitored.lock() {
                list.clone_from(&state.unmonitored);
            }
            // Reported once; afterwards the GPUs that did register are watched.
            if !state.unmonitored.is_empty() {
                let list: Vec<String> = state
                    .unmonitored
                    .iter()
                    .map(|(uuid, why)| format!("{uuid}: {why}"))
                    .collect();
                return Err(GpuError::Nvml {
                    call: "nvmlDeviceRegisterEvents".to_string(),
                    reason: format!("health events are not watched on {}", list.join("; ")),
                });
            }
        }
        let due = state
            .last_memory_poll
            .is_none_or(|at| at.elapsed() >= MEMORY_POLL);
        if due {
            state.last_memory_poll = Some(std::time::Instant::now());
            self.poll_memory_health(&mut state);
            if let Some(event) = state.pending.pop_front() {
                return Ok(Some(event));
            }
        }
        let ms = timeout.as_millis().min(u128::from(u32::MAX)) as u32;
        let outcome = match &state.set {
            Some(set) if !state.monitored.is_empty() => Some(wait_raw(set, ms)?),
            _ => None,
        };
        let (code, data) = match outcome {
            Some(outcome) => outcome,
            None => {
                drop(state);
                std::thread::sleep(timeout);
                return Ok(None);
            }
        };
        let key = data.device as usize;
        match nvml_try(code) {
            Ok(()) => Ok(Some(GpuEvent {
                gpu_uuid: match state.monitored.get(&key) {
                    Some(uuid) => uuid.clone(),
                    None => format!("unknown GPU (NVML handle {key:#x})"),
                },
                gpu_instance_id: support::instance_id(data.gpuInstanceId),
                compute_instance_id: support::instance_id(data.computeInstanceId),
                kind: support::event_kind(data.eventType, data.eventData),
            })),
            Err(NvmlError::Timeout) => Ok(None),
            Err(NvmlError::GpuLost) => {
                self.queue_lost(&mut state, key);
                if let Some(event) = state.pending.pop_front() {
                    return Ok(Some(event));
                }
                // Every loss is reported already and NVML keeps answering "lost".
                drop(state);
                std::thread::sleep(timeout);
                Ok(None)
            }
            Err(e) => Err(Failed {
                call: "nvmlEventSetWait_v2",
                error: e,
            }
            .into()),
        }
    }
}

fn event(uuid: &str, kind: GpuEventKind) -> GpuEvent {
    GpuEvent {
        gpu_uuid: uuid.to_string(),
        gpu_instance_id: None,
        compute_instance_id: None,
        kind,
    }
}

/// (rows waiting to be remapped at the next reset, a remap failed), Ampere and later.
fn remapped_rows(device: &Device) -> Result<(bool, bool), Failed> {
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

pub(super) fn architecture_code(device: &Device) -> Option<u32> {
    match device.architecture() {
        Ok(arch) => Some(arch.as_c()),
        Err(NvmlError::UnexpectedVariant(code)) => Some(code),
        Err(_) => None,
    }
}

pub(super) fn pcie_root(bus_id: &str) -> Option<String> {
    let resolved = std::fs::canonicalize(Path::new(SYSFS_PCI_DEVICES).join(bus_id)).ok()?;
    support::pcie_root_of(&resolved)
}

fn numa_node(device: &Device, bus_id: &str) -> Option<i64> {
    if let Ok(node) = device.numa_node_id() {
        return support::numa_from_nvml(node);
    }
    let path = Path::new(SYSFS_PCI_DEVICES).join(bus_id).join("numa_node");
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| support::parse_numa_node(&text))
}

/// Remote PCI bus ids of the active links (GPUs, or NVSwitches on switched systems).
fn nvlink_peers(device: &Device) -> Vec<String> {
    let mut peers = BTreeSet::new();
    for link in 0..NVML_NVLINK_MAX_LINKS {
        let nvlink = device.link_wrapper_for(link);
        match nvlink.is_active() {
            Ok(true) => {
                if let Ok(r) = nvlink.remote_pci_info() {
                    peers.insert(support::sysfs_bus_id(r.domain, r.bus, r.device));
                }
            }
            // No NVLink at all, or past the GPU's last link.
            Err(NvmlError::InvalidArg | NvmlError::NotSupported) => break,
            Ok(false) | Err(_) => {}
        }
    }
    peers.into_iter().collect()
}

/// Device files every GPU container needs; the UVM nodes only where the driver created them.
fn control_device_files() -> Vec<String> {
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        .into_iter()
        .filter(|path| *path == "/dev/nvidiactl" || Path::new(path).exists())
        .map(str::to_string)
        .collect()
}

// ---- Raw NVML calls. Handles come from NVML and stay valid while `Nvml` lives (it is leaked);
// ---- out-pointers point at locals, or at buffers sized as NVML documents.

fn handle_key(device: &Device) -> usize {
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
fn register_events(device: &Device, bits: u64, set: &EventSet) -> Result<(), Failed> {
    // SAFETY: both handles are live; the set stays owned by its `EventSet`.
    raw!(device.nvml().lib(), nvmlDeviceRegisterEvents, |f| unsafe {
        f(device.handle(), bits, set.handle())
    })
}

/// Raw `_v2` wait, because nvml-wrapper's `EventData` drops the GPU / compute instance ids.
fn wait_raw(set: &EventSet, timeout_ms: u32) -> Result<(nvmlReturn_t, nvmlEventData_t), Failed> {
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
