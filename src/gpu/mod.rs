//! The hardware vocabulary (GPU, MIG profile and placement, NVLink domain, events) and the `GpuBackend`
//! trait that the rest of the driver reads and changes the node's GPUs through. Backends: `fake` (YAML
//! profiles, for tests, the demo and kind) and `nvml` (the NVIDIA driver's management library).

pub mod caps;
pub mod device_files;
pub mod driver_exec;
pub mod fake;
mod fake_check;
mod fake_faults;
mod fake_gpus;
mod fake_mig;
mod fake_pci;
mod fake_proc;
mod fake_sharing;
#[cfg(test)]
mod fake_tests;
mod host_arch;
mod locks;
pub mod mig;
mod nvidia_smi;
pub mod nvlink;
pub mod nvml;
mod nvml_events;
mod nvml_inventory;
mod nvml_mig;
mod nvml_probe;
mod nvml_sharing;
mod nvml_support;
pub mod pci;
mod profiles;

pub use device_files::{DeviceMajors, DeviceNumber, DriverProc};
pub use driver_exec::{DriverCommand, DriverExecError};
pub use fake::FakeBackend;
pub use host_arch::HostArch;
pub use locks::GpuLocks;
pub use mig::{
    ComputeShare, MigDestroyed, MigInfo, MigInstance, MigPlacement, MigProfile, MigRequest,
    NO_COMPUTE_INSTANCE,
};
pub use nvml::{NvmlBackend, NvmlOptions};
pub use pci::{PciFunction, PciGpu, PciSysfs};
pub use profiles::{
    builtin_profile, builtin_profile_names, gb200_tray, FakeFault, FakeFaultKind, FakeGpuSpec,
    FakePci, FakeProfile, GB200_CLUSTER_UUID,
};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// One physical GPU as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The minor number of `/dev/nvidia<minor>`; names the DRA device (`gpu-<minor>`).
    pub minor: u32,
    /// NVML's index of the GPU (`nvmlDeviceGetIndex`; `nvidia-smi -i`), which follows PCI bus id
    /// order. NVIDIA's driver published it as the `index` attribute up to v25.3.
    pub index: u32,
    /// `GPU-xxxxxxxx-...`, as NVML reports it.
    pub uuid: String,
    pub product_name: String,
    pub brand: String,
    pub architecture: String,
    /// `major.minor`, e.g. `9.0`.
    pub cuda_compute_capability: String,
    pub memory_bytes: u64,
    /// PCI address in sysfs form, e.g. `0000:18:00.0`.
    pub pci_bus_id: String,
    /// The PCIe root complex the GPU hangs off, e.g. `pci0000:17`.
    pub pcie_root: Option<String>,
    pub numa_node: Option<i64>,
    /// GPUs with the same value share NVLink; `None` when the GPU has no active NVLink. Derived from
    /// `fabric` and `nvlink_peers` by [`nvlink::assign_domains`].
    pub nvlink_domain: Option<String>,
    /// The NVLink fabric this GPU joined (NVSwitch systems), when its registration completed.
    pub fabric: Option<nvlink::FabricInfo>,
    /// PCI bus ids of the GPUs this one has an active NVLink to.
    pub nvlink_peers: Vec<String>,
    /// The MIG side of a MIG-capable GPU; `None` for GPUs without MIG.
    pub mig: Option<MigInfo>,
    /// The memory addressing mode on coherent-memory systems (Grace Hopper/Blackwell): `HMM`, `ATS`
    /// or `None` (supported but inactive), as NVIDIA's driver names them; `None` where the platform
    /// does not support it (`nvmlDeviceGetAddressingMode` answers NOT_SUPPORTED).
    pub addressing_mode: Option<String>,
    /// The GPU's module id on its baseboard (`nvmlDeviceGetModuleId`, 1-based); `None` where NVML
    /// does not report one (0 or NOT_SUPPORTED).
    pub module_id: Option<u32>,
}

impl Gpu {
    /// The device file of this GPU inside a container.
    pub fn device_file(&self) -> String {
        format!("/dev/nvidia{}", self.minor)
    }
}

/// Everything the driver publishes about the node's GPUs at one point in time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    /// Kernel driver version, e.g. `550.90.07`.
    pub driver_version: String,
    /// Highest CUDA version the driver supports, e.g. `12.4`.
    pub cuda_driver_version: String,
    pub gpus: Vec<Gpu>,
    /// Device files every GPU container needs besides its GPUs' own (`/dev/nvidiactl`, UVM).
    pub control_device_files: Vec<String>,
    /// The majors of the driver's device files on this node, from its `/proc/devices`.
    pub device_majors: DeviceMajors,
    /// Set by the fake backend: the numbers every fake device file gets (`/dev/null`'s, read from the
    /// host), so that containers open them harmlessly; the files themselves exist on no host, as a MIG
    /// device's capability files on a real node.
    pub stand_in_device: Option<DeviceNumber>,
    /// GPUs the backend sees but could not read (lost, in a MIG mode change, any per-GPU error): left
    /// out of `gpus`, reported, and read again at the next rescan.
    pub unreadable: Vec<UnreadableGpu>,
    /// NVIDIA GPU functions on the PCI bus (sysfs), whatever driver they are bound to: GPUs bound
    /// to vfio-pci are here and not in `gpus` on a node, where NVML no longer sees them. Empty where
    /// sysfs could not be read.
    pub pci_gpus: Vec<PciGpu>,
}

