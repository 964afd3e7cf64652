//! The Pod that runs one claim's MPS control daemon. The daemon lives outside the plugin's container,
//! so that a plugin crash, OOM kill, liveness restart or upgrade leaves running CUDA contexts alone and
//! the daemon's memory is not counted against the plugin's limit. The kubelet restarts a daemon that
//! dies; the plugin only creates and deletes the Pod (NVIDIA's DRA driver makes the same choice).
//!
//! The Pod (`claims::daemon_pod`, shared with the IMEX daemon) runs this binary as `gpu-dra
//! mps-daemon`: a supervisor that starts `nvidia-cuda-mps-control -f` inside the driver root (chroot,
//! so the driver's binaries load the driver root's own libc), applies the claim's limits and reports
//! ready through a file its readiness probe reads. Its volumes give it the claim's directories at the
//! paths the daemon sees:
//! - chroot: the claim's directory over `<root>/tmp` (pipe `/tmp/pipe`, log `/tmp/log`) and the
//!   claim's shared-memory tmpfs over `<root>/dev/shm`, so that server and clients share it;
//! - direct (a root that cannot run its own binaries, GKE's): the same at `/mps` and `/dev/shm`;
//! - stand-in (fake backend): as direct, with `gpu-dra fake mps-control-daemon` as the program.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::{MpsDaemonSpec, MpsError};
use crate::claims::daemon_pod::{
    in_pod_driver_root, DaemonPod, DriverProgram, DriverPrograms, HostDir, PodTemplate, MIB,
};

pub use crate::claims::daemon_pod::{COMPONENT_LABEL, DRIVER_LABEL};

/// The component label of every MPS daemon Pod; the plugin lists its node's daemons by it.
pub const COMPONENT: &str = "mps-control-daemon";
pub const CLAIM_LABEL: &str = "gpu-dra.dev/claim-uid";
/// The file, in the claim's log directory, that the supervisor writes once the daemon answers.
pub const READY_FILE: &str = "ready";
/// Where the daemon container sees the claim's directory when it does not chroot.
const POD_CLAIM_DIR: &str = "/mps";
/// The memory the daemon's own processes may use: the supervisor (this binary, a few MiB), the
/// control daemon (a few MiB) and the MPS server it starts, whose host memory is the CUDA driver's
/// state for its contexts on the claim's devices. The control daemon runs at most one server at a
/// time (NVIDIA, "Multi-Process Service", Architecture, Provisioning Sequence: "The control daemon
/// allows at most one MPS server to be active at a time"). NVIDIA publishes no figure for the
/// server's host memory and its own DRA driver's daemon has no limit; 1 GiB is well above what a
/// CUDA context's host state takes on current drivers, so the limit only stops a daemon that leaks,
/// never one that works. The Pod's limit adds the claim's tmpfs size to it: what the server writes
/// into the claim's `/dev/shm` is charged to the Pod (`shm.rs`), at most the whole tmpfs.
pub const DAEMON_MEMORY: u64 = 1024 * MIB;
/// The daemon's resting size, which the scheduler counts.
const MEMORY_REQUEST: &str = "16Mi";

/// The driver's program an MPS daemon runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsPrograms {
    /// `nvidia-cuda-mps-control`'s path in the driver root.
    pub control: PathBuf,
}

impl DriverPrograms for MpsPrograms {
    const NAMES: &'static [&'static str] = &["nvidia-cuda-mps-control"];
    const FLAGS: &'static [&'static str] = &["--program"];
    const MOUNT_POINTS: &'static [&'static str] = &["tmp", "dev/shm"];

    fn paths(&self) -> Vec<&Path> {
        vec![&self.control]
    }

    fn from_paths(paths: Vec<PathBuf>) -> Self {
        MpsPrograms {
            control: paths.into_iter().next().unwrap_or_default(),
        }
    }
}

/// How the daemon Pod runs the control program.
pub type DaemonProgram = DriverProgram<MpsPrograms>;

/// What every MPS daemon Pod of this plugin shares.
pub type DaemonPodTemplate = PodTemplate<MpsPrograms>;

impl PodTemplate<MpsPrograms> {
    /// The Pod's name: one per claim UID, which is a plain name of at most 128 characters.
    pub fn pod_name(claim_uid: &str) -> String {
        format!("gpu-dra-mps-{claim_uid}")
    }

    /// The daemon Pod of one claim; `host_dir` is the claim's directory on the host (with `pipe`,
    /// `log` and the tmpfs `shm` in it). Its memory limit is [`DAEMON_MEMORY`] and the claim's tmpfs
    /// size (the spec's, else [`super::shm::DEFAULT_SIZE`]).
    pub fn pod(&self, spec: &MpsDaemonSpec, host_dir: &Path) -> Result<Pod, MpsError> {
        let limits = super::limit_commands(spec)?;
        let (claim_dir, shm_dir, inside) = match &self.program {
            DriverProgram::Chroot(_) => (
                in_pod_driver_root(Path::new("/tmp")),
                in_pod_driver_root(Path::new("/dev/shm")),
                PathBuf::from("/tmp"),
            ),
            DriverProgram::Direct { .. } | DriverProgram::StandIn => (
                PathBuf::from(POD_CLAIM_DIR),
                PathBuf::from("/dev/shm"),
                PathBuf::from(POD_CLAIM_DIR),
            ),
        };
        let mut trailing_args = Vec::new();
        if spec.multi_user {
            trailing_args.push("--multi-user".to_string());
        }
        trailing_args.extend(limits.iter().map(|command| format!("--command={command}")));
        let shm_size = spec.shm_size_bytes.unwrap_or(super::shm::DEFAULT_SIZE);
        DaemonPod {
            template: self,
            name: Self::pod_name(&spec.claim_uid),
            component: COMPONENT,
            labels: vec![(CLAIM_LABEL, spec.claim_uid.clone())],
            annotations: Vec::new(),
            subcommand: "mps-daemon",
            args: vec![
                format!("--claim={}", spec.claim_uid),
                format!("--pipe-dir={}/pipe", inside.display()),
                format!("--log-dir={}/log", inside.display()),
                // The supervisor checks the shared memory from where it stands (before a chroot).
                format!("--shm-dir={}", shm_dir.display()),
            ],
            trailing_args,
            env: vec![
                json!({"name": "CUDA_VISIBLE_DEVICES", "value": super::visible_devices(&spec.devices)}),
            ],
            volumes: vec![
                HostDir {
                    name: "claim",
                    host_path: host_dir.to_path_buf(),
                    mount_path: claim_dir.display().to_string(),
                },
                HostDir {
                    name: "shm",
                    host_path: host_dir.join("shm"),
                    mount_path: shm_dir.display().to_string(),
                },
            ],
            ready_file: format!("{}/log/{READY_FILE}", claim_dir.display()),
            host_network: false,
            memory_request: MEMORY_REQUEST,
            memory_limit: DAEMON_MEMORY.saturating_add(shm_size),
        }
        .pod()
        .map_err(|e| MpsError::InvalidSpec {
            claim: spec.claim_uid.clone(),
            reason: format!("daemon Pod: {e}"),
        })
    }
}

/// How the daemon runs `nvidia-cuda-mps-control` of the driver root that this process sees at
/// `container_root`: inside it (chroot) where the root can run its own binaries and has the `/tmp`
/// and `/dev/shm` the Pod mounts the claim's directories on; directly with the root's libraries
/// otherwise (a root without a loader, GKE's).
pub fn program_for_root(container_root: &Path) -> DaemonProgram {
    DriverProgram::for_root(container_root)
}

#[cfg(test)]
#[path = "pod_tests.rs"]
mod tests;
