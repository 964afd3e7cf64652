//! Runs the driver's `nvidia-smi` for the settings NVML has no public call for: today the time-slice
//! interval (`nvidia-smi compute-policy -i <uuid> --set-timeslice <n>`). The binary is the one under
//! the driver root as this process sees it, run with that root's library directory on the loader's
//! path, under a timeout; failures name the command, its exit status and what it printed.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::nvml_support::library_candidates;
use super::TimeSliceInterval;

/// How long one `nvidia-smi` call may take before it is killed. It normally answers in well under a
/// second; a hang means a stuck driver, which a prepare should report rather than wait on.
pub(super) const TIMEOUT: Duration = Duration::from_secs(10);

/// Where drivers and driver containers install `nvidia-smi`, below the driver root.
const BINARY_DIRS: [&str; 6] = [
    "usr/bin",
    "usr/local/bin",
    "usr/local/nvidia/bin",
    "bin",
    "usr/sbin",
    "sbin",
];

/// Output beyond this is cut from error messages (nvidia-smi's errors are one or two lines).
const MAX_SHOWN: usize = 2000;

/// Symlink chains longer than this are loops, as the kernel's own limit says.
const MAX_SYMLINKS: usize = 40;

/// How often a running command is checked for having exited.
const POLL: Duration = Duration::from_millis(10);

#[derive(Debug, thiserror::Error)]
pub(super) enum NvidiaSmiError {
    #[error("nvidia-smi not found under the driver root {} (looked in {searched})", root.display())]
    NotFound { root: PathBuf, searched: String },
    #[error("`{command}` could not be started: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {output}")]
    Failed {
        command: String,
        status: String,
        output: String,
    },
    #[error("`{command}` did not finish within {}s and was killed", timeout.as_secs_f64())]
    TimedOut { command: String, timeout: Duration },
}

/// One `nvidia-smi` binary of one driver root.
#[derive(Debug, Clone)]
pub(super) struct NvidiaSmi {
    binary: PathBuf,
    /// Put on `LD_LIBRARY_PATH`, so that the binary loads the driver root's libnvidia-ml rather than
    /// looking in this process's own library directories; `None` for the driver root `/`.
    library_dir: Option<PathBuf>,
    timeout: Duration,
}

/// A driver binary (`nvidia-cuda-mps-control`, ...) under `driver_root` as this process sees it, looked
/// for where `nvidia-smi` is, with the library directory it needs on `LD_LIBRARY_PATH` (`None` for the
/// driver root `/`).
pub fn find_driver_binary(driver_root: &Path, name: &str) -> Option<(PathBuf, Option<PathBuf>)> {
    let binary = BINARY_DIRS
        .iter()
        .find_map(|dir| resolve_in_root(driver_root, &Path::new(dir).join(name)))?;
    let library_dir = (driver_root != Path::new("/"))
        .then(|| {
            library_candidates(driver_root)
                .into_iter()
                .find(|lib| lib.exists())
                .and_then(|lib| lib.parent().map(Path::to_path_buf))
        })
        .flatten();
    Some((binary, library_dir))
}

impl NvidiaSmi {
    /// Finds `nvidia-smi` under `driver_root` (the path this process sees the root at). Symlinks are
    /// followed as the host would follow them: an absolute target is taken below the driver root.
    pub(super) fn find(driver_root: &Path) -> Result<Self, NvidiaSmiError> {
        let binary = BINARY_DIRS
            .iter()
            .find_map(|dir| resolve_in_root(driver_root, &Path::new(dir).join("nvidia-smi")))
            .ok_or_else(|| NvidiaSmiError::NotFound {
                root: driver_root.to_path_buf(),
                searched: BINARY_DIRS.map(|d| format!("/{d}")).join(", "),
            })?;
        let library_dir = (driver_root != Path::new("/"))
            .then(|| {
                library_candidates(driver_root)
                    .into_iter()
                    .find(|lib| lib.exists())
                    .and_then(|lib| lib.parent().map(Path::to_path_buf))
            })
            .flatten();
        Ok(Self {
            binary,
            library_dir,
            timeout: TIMEOUT,
        })
    }

    #[cfg(test)]
    pub(super) fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the time-slice interval of one GPU (`Default` = 0 … `Long` = 3).
    pub(super) fn set_timeslice(
        &self,
        gpu_uuid: &str,
        interval: TimeSliceInterval,
    ) -> Result<(), NvidiaSmiError> {
        let number = match interval {
            TimeSliceInterval::Default => "0",
            TimeSliceInterval::Short => "1",
            TimeSliceInterval::Medium => "2",
            TimeSliceInterval::Long => "3",
        };
        self.run(&["compute-policy", "-i", gpu_uuid, "--set-timeslice", number])
            .map(|_| ())
    }