impl Inventory {
    /// The numbers a container's device file at `path` gets, where the driver's are known; the fake
    /// backend's stand-in replaces them.
    pub fn device_number(&self, path: &str) -> Option<DeviceNumber> {
        let real = self.device_majors.number_of(path)?;
        Some(self.stand_in_device.unwrap_or(real))
    }
}

/// A GPU that is there but could not be read, with what is known of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadableGpu {
    /// The backend's index of the GPU (NVML's enumeration order; the profile's order for the fake).
    pub index: u32,
    /// Known when the GPU answered that far: then its device (`gpu-<minor>`) is reported UNHEALTHY.
    pub minor: Option<u32>,
    pub uuid: Option<String>,
    pub pci_bus_id: Option<String>,
    pub reason: String,
}

impl UnreadableGpu {
    /// How an operator finds the GPU: its minor, UUID or PCI address, whichever are known.
    pub fn describe(&self) -> String {
        let mut parts = vec![match self.minor {
            Some(minor) => format!("gpu-{minor}"),
            None => format!("GPU index {}", self.index),
        }];
        parts.extend(self.uuid.clone());
        parts.extend(self.pci_bus_id.as_ref().map(|bus| format!("PCI {bus}")));
        parts.join(" ")
    }
}

#[derive(Debug, Error)]
pub enum GpuError {
    #[error("unknown fake GPU profile {0:?} (built-in profiles: {1})")]
    UnknownProfile(String, String),
    #[error("reading fake GPU profile {path}: {source}")]
    ReadProfile {
        path: String,
        source: std::io::Error,
    },
    #[error("fake GPU profile {path} is malformed: {message}")]
    MalformedProfile { path: String, message: String },
    #[error("GPU backend {backend} is not available: {reason}")]
    Unavailable { backend: String, reason: String },
    #[error("GPU {gpu}: {reason}")]
    Mig { gpu: String, reason: String },
    #[error("NVML {call} failed: {reason}")]
    Nvml { call: String, reason: String },
    #[error("GPU {gpu}: MIG device {uuid} is in use by a process (NVML_ERROR_IN_USE); it can be destroyed once that process has ended")]
    MigInUse { gpu: String, uuid: String },
    /// Reading or changing how a GPU is shared (compute mode, time-slice interval) failed; `reason`
    /// says which step and why.
    #[error("GPU {gpu}: {reason}")]
    Sharing { gpu: String, reason: String },
}

/// How long the GPU lets one process run before switching to another when several share it
/// (`nvidia-smi compute-policy --set-timeslice`). The wire names are those of the `GpuConfig`
/// `timeSlicingConfig.interval` field.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
pub enum TimeSliceInterval {
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

impl TimeSliceInterval {
    /// Every interval, in the order of their `nvidia-smi` numbers.
    pub const ALL: [TimeSliceInterval; 4] = [
        TimeSliceInterval::Default,
        TimeSliceInterval::Short,
        TimeSliceInterval::Medium,
        TimeSliceInterval::Long,
    ];

    /// The wire name (`Default`, `Short`, `Medium`, `Long`).
    pub fn as_str(self) -> &'static str {
        match self {
            TimeSliceInterval::Default => "Default",
            TimeSliceInterval::Short => "Short",
            TimeSliceInterval::Medium => "Medium",
            TimeSliceInterval::Long => "Long",
        }
    }
}

impl std::fmt::Display for TimeSliceInterval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a whole GPU is set to for sharing. Linux resets both settings at reboot, so `Default` is how a
/// GPU comes up; the driver sets another mode at prepare and `Default` again when the last claim that
/// needed it is unprepared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum GpuSharingMode {
    /// Compute mode DEFAULT (any number of processes) and the default time-slice interval.
    #[default]
    Default,
    /// Compute mode DEFAULT and this time-slice interval.
    TimeSlice(TimeSliceInterval),
    /// Compute mode EXCLUSIVE_PROCESS: one process (the MPS server) owns the GPU, as MPS needs.
    ExclusiveProcess,
}

impl std::fmt::Display for GpuSharingMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuSharingMode::Default => {
                f.write_str("compute mode DEFAULT with the default time-slice interval")
            }
            GpuSharingMode::TimeSlice(interval) => {
                write!(
                    f,
                    "compute mode DEFAULT with time-slice interval {interval}"
                )
            }
            GpuSharingMode::ExclusiveProcess => f.write_str("compute mode EXCLUSIVE_PROCESS"),
        }
    }
}

