//! What the daemons' supervisors (`gpu-dra mps-daemon`, `gpu-dra imex-daemon`) share: entering the
//! driver root, starting a driver program (inside the root, directly with the root's libraries, or
//! this binary's stand-in for it), and the ready file that the Pod's readiness probe reads.

use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;
use tokio::process::Command;

use crate::fsutil::write_for_this_boot;

/// The program path that means the fake backend's stand-in (a `gpu-dra fake` command), which only a
/// build with the `doubles` feature has.
pub const STAND_IN_PROGRAM: &str = "stand-in";

/// Whether `program` names the stand-in and this build has it.
pub fn runs_stand_in(program: &str) -> bool {
    cfg!(feature = "doubles") && program == STAND_IN_PROGRAM
}

/// Why a supervisor gave up; `daemon` names it (`MPS daemon of claim <uid>`, `IMEX daemon in <dir>`).
#[derive(Debug, Error)]
pub enum SupervisorError {
    #[error("{daemon}: {action} {}: {source}", path.display())]
    Io {
        daemon: String,
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{daemon}: entering the driver root {}: {source}", root.display())]
    Chroot {
        daemon: String,
        root: PathBuf,
        source: nix::Error,
    },
    #[error("{daemon}: {detail}")]
    Daemon { daemon: String, detail: String },
}

/// A supervisor's arguments, which name its daemon in its errors.
pub trait Supervised {
    /// `MPS daemon of claim <uid>`, `IMEX daemon in <dir>`.
    fn daemon(&self) -> String;

    /// An I/O error's cause: `action` on `path`.
    fn io(&self, action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SupervisorError {
        let (daemon, path) = (self.daemon(), path.to_path_buf());
        move |source| SupervisorError::Io {
            daemon,
            action,
            path,
            source,
        }
    }

    fn failed(&self, detail: String) -> SupervisorError {
        SupervisorError::Daemon {
            daemon: self.daemon(),
            detail,
        }
    }

    /// Enters the driver root (chroot), so that the driver's binaries load the root's own libc with
    /// the root's own loader.
    fn enter_driver_root(&self, root: &Path) -> Result<(), SupervisorError> {
        nix::unistd::chroot(root)
            .and_then(|()| nix::unistd::chdir("/"))
            .map_err(|source| SupervisorError::Chroot {
                daemon: self.daemon(),
                root: root.to_path_buf(),
                source,
            })
    }
}

/// A command that runs `program`: its path (inside the driver root after a chroot), with the root's
/// library directory where the Pod runs it directly; where `program` is the stand-in, this binary's
/// `gpu-dra fake <stand_in>` (never after a chroot: the stand-in runs without one).
pub fn program_command(program: &str, library_path: Option<&Path>, stand_in: &str) -> Command {
    if runs_stand_in(program) {
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
        let mut command = Command::new(exe);
        command.args(["fake", stand_in]);
        return command;
    }
    let mut command = Command::new(program);
    if let Some(dir) = library_path {
        command.env("LD_LIBRARY_PATH", dir);
    }
    command
}

/// The readiness probe: exit 0 when the ready file exists, 1 otherwise.
pub fn check_ready(ready_file: &Path) -> i32 {
    i32::from(!ready_file.is_file())
}

/// The file the supervisor keeps while its daemon answers; the Pod's readiness probe reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyFile {
    path: PathBuf,
}

impl ReadyFile {
    pub fn new(path: PathBuf) -> Self {
        ReadyFile { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn exists(&self) -> bool {
        self.path.is_file()
    }

    /// Ready: the file, naming `pid`, replaces any other at once (a probe never reads half of it).
    pub fn mark(&self, pid: u32) -> io::Result<()> {
        write_for_this_boot(&self.path, format!("{pid}\n").as_bytes(), 0o644)
    }

    /// Not ready (starting, stopping, or the daemon is gone). A file already gone is fine.
    pub fn clear(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_follows_the_ready_file() {
        let dir = tempfile::tempdir().unwrap();
        let ready = ReadyFile::new(dir.path().join("ready"));
        assert_eq!(check_ready(ready.path()), 1);
        ready.mark(42).unwrap();
        assert_eq!(check_ready(ready.path()), 0);
        assert_eq!(std::fs::read_to_string(ready.path()).unwrap(), "42\n");
        ready.clear();
        ready.clear();
        assert!(!ready.exists());
    }
}
