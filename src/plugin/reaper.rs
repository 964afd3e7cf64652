//! Reaping orphans where the plugin is PID 1 of its container. A process whose parent dies (an MPS
//! server whose control daemon died, anything a daemon leaves) is handed to PID 1, or to the nearest
//! child subreaper, and stays a zombie until that process waits for it.
//!
//! A reaper that waited for every child inside the plugin's own process would take the exit status
//! of the children the plugin waits for itself through `std::process` (nvidia-smi, the MPS control
//! program, a kubeconfig's credential plugin in a library): their wait would fail with ECHILD. So,
//! as tini does, the plugin splits in two where it adopts orphans: this first process only forwards
//! signals and waits for any child; the plugin runs as its only child. The plugin's own children
//! are the plugin's, never this process's, so waiting for any child here cannot take their status;
//! orphans come here and are reaped.
//!
//! ```no_run
//! if gpu_dra::plugin::reaper::adopts_orphans() {
//!     std::process::exit(gpu_dra::plugin::reaper::supervise_this_program().unwrap());
//! }
//! ```

use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::errno::Errno;
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{getpid, Pid};
use thiserror::Error;
use tracing::{debug, info};

/// Signals passed on to the plugin: the ones it handles (the kubelet stops a container with
/// SIGTERM). Others keep what they did to the plugin as PID 1, nothing: the kernel drops signals a
/// PID 1 has no handler for.
const FORWARDED: [Signal; 2] = [Signal::SIGTERM, Signal::SIGINT];

#[derive(Debug, Error)]
pub enum ReaperError {
    #[error("finding this program to run the plugin under the reaper: {0}")]
    Program(std::io::Error),
    #[error("starting the plugin under the reaper: {0}")]
    Spawn(std::io::Error),
    #[error("blocking the signals the reaper forwards: {0}")]
    Signals(Errno),
    #[error("waiting for the reaper's children: {0}")]
    Wait(Errno),
}

/// Whether orphaned processes are handed to this one: PID 1 of its PID namespace (the plugin's
/// container), or a child subreaper (`PR_SET_CHILD_SUBREAPER`, kept across `execve`).
pub fn adopts_orphans() -> bool {
    getpid().as_raw() == 1 || nix::sys::prctl::get_child_subreaper().unwrap_or(false)
}

/// Unblocks the signals the reaper forwards, in the program it runs: a child inherits its parent's
/// signal mask, and one started by [`supervise`] would otherwise never see the kubelet's SIGTERM.
/// Called first thing, before any thread exists (threads inherit the mask of their creator).
pub fn unblock_forwarded_signals() -> Result<(), ReaperError> {
    let mut forwarded = SigSet::empty();
    for signal in FORWARDED {
        forwarded.add(signal);
    }
    forwarded.thread_unblock().map_err(ReaperError::Signals)
}

/// Runs this program again, with the same arguments, as the child of [`supervise`]. The child is
/// neither PID 1 nor a subreaper (that attribute is not inherited across `fork`), so it runs the
/// plugin itself.
pub fn supervise_this_program() -> Result<i32, ReaperError> {
    let exe = std::env::current_exe().map_err(ReaperError::Program)?;
    let mut args = std::env::args_os();
    let mut program = Command::new(exe);
    if let Some(arg0) = args.next() {
        program.arg0(arg0);
    }
    program.args(args);
    supervise(program)
}

/// Starts `program` and waits for any child until it ends, reaping orphans meanwhile, and passes on
/// SIGTERM and SIGINT to it. Returns the exit code to end with:
/// the program's, or 128 plus the signal that killed it, as a shell reports it.
pub fn supervise(mut program: Command) -> Result<i32, ReaperError> {
    let mut forwarded = SigSet::empty();
    for signal in FORWARDED {
        forwarded.add(signal);
    }
    // Blocked before the child exists, so a SIGTERM that comes first waits for it. The child inherits
    // the mask (std::process keeps it) and unblocks them itself: [`unblock_forwarded_signals`].
    forwarded.thread_block().map_err(ReaperError::Signals)?;
    let child = program.spawn().map_err(ReaperError::Spawn)?;
    // A pid always fits in i32 (pid_max is at most 2^22).
    let plugin = Pid::from_raw(child.id() as i32);
    info!(pid = plugin.as_raw(), "adopting orphaned processes (PID 1 of the container, or a subreaper): the plugin runs as a child of this reaper");
    // Threads start with the mask of the thread that makes them: this one takes the blocked signals.
    std::thread::spawn(move || loop {
        if let Ok(signal) = forwarded.wait() {
            let _ = kill(plugin, signal);
        }
    });
    // Never waited for through `child` (the loop below waits for it); dropping it neither waits nor kills.
    drop(child);
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == plugin => return Ok(code),
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == plugin => {
                return Ok(128 + signal as i32)
            }
            Ok(status) => {
                debug!(pid = ?status.pid().map(Pid::as_raw), ?status, "orphaned process reaped")
            }
            Err(Errno::EINTR) => continue,
            Err(error) => return Err(ReaperError::Wait(error)),
        }
    }
}
