//! The Pod that runs one claim's MPS control daemon. The daemon lives outside the plugin's container,
//! so that a plugin crash, OOM kill, liveness restart or upgrade leaves running CUDA contexts alone and
//! the daemon's memory is not counted against the plugin's limit. The kubelet restarts a daemon that
//! dies; the plugin only creates and deletes the Pod (NVIDIA's DRA driver makes the same choice).
//!
//! The Pod runs this binary as `gpu-dra mps-daemon` (the plugin's own image): a supervisor that starts
//! `nvidia-cuda-mps-control -f` inside the driver root (chroot, so the driver's binaries load the
//! driver root's own libc), applies the claim's limits and reports ready through a file its readiness
//! probe reads. Its volumes give it the claim's directories at the paths the daemon sees:
//! - chroot: the claim's directory over `<root>/tmp` (pipe `/tmp/pipe`, log `/tmp/log`) and the
//!   claim's shared-memory tmpfs over `<root>/dev/shm`, so that server and clients share it;
//! - direct (a root that cannot run its own binaries, GKE's): the same at `/mps` and `/dev/shm`;
//! - stand-in (fake backend): as direct, with `gpu-dra fake mps-control-daemon` as the program.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::{MpsDaemonSpec, MpsError};

/// Labels every daemon Pod carries; the plugin lists its own node's Pods by them.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
pub const COMPONENT: &str = "mps-control-daemon";
pub const CLAIM_LABEL: &str = "gpu-dra.dev/claim-uid";
pub const DRIVER_LABEL: &str = "gpu-dra.dev/driver";
/// The file, in the claim's log directory, that the supervisor writes once the daemon answers.
pub const READY_FILE: &str = "ready";
/// Where the daemon container sees the driver root.
const POD_DRIVER_ROOT: &str = "/driver-root";
/// Where the daemon container sees the claim's directory when it does not chroot.
const POD_CLAIM_DIR: &str = "/mps";

/// How the daemon Pod runs the control program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DaemonProgram {
    /// `nvidia-cuda-mps-control` inside the driver root (chroot); `binary` is its path there.
    Chroot { binary: PathBuf },
    /// The driver root cannot run its binaries itself (no loader of its own): the binary at
    /// `<root>/<binary>` with the root's library directory `<root>/<library_dir>`.
    Direct {
        binary: PathBuf,
        library_dir: Option<PathBuf>,
    },
    /// The fake backend's stand-in, this binary's `fake mps-control-daemon`.
    StandIn,
}

/// What every daemon Pod of this plugin shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonPodTemplate {
    pub namespace: String,
    pub node: String,
    pub driver: String,
    /// The plugin's own image: the daemon runs `gpu-dra mps-daemon` from it.
    pub image: String,
    /// The driver root on the host.
    pub host_driver_root: PathBuf,
    pub program: DaemonProgram,
}

impl DaemonPodTemplate {
    /// The Pod's name: one per claim UID, which is a plain name of at most 128 characters.
    pub fn pod_name(claim_uid: &str) -> String {
        format!("gpu-dra-mps-{claim_uid}")
    }

