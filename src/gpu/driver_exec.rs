//! Runs the driver's own programs (`nvidia-smi`, `nvidia-cuda-mps-control`) as NVIDIA's tooling does:
//! inside the driver root (`chroot <root> /usr/bin/nvidia-smi ...`), so that they load the root's own
//! loader and libc. Started from this container instead, with the root's library directory on
//! `LD_LIBRARY_PATH`, this container's loader would load the host's `libc.so.6` from there and fail
//! (`GLIBC_PRIVATE`) on most hosts. Only a root that cannot run its own programs (no loader or shell
//! for them, as on GKE's Container-Optimized OS) gets them started from outside, and only when its
//! library directory holds no libc.
//!
//! ```no_run
//! # use std::path::Path;
//! let smi = gpu_dra::gpu::DriverCommand::find(Path::new("/driver-root"), "nvidia-smi")?;
//! let status = smi.command().arg("-L").status()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::nvml_support::library_candidates;

/// Where drivers and driver containers install their programs, below the driver root.
pub(super) const BINARY_DIRS: [&str; 6] = [
    "usr/bin",
    "usr/local/bin",
    "usr/local/nvidia/bin",
    "bin",
    "usr/sbin",
    "sbin",
];

/// Where this container's `chroot` program may be (coreutils; Debian puts it in /usr/sbin).
const CHROOT_PROGRAMS: [&str; 4] = [
    "/usr/sbin/chroot",
    "/usr/bin/chroot",
    "/sbin/chroot",
    "/bin/chroot",
];

/// A script's interpreter may itself be a script; the kernel stops after 4 levels.
const MAX_INTERPRETERS: usize = 4;

/// The ELF program header type that names the loader.
const PT_INTERP: u32 = 3;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverExecError {
    #[error("{name} not found under the driver root {} (looked in {searched})", root.display())]
    NotFound {
        root: PathBuf,
        name: String,
        searched: String,
    },
    #[error("{} cannot be run: {reason}", binary.display())]
    NotExecutable { binary: PathBuf, reason: String },
    #[error(
        "{} cannot be run: the driver root {} has no {} for it, so it cannot run inside the root, \
         and started from this container it would load the root's {} with this container's loader \
         (GLIBC_PRIVATE errors); install the driver's programs with their loader in the driver root",
        binary.display(), root.display(), interpreter.display(), libc.display()
    )]
    WouldLoadRootLibc {
        root: PathBuf,
        binary: PathBuf,
        interpreter: PathBuf,
        libc: PathBuf,
    },
    #[error(
        "{} must run inside the driver root {}, but this container has no chroot program (looked for {})",
        binary.display(), root.display(), CHROOT_PROGRAMS.join(", ")
    )]
    NoChroot { root: PathBuf, binary: PathBuf },
}

/// How a driver program is started.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Launch {
    /// The driver root is `/`: this container is the host, nothing to do.
    Direct,
    /// `chroot <root> <path in root>`: the program sees the root as `/`.
    InRoot { chroot: PathBuf },
    /// From this container, with the root's library directory (which holds no libc) on
    /// `LD_LIBRARY_PATH`.
    Outside { library_dir: Option<PathBuf> },
    /// It cannot be run; started inside the root all the same, where it fails without loading the
    /// wrong libc, and `reason` goes into every message about it.
    Refused { chroot: PathBuf, reason: String },
}

/// One program of one driver root, and how to start it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverCommand {
    /// The driver root as this process sees it.
    root: PathBuf,
    /// The program's path inside the root (`/usr/bin/nvidia-smi`), symlinks resolved.
    in_root: PathBuf,
    launch: Launch,
}

impl DriverCommand {
    /// Finds program `name` under `driver_root` (the path this process sees the root at) and decides
    /// how to start it. Symlinks are followed as the host would follow them: an absolute target is
    /// taken below the driver root.
    pub fn find(driver_root: &Path, name: &str) -> Result<Self, DriverExecError> {
        let located = locate(driver_root, name)?;
        let launch = if driver_root == Path::new("/") {
            Launch::Direct
        } else if located.runs_inside_root {
            Launch::InRoot {
                chroot: chroot_program().ok_or_else(|| DriverExecError::NoChroot {
                    root: driver_root.to_path_buf(),
                    binary: driver_root.join(
                        located
                            .in_root
                            .strip_prefix("/")
                            .unwrap_or(&located.in_root),
                    ),
                })?,
            }
        } else {
            Launch::Outside {
                library_dir: located.library_dir,
            }
        };
        Ok(Self {
            root: driver_root.to_path_buf(),
            in_root: located.in_root,
            launch,
        })
    }