    /// Runs `nvidia-smi` with `args`; its stdout when it exits with status 0.
    pub(super) fn run(&self, args: &[&str]) -> Result<String, NvidiaSmiError> {
        let command_line = std::iter::once(self.binary.display().to_string())
            .chain(args.iter().map(|a| a.to_string()))
            .collect::<Vec<_>>()
            .join(" ");
        let mut command = Command::new(&self.binary);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so that a timeout kills whatever it started too.
            .process_group(0);
        if let Some(dir) = &self.library_dir {
            let mut path = dir.as_os_str().to_owned();
            if let Some(inherited) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
                path.push(":");
                path.push(inherited);
            }
            command.env("LD_LIBRARY_PATH", path);
        }
        let mut child = command.spawn().map_err(|source| NvidiaSmiError::Spawn {
            command: command_line.clone(),
            source,
        })?;
        // Read both pipes on their own threads so a chatty child never blocks on a full pipe.
        let stdout = child.stdout.take().map(read_all);
        let stderr = child.stderr.take().map(read_all);
        let status = match wait_until(&mut child, Instant::now() + self.timeout) {
            Ok(Some(status)) => status,
            Ok(None) => {
                kill_group(&mut child);
                // The reader threads end when the killed processes' pipes close; not waited for.
                return Err(NvidiaSmiError::TimedOut {
                    command: command_line,
                    timeout: self.timeout,
                });
            }
            Err(source) => {
                kill_group(&mut child);
                return Err(NvidiaSmiError::Spawn {
                    command: command_line,
                    source,
                });
            }
        };
        let collect = |reader: Option<std::thread::JoinHandle<String>>| {
            reader.and_then(|r| r.join().ok()).unwrap_or_default()
        };
        let (stdout, stderr) = (collect(stdout), collect(stderr));
        if status.success() {
            return Ok(stdout);
        }
        // nvidia-smi prints many of its errors on stdout.
        let output = [stderr.trim(), stdout.trim()]
            .into_iter()
            .find(|text| !text.is_empty())
            .map(shorten)
            .unwrap_or_else(|| "no output".to_string());
        Err(NvidiaSmiError::Failed {
            command: command_line,
            status: describe_status(status),
            output,
        })
    }
}

/// `relative` below `root`, following symlinks of its last component with absolute targets taken
/// below the root; `None` unless it ends at a regular file.
fn resolve_in_root(root: &Path, relative: &Path) -> Option<PathBuf> {
    let mut path = root.join(relative);
    for _ in 0..MAX_SYMLINKS {
        let meta = std::fs::symlink_metadata(&path).ok()?;
        if !meta.file_type().is_symlink() {
            return meta.is_file().then_some(path);
        }
        let target = std::fs::read_link(&path).ok()?;
        path = match target.strip_prefix("/") {
            Ok(inside) => root.join(inside),
            Err(_) => path.parent()?.join(target),
        };
    }
    None
}

fn read_all(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        // A read error leaves what was read so far: the text is only shown in messages.
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// The child's exit status, or `None` once `deadline` passed with it still running.
fn wait_until(
    child: &mut std::process::Child,
    deadline: Instant,
) -> std::io::Result<Option<ExitStatus>> {
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        std::thread::sleep(POLL.min(deadline - now));
    }
}

/// Kills the child's process group (the child and anything it started), then reaps the child.
fn kill_group(child: &mut std::process::Child) {
    use nix::sys::signal::{killpg, Signal};
    use nix::unistd::Pid;
    // The child leads its own group (`process_group(0)`), so its pid is the group id. Errors mean
    // the group is already gone.
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn describe_status(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    }
}