/// Something the backend saw happen to a GPU (input to the health monitor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuEvent {
    pub gpu_uuid: String,
    /// Set when the event concerns one MIG device of the GPU.
    pub gpu_instance_id: Option<u32>,
    pub compute_instance_id: Option<u32>,
    pub kind: GpuEventKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuEventKind {
    /// An XID error with its number.
    Xid(u64),
    SingleBitEcc,
    DoubleBitEcc,
    /// Memory pages wait to be retired (pre-Ampere) or rows to be remapped (Ampere and later); the
    /// GPU needs a reset for it to take effect.
    RetirementPending,
    /// Row remapping failed: the memory cannot be repaired in the field.
    RowRemapFailure,
    /// The GPU fell off the bus.
    Lost,
    /// The GPU (or the MIG device) is healthy again: every fault seen on it is over (after a reset,
    /// or when a fake fault is removed).
    Recovered,
    /// MIG devices were created or destroyed.
    MigConfigChange,
    /// Any other event NVML reported, by its event type bit.
    Other(u64),
}

/// The source of truth about the node's GPUs.
pub trait GpuBackend: Send + Sync {
    /// A short name for logs (`fake`, `nvml`).
    fn name(&self) -> &str;
    /// The current inventory; called at start and on every rescan, so it must be cheap and must not
    /// change what it reports unless the hardware (or the fake profile) changed.
    fn inventory(&self) -> Result<Inventory, GpuError>;
    /// Creates a MIG device (GPU instance plus one compute instance spanning it) at the requested
    /// placement, enabling MIG mode first where the GPU can switch without a reset. MIG operations on
    /// one GPU run one at a time.
    fn create_mig(&self, request: &MigRequest) -> Result<MigInstance, GpuError>;
    /// Like `create_mig`, but a MIG device of the requested profile that already exists at exactly
    /// the requested placement is returned as it is, with `true` (a GPU instance there without a
    /// compute instance gets one). That is what a prepare the kubelet cancelled mid-create leaves;
    /// the retry adopts it instead of failing on the overlap or making a second one. A create still
    /// running for the cancelled prepare finishes first (operations on one GPU are serialised).
    fn create_or_adopt_mig(&self, request: &MigRequest) -> Result<(MigInstance, bool), GpuError>;
    /// Destroys a MIG device (its compute instances, then the GPU instance), after checking that the
    /// GPU instance with this id is still the one with `expected_uuid` (empty: a GPU instance without
    /// compute instance): one that now holds another MIG device is left alone (`Replaced`). One that
    /// no longer exists is `Gone`, so that retries and recovery converge. A device a process still
    /// uses is refused with [`GpuError::MigInUse`] and stays as it is.
    fn destroy_mig(
        &self,
        parent_uuid: &str,
        gpu_instance_id: u32,
        expected_uuid: &str,
    ) -> Result<MigDestroyed, GpuError>;
    /// Sets how GPU `gpu_uuid` is shared. Idempotent: setting the mode a GPU already has succeeds (and
    /// runs again what cannot be read back, such as the time-slice interval). Changes on one GPU run
    /// one at a time. Blocks for up to about ten seconds (the NVML backend runs `nvidia-smi`).
    fn set_sharing(&self, gpu_uuid: &str, mode: &GpuSharingMode) -> Result<(), GpuError> {
        let _ = mode;
        Err(GpuError::Sharing {
            gpu: gpu_uuid.to_string(),
            reason: format!("the {} GPU backend cannot change GPU sharing", self.name()),
        })
    }
    /// How GPU `gpu_uuid` is shared now, as far as the backend can read it: the NVML backend reads the
    /// compute mode only (NVML has no call for the time-slice interval), so a GPU in compute mode
    /// DEFAULT reads as `Default` whatever its interval.
    fn sharing(&self, gpu_uuid: &str) -> Result<GpuSharingMode, GpuError> {
        Err(GpuError::Sharing {
            gpu: gpu_uuid.to_string(),
            reason: format!("the {} GPU backend cannot read GPU sharing", self.name()),
        })
    }
    /// The node's PCI bus in sysfs, through which GPUs are bound to vfio-pci for passthrough and
    /// given back; `None` where the backend has none.
    fn pci(&self) -> Result<Option<PciSysfs>, GpuError> {
        Ok(None)
    }
    /// Waits up to `timeout` for the next event; `Ok(None)` on timeout. Backends without events sleep.
    fn wait_event(&self, timeout: std::time::Duration) -> Result<Option<GpuEvent>, GpuError> {
        std::thread::sleep(timeout);
        Ok(None)
    }
}

/// The `gpu-dra fake profiles` listing: one line per built-in profile.
pub fn describe_builtin_profiles() -> String {
    let mut text = format!(
        "{:<10} {:>4}  {:<24} {:<4} {:<7} DESCRIPTION\n",
        "NAME", "GPUS", "MODEL", "MIG", "NVLINK"
    );
    for name in builtin_profile_names() {
        let Some(profile) = builtin_profile(name) else {
            continue;
        };
        let first = profile.gpus.first();
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        text.push_str(&format!(
            "{:<10} {:>4}  {:<24} {:<4} {:<7} {}\n",
            profile.name,
            profile.gpus.len(),
            first.map(|g| g.product_name.as_str()).unwrap_or("-"),
            yes_no(first.is_some_and(|g| g.mig_capable)),
            yes_no(first.is_some_and(|g| g.nvlink || g.nvlink_group.is_some())),
            profile.description
        ));
    }
    text
}