    /// Program `name` of `driver_root`, which [`find`](Self::find) refused with `error`, for a
    /// program set up once at start and used later: [`describe`](Self::describe) says why it cannot
    /// run, and the command starts it inside the root at its usual place, where it fails without
    /// loading the root's libc.
    pub fn refused(driver_root: &Path, name: &str, error: &DriverExecError) -> Self {
        Self {
            root: driver_root.to_path_buf(),
            in_root: Path::new("/usr/bin").join(name),
            launch: Launch::Refused {
                chroot: chroot_program().unwrap_or_else(|| PathBuf::from(CHROOT_PROGRAMS[0])),
                reason: error.to_string(),
            },
        }
    }

    /// A command that starts the program, without arguments; the caller adds them, its environment
    /// and its stdio. `PATH` gets the program's own directory first, so that it finds the programs
    /// installed beside it (`nvidia-cuda-mps-control` starts `nvidia-cuda-mps-server`).
    pub fn command(&self) -> Command {
        let mut command = match &self.launch {
            Launch::Direct => Command::new(&self.in_root),
            Launch::InRoot { chroot } | Launch::Refused { chroot, .. } => {
                let mut command = Command::new(chroot);
                command.arg(&self.root).arg(&self.in_root);
                // This container's library settings name files of this container, not the root's.
                command
                    .env_remove("LD_LIBRARY_PATH")
                    .env_remove("LD_PRELOAD");
                command
            }
            Launch::Outside { library_dir } => {
                let mut command = Command::new(self.seen_path());
                if let Some(dir) = library_dir {
                    command.env("LD_LIBRARY_PATH", prepend(dir, "LD_LIBRARY_PATH"));
                }
                command
            }
        };
        if let Some(dir) = self.path_seen_by_program(&self.seen_path()) {
            if let Some(dir) = dir.parent() {
                command.env("PATH", prepend(dir, "PATH"));
            }
        }
        // chroot(1) changes to `/` itself; the others start at `/` as well, never in a directory of
        // this container that the program might write to.
        command.current_dir("/");
        command
    }

    /// How the program is started, for messages: `chroot /driver-root /usr/bin/nvidia-smi`, or its
    /// path as this process sees it, with why it cannot run where that is so.
    pub fn describe(&self) -> String {
        match &self.launch {
            Launch::Direct => self.in_root.display().to_string(),
            Launch::InRoot { chroot } => format!(
                "{} {} {}",
                chroot.display(),
                self.root.display(),
                self.in_root.display()
            ),
            Launch::Outside { .. } => self.seen_path().display().to_string(),
            Launch::Refused { reason, .. } => reason.clone(),
        }
    }

    /// Whether the program sees the driver root as `/`: paths given to it (in arguments or the
    /// environment) must then be paths inside the root ([`path_seen_by_program`]).
    ///
    /// [`path_seen_by_program`]: Self::path_seen_by_program
    pub fn runs_inside_root(&self) -> bool {
        matches!(
            self.launch,
            Launch::Direct | Launch::InRoot { .. } | Launch::Refused { .. }
        )
    }

    /// Where the program sees `path` (a path of this process): below the root it is the path inside
    /// the root; `None` when the program cannot see it at all (outside the root, for a program that
    /// runs inside it).
    pub fn path_seen_by_program(&self, path: &Path) -> Option<PathBuf> {
        if !self.runs_inside_root() || self.root == Path::new("/") {
            return Some(path.to_path_buf());
        }
        path.strip_prefix(&self.root)
            .ok()
            .map(|rest| Path::new("/").join(rest))
    }

    /// The program's path as this process sees it.
    fn seen_path(&self) -> PathBuf {
        self.root
            .join(self.in_root.strip_prefix("/").unwrap_or(&self.in_root))
    }
}

/// Where a driver program is and how it can run, whoever starts it (this process through chroot(1),
/// or the MPS daemon's supervisor, which enters the root itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The program's path inside the root (`/usr/bin/nvidia-smi`), symlinks resolved.
    pub in_root: PathBuf,
    /// Whether the root has the program's loader, so that it can run inside the root.
    pub runs_inside_root: bool,
    /// For a program that cannot run inside the root: the root's library directory (which holds no
    /// libc), as this process sees it.
    pub library_dir: Option<PathBuf>,
}

