//! MPS control daemons: one per prepared claim that shares its GPUs through MPS. A claim gets
//! `<plugin-dir>/mps/<claimUID>/{pipe,shm,log}`; its daemon (NVIDIA's `nvidia-cuda-mps-control -d`,
//! or the fake backend's stand-in `gpu-dra fake mps-control-daemon -d`) listens in `pipe`, and the
//! claim's containers get `pipe` and `shm` through CDI ([`MpsDaemons::container_edits`]).
//!
//! The plugin talks to a daemon the way NVIDIA's own tools do: it runs the control program with
//! one command on its stdin. The stand-in has the same command line, so the real daemon and the
//! stand-in go through one code path here. Every call blocks (process starts, bounded waits of a
//! few seconds): run it on a blocking thread.
//!
//! Signals go only to a process proven to be the daemon: the pid and start time of our own record,
//! or, for a directory nobody claims any more, a process whose command line is an MPS control daemon
//! and whose `CUDA_MPS_PIPE_DIRECTORY` is that directory's pipe.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tracing::{info, warn};

use crate::cdi::{ContainerEdits, Mount};
use process::same_process_alive;

#[path = "mps_process.rs"]
mod process;
#[path = "mps_stand_in.rs"]
pub mod stand_in;

/// The file, in the pipe directory, where the daemon keeps its pid (the real daemon's name).
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The daemon's control socket in the pipe directory.
pub const CONTROL_SOCKET: &str = "control";
/// Where a claim's containers find the pipe directory, and the log directory (read-only).
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";
pub const CONTAINER_LOG_DIR: &str = "/tmp/nvidia-mps-log";
/// Output of `<control> -d` (and of the stand-in daemon), in the claim's log directory.
pub const START_LOG: &str = "start.log";

const READY_TIMEOUT: Duration = Duration::from_secs(10);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const QUIT_WAIT: Duration = Duration::from_secs(5);
const SIGNAL_WAIT: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(20);
/// `sun_path` holds 108 bytes with the NUL; the real daemon's longest socket is `control_privileged`.
const LONGEST_SOCKET: &str = "control_privileged";
const MAX_SOCKET_PATH: usize = 107;
const MIB: u64 = 1024 * 1024;

/// The program that plays the control daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MpsProgram {
    /// `<container driver root>/usr/bin/nvidia-cuda-mps-control`; `library_path` becomes its
    /// `LD_LIBRARY_PATH` (the driver root's libraries as this process sees them).
    Nvidia {
        control: PathBuf,
        library_path: Option<String>,
    },
    /// The gpu-dra binary itself: `<exe> fake mps-control-daemon`.
    StandIn { exe: PathBuf },
}

impl MpsProgram {
    fn command(&self, args: &[&str]) -> Command {
        match self {
            MpsProgram::Nvidia {
                control,
                library_path,
            } => {
                let mut command = Command::new(control);
                command.args(args);
                if let Some(path) = library_path {
                    command.env("LD_LIBRARY_PATH", path);
                }
                // The daemon starts nvidia-cuda-mps-server, which the driver installs beside it.
                if let Some(dir) = control.parent() {
                    let inherited = std::env::var("PATH").unwrap_or_default();
                    command.env("PATH", format!("{}:{inherited}", dir.display()));
                }
                command
            }
            MpsProgram::StandIn { exe } => {
                let mut command = Command::new(exe);
                command.args(["fake", "mps-control-daemon"]).args(args);
                command
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            MpsProgram::Nvidia { control, .. } => control.display().to_string(),
            MpsProgram::StandIn { exe } => format!("{} fake mps-control-daemon", exe.display()),
        }
    }
}

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
}

