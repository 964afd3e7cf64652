//! CDI (Container Device Interface) specs: the JSON the container runtime reads to give a container its GPU
//! device nodes, environment and mounts. gpu-dra writes one spec file per prepared claim and returns the
//! qualified device ids to the kubelet, which hands them to containerd / CRI-O. On real GPU nodes the
//! specs also carry the host driver's libraries and binaries (`host_driver`), unless the NVIDIA
//! Container Toolkit's own spec (`toolkit`) already describes the GPU; their host paths come from the
//! driver root on the host (`driver_root`).

mod driver_root;
mod host_driver;
mod ldcache;
mod spec;
mod toolkit;
mod writer;

use std::io;
use std::path::PathBuf;

pub use driver_root::{device_host_path, DriverRoot, DriverRootError};
/// The fake driver roots of the tests, for the tests of other modules that run driver programs.
#[cfg(test)]
pub(crate) use host_driver::fake_root;
pub use host_driver::{
    find_nvml_library, CdiHook, DiscoveryOptions, DriverFile, FileKind, HookCli, HostDriver,
    HostDriverError, KnownHooks, LibraryClass,
};
pub use spec::{minimum_version, validate, ContainerEdits, Device, DeviceNode, Hook, Mount, Spec};
pub use toolkit::{DeviceIndex, ToolkitSearch, ToolkitSpec, ToolkitWarning, TOOLKIT_KIND};
pub use writer::CdiRegistry;

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// The spec would be rejected by a container runtime; the message names the device and field.
    #[error("invalid CDI spec: {0}")]
    InvalidSpec(String),
    #[error("claim {claim_uid}: CDI spec {}: {reason}", path.display())]
    InvalidClaimSpec {
        claim_uid: String,
        path: PathBuf,
        reason: String,
    },
    #[error("claim {claim_uid}: {action} CDI spec {}: {source}", path.display())]
    Io {
        claim_uid: String,
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("claim {claim_uid}: CDI spec {} is not valid JSON for a spec: {source}", path.display())]
    Parse {
        claim_uid: String,
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("listing CDI specs in {}: {source}", dir.display())]
    List { dir: PathBuf, source: io::Error },
}