fn shorten(text: &str) -> String {
    match text.char_indices().nth(MAX_SHOWN) {
        Some((cut, _)) => format!("{} …", &text[..cut]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A driver root whose `nvidia-smi` is the shell script `body`.
    fn root_with(body: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let bin = root.path().join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        write_script(&bin.join("nvidia-smi"), body);
        root
    }

    fn write_script(path: &Path, body: &str) {
        std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn sets_the_interval_with_the_driver_roots_libraries_on_the_loader_path() {
        let root = root_with(
            r#"echo "$@" > "$(dirname "$0")/args"; echo "$LD_LIBRARY_PATH" > "$(dirname "$0")/ld"; echo ok"#,
        );
        let lib = library_candidates(root.path())[0].clone();
        let libs = lib.parent().unwrap().to_path_buf();
        std::fs::create_dir_all(&libs).unwrap();
        std::fs::write(&lib, b"").unwrap();
        let smi = NvidiaSmi::find(root.path()).unwrap();
        for (interval, number) in TimeSliceInterval::ALL.into_iter().zip(0..) {
            smi.set_timeslice("GPU-1234", interval).unwrap();
            let args = std::fs::read_to_string(root.path().join("usr/bin/args")).unwrap();
            assert_eq!(
                args.trim(),
                format!("compute-policy -i GPU-1234 --set-timeslice {number}")
            );
        }
        let ld = std::fs::read_to_string(root.path().join("usr/bin/ld")).unwrap();
        assert_eq!(
            ld.trim().split(':').next(),
            Some(libs.to_str().unwrap()),
            "the driver root's library directory comes first"
        );
    }

    #[test]
    fn a_failure_names_the_command_its_status_and_what_it_said() {
        let root = root_with(
            "echo 'Unable to set the time slice for GPU 00000000:18:00.0: Insufficient Permissions' >&2\n\
             echo '  ' >&2\nexit 4",
        );
        let err = NvidiaSmi::find(root.path())
            .unwrap()
            .set_timeslice("GPU-1234", TimeSliceInterval::Long)
            .unwrap_err()
            .to_string();
        let binary = root.path().join("usr/bin/nvidia-smi");
        assert!(
            err.starts_with(&format!(
                "`{} compute-policy -i GPU-1234 --set-timeslice 3` failed (exit status 4): ",
                binary.display()
            )),
            "{err}"
        );
        assert!(
            err.ends_with("GPU 00000000:18:00.0: Insufficient Permissions"),
            "stderr, trimmed: {err}"
        );

        // Errors printed on stdout are shown when stderr is empty.
        let root = root_with("echo 'Not supported in MIG mode'; exit 2");
        let err = NvidiaSmi::find(root.path())
            .unwrap()
            .run(&["compute-policy"])
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("(exit status 2): Not supported in MIG mode"),
            "{err}"
        );
    }

    #[test]
    fn a_hang_is_killed_at_the_timeout_with_what_it_started() {
        let root = root_with(r#"sleep 30 & echo $! > "$(dirname "$0")/pid"; wait"#);
        let smi = NvidiaSmi::find(root.path())
            .unwrap()
            .with_timeout(Duration::from_millis(500));
        let started = Instant::now();
        let err = smi
            .set_timeslice("GPU-1234", TimeSliceInterval::Short)
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(matches!(err, NvidiaSmiError::TimedOut { .. }), "{err}");
        assert!(
            err.to_string()
                .ends_with("--set-timeslice 1` did not finish within 0.5s and was killed"),
            "{err}"
        );
        // The script's own child went with it (gone, or a zombie awaiting its reaper).
        let pid = std::fs::read_to_string(root.path().join("usr/bin/pid")).unwrap();
        let stat = format!("/proc/{}/stat", pid.trim());
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let state = std::fs::read_to_string(&stat)
                .ok()
                .and_then(|s| Some(s.rsplit(')').next()?.split_whitespace().next()?.to_string()));
            if state.as_deref().is_none_or(|s| s.starts_with('Z')) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "sleep {pid} still runs: {state:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_missing_binary_names_the_root_and_where_it_looked() {
        let root = tempfile::tempdir().unwrap();
        let err = NvidiaSmi::find(root.path()).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "nvidia-smi not found under the driver root {}",
                root.path().display()
            )),
            "{err}"
        );
        assert!(err.contains("/usr/bin, /usr/local/bin"), "{err}");
        // A directory of that name is not the binary.
        std::fs::create_dir_all(root.path().join("usr/bin/nvidia-smi")).unwrap();
        assert!(NvidiaSmi::find(root.path()).is_err());
    }

    #[test]
    fn absolute_symlinks_resolve_below_the_driver_root() {
        let root = tempfile::tempdir().unwrap();
        for dir in ["usr/bin", "opt/bin"] {
            std::fs::create_dir_all(root.path().join(dir)).unwrap();
        }
        write_script(&root.path().join("opt/bin/nvidia-smi"), "echo from-opt");
        std::os::unix::fs::symlink(
            "/opt/bin/nvidia-smi",
            root.path().join("usr/bin/nvidia-smi"),
        )
        .unwrap();
        let smi = NvidiaSmi::find(root.path()).unwrap();
        assert_eq!(smi.binary, root.path().join("opt/bin/nvidia-smi"));
        assert_eq!(smi.run(&[]).unwrap().trim(), "from-opt");
        assert_eq!(smi.library_dir, None, "no libnvidia-ml in this root");
    }
}
