//! `gpu-dra mps-daemon`: PID 1 of a claim's MPS daemon Pod (`pod.rs`). It checks that the claim's
//! shared memory is a tmpfs, enters the driver root (chroot) where the Pod says so, runs the control
//! daemon in the foreground (`nvidia-cuda-mps-control -f`, or the fake backend's stand-in), applies the
//! claim's limits once it answers and writes the ready file that the Pod's readiness probe reads.
//! SIGTERM (the Pod is deleted) is passed on as `quit`; a daemon that dies ends the supervisor with
//! status 1, so the kubelet restarts the container and the limits are applied again.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::process::{Child, Command};

use super::pod::READY_FILE;
use super::shm::is_tmpfs;
use super::{reports_error, CONTROL_SOCKET, PID_FILE, SHM_MARKER};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const QUIT_WAIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);
/// `--program` for the fake backend's stand-in (`gpu-dra fake mps-control-daemon`), which only a build
/// with the `doubles` feature has.
pub const STAND_IN_PROGRAM: &str = "stand-in";
/// The environment variable that tells the stand-in where its `/dev/shm` is (the real daemon always
/// uses `/dev/shm`; the stand-in may run where nothing is mounted there, in the test doubles).
pub const STAND_IN_SHM_ENV: &str = "GPU_DRA_FAKE_MPS_SHM";

/// Why MPS on the fake backend fails in the node binary.
pub const NO_STAND_IN: &str = "MPS on the fake backend runs a stand-in for NVIDIA's control daemon, which this build leaves out (only a build with `--features doubles` has it); the node binary runs MPS on real GPUs only";

/// What the Pod's arguments say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisorArgs {
    pub claim: String,
    /// As the daemon sees them (inside the driver root after a chroot).
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    /// As the supervisor sees it, before any chroot.
    pub shm_dir: PathBuf,
    /// Chroot here before starting the daemon.
    pub driver_root: Option<PathBuf>,
    /// The control program's path (inside the root after a chroot), or `stand-in`.
    pub program: String,
    pub library_path: Option<PathBuf>,
    /// Control commands that apply the claim's limits, in order.
    pub commands: Vec<String>,
    /// Start the daemon in multi-user mode: it serves clients of different user ids at once.
    pub multi_user: bool,
}

#[derive(Debug, Error)]
pub enum SupervisorError {
    #[error("MPS daemon of claim {claim}: {} is not a tmpfs: the MPS server and the claim's containers must share one tmpfs at /dev/shm; the Pod must mount the claim's shm directory there", dir.display())]
    SharedMemoryNotTmpfs { claim: String, dir: PathBuf },
    #[error("MPS daemon of claim {claim}: {action} {}: {source}", path.display())]
    Io {
        claim: String,
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("MPS daemon of claim {claim}: entering the driver root {}: {source}", root.display())]
    Chroot {
        claim: String,
        root: PathBuf,
        source: nix::Error,
    },
    #[error("MPS daemon of claim {claim}: {detail}")]
    Daemon { claim: String, detail: String },
}

impl SupervisorArgs {
    fn io(
        &self,
        action: &'static str,
        path: &Path,
    ) -> impl FnOnce(std::io::Error) -> SupervisorError {
        let (claim, path) = (self.claim.clone(), path.to_path_buf());
        move |source| SupervisorError::Io {
            claim,
            action,
            path,
            source,
        }
    }

    fn failed(&self, detail: String) -> SupervisorError {
        SupervisorError::Daemon {
            claim: self.claim.clone(),
            detail,
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = if cfg!(feature = "doubles") && self.program == STAND_IN_PROGRAM {
            // Never after a chroot: the stand-in mode runs without one.
            let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
            let mut command = Command::new(exe);
            command.args(["fake", "mps-control-daemon"]);
            command.env(STAND_IN_SHM_ENV, &self.shm_dir);
            command
        } else {
            let mut command = Command::new(&self.program);
            if let Some(dir) = &self.library_path {
                command.env("LD_LIBRARY_PATH", dir);
            }
            // The daemon starts nvidia-cuda-mps-server, which the driver installs beside it.
            if let Some(dir) = Path::new(&self.program).parent() {
                command.env(
                    "PATH",
                    format!("{}:/usr/bin:/bin:/usr/sbin:/sbin", dir.display()),
                );
            }
            command
        };
        command
            .args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir);
        command
    }

    fn ready_file(&self) -> PathBuf {
        self.log_dir.join(READY_FILE)
    }
}

