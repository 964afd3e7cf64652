//! MPS control daemons: one per prepared claim that shares its GPUs through MPS. A claim gets
//! `<plugin-dir>/mps/<claimUID>/{pipe,log,shm}`, with a size-limited tmpfs mounted at `shm`
//! (`shm.rs`), and a Pod of its own that runs the daemon (`pod.rs`, `supervisor.rs`): the
//! daemon outlives the plugin's container (crash, OOM kill, upgrade), and its memory is the Pod's. The
//! claim's containers get `pipe`, `log` and `shm` through CDI ([`MpsDaemons::container_edits`]).
//!
//! The plugin creates and deletes the Pods and waits for them to be Ready; it never signals a process
//! itself. Every call may wait on the API server and the kubelet for seconds, bounded.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tracing::{info, warn};

use crate::cdi::{ContainerEdits, Mount};
use crate::claims::daemon_pod::api::GONE_TIMEOUT;
pub use daemon_pods::DaemonPods;
pub use pod::{DaemonPodTemplate, DaemonProgram, MpsPrograms};

pub(crate) mod daemon_pods;
mod dirs;
pub mod pod;
pub mod shm;
#[cfg(feature = "doubles")]
pub mod stand_in;
pub mod supervisor;

/// The file, in the pipe directory, where the daemon keeps its pid (the real daemon's name).
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The daemon's control socket in the pipe directory.
pub const CONTROL_SOCKET: &str = "control";
/// Where a claim's containers find the pipe directory, and the log directory (read-only).
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";
pub const CONTAINER_LOG_DIR: &str = "/tmp/nvidia-mps-log";
/// The file the daemon's supervisor writes into the shared memory it sees; the plugin finds it in the
/// claim's tmpfs, which proves that daemon and clients share one `/dev/shm`.
pub const SHM_MARKER: &str = ".gpu-dra-mps-daemon";

/// How long a whole start may take: removing a Pod left by an earlier attempt, creating the new one
/// and waiting until it is Ready share it. The kubelet gives a whole NodePrepareResources 45 s (its
/// DRA client's `defaultClientCallTimeout`), and the rest of a prepare (reading the claim, MIG
/// devices, CDI spec, checkpoint) needs some of it; a prepare that fails here is retried by the
/// kubelet.
pub const START_BUDGET: Duration = Duration::from_secs(30);
/// `sun_path` holds 108 bytes with the NUL; the real daemon's longest socket is `control_privileged`.
const LONGEST_SOCKET: &str = "control_privileged";
const MAX_SOCKET_PATH: usize = 107;
const MIB: u64 = 1024 * 1024;

/// One device a daemon serves, in `CUDA_VISIBLE_DEVICES` order (its index there is the ordinal
/// the daemon's per-device commands use).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsDevice {
    /// The DRA device name (`gpu-0`, `gpu-0-mig-1g10gb-0`).
    pub device: String,
    /// `GPU-…` or `MIG-…`.
    pub uuid: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_memory_limit_bytes: Option<u64>,
}

/// What to start for one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDaemonSpec {
    pub claim_uid: String,
    pub devices: Vec<MpsDevice>,
    pub active_thread_percentage: Option<u8>,
    /// Serve clients of different user ids at once (`-multiuser-server`; NVIDIA's `multiUser`).
    pub multi_user: bool,
    /// The size of the claim's shared-memory tmpfs (the MPS config's `shmSize`); `None`: the
    /// node's default (`--mps-shm-size`).
    pub shm_size_bytes: Option<u64>,
}

/// A started daemon, as the checkpoint keeps it. Records of releases that ran the daemon inside the
/// plugin (a `pid`, no `pod`) load with an empty `pod`: their daemon died with that container, and
/// recovery starts a Pod for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsDaemonRecord {
    /// The daemon's Pod, in the plugin's namespace.
    #[serde(default)]
    pub pod: String,
    #[serde(default)]
    pub pod_uid: String,
    /// `<root>/<claimUID>` as this process sees it.
    pub dir: PathBuf,
    pub devices: Vec<MpsDevice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u8>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub multi_user: bool,
}

