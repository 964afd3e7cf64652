//! `gpu-dra mps-daemon`: PID 1 of a claim's MPS daemon Pod (`pod.rs`). It checks that the claim's
//! shared memory is a tmpfs, enters the driver root (chroot) where the Pod says so, runs the control
//! daemon in the foreground (`nvidia-cuda-mps-control -f`, or the fake backend's stand-in), applies the
//! claim's limits once it answers and writes the ready file that the Pod's readiness probe reads (the
//! steps every daemon's supervisor shares are `claims::daemon_pod::supervisor`'s).
//! SIGTERM (the Pod is deleted) is passed on as `quit`; a daemon that dies ends the supervisor with
//! status 1, so the kubelet restarts the container and the limits are applied again.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use super::pod::READY_FILE;
use super::shm::is_tmpfs;
use super::{reports_error, CONTROL_SOCKET, PID_FILE, SHM_MARKER};
pub use crate::claims::daemon_pod::supervisor::{check_ready, SupervisorError, STAND_IN_PROGRAM};
use crate::claims::daemon_pod::supervisor::{program_command, ReadyFile, Supervised};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const QUIT_WAIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);
/// The control daemon's option for multi-user mode: one MPS server, root's, serves the clients of
/// every user id. NVIDIA documents it as `-multiuser-server` ("Multi-Process Service",
/// Architecture, Provisioning Sequence, Server: "To allow multiple Linux users share one MPS server,
/// start the control daemon under superuser with the -multiuser-server option",
/// https://docs.nvidia.com/deploy/mps/architecture.html#server). NVIDIA's DRA driver passes `-M`,
/// which no NVIDIA document names; gpu-dra passes the documented option.
pub const MULTI_USER_OPTION: &str = "-multiuser-server";
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

impl Supervised for SupervisorArgs {
    fn daemon(&self) -> String {
        format!("MPS daemon of claim {}", self.claim)
    }
}

impl SupervisorArgs {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = program_command(
            &self.program,
            self.library_path.as_deref(),
            "mps-control-daemon",
        );
        if self.program == STAND_IN_PROGRAM {
            command.env(STAND_IN_SHM_ENV, &self.shm_dir);
        } else if let Some(dir) = Path::new(&self.program).parent() {
            // The daemon starts nvidia-cuda-mps-server, which the driver installs beside it.
            command.env(
                "PATH",
                format!("{}:/usr/bin:/bin:/usr/sbin:/sbin", dir.display()),
            );
        }
        command
            .args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir);
        command
    }

    fn ready_file(&self) -> ReadyFile {
        ReadyFile::new(self.log_dir.join(READY_FILE))
    }
}

/// Runs the supervisor; returns the exit code.
pub async fn supervise(args: SupervisorArgs) -> Result<i32, SupervisorError> {
    use tokio::signal::unix::{signal, SignalKind};
    if args.program == STAND_IN_PROGRAM && !cfg!(feature = "doubles") {
        return Err(args.failed(NO_STAND_IN.to_string()));
    }
    if !is_tmpfs(&args.shm_dir) {
        return Err(args.failed(format!(
            "{} is not a tmpfs: the MPS server and the claim's containers must share one tmpfs at /dev/shm; the Pod must mount the claim's shm directory there",
            args.shm_dir.display()
        )));
    }
    // Found by the plugin in the claim's tmpfs: proof that this is the memory the clients get.
    let marker = args.shm_dir.join(SHM_MARKER);
    fs::write(&marker, format!("{}\n", args.claim)).map_err(args.io("writing", &marker))?;
    if let Some(root) = &args.driver_root {
        args.enter_driver_root(root)?;
    }
    let mut term =
        signal(SignalKind::terminate()).map_err(args.io("handling SIGTERM in", Path::new("/")))?;
    clear_pipe_dir(&args)?;
    let ready = args.ready_file();
    ready.clear();
    let mut daemon = args
        .command(if args.multi_user {
            &["-f", MULTI_USER_OPTION]
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
    ready
        .mark(daemon.id().unwrap_or_default())
        .map_err(args.io("writing", ready.path()))?;
    tracing::info!(claim = %args.claim, "MPS control daemon ready");
    tokio::select! {
        _ = term.recv() => {
            ready.clear();
            tracing::info!(claim = %args.claim, "SIGTERM: stopping the MPS control daemon");
            stop(&args, &mut daemon).await;
            Ok(0)
        }
        status = daemon.wait() => {
            ready.clear();
            let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
            tracing::error!(claim = %args.claim, %status, "MPS control daemon exited; the kubelet starts it again");
            Ok(1)
        }
    }
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