/// Runs the supervisor; returns the exit code.
pub async fn supervise(args: SupervisorArgs) -> Result<i32, SupervisorError> {
    use tokio::signal::unix::{signal, SignalKind};
    if args.program == STAND_IN_PROGRAM && !cfg!(feature = "doubles") {
        return Err(args.failed(NO_STAND_IN.to_string()));
    }
    if !is_tmpfs(&args.shm_dir) {
        return Err(SupervisorError::SharedMemoryNotTmpfs {
            claim: args.claim.clone(),
            dir: args.shm_dir.clone(),
        });
    }
    // Found by the plugin in the claim's tmpfs: proof that this is the memory the clients get.
    let marker = args.shm_dir.join(SHM_MARKER);
    fs::write(&marker, format!("{}\n", args.claim)).map_err(args.io("writing", &marker))?;
    if let Some(root) = &args.driver_root {
        // The driver's binaries then load the driver root's own libc with its own loader.
        nix::unistd::chroot(root.as_path())
            .and_then(|()| nix::unistd::chdir("/"))
            .map_err(|source| SupervisorError::Chroot {
                claim: args.claim.clone(),
                root: root.clone(),
                source,
            })?;
    }
    let mut term =
        signal(SignalKind::terminate()).map_err(args.io("handling SIGTERM in", Path::new("/")))?;
    clear_pipe_dir(&args)?;
    let _ = fs::remove_file(args.ready_file());
    let mut daemon = args
        .command(if args.multi_user {
            &["-f", "-M"]
        } else {
            &["-f"]
        })
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(args.io("starting", Path::new(&args.program)))?;
    tracing::info!(claim = %args.claim, pid = daemon.id(), program = %args.program, "MPS control daemon started");
    if let Err(error) = wait_ready(&args, &mut daemon).await {
        stop(&args, &mut daemon).await;
        return Err(error);
    }
    for command in &args.commands {
        if let Err(detail) = control(&args, command).await {
            stop(&args, &mut daemon).await;
            return Err(args.failed(format!("{command}: {detail}")));
        }
    }
    let pid = daemon.id().unwrap_or_default();
    fs::write(args.ready_file(), format!("{pid}\n"))
        .map_err(args.io("writing", &args.ready_file()))?;
    tracing::info!(claim = %args.claim, "MPS control daemon ready");
    tokio::select! {
        _ = term.recv() => {
            let _ = fs::remove_file(args.ready_file());
            tracing::info!(claim = %args.claim, "SIGTERM: stopping the MPS control daemon");
            stop(&args, &mut daemon).await;
            Ok(0)
        }
        status = daemon.wait() => {
            let _ = fs::remove_file(args.ready_file());
            let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
            tracing::error!(claim = %args.claim, %status, "MPS control daemon exited; the kubelet starts it again");
            Ok(1)
        }
    }
}

/// The readiness probe: the ready file exists.
pub fn check_ready(ready_file: &Path) -> i32 {
    i32::from(!ready_file.is_file())
}

/// A restarted container finds the last daemon's pid file and sockets: they name a process that is
/// gone with the old container.
fn clear_pipe_dir(args: &SupervisorArgs) -> Result<(), SupervisorError> {
    for name in [PID_FILE, CONTROL_SOCKET] {
        let path = args.pipe_dir.join(name);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(args.io("removing", &path)(e))
            }
            _ => {}
        }
    }
    Ok(())
}

async fn wait_ready(args: &SupervisorArgs, daemon: &mut Child) -> Result<(), SupervisorError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(Some(status)) = daemon.try_wait() {
            return Err(args.failed(format!(
                "the control daemon exited while starting: {status}"
            )));
        }
        let last = match control(args, "get_default_active_thread_percentage").await {
            Ok(_) => return Ok(()),
            Err(detail) => detail,
        };
        if Instant::now() >= deadline {
            return Err(args.failed(format!("not answering within {READY_TIMEOUT:?}: {last}")));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Runs the control program as a client with `command` on its stdin; its answer.
async fn control(args: &SupervisorArgs, command: &str) -> Result<String, String> {
    use tokio::io::AsyncWriteExt;
    let mut client = args
        .command(&[])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("running {}: {e}", args.program))?;
    if let Some(mut stdin) = client.stdin.take() {
        // A client that exits early closes the pipe; its status says why.
        let _ = stdin.write_all(format!("{command}\n").as_bytes()).await;
    }
    let output = tokio::time::timeout(COMMAND_TIMEOUT, client.wait_with_output())
        .await
        .map_err(|_| format!("no answer within {COMMAND_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    let answer = String::from_utf8_lossy(&output.stdout).trim().to_string();
    let said = format!(
        "{answer} {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    if !output.status.success() {
        return Err(format!("{}: {}", output.status, said.trim()));
    }
    if reports_error(&answer) {
        return Err(said.trim().to_string());
    }
    Ok(answer)
}

/// `quit`, then SIGKILL if the daemon is still there after a while.
async fn stop(args: &SupervisorArgs, daemon: &mut Child) {
    if let Err(detail) = control(args, "quit").await {
        tracing::warn!(claim = %args.claim, %detail, "the MPS control daemon did not take quit");
    }
    if tokio::time::timeout(QUIT_WAIT, daemon.wait())
        .await
        .is_err()
    {
        tracing::warn!(claim = %args.claim, "the MPS control daemon still runs after quit; killing it");
        let _ = daemon.kill().await;
    }
}