impl MpsDaemonRecord {
    /// The claim the daemon serves: the last component of `dir`.
    pub fn claim_uid(&self) -> Option<&str> {
        self.dir.file_name().and_then(|name| name.to_str())
    }
}

/// What [`MpsDaemons::take_over`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TakeOver {
    /// The recorded daemon's Pod still runs, Ready, for the same devices; nothing changed.
    TakenOver,
    /// Its Pod was gone, not Ready, or served other devices (a MIG device made again after a reboot
    /// has a new UUID): a new Pod runs in the same directories.
    Restarted(MpsDaemonRecord),
}

#[derive(Debug, Error)]
pub enum MpsError {
    #[error("MPS daemon for claim {claim:?}: the claim UID is not a plain name")]
    InvalidClaimUid { claim: String },
    #[error("MPS daemon record names {}, which is not a claim directory under {}", dir.display(), root.display())]
    ForeignDir { dir: PathBuf, root: PathBuf },
    #[error("MPS daemon for claim {claim}: socket path {} is longer than the 107 bytes a unix socket allows; use a shorter plugin directory", path.display())]
    PathTooLong { claim: String, path: PathBuf },
    #[error("MPS daemon for claim {claim}: {reason}")]
    InvalidSpec { claim: String, reason: String },
    #[error("MPS daemon for claim {claim}: {action} {}: {source}", path.display())]
    Io {
        claim: String,
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("MPS daemon for claim {claim}: mounting its shared-memory tmpfs at {}: {source} (the plugin must run privileged, with the plugins directory mounted Bidirectional)", path.display())]
    Shm {
        claim: String,
        path: PathBuf,
        source: nix::Error,
    },
    #[error("MPS daemon for claim {claim}: no image to run the daemon's Pod in: the plugin runs outside a Pod (set --mps-daemon-image, or POD_NAME and POD_NAMESPACE)")]
    NoDaemonPods { claim: String },
    #[error("MPS daemon for claim {claim}: {}", supervisor::NO_STAND_IN)]
    NoStandIn { claim: String },
    #[error("MPS daemon for claim {claim}: Pod {namespace}/{pod}: {action}: {source}")]
    Api {
        claim: String,
        namespace: String,
        pod: String,
        action: &'static str,
        source: Box<kube::Error>,
    },
    #[error(
        "MPS daemon for claim {claim}: Pod {namespace}/{pod} not Ready within the start's {waited:?}: {detail}"
    )]
    NotReady {
        claim: String,
        namespace: String,
        pod: String,
        waited: Duration,
        detail: String,
    },
    #[error("MPS daemon for claim {claim}: Pod {namespace}/{pod}: the start's {budget:?} ran out waiting for {waiting_for}")]
    StartTimedOut {
        claim: String,
        namespace: String,
        pod: String,
        budget: Duration,
        waiting_for: String,
    },
    #[error("MPS daemon for claim {claim}: Pod {namespace}/{pod} still there {waited:?} after its deletion")]
    StillRunning {
        claim: String,
        namespace: String,
        pod: String,
        waited: Duration,
    },
}

/// The per-claim MPS daemons under one directory.
#[derive(Debug, Clone)]
pub struct MpsDaemons {
    root: PathBuf,
    host_root: PathBuf,
    /// The node's default size of a claim's tmpfs.
    shm_size: u64,
    /// The node's memory, which bounds a claim's tmpfs; `None`: unknown, not checked.
    node_memory: Option<u64>,
    pods: Option<DaemonPods>,
}

impl MpsDaemons {
    /// `root` is `<plugin-dir>/mps` as this process sees it; the host sees it at the same path
    /// unless [`with_host_root`](Self::with_host_root) says otherwise. Without
    /// [`with_pods`](Self::with_pods), MPS claims fail with a clear error.
    pub fn new(root: PathBuf, shm_size: u64) -> Self {
        Self {
            host_root: root.clone(),
            root,
            shm_size,
            node_memory: shm::node_memory(),
            pods: None,
        }
    }

