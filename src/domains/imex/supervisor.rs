//! `gpu-dra imex-daemon`: PID 1 of a domain's IMEX daemon Pod (`pod.rs`). It enters the driver root
//! (chroot) where the Pod says so, runs `nvidia-imex -c <dir>/config.cfg` in the foreground, asks
//! `nvidia-imex-ctl -q` every second whether it is READY and keeps `<dir>/ready` (read by the Pod's
//! readiness probe) or `<dir>/not-ready` (why not, read by the plugin) accordingly.
//!
//! - The peers change (`nodes_config.cfg`'s content): the daemon is stopped and started again, so it
//!   reads them. NVIDIA's ComputeDomain daemon does the same when it lists peers by IP address (its
//!   `IMEXDaemonUpdateLoopWithIPs` restarts `nvidia-imex` on every update).
//! - SIGTERM (the Pod is deleted): passed on to the daemon; the supervisor exits 0 once it ended.
//! - The daemon exits by itself: the supervisor exits with its status, so the kubelet restarts the
//!   container and the Pod is not Ready meanwhile; the daemon's last stderr line goes into `not-ready`.

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use super::config::{CONFIG_FILE, NODES_CONFIG_FILE};
use super::{NOT_READY_FILE, READY_FILE};
use crate::fsutil::write_for_this_boot;

/// How often the daemon is asked whether it is ready, and the peers file compared.
const CHECK_PERIOD: Duration = Duration::from_secs(1);
const CTL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the daemon has to end after SIGTERM (the Pod's grace period is 15 s).
const STOP_WAIT: Duration = Duration::from_secs(10);
/// `--program` and `--ctl-program` for the fake backend's stand-ins (`gpu-dra fake imex-daemon`,
/// `gpu-dra fake imex-ctl`), which only a build with the `doubles` feature has.
pub const STAND_IN_PROGRAM: &str = "stand-in";
/// Why IMEX on the fake backend fails in the node binary.
pub const NO_STAND_IN: &str = "IMEX on the fake backend runs a stand-in for NVIDIA's nvidia-imex, which this build leaves out (only a build with `--features doubles` has it); the node binary runs IMEX daemons on real GPUs only";

/// What the Pod's arguments say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisorArgs {
    /// The domain's directory as the daemon sees it (inside the driver root after a chroot).
    pub dir: PathBuf,
    /// `nvidia-imex`'s path (inside the root after a chroot), or `stand-in`.
    pub program: String,
    /// `nvidia-imex-ctl`'s path, or `stand-in`.
    pub ctl_program: String,
    /// Chroot here before starting the daemon.
    pub driver_root: Option<PathBuf>,
    pub library_path: Option<PathBuf>,
}

#[derive(Debug, Error)]
pub enum SupervisorError {
    #[error("IMEX daemon in {}: {action} {}: {source}", dir.display(), path.display())]
    Io {
        dir: PathBuf,
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("IMEX daemon in {}: entering the driver root {}: {source}", dir.display(), root.display())]
    Chroot {
        dir: PathBuf,
        root: PathBuf,
        source: nix::Error,
    },
    #[error("IMEX daemon in {}: {detail}", dir.display())]
    Daemon { dir: PathBuf, detail: String },
}

impl SupervisorArgs {
    fn io(
        &self,
        action: &'static str,
        path: &Path,
    ) -> impl FnOnce(std::io::Error) -> SupervisorError {
        let (dir, path) = (self.dir.clone(), path.to_path_buf());
        move |source| SupervisorError::Io {
            dir,
            action,
            path,
            source,
        }
    }