/// A started daemon, as the checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsDaemonRecord {
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat` (clock ticks after boot): a reused pid has another.
    pub start_time: u64,
    /// `<root>/<claimUID>` as this process sees it.
    pub dir: PathBuf,
    pub devices: Vec<MpsDevice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u8>,
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
    /// The recorded daemon still runs; nothing changed.
    TakenOver,
    /// It had died (with the old plugin container); a new one runs in the same directories.
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
    #[error("MPS daemon for claim {claim}: running {program}: {source}")]
    Spawn {
        claim: String,
        program: String,
        source: io::Error,
    },
    #[error("MPS daemon for claim {claim}: {program} -d failed: {detail}")]
    StartFailed {
        claim: String,
        program: String,
        detail: String,
    },
    #[error("MPS daemon for claim {claim}: not answering within {waited:?}: {detail}")]
    NotReady {
        claim: String,
        waited: Duration,
        detail: String,
    },
    #[error("MPS daemon for claim {claim}: command {command:?}: {detail}")]
    Command {
        claim: String,
        command: String,
        detail: String,
    },
    #[error("MPS daemon for claim {claim}: process {pid} named in {} is alive but could not be checked: {reason}; left alone", pid_file.display())]
    Unverifiable {
        claim: String,
        pid: u32,
        pid_file: PathBuf,
        reason: String,
    },
    #[error(
        "MPS daemon for claim {claim}: process {pid} still runs after quit, SIGTERM and SIGKILL"
    )]
    StillRunning { claim: String, pid: u32 },
}

/// The per-claim MPS daemons under one directory.
#[derive(Debug, Clone)]
pub struct MpsDaemons {
    root: PathBuf,
    host_root: PathBuf,
    program: MpsProgram,
}

/// A claim's directories, as this process sees them.
struct ClaimDirs {
    claim: String,
    dir: PathBuf,
    pipe: PathBuf,
    shm: PathBuf,
    log: PathBuf,
}

impl ClaimDirs {
    fn pid_file(&self) -> PathBuf {
        self.pipe.join(PID_FILE)
    }

    fn io(&self, action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> MpsError {
        let (claim, path) = (self.claim.clone(), path.to_path_buf());
        move |source| MpsError::Io {
            claim,
            action,
            path,
            source,
        }
    }
}

impl MpsDaemons {
    /// `root` is `<plugin-dir>/mps` as this process sees it; the host sees it at the same path
    /// unless [`with_host_root`](Self::with_host_root) says otherwise.
    pub fn new(root: PathBuf, program: MpsProgram) -> Self {
        Self {
            host_root: root.clone(),
            root,
            program,
        }
    }

    /// Where the host (the container runtime that performs the CDI mounts) sees `root`.
    pub fn with_host_root(mut self, host_root: PathBuf) -> Self {
        self.host_root = host_root;
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Starts the claim's daemon with its devices and limits; replaces whatever an earlier,
    /// interrupted attempt left in the claim's directory.
    pub fn start(&self, spec: &MpsDaemonSpec) -> Result<MpsDaemonRecord, MpsError> {
        let dirs = self.dirs_for_uid(&spec.claim_uid)?;
        let limits = limit_commands(spec)?;
        self.prepare_dirs(&dirs)?;
        let started = self.launch(&dirs, spec, &limits);
        match &started {
            Ok(record) => {
                info!(claim = %dirs.claim, pid = record.pid, devices = %visible_devices(&spec.devices), "MPS control daemon started")
            }
            Err(_) => {
                let _ = fs::remove_dir_all(&dirs.dir);
            }
        }
        started
    }

    /// Whether the recorded daemon still runs: same pid, same start time, not a zombie.
    pub fn is_running(&self, record: &MpsDaemonRecord) -> bool {
        same_process_alive(record.pid, record.start_time)
    }

    /// At plugin start, for a claim that is still prepared: keeps a running daemon, or starts a
    /// new one in the same directories (kept, so that containers that mounted them see it). The
    /// new record replaces the old one in the checkpoint.
    pub fn take_over(&self, record: &MpsDaemonRecord) -> Result<TakeOver, MpsError> {
        let dirs = self.dirs_for_record(record)?;
        if self.is_running(record) {
            info!(claim = %dirs.claim, pid = record.pid, "MPS control daemon taken over");
            return Ok(TakeOver::TakenOver);
        }
        let spec = MpsDaemonSpec {
            claim_uid: dirs.claim.clone(),
            devices: record.devices.clone(),
            active_thread_percentage: record.active_thread_percentage,
        };
        let limits = limit_commands(&spec)?;
        self.prepare_dirs(&dirs)?;
        let restarted = self.launch(&dirs, &spec, &limits)?;
        info!(claim = %dirs.claim, old_pid = record.pid, pid = restarted.pid, "MPS control daemon had stopped; restarted");
        Ok(TakeOver::Restarted(restarted))
    }

    /// Stops the daemon (`quit`, then SIGTERM, then SIGKILL, each waited for) and removes the
    /// claim's directory. A daemon already gone is fine; one its pid file names (a restart the
    /// record missed) is stopped as well, after the same checks as [`sweep`](Self::sweep)'s.
    pub fn stop(&self, record: &MpsDaemonRecord) -> Result<(), MpsError> {
        let dirs = self.dirs_for_record(record)?;
        self.stop_process(&dirs, record.pid, record.start_time)?;
        self.stop_leftover(&dirs)?;
        remove_dir_all(&dirs.dir).map_err(dirs.io("removing", &dirs.dir))?;
        info!(claim = %dirs.claim, pid = record.pid, "MPS control daemon stopped");
        Ok(())
    }

    /// At plugin start: for every claim directory not in `keep`, stops the daemon its pid file
    /// names (only if that process is this directory's MPS daemon) and removes the directory.
    /// Returns the claim UIDs cleaned up; failures are logged and the directory stays.
    pub fn sweep(&self, keep: &BTreeSet<String>) -> Vec<String> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                warn!(dir = %self.root.display(), error = %e, "cannot list MPS daemon directories");
                return Vec::new();
            }
        };
        let mut names: Vec<String> = entries
            .filter_map(|entry| entry.ok())
            .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|entry| entry.file_name().into_string().ok())
            .filter(|name| is_plain_name(name) && !keep.contains(name))
            .collect();
        names.sort();
        let mut cleaned = Vec::new();
        for name in names {
            let dirs = match self.dirs_for_uid(&name) {
                Ok(dirs) => dirs,
                Err(_) => continue,
            };
            let result = self
                .stop_leftover(&dirs)
                .and_then(|()| remove_dir_all(&dirs.dir).map_err(dirs.io("removing", &dirs.dir)));
            match result {
                Ok(()) => {
                    info!(claim = %name, "MPS daemon directory of a claim no longer prepared removed");
                    cleaned.push(name);
                }
                Err(e) => {
                    warn!(claim = %name, error = %e, "MPS daemon of a claim no longer prepared left in place")
                }
            }
        }
        cleaned
    }

    /// What a container of the claim needs to reach the daemon: the pipe and log directories and
    /// the shared-memory directory, at the host's paths.
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

    /// Sends one control command to the recorded daemon and returns its answer.
    pub fn control(&self, record: &MpsDaemonRecord, command: &str) -> Result<String, MpsError> {
        let dirs = self.dirs_for_record(record)?;
        self.run_control(&dirs, command, COMMAND_TIMEOUT)
    }

    fn dirs_for_uid(&self, claim_uid: &str) -> Result<ClaimDirs, MpsError> {
        if !is_plain_name(claim_uid) {
            return Err(MpsError::InvalidClaimUid {
                claim: claim_uid.to_string(),
            });
        }
        let dir = self.root.join(claim_uid);
        Ok(ClaimDirs {
            claim: claim_uid.to_string(),
            pipe: dir.join("pipe"),
            shm: dir.join("shm"),
            log: dir.join("log"),
            dir,
        })
    }

    /// A record's directory must be a claim directory under this root: `stop` removes it.
    fn dirs_for_record(&self, record: &MpsDaemonRecord) -> Result<ClaimDirs, MpsError> {
        let foreign = || MpsError::ForeignDir {
            dir: record.dir.clone(),
            root: self.root.clone(),
        };
        let uid = record.claim_uid().ok_or_else(foreign)?;
        if record.dir.parent() != Some(self.root.as_path()) {
            return Err(foreign());
        }
        self.dirs_for_uid(uid).map_err(|_| foreign())
    }

    /// Makes the directories (keeping existing ones: containers may have them mounted), stops a
    /// daemon a crashed attempt left there, and clears stale sockets and pid file from `pipe`.
    /// Modes: MPS servers run as the client's user, so they must reach and write `pipe`, `shm`
    /// and `log`; those are sticky and world-writable like `/tmp`, their parents only traversable.
    fn prepare_dirs(&self, dirs: &ClaimDirs) -> Result<(), MpsError> {
        let socket = dirs.pipe.join(LONGEST_SOCKET);
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(MpsError::PathTooLong {
                claim: dirs.claim.clone(),
                path: socket,
            });
        }
        for (dir, mode) in [
            (&self.root, 0o711),
            (&dirs.dir, 0o711),
            (&dirs.pipe, 0o1777),
            (&dirs.shm, 0o1777),
            (&dirs.log, 0o1777),
        ] {
            fs::create_dir_all(dir).map_err(dirs.io("creating", dir))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(mode))
                .map_err(dirs.io("setting the mode of", dir))?;
        }
        self.stop_leftover(dirs)?;
        for entry in fs::read_dir(&dirs.pipe).map_err(dirs.io("listing", &dirs.pipe))? {
            let path = entry.map_err(dirs.io("listing", &dirs.pipe))?.path();
            let removed = if path.is_dir() && !path.is_symlink() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            removed.map_err(dirs.io("removing", &path))?;
        }
        Ok(())
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

fn remove_dir_all(dir: &Path) -> io::Result<()> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
#[path = "mps_tests.rs"]
mod tests;