    /// The node's memory, which bounds the size a claim's MPS config may ask for its tmpfs.
    pub fn with_node_memory(mut self, bytes: u64) -> Self {
        self.node_memory = Some(bytes);
        self
    }

    /// Where the host (the container runtime that performs the CDI mounts) sees `root`.
    pub fn with_host_root(mut self, host_root: PathBuf) -> Self {
        self.host_root = host_root;
        self
    }

    /// Runs the daemons in Pods made from `pods`.
    pub fn with_pods(mut self, pods: DaemonPods) -> Self {
        self.pods = Some(pods);
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The size of each claim's shared-memory tmpfs, in bytes.
    pub fn shm_size(&self) -> u64 {
        self.shm_size
    }

    /// The size of a claim's tmpfs in bytes: its MPS config's `shmSize`, within the node's memory, or
    /// the node's default.
    fn shm_size_for(&self, spec: &MpsDaemonSpec) -> Result<u64, MpsError> {
        match (spec.shm_size_bytes, self.node_memory) {
            (Some(0), _) => Err(MpsError::InvalidSpec {
                claim: spec.claim_uid.clone(),
                reason: "the MPS config's shmSize is 0; a claim's /dev/shm needs at least one byte"
                    .into(),
            }),
            (Some(asked), Some(memory)) if asked > memory => Err(MpsError::InvalidSpec {
                claim: spec.claim_uid.clone(),
                reason: format!(
                    "the MPS config's shmSize ({} bytes, {} MiB) is more than this node's memory ({} MiB); a claim's /dev/shm is a tmpfs in the node's memory",
                    asked,
                    asked / MIB,
                    memory / MIB
                ),
            }),
            (Some(asked), _) => Ok(asked),
            (None, _) => Ok(self.shm_size),
        }
    }

    /// [`start_within`](Self::start_within) the [`START_BUDGET`].
    pub async fn start(&self, spec: &MpsDaemonSpec) -> Result<MpsDaemonRecord, MpsError> {
        self.start_within(spec, START_BUDGET).await
    }

    /// Makes the claim's directories and tmpfs, starts its daemon's Pod and waits until it is Ready,
    /// all within `budget`. A Pod left by an earlier, interrupted attempt is replaced (and waited on
    /// until gone, within the same budget). On failure nothing is left behind.
    pub async fn start_within(
        &self,
        spec: &MpsDaemonSpec,
        budget: Duration,
    ) -> Result<MpsDaemonRecord, MpsError> {
        let dirs = self.dirs_for_uid(&spec.claim_uid)?;
        let pods = self.pods.as_ref().ok_or_else(|| MpsError::NoDaemonPods {
            claim: dirs.claim.clone(),
        })?;
        if pods.template.program == DaemonProgram::StandIn && !cfg!(feature = "doubles") {
            return Err(MpsError::NoStandIn { claim: dirs.claim });
        }
        limit_commands(spec)?;
        self.shm_size_for(spec)?;
        let started = self.launch(pods, &dirs, spec, budget).await;
        match &started {
            Ok(record) => {
                info!(claim = %dirs.claim, pod = %record.pod, devices = %visible_devices(&spec.devices), "MPS control daemon started")
            }
            Err(_) => {
                let _ = self.delete_pod(pods, &dirs.claim, None).await;
                self.remove_dirs(&dirs);
            }
        }
        started
    }

    /// At plugin start, for a claim that is still prepared: keeps a Ready daemon Pod that serves
    /// `spec`'s devices, or starts a new one in the same directories (kept, so that containers that
    /// mounted them see it), within the [`START_BUDGET`]. `spec` comes from the claim's devices as
    /// they are now, so a MIG device made again after a reboot (new UUID) gets a daemon that names it.
    pub async fn take_over(
        &self,
        record: &MpsDaemonRecord,
        spec: &MpsDaemonSpec,
    ) -> Result<TakeOver, MpsError> {
        let dirs = self.dirs_for_record(record)?;
        let same_devices = record.devices == spec.devices
            && record.active_thread_percentage == spec.active_thread_percentage
            && record.multi_user == spec.multi_user;
        let mounted = shm::is_mount_point(&dirs.shm) && shm::is_tmpfs(&dirs.shm);
        if same_devices && mounted && self.is_running(record).await {
            info!(claim = %dirs.claim, pod = %record.pod, "MPS control daemon taken over");
            return Ok(TakeOver::TakenOver);
        }
        let pods = self.pods.as_ref().ok_or_else(|| MpsError::NoDaemonPods {
            claim: dirs.claim.clone(),
        })?;
        limit_commands(spec)?;
        let restarted = self.launch(pods, &dirs, spec, START_BUDGET).await?;
        info!(claim = %dirs.claim, old_pod_uid = %record.pod_uid, pod_uid = %restarted.pod_uid, same_devices, "MPS control daemon started again");
        Ok(TakeOver::Restarted(restarted))
    }

    /// Deletes the daemon's Pod and waits until it is gone, then unmounts the claim's tmpfs and
    /// removes its directory. A Pod already gone is fine; so is a repeat.
    pub async fn stop(&self, record: &MpsDaemonRecord) -> Result<(), MpsError> {
        let dirs = self.dirs_for_record(record)?;
        if let Some(pods) = &self.pods {
            self.delete_pod(pods, &dirs.claim, Some(GONE_TIMEOUT))
                .await?;
        }
        self.remove_dirs(&dirs);
        if dirs.dir.exists() {
            return Err(MpsError::Io {
                claim: dirs.claim.clone(),
                action: "removing",
                path: dirs.dir.clone(),
                source: io::Error::other("still there (see the log)"),
            });
        }
        info!(claim = %dirs.claim, pod = %record.pod, "MPS control daemon stopped");
        Ok(())
    }

    /// At plugin start: deletes this node's daemon Pods and removes the directories of claims not
    /// in `keep` ([`sweep_dirs`](Self::sweep_dirs), then [`sweep_pods`](Self::sweep_pods)). Returns
    /// the claim UIDs cleaned up; failures are logged and retried at the next start.
    pub async fn sweep(&self, keep: &BTreeSet<String>) -> Vec<String> {
        let mut cleaned: BTreeSet<String> = self.sweep_dirs(keep).await.into_iter().collect();
        cleaned.extend(self.sweep_pods(keep).await);
        cleaned.into_iter().collect()
    }

    /// For each claim directory not in `keep`: deletes the claim's daemon Pod (by name), then unmounts
    /// its tmpfs and removes the directory. Touches the API server only where there is something to
    /// clean, so a start with an unreachable API server is not held up by it.
    pub async fn sweep_dirs(&self, keep: &BTreeSet<String>) -> Vec<String> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries.filter_map(|e| e.ok()).collect::<Vec<_>>(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                warn!(dir = %self.root.display(), error = %e, "cannot list MPS daemon directories");
                Vec::new()
            }
        };
        let mut cleaned = Vec::new();
        for entry in entries {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            // Under NVIDIA's driver name the directory is shared with NVIDIA's plugin, whose daemons
            // (`<claim UID>-<hash>`) are stopped only with the claims taken over from it.
            if !entry.file_type().is_ok_and(|t| t.is_dir())
                || !is_plain_name(&name)
                || keep.contains(&name)
                || crate::claims::nvidia_checkpoint::is_nvidia_mps_dir(&name)
            {
                continue;
            }
            let Ok(dirs) = self.dirs_for_uid(&name) else {
                continue;
            };
            if let Some(pods) = &self.pods {
                // The Pod goes first: it mounts the directory.
                if let Err(e) = self.delete_pod(pods, &name, Some(GONE_TIMEOUT)).await {
                    warn!(claim = %name, error = %e, "MPS daemon Pod of a claim no longer prepared left in place; its directory too");
                    continue;
                }
            }
            self.remove_dirs(&dirs);
            if dirs.dir.exists() {
                warn!(claim = %name, "MPS daemon directory of a claim no longer prepared left in place");
            } else {
                info!(claim = %name, "MPS daemon of a claim no longer prepared removed");
                cleaned.push(name);
            }
        }
        cleaned
    }

    /// The record of the daemon [`start`](Self::start) makes for `spec`, before it makes anything:
    /// its Pod's name and directory follow from the claim's UID (the Pod's UID is not known yet).
    /// [`stop`](Self::stop) takes it as it takes a started one.
    pub fn planned(&self, spec: &MpsDaemonSpec) -> Result<MpsDaemonRecord, MpsError> {
        let dirs = self.dirs_for_uid(&spec.claim_uid)?;
        limit_commands(spec)?;
        Ok(MpsDaemonRecord {
            pod: DaemonPodTemplate::pod_name(&spec.claim_uid),
            pod_uid: String::new(),
            dir: dirs.dir,
            devices: spec.devices.clone(),
            active_thread_percentage: spec.active_thread_percentage,
            multi_user: spec.multi_user,
        })
    }

    /// What a container of the claim needs to reach the daemon: the pipe and log directories and
    /// the shared-memory tmpfs, at the host's paths.
    pub fn container_edits(&self, record: &MpsDaemonRecord) -> Result<ContainerEdits, MpsError> {
        let dirs = self.dirs_for_record(record)?;
        let host = self.host_root.join(&dirs.claim);
        let mount = |from: &str, to: &str, options: &[&str]| Mount {
            host_path: host.join(from).display().to_string(),
            container_path: to.to_string(),
            options: options.iter().map(|o| o.to_string()).collect(),
            mount_type: None,
        };
        Ok(ContainerEdits {
            env: vec![
                format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}"),
                format!("CUDA_MPS_LOG_DIRECTORY={CONTAINER_LOG_DIR}"),
            ],
            mounts: vec![
                mount(
                    "pipe",
                    CONTAINER_PIPE_DIR,
                    &["rw", "nosuid", "nodev", "bind"],
                ),
                mount("log", CONTAINER_LOG_DIR, &["ro", "nosuid", "nodev", "bind"]),
                mount(
                    "shm",
                    "/dev/shm",
                    &["rw", "nosuid", "nodev", "noexec", "bind"],
                ),
            ],
            ..Default::default()
        })
    }
}