/// Finds program `name` under `driver_root` (the path this process sees the root at). Symlinks are
/// followed as the host would follow them: an absolute target is taken below the driver root. A
/// program whose loader the root lacks can only run from outside, and is refused where the root's
/// library directory holds a libc that the outside loader would load.
pub fn locate(driver_root: &Path, name: &str) -> Result<Located, DriverExecError> {
    let seen = BINARY_DIRS
        .iter()
        .find_map(|dir| resolve_in_root(driver_root, &Path::new(dir).join(name)))
        .ok_or_else(|| DriverExecError::NotFound {
            root: driver_root.to_path_buf(),
            name: name.to_string(),
            searched: BINARY_DIRS.map(|d| format!("/{d}")).join(", "),
        })?;
    let in_root = inside(driver_root, &seen);
    if driver_root == Path::new("/") {
        return Ok(Located {
            in_root,
            runs_inside_root: true,
            library_dir: None,
        });
    }
    match missing_interpreter(driver_root, &seen)? {
        None => Ok(Located {
            in_root,
            runs_inside_root: true,
            library_dir: None,
        }),
        Some(interpreter) => {
            let library_dir = library_dir(driver_root);
            if let Some(libc) = library_dir
                .as_ref()
                .map(|dir| dir.join("libc.so.6"))
                .filter(|libc| libc.exists())
            {
                return Err(DriverExecError::WouldLoadRootLibc {
                    root: driver_root.to_path_buf(),
                    binary: seen,
                    interpreter,
                    libc,
                });
            }
            Ok(Located {
                in_root,
                runs_inside_root: false,
                library_dir,
            })
        }
    }
}

/// `value` first, then the inherited value of `variable`, `:`-separated.
fn prepend(value: &Path, variable: &str) -> std::ffi::OsString {
    let mut joined = value.as_os_str().to_owned();
    if let Some(inherited) = std::env::var_os(variable).filter(|v| !v.is_empty()) {
        joined.push(":");
        joined.push(inherited);
    }
    joined
}

/// `seen` (below `root`) as a path inside the root.
fn inside(root: &Path, seen: &Path) -> PathBuf {
    Path::new("/").join(seen.strip_prefix(root).unwrap_or(seen))
}

/// The directory holding the root's libnvidia-ml, as this process sees it; `None` for the root `/`.
fn library_dir(driver_root: &Path) -> Option<PathBuf> {
    if driver_root == Path::new("/") {
        return None;
    }
    library_candidates(driver_root)
        .into_iter()
        .find(|lib| lib.exists())
        .and_then(|lib| lib.parent().map(Path::to_path_buf))
}

fn chroot_program() -> Option<PathBuf> {
    CHROOT_PROGRAMS
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
}

/// `relative` below `root`, resolved as the root's own programs would see it: every symlink on the way,
/// absolute targets taken below the root and `..` held at it (pathrs: `openat2(RESOLVE_IN_ROOT)`, or its
/// own safe emulation on kernels before 5.6). The path is `root` joined with where it ends inside the
/// root; `None` unless that is a regular file.
pub(super) fn resolve_in_root(root: &Path, relative: &Path) -> Option<PathBuf> {
    use std::os::fd::{AsFd, AsRawFd};
    let handle = pathrs::Root::open(root).ok()?.resolve(relative).ok()?;
    // Where the handle ends, as this process sees it; below the root's own canonical path.
    let reached =
        std::fs::read_link(format!("/proc/self/fd/{}", handle.as_fd().as_raw_fd())).ok()?;
    let inside = reached
        .strip_prefix(std::fs::canonicalize(root).ok()?)
        .ok()?
        .to_path_buf();
    let path = root.join(inside);
    std::fs::metadata(&path)
        .is_ok_and(|meta| meta.is_file())
        .then_some(path)
}

