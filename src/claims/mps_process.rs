//! How the plugin runs a claim's MPS daemon: the control program (start, commands), and the
//! `/proc` checks that make sure a signal only ever reaches the daemon it is meant for.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use tracing::warn;

use super::{
    reports_error, visible_devices, ClaimDirs, MpsDaemonRecord, MpsDaemonSpec, MpsDaemons,
    MpsError, COMMAND_TIMEOUT, POLL, QUIT_WAIT, READY_TIMEOUT, SIGNAL_WAIT, START_LOG,
};

impl MpsDaemons {
    /// Runs `<control> -d`, waits until the daemon answers, applies the limits.
    pub(super) fn launch(
        &self,
        dirs: &ClaimDirs,
        spec: &MpsDaemonSpec,
        limits: &[String],
    ) -> Result<MpsDaemonRecord, MpsError> {
        let log_path = dirs.log.join(START_LOG);
        let out = File::create(&log_path).map_err(dirs.io("creating", &log_path))?;
        let err = out.try_clone().map_err(dirs.io("opening", &log_path))?;
        let mut command = self.program.command(&["-d"]);
        self.daemon_env(&mut command, dirs);
        command
            .env("CUDA_VISIBLE_DEVICES", visible_devices(&spec.devices))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let spawn_error = |source| MpsError::Spawn {
            claim: dirs.claim.clone(),
            program: self.program.describe(),
            source,
        };
        let child = command.spawn().map_err(spawn_error)?;
        let started = wait_bounded(child, READY_TIMEOUT).map_err(spawn_error)?;
        if !started.is_some_and(|status| status.success()) {
            let status = started.map_or("did not return in time".to_string(), |s| s.to_string());
            return Err(MpsError::StartFailed {
                claim: dirs.claim.clone(),
                program: self.program.describe(),
                detail: format!("{status}; {}", tail(&log_path)),
            });
        }
        let (pid, start_time) = self.wait_ready(dirs)?;
        for limit in limits {
            if let Err(e) = self.run_control(dirs, limit, COMMAND_TIMEOUT) {
                let _ = self.stop_process(dirs, pid, start_time);
                return Err(e);
            }
        }
        Ok(MpsDaemonRecord {
            pid,
            start_time,
            dir: dirs.dir.clone(),
            devices: spec.devices.clone(),
            active_thread_percentage: spec.active_thread_percentage,
        })
    }