    /// The daemon Pod of one claim; `host_dir` is the claim's directory on the host (with `pipe`,
    /// `log` and the tmpfs `shm` in it).
    pub fn pod(&self, spec: &MpsDaemonSpec, host_dir: &Path) -> Result<Pod, MpsError> {
        let limits = super::limit_commands(spec)?;
        let host = |sub: &str| host_dir.join(sub).display().to_string();
        let (claim_dir, shm_dir, inside) = match &self.program {
            DaemonProgram::Chroot { .. } => (
                format!("{POD_DRIVER_ROOT}/tmp"),
                format!("{POD_DRIVER_ROOT}/dev/shm"),
                "/tmp".to_string(),
            ),
            DaemonProgram::Direct { .. } | DaemonProgram::StandIn => (
                POD_CLAIM_DIR.to_string(),
                "/dev/shm".to_string(),
                POD_CLAIM_DIR.to_string(),
            ),
        };
        let mut args = vec![
            "mps-daemon".to_string(),
            format!("--claim={}", spec.claim_uid),
            format!("--pipe-dir={inside}/pipe"),
            format!("--log-dir={inside}/log"),
            // The supervisor checks the shared memory from where it stands (before a chroot).
            format!("--shm-dir={shm_dir}"),
        ];
        match &self.program {
            DaemonProgram::Chroot { binary } => {
                args.push(format!("--driver-root={POD_DRIVER_ROOT}"));
                args.push(format!("--program={}", binary.display()));
            }
            DaemonProgram::Direct {
                binary,
                library_dir,
            } => {
                let in_root =
                    |p: &Path| Path::new(POD_DRIVER_ROOT).join(p.strip_prefix("/").unwrap_or(p));
                args.push(format!("--program={}", in_root(binary).display()));
                if let Some(dir) = library_dir {
                    args.push(format!("--library-path={}", in_root(dir).display()));
                }
            }
            DaemonProgram::StandIn => {
                args.push(format!("--program={}", super::supervisor::STAND_IN_PROGRAM))
            }
        }
        if spec.multi_user {
            args.push("--multi-user".to_string());
        }
        args.extend(limits.iter().map(|command| format!("--command={command}")));
        let mut mounts = vec![
            json!({"name": "claim", "mountPath": claim_dir}),
            json!({"name": "shm", "mountPath": shm_dir}),
        ];
        let mut volumes = vec![
            json!({"name": "claim", "hostPath": {"path": host_dir.display().to_string(), "type": "Directory"}}),
            json!({"name": "shm", "hostPath": {"path": host("shm"), "type": "Directory"}}),
        ];
        if !matches!(self.program, DaemonProgram::StandIn) {
            // Mounted first (shorter path), so the claim's directories go on top of it.
            mounts.insert(
                0,
                json!({"name": "driver-root", "mountPath": POD_DRIVER_ROOT, "readOnly": true,
                       "mountPropagation": "HostToContainer"}),
            );
            volumes.push(json!({"name": "driver-root", "hostPath": {
                "path": self.host_driver_root.display().to_string(), "type": "Directory"}}));
        }
        let ready_file = format!("{}/log/{READY_FILE}", claim_dir);
        let pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": Self::pod_name(&spec.claim_uid),
                "namespace": self.namespace,
                "labels": {
                    "app.kubernetes.io/name": "gpu-dra",
                    COMPONENT_LABEL: COMPONENT,
                    CLAIM_LABEL: spec.claim_uid,
                    DRIVER_LABEL: self.driver,
                },
            },
            "spec": {
                // Bound by the plugin, never scheduled: the daemon belongs to this node's claim.
                "nodeName": self.node,
                "restartPolicy": "Always",
                "priorityClassName": "system-node-critical",
                "automountServiceAccountToken": false,
                "enableServiceLinks": false,
                // Quit is answered within seconds; the supervisor then ends the daemon itself.
                "terminationGracePeriodSeconds": 15,
                // Whatever taints the node carries, the claim's pods already run there.
                "tolerations": [{"operator": "Exists"}],
                "containers": [{
                    "name": "mps-control-daemon",
                    "image": self.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["gpu-dra"],
                    "args": args,
                    "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": super::visible_devices(&spec.devices)}],
                    "readinessProbe": {
                        "exec": {"command": ["gpu-dra", "mps-daemon", "--check-ready", ready_file]},
                        "periodSeconds": 2,
                        "failureThreshold": 1,
                    },
                    // The daemon opens the GPUs' device nodes, and chroot needs CAP_SYS_CHROOT.
                    "securityContext": {"privileged": true},
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                    "volumeMounts": mounts,
                }],
                "volumes": volumes,
            },
        });
        serde_json::from_value(pod).map_err(|e| MpsError::InvalidSpec {
            claim: spec.claim_uid.clone(),
            reason: format!("daemon Pod: {e}"),
        })
    }
}

/// How the daemon runs `nvidia-cuda-mps-control` of the driver root that this process sees at
/// `container_root`: inside it (chroot) where the root can run its own binaries (their ELF
/// interpreter is in the root) and has the `/tmp` and `/dev/shm` the Pod mounts the claim's
/// directories on; directly with the root's libraries otherwise (a root without a loader, GKE's).
pub fn program_for_root(container_root: &Path) -> DaemonProgram {
    let located = match crate::gpu::driver_exec::locate(container_root, "nvidia-cuda-mps-control") {
        Ok(located) => located,
        // The supervisor then says which program it could not start.
        Err(_) => {
            return DaemonProgram::Chroot {
                binary: PathBuf::from("/usr/bin/nvidia-cuda-mps-control"),
            }
        }
    };
    let inside = |path: &Path| {
        path.strip_prefix(container_root)
            .map(|rest| Path::new("/").join(rest))
            .unwrap_or_else(|_| path.to_path_buf())
    };
    let has_mount_points =
        container_root.join("tmp").is_dir() && container_root.join("dev/shm").is_dir();
    if located.runs_inside_root && has_mount_points {
        DaemonProgram::Chroot {
            binary: located.in_root,
        }
    } else {
        DaemonProgram::Direct {
            binary: located.in_root,
            library_dir: located.library_dir.as_deref().map(inside),
        }
    }
}

#[cfg(test)]
#[path = "pod_tests.rs"]
mod tests;