/// The first interpreter on `binary`'s chain (its ELF loader, or a script's `#!` program, and so on)
/// that the root lacks, as a path inside the root; `None` when the root can run it (a static
/// program needs none).
fn missing_interpreter(root: &Path, binary: &Path) -> Result<Option<PathBuf>, DriverExecError> {
    let mut current = binary.to_path_buf();
    for _ in 0..MAX_INTERPRETERS {
        let interpreter =
            interpreter_of(&current).map_err(|reason| DriverExecError::NotExecutable {
                binary: current.clone(),
                reason,
            })?;
        let Some(interpreter) = interpreter else {
            return Ok(None);
        };
        match resolve_in_root(root, &interpreter) {
            Some(found) => current = found,
            None => return Ok(Some(interpreter)),
        }
    }
    Err(DriverExecError::NotExecutable {
        binary: binary.to_path_buf(),
        reason: format!("more than {MAX_INTERPRETERS} interpreters in a row"),
    })
}

/// The program the kernel starts to run `path`: the ELF loader (`PT_INTERP`) or the `#!` line's
/// program; `None` for a static ELF program.
pub fn interpreter_of(path: &Path) -> Result<Option<PathBuf>, String> {
    let mut file = File::open(path).map_err(|e| format!("opening it: {e}"))?;
    let mut head = [0u8; 256];
    let mut len = 0;
    while len < head.len() {
        match file.read(&mut head[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading it: {e}")),
        }
    }
    let head = &head[..len];
    if let Some(line) = head.strip_prefix(b"#!") {
        let line = line.split(|b| *b == b'\n').next().unwrap_or_default();
        let program = String::from_utf8_lossy(line)
            .split_whitespace()
            .next()
            .map(PathBuf::from)
            .ok_or("its #! line names no interpreter")?;
        return Ok(Some(program));
    }
    if head.starts_with(b"\x7fELF") {
        return elf_interpreter(&file, head).map_err(|e| format!("not a readable ELF file: {e}"));
    }
    Err("neither an ELF program nor a #! script".to_string())
}

/// The `PT_INTERP` path of an ELF file whose first bytes are `head`.
fn elf_interpreter(file: &File, head: &[u8]) -> Result<Option<PathBuf>, String> {
    let wide = match head.get(4) {
        Some(1) => false,
        Some(2) => true,
        _ => return Err("unknown ELF class".into()),
    };
    let little = match head.get(5) {
        Some(1) => true,
        Some(2) => false,
        _ => return Err("unknown byte order".into()),
    };
    let field = |bytes: &[u8], at: usize, size: usize| -> Result<u64, String> {
        let raw = bytes.get(at..at + size).ok_or("truncated header")?;
        let push = |value: u64, byte: &u8| (value << 8) | u64::from(*byte);
        Ok(if little {
            raw.iter().rev().fold(0, push)
        } else {
            raw.iter().fold(0, push)
        })
    };
    // e_phoff, e_phentsize, e_phnum; then per entry p_type, p_offset, p_filesz.
    let (phoff, phentsize, phnum) = if wide {
        (
            field(head, 0x20, 8)?,
            field(head, 0x36, 2)?,
            field(head, 0x38, 2)?,
        )
    } else {
        (
            field(head, 0x1c, 4)?,
            field(head, 0x2a, 2)?,
            field(head, 0x2c, 2)?,
        )
    };
    let (offset_at, size_at, word) = if wide { (8, 32, 8) } else { (4, 16, 4) };
    if phentsize < (size_at + word) as u64 {
        return Err(format!("program header entries of {phentsize} bytes"));
    }
    let mut entry = vec![0u8; phentsize as usize];
    for index in 0..phnum {
        let at = phoff
            .checked_add(index * phentsize)
            .ok_or("program headers beyond any file's end")?;
        file.read_exact_at(&mut entry, at)
            .map_err(|e| format!("program header {index}: {e}"))?;
        if field(&entry, 0, 4)? != u64::from(PT_INTERP) {
            continue;
        }
        let (offset, size) = (
            field(&entry, offset_at, word)?,
            field(&entry, size_at, word)?,
        );
        if size == 0 || size > 4096 {
            return Err(format!("a loader path of {size} bytes"));
        }
        let mut path = vec![0u8; size as usize];
        file.read_exact_at(&mut path, offset)
            .map_err(|e| format!("the loader path: {e}"))?;
        let end = path.iter().position(|b| *b == 0).unwrap_or(path.len());
        return Ok(Some(PathBuf::from(
            String::from_utf8_lossy(&path[..end]).into_owned(),
        )));
    }
    Ok(None)
}

#[cfg(test)]
#[path = "driver_exec_tests.rs"]
mod tests;