    /// Waits for the pid file and a first answer; a daemon that comes up too late is stopped.
    fn wait_ready(&self, dirs: &ClaimDirs) -> Result<(u32, u64), MpsError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let detail = match read_pid_file(&dirs.pid_file()) {
                Err(e) => format!("no pid file {}: {e}", dirs.pid_file().display()),
                Ok(pid) => match proc_stat(pid).filter(ProcStat::alive) {
                    None => format!("process {pid} from the pid file is not running"),
                    Some(stat) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let probe = "get_default_active_thread_percentage";
                        match self.run_control(dirs, probe, left.min(COMMAND_TIMEOUT)) {
                            Ok(_) => return Ok((pid, stat.start_time)),
                            Err(e) => e.to_string(),
                        }
                    }
                },
            };
            if Instant::now() >= deadline {
                let _ = self.stop_leftover(dirs);
                return Err(MpsError::NotReady {
                    claim: dirs.claim.clone(),
                    waited: READY_TIMEOUT,
                    detail: format!("{detail}; {}", tail(&dirs.log.join(START_LOG))),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    fn daemon_env(&self, command: &mut Command, dirs: &ClaimDirs) {
        command
            .env("CUDA_MPS_PIPE_DIRECTORY", &dirs.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &dirs.log);
    }

    /// Runs the control program with `command` on its stdin. An exit status other than 0, or an
    /// answer that reports an error, is an error.
    pub(super) fn run_control(
        &self,
        dirs: &ClaimDirs,
        command: &str,
        timeout: Duration,
    ) -> Result<String, MpsError> {
        let failed = |detail: String| MpsError::Command {
            claim: dirs.claim.clone(),
            command: command.to_string(),
            detail,
        };
        let mut client = self.program.command(&[]);
        self.daemon_env(&mut client, dirs);
        client
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = client.spawn().map_err(|source| MpsError::Spawn {
            claim: dirs.claim.clone(),
            program: self.program.describe(),
            source,
        })?;
        if let Some(mut stdin) = child.stdin.take() {
            // A client that exits early closes the pipe; its status says why.
            let _ = stdin.write_all(format!("{command}\n").as_bytes());
        }
        let stdout = read_in_background(child.stdout.take());
        let stderr = read_in_background(child.stderr.take());
        let status = wait_bounded(child, timeout).map_err(|e| failed(e.to_string()))?;
        let (stdout, stderr) = (joined(stdout), joined(stderr));
        let answer = stdout.trim().to_string();
        let said = || format!("{} {}", answer, stderr.trim()).trim().to_string();
        match status {
            None => Err(failed(format!("no answer within {timeout:?}"))),
            Some(status) if !status.success() => Err(failed(format!("{status}: {}", said()))),
            Some(_) if reports_error(&answer) => Err(failed(said())),
            Some(_) => Ok(answer),
        }
    }

    /// Stops the daemon a claim directory's pid file names, if that is the directory's daemon.
    pub(super) fn stop_leftover(&self, dirs: &ClaimDirs) -> Result<(), MpsError> {
        let pid_file = dirs.pid_file();
        let Ok(pid) = read_pid_file(&pid_file) else {
            return Ok(());
        };
        match identify(pid, &dirs.pipe) {
            Identity::Daemon { start_time } => self.stop_process(dirs, pid, start_time),
            Identity::Gone => Ok(()),
            Identity::NotDaemon(reason) => {
                warn!(claim = %dirs.claim, pid, %reason, "stale MPS pid file; nothing signalled");
                Ok(())
            }
            Identity::Unknown(reason) => Err(MpsError::Unverifiable {
                claim: dirs.claim.clone(),
                pid,
                pid_file,
                reason,
            }),
        }
    }

    /// `quit`, then SIGTERM, then SIGKILL, each only to the process with this start time.
    pub(super) fn stop_process(
        &self,
        dirs: &ClaimDirs,
        pid: u32,
        start_time: u64,
    ) -> Result<(), MpsError> {
        if !same_process_alive(pid, start_time) {
            reap(pid, start_time);
            return Ok(());
        }
        match self.run_control(dirs, "quit", COMMAND_TIMEOUT) {
            Ok(_) if wait_gone(pid, start_time, QUIT_WAIT) => return Ok(()),
            Ok(_) => {
                warn!(claim = %dirs.claim, pid, "MPS daemon still runs after quit; signalling it")
            }
            Err(e) => {
                warn!(claim = %dirs.claim, pid, error = %e, "MPS daemon did not take quit; signalling it")
            }
        }
        for signal in [Signal::SIGTERM, Signal::SIGKILL] {
            signal_daemon(pid, start_time, signal);
            if wait_gone(pid, start_time, SIGNAL_WAIT) {
                return Ok(());
            }
        }
        Err(MpsError::StillRunning {
            claim: dirs.claim.clone(),
            pid,
        })
    }
}

pub(super) fn read_pid_file(path: &Path) -> io::Result<u32> {
    let text = fs::read_to_string(path)?;
    text.trim()
        .parse::<u32>()
        .ok()
        .filter(|pid| *pid > 1 && i32::try_from(*pid).is_ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("not a pid: {text:?}")))
}

/// The fields of `/proc/<pid>/stat` this module needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ProcStat {
    pub state: char,
    pub pgrp: i32,
    pub start_time: u64,
}

impl ProcStat {
    pub fn alive(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Field 2 (the command name) is in parentheses and may hold spaces and parentheses itself, so
/// the fields are counted from the last `)`: field 3 (state) comes right after it.
pub(super) fn parse_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).copied();
    Some(ProcStat {
        state: field(3)?.chars().next()?,
        pgrp: field(5)?.parse().ok()?,
        start_time: field(22)?.parse().ok()?,
    })
}

pub(super) fn proc_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

pub(super) fn same_process_alive(pid: u32, start_time: u64) -> bool {
    proc_stat(pid).is_some_and(|stat| stat.alive() && stat.start_time == start_time)
}

