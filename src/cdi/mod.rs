//! CDI (Container Device Interface) specs: the JSON the container runtime reads to give a container its GPU
//! device nodes, environment and mounts. gpu-dra writes one spec file per prepared claim and returns the
//! qualified device ids to the kubelet, which hands them to containerd / CRI-O.

mod spec;
mod writer;

use std::io;
use std::path::PathBuf;

pub use spec::{minimum_version, validate, ContainerEdits, Device, DeviceNode, Hook, Mount, Spec};
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