/// The commands that apply a spec's limits, checked before anything starts.
pub(crate) fn limit_commands(spec: &MpsDaemonSpec) -> Result<Vec<String>, MpsError> {
    let invalid = |reason: String| MpsError::InvalidSpec {
        claim: spec.claim_uid.clone(),
        reason,
    };
    if spec.devices.is_empty() {
        return Err(invalid("no devices".into()));
    }
    let mut commands = Vec::new();
    if let Some(percentage) = spec.active_thread_percentage {
        if !(1..=100).contains(&percentage) {
            return Err(invalid(format!(
                "active thread percentage {percentage} is not between 1 and 100"
            )));
        }
        commands.push(format!("set_default_active_thread_percentage {percentage}"));
    }
    for (ordinal, device) in spec.devices.iter().enumerate() {
        if device.uuid.is_empty() || device.uuid.contains([',', ' ', '\n']) {
            return Err(invalid(format!(
                "device {}: bad UUID {:?}",
                device.device, device.uuid
            )));
        }
        let Some(bytes) = device.pinned_memory_limit_bytes else {
            continue;
        };
        // The daemon takes whole MiB (or GiB); rounding down keeps a claim within its share.
        let mib = bytes / MIB;
        if mib == 0 {
            return Err(invalid(format!(
                "device {}: pinned memory limit of {bytes} bytes is under the 1 MiB the daemon can set",
                device.device
            )));
        }
        commands.push(format!(
            "set_default_device_pinned_mem_limit {ordinal} {mib}M"
        ));
    }
    Ok(commands)
}

fn visible_devices(devices: &[MpsDevice]) -> String {
    devices
        .iter()
        .map(|d| d.uuid.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// A name that is one path component: letters, digits, `-`, `_`, `.`, not starting with `.`.
pub(crate) fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Answers of the control program that report a failure while it still exits 0.
fn reports_error(answer: &str) -> bool {
    answer.lines().any(|line| {
        let line = line.trim_start().to_ascii_lowercase();
        line.starts_with("error") || line.starts_with("invalid") || line.starts_with("unrecognized")
    })
}

#[cfg(test)]
mod tests;