    fn config(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    /// `program` with `args`; the stand-ins are this binary's `fake` commands.
    fn command(&self, program: &str, stand_in: &str, args: &[&str]) -> Command {
        if cfg!(feature = "doubles") && program == STAND_IN_PROGRAM {
            // Never after a chroot: the stand-in mode runs without one.
            let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
            let mut command = Command::new(exe);
            command.args(["fake", stand_in]).args(args);
            return command;
        }
        let mut command = Command::new(program);
        if let Some(dir) = &self.library_path {
            command.env("LD_LIBRARY_PATH", dir);
        }
        command.args(args);
        command
    }

    fn daemon_name(&self) -> &str {
        if self.program == STAND_IN_PROGRAM {
            "the IMEX stand-in"
        } else {
            "nvidia-imex"
        }
    }
}

/// `ready` and `not-ready` in the domain's directory: one or the other.
struct Readiness {
    ready: PathBuf,
    not_ready: PathBuf,
    is_ready: bool,
}

impl Readiness {
    fn new(dir: &Path) -> Self {
        Self {
            ready: dir.join(READY_FILE),
            not_ready: dir.join(NOT_READY_FILE),
            is_ready: false,
        }
    }

    fn ready(&mut self) {
        if self.is_ready && self.ready.is_file() {
            return;
        }
        match write_for_this_boot(
            &self.ready,
            format!("{}\n", std::process::id()).as_bytes(),
            0o644,
        ) {
            Ok(()) => {
                let _ = fs::remove_file(&self.not_ready);
                if !self.is_ready {
                    tracing::info!("IMEX daemon ready");
                }
                self.is_ready = true;
            }
            Err(e) => {
                tracing::warn!(path = %self.ready.display(), error = %e, "cannot write the ready file")
            }
        }
    }

    fn not_ready(&mut self, reason: &str) {
        let _ = fs::remove_file(&self.ready);
        if self.is_ready {
            tracing::warn!(%reason, "IMEX daemon not ready");
        }
        self.is_ready = false;
        let line = format!("{}\n", reason.replace('\n', " ").trim());
        if fs::read_to_string(&self.not_ready).ok().as_deref() != Some(line.as_str()) {
            if let Err(e) = write_for_this_boot(&self.not_ready, line.as_bytes(), 0o644) {
                tracing::warn!(path = %self.not_ready.display(), error = %e, "cannot write the not-ready file");
            }
        }
    }
}

/// A running daemon, with the last line it wrote to stderr.
struct Daemon {
    child: Child,
    last_line: Arc<Mutex<String>>,
    forwarder: Option<JoinHandle<()>>,
}

impl Daemon {
    fn start(args: &SupervisorArgs) -> Result<Daemon, SupervisorError> {
        let config = args.config();
        let config_arg = config.display().to_string();
        let mut child = args
            .command(&args.program, "imex-daemon", &["-c", &config_arg])
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(args.io("starting", Path::new(&args.program)))?;
        let last_line = Arc::new(Mutex::new(String::new()));
        // The daemon's stderr goes on to the container's log; its last line says why it died.
        let forwarder = child.stderr.take().map(|stderr| {
            let last_line = last_line.clone();
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    eprintln!("{line}");
                    if !line.trim().is_empty() {
                        if let Ok(mut last) = last_line.lock() {
                            *last = line;
                        }
                    }
                }
            })
        });
        tracing::info!(pid = child.id(), program = %args.program, config = %config.display(), "IMEX daemon started");
        Ok(Daemon {
            child,
            last_line,
            forwarder,
        })
    }

    /// Why the daemon ended, once its stderr is read to the end (bounded: a grandchild may hold it).
    async fn exit_reason(&mut self, name: &str, status: &ExitStatus) -> String {
        if let Some(forwarder) = self.forwarder.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), forwarder).await;
        }
        let last = self.last_line.lock().map(|l| l.clone()).unwrap_or_default();
        if last.is_empty() {
            format!("{name} exited with {status}")
        } else {
            format!("{name} exited with {status}: {last}")
        }
    }

    /// SIGTERM, then SIGKILL if it is still there after a while.
    async fn stop(&mut self) {
        if let Some(pid) = self.child.id().and_then(|id| i32::try_from(id).ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        if tokio::time::timeout(STOP_WAIT, self.child.wait())
            .await
            .is_err()
        {
            tracing::warn!("the IMEX daemon still runs {STOP_WAIT:?} after SIGTERM; killing it");
            let _ = self.child.kill().await;
        }
    }
}

enum Outcome {
    Terminated,
    Exited(ExitStatus),
    PeersChanged,
}