/// Whether a command line is an MPS control daemon's: NVIDIA's (`nvidia-cuda-mps-control -d|-f`)
/// or the stand-in's (`<exe> fake mps-control-daemon -d|-f`). Its client (no flag) is not.
pub(super) fn is_daemon_command_line(args: &[&str]) -> bool {
    let daemon_flag = |rest: &[&str]| rest.iter().any(|a| *a == "-d" || *a == "-f");
    match args {
        [program, rest @ ..]
            if Path::new(program).file_name() == Some("nvidia-cuda-mps-control".as_ref()) =>
        {
            daemon_flag(rest)
        }
        [_, "fake", "mps-control-daemon", rest @ ..] => daemon_flag(rest),
        _ => false,
    }
}

enum Identity {
    /// This pipe directory's daemon.
    Daemon { start_time: u64 },
    /// Not running: the pid file outlived its daemon.
    Gone,
    /// Another program, or another directory's daemon: the pid was reused.
    NotDaemon(String),
    /// Alive, but /proc would not say what it is.
    Unknown(String),
}

fn identify(pid: u32, pipe: &Path) -> Identity {
    let Some(stat) = proc_stat(pid).filter(ProcStat::alive) else {
        return Identity::Gone;
    };
    let read = |file: &str| fs::read(format!("/proc/{pid}/{file}"));
    let cmdline = match read("cmdline") {
        Ok(bytes) => bytes,
        Err(e) => return Identity::Unknown(format!("reading /proc/{pid}/cmdline: {e}")),
    };
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|arg| !arg.is_empty())
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    if !is_daemon_command_line(&args) {
        return Identity::NotDaemon(format!(
            "process {pid} is {:?}, not an MPS control daemon",
            args.join(" ")
        ));
    }
    let environ = match read("environ") {
        Ok(bytes) => bytes,
        Err(e) => return Identity::Unknown(format!("reading /proc/{pid}/environ: {e}")),
    };
    let wanted = format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe.display());
    if environ
        .split(|b| *b == 0)
        .any(|var| var == wanted.as_bytes())
    {
        Identity::Daemon {
            start_time: stat.start_time,
        }
    } else {
        Identity::NotDaemon(format!(
            "process {pid} is the MPS control daemon of another pipe directory"
        ))
    }
}

/// Signals the daemon, and its process group when it leads one (the MPS servers it started).
fn signal_daemon(pid: u32, start_time: u64, signal: Signal) {
    let Some(stat) = proc_stat(pid).filter(|s| s.alive() && s.start_time == start_time) else {
        return;
    };
    let Ok(raw) = i32::try_from(pid) else {
        return;
    };
    let _ = if stat.pgrp == raw {
        killpg(Pid::from_raw(raw), signal)
    } else {
        kill(Pid::from_raw(raw), signal)
    };
}

fn wait_gone(pid: u32, start_time: u64, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if !same_process_alive(pid, start_time) {
            reap(pid, start_time);
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// Where the plugin is the daemon's reaper (pid 1 of its container, or a subreaper), a stopped
/// daemon stays a zombie until waited for. Only that zombie (same start time) is waited for, never
/// another child of the plugin's; anyone else's child answers ECHILD, ignored.
fn reap(pid: u32, start_time: u64) {
    let ours = proc_stat(pid).is_some_and(|s| s.state == 'Z' && s.start_time == start_time);
    if let (true, Ok(raw)) = (ours, i32::try_from(pid)) {
        let _ = waitpid(Pid::from_raw(raw), Some(WaitPidFlag::WNOHANG));
    }
}

/// Waits for a child up to `within`; kills it after that. `None`: it did not finish in time.
fn wait_bounded(mut child: Child, within: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

type Reader = Option<std::thread::JoinHandle<String>>;

fn read_in_background(pipe: Option<impl Read + Send + 'static>) -> Reader {
    pipe.map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    })
}

fn joined(reader: Reader) -> String {
    reader
        .and_then(|handle| handle.join().ok())
        .unwrap_or_default()
}

/// The last lines of a log, for an error message.
fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.len() {
        0 => format!("{} is empty", path.display()),
        n => format!(
            "{}: {}",
            path.display(),
            lines[n.saturating_sub(5)..].join(" | ")
        ),
    }
}
