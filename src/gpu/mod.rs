//! The hardware vocabulary (GPU, inventory) and the `GpuBackend` trait that the rest of the driver reads
//! the node's GPUs through. Backends: `fake` (YAML profiles, for tests, the demo and kind); NVML comes later.

pub mod fake;
mod profiles;

pub use fake::FakeBackend;
pub use profiles::{builtin_profile, builtin_profile_names, FakeGpuSpec, FakeProfile};

use thiserror::Error;

/// One physical GPU as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The minor number of `/dev/nvidia<minor>`; names the DRA device (`gpu-<minor>`).
    pub minor: u32,
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
    /// GPUs with the same value share NVLink; `None` when the GPU has no active NVLink.
    pub nvlink_domain: Option<String>,
    pub mig_capable: bool,
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
    /// Set by the fake backend: every device file maps onto this host file (`/dev/null`), so that the
    /// CDI specs it produces can be injected on a node that has no GPU device files.
    pub stand_in_device_file: Option<String>,
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
    #[error("GPU backend {backend} is not available in this build: {reason}")]
    Unavailable { backend: String, reason: String },
}

/// The source of truth about the node's GPUs.
pub trait GpuBackend: Send + Sync {
    /// A short name for logs (`fake`, `nvml`).
    fn name(&self) -> &str;
    /// The current inventory; called at start and on every rescan, so it must be cheap and must not
    /// change what it reports unless the hardware (or the fake profile) changed.
    fn inventory(&self) -> Result<Inventory, GpuError>;
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
            yes_no(first.is_some_and(|g| g.nvlink)),
            profile.description
        ));
    }
    text
}