/// Runs the supervisor; returns the exit code.
pub async fn supervise(args: SupervisorArgs) -> Result<i32, SupervisorError> {
    use tokio::signal::unix::{signal, SignalKind};
    let stand_in = args.program == STAND_IN_PROGRAM || args.ctl_program == STAND_IN_PROGRAM;
    if stand_in && !cfg!(feature = "doubles") {
        return Err(SupervisorError::Daemon {
            dir: args.dir.clone(),
            detail: NO_STAND_IN.to_string(),
        });
    }
    if let Some(root) = &args.driver_root {
        // The driver's binaries then load the driver root's own libc with its own loader.
        nix::unistd::chroot(root.as_path())
            .and_then(|()| nix::unistd::chdir("/"))
            .map_err(|source| SupervisorError::Chroot {
                dir: args.dir.clone(),
                root: root.clone(),
                source,
            })?;
    }
    let mut term =
        signal(SignalKind::terminate()).map_err(args.io("handling SIGTERM in", Path::new("/")))?;
    let peers_file = args.dir.join(NODES_CONFIG_FILE);
    let mut readiness = Readiness::new(&args.dir);
    // A restarted container finds the last run's files; the reason why it ended stays until the
    // daemon answers (or says something else).
    let _ = fs::remove_file(&readiness.ready);
    if !readiness.not_ready.exists() {
        readiness.not_ready("starting");
    }
    loop {
        let peers = fs::read(&peers_file).map_err(args.io("reading", &peers_file))?;
        let mut daemon = Daemon::start(&args)?;
        let mut check = tokio::time::interval(CHECK_PERIOD);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let outcome = loop {
            tokio::select! {
                _ = term.recv() => break Outcome::Terminated,
                status = daemon.child.wait() => match status {
                    Ok(status) => break Outcome::Exited(status),
                    Err(e) => return Err(args.io("waiting for", Path::new(&args.program))(e)),
                },
                _ = check.tick() => {
                    if fs::read(&peers_file).ok().as_ref() != Some(&peers) {
                        break Outcome::PeersChanged;
                    }
                    match query_ready(&args).await {
                        Ok(()) => readiness.ready(),
                        Err(reason) => readiness.not_ready(&reason),
                    }
                }
            }
        };
        match outcome {
            Outcome::Terminated => {
                tracing::info!("SIGTERM: stopping the IMEX daemon");
                readiness.not_ready("stopping: its Pod is being deleted");
                daemon.stop().await;
                return Ok(0);
            }
            Outcome::Exited(status) => {
                let reason = daemon.exit_reason(args.daemon_name(), &status).await;
                tracing::error!(%reason, "the IMEX daemon exited; the kubelet starts it again");
                readiness.not_ready(&reason);
                // A daemon that exits is a failure even with status 0: it should run until told.
                return Ok(match (status.code(), status.signal()) {
                    (Some(code), _) if code != 0 => code,
                    (_, Some(signal)) => 128 + signal,
                    _ => 1,
                });
            }
            Outcome::PeersChanged => {
                tracing::info!(peers = %peers_file.display(), "the peers changed: restarting the IMEX daemon so it reads them");
                readiness.not_ready("restarting: the peers changed");
                daemon.stop().await;
            }
        }
    }
}

/// `nvidia-imex-ctl -q`: `Ok` when the daemon answers READY, else what it said.
async fn query_ready(args: &SupervisorArgs) -> Result<(), String> {
    let config = args.config().display().to_string();
    let child = args
        .command(&args.ctl_program, "imex-ctl", &["-q", "-c", &config])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("running {}: {e}", args.ctl_program))?;
    let output = tokio::time::timeout(CTL_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| format!("nvidia-imex-ctl -q: no answer within {CTL_TIMEOUT:?}"))?
        .map_err(|e| format!("nvidia-imex-ctl -q: {e}"))?;
    let answer = String::from_utf8_lossy(&output.stdout).trim().to_string();
    if output.status.success() && answer == "READY" {
        return Ok(());
    }
    let said = format!(
        "{answer} {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    if output.status.success() {
        Err(format!("nvidia-imex-ctl -q: {}", said.trim()))
    } else {
        Err(format!(
            "nvidia-imex-ctl -q ({}): {}",
            output.status,
            said.trim()
        ))
    }
}
