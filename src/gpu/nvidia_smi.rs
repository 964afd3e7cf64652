//! Runs the driver's `nvidia-smi` for the settings NVML has no public call for: today the time-slice
//! interval (`nvidia-smi compute-policy -i <uuid> --set-timeslice <n>`). The binary is the driver
//! root's, started inside that root ([`DriverCommand`]), under a timeout; failures name the command,
//! its exit status and what it printed.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use super::driver_exec::{DriverCommand, DriverExecError};
use super::TimeSliceInterval;

/// How long one `nvidia-smi` call may take before it is killed. It normally answers in well under a
/// second; a hang means a stuck driver, which a prepare should report rather than wait on.
pub(super) const TIMEOUT: Duration = Duration::from_secs(10);

/// Output beyond this is cut from error messages (nvidia-smi's errors are one or two lines).
const MAX_SHOWN: usize = 2000;

#[derive(Debug, thiserror::Error)]
pub(super) enum NvidiaSmiError {
    #[error(transparent)]
    Driver(#[from] DriverExecError),
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
    program: DriverCommand,
    timeout: Duration,
}

impl NvidiaSmi {
    /// Finds `nvidia-smi` under `driver_root` (the path this process sees the root at).
    pub(super) fn find(driver_root: &Path) -> Result<Self, NvidiaSmiError> {
        Ok(Self {
            program: DriverCommand::find(driver_root, "nvidia-smi")?,
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

    /// Runs `nvidia-smi` with `args`; its stdout when it exits with status 0. Called from blocking
    /// threads (a GPU's sharing change) and tests: the wait runs on a runtime of its own, whose timer
    /// bounds it and whose process driver reads both pipes, so a chatty child never blocks on a full one.
    pub(super) fn run(&self, args: &[&str]) -> Result<String, NvidiaSmiError> {
        let command_line = std::iter::once(self.program.describe())
            .chain(args.iter().map(|a| a.to_string()))
            .collect::<Vec<_>>()
            .join(" ");
        let spawn_error = |source| NvidiaSmiError::Spawn {
            command: command_line.clone(),
            source,
        };
        let mut command = tokio::process::Command::from(self.program.command());
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so that a timeout kills whatever it started too.
            .process_group(0);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(spawn_error)?;
        let output = runtime.block_on(async {
            let child = command.spawn()?;
            let group = child.id();
            let output = tokio::time::timeout(self.timeout, child.wait_with_output()).await;
            if !matches!(output, Ok(Ok(_))) {
                kill_group(group);
            }
            Ok(output)
        });
        let output = match output.map_err(spawn_error)? {
            Ok(Ok(output)) => output,
            Ok(Err(source)) => return Err(spawn_error(source)),
            // The child went with the dropped wait: tokio reaps it once it dies, and a process in
            // uninterruptible sleep (a driver call that does not return) dies only when that call
            // returns, so nothing here waits for it, and the GPU's sharing lock is not held as long.
            Err(_) => {
                return Err(NvidiaSmiError::TimedOut {
                    command: command_line,
                    timeout: self.timeout,
                })
            }
        };
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
        if output.status.success() {
            return Ok(stdout);
        }
        // nvidia-smi prints many of its errors on stdout.
        let shown = [stderr.trim(), stdout.trim()]
            .into_iter()
            .find(|text| !text.is_empty())
            .map(shorten)
            .unwrap_or_else(|| "no output".to_string());
        Err(NvidiaSmiError::Failed {
            command: command_line,
            status: describe_status(output.status),
            output: shown,
        })
    }
}

/// Kills the process group the child leads (`process_group(0)`: its pid is the group id), so what it
/// started goes too. Errors mean the group is already gone.
fn kill_group(group: Option<u32>) {
    use nix::sys::signal::{killpg, Signal};
    use nix::unistd::Pid;
    if let Some(pid) = group.and_then(|pid| i32::try_from(pid).ok()) {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
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
    use crate::cdi::fake_root::FakeRoot;
    use crate::gpu::nvml_support::library_candidates;
    use std::os::unix::fs::PermissionsExt;
    use std::time::Instant;

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
    fn sets_the_interval_inside_a_host_driver_root() {
        if !crate::cdi::fake_root::running_as_root("sets_the_interval_inside_a_host_driver_root") {
            return;
        }
        // A root like an Ubuntu host's `/`: its libc lies beside libnvidia-ml, and its nvidia-smi
        // fails with GLIBC_PRIVATE when this process's loader starts it.
        let root = FakeRoot::host_like();
        root.stand_in(
            "/usr/bin/nvidia-smi",
            r#"echo "$@" > /args; echo "Set timeslice for GPU $3""#,
        );
        let smi = NvidiaSmi::find(root.path()).unwrap();
        smi.set_timeslice("GPU-1234", TimeSliceInterval::Medium)
            .unwrap();
        let args = std::fs::read_to_string(root.path().join("args")).unwrap();
        assert_eq!(args.trim(), "compute-policy -i GPU-1234 --set-timeslice 2");

        // A failure shows the command as it ran, inside the root.
        root.stand_in(
            "/usr/bin/nvidia-smi",
            "echo 'Insufficient Permissions' >&2; exit 4",
        );
        let err = smi
            .set_timeslice("GPU-1234", TimeSliceInterval::Long)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!(
                "chroot {} /usr/bin/nvidia-smi compute-policy -i GPU-1234 --set-timeslice 3` failed (exit status 4): Insufficient Permissions",
                root.path().display()
            )),
            "{err}"
        );
    }

    #[test]
    fn sets_the_interval_from_outside_a_root_without_a_loader_with_its_libraries_on_the_loader_path(
    ) {
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
        assert_eq!(
            smi.program.describe(),
            root.path().join("opt/bin/nvidia-smi").display().to_string()
        );
        assert_eq!(smi.run(&[]).unwrap().trim(), "from-opt");
    }
}
