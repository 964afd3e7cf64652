//! The fake backend's MPS control daemon, `gpu-dra fake mps-control-daemon`, with the command line
//! of NVIDIA's `nvidia-cuda-mps-control`: `-d` starts the daemon in the background and returns once
//! it runs, `-f` runs it in the foreground, and with neither it is a client that sends the command
//! lines on its stdin to the running daemon and prints the answers. `-multiuser-server` (with `-d` or
//! `-f`) is multi-user mode, which it logs and notes in its shared-memory state. It takes only the
//! options NVIDIA documents ([`Mode::from_args`]), so that the plugin never relies on one that the
//! documentation does not promise: `-M`, which NVIDIA's DRA driver passes, is refused.
//!
//! The daemon reads `CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY` and `CUDA_VISIBLE_DEVICES`,
//! writes `<pipe>/nvidia-cuda-mps-control.pid`, listens on `<pipe>/control` (one command per line,
//! one answer line each) and logs every command to `<log>/control.log`. It keeps the default
//! active thread percentage and per-device pinned memory limits it is given. What it does not
//! model: MPS servers and clients, `ps`, `get_server_list`, per-server settings, user ids.
//!
//! Like the real daemon's server, it keeps its state in `/dev/shm` (`GPU_DRA_FAKE_MPS_SHM` where the
//! test doubles run it without a mount namespace): a file `cuda.shm.mps-stand-in` naming its devices,
//! which a client container finds in its own `/dev/shm` only when both share one tmpfs. It refuses to
//! start on a `/dev/shm` that is no tmpfs.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Notify;

use super::{CONTROL_SOCKET, PID_FILE};
use crate::fsutil::write_atomically;

/// The stand-in server's state in shared memory.
pub const SHM_SEGMENT: &str = "cuda.shm.mps-stand-in";

/// How the program was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `-d`: start the daemon in a process group of its own, return once it wrote its pid file.
    Background { multi_user: bool },
    /// `-f`: be the daemon.
    Foreground { multi_user: bool },
    /// Neither: send stdin's commands to the daemon.
    Client,
}

#[derive(Debug, Error)]
pub enum StandInError {
    #[error("{0} is not set")]
    MissingEnv(&'static str),
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// The options NVIDIA documents for starting the control daemon: `-d` and `-f` (`man
/// nvidia-cuda-mps-control`, SYNOPSIS `[-d | -f]`) and `-multiuser-server` ("Multi-Process Service",
/// Architecture, Provisioning Sequence, Server).
pub const OPTIONS: [&str; 3] = ["-d", "-f", super::supervisor::MULTI_USER_OPTION];

impl Mode {
    /// The mode the command line asks for; an option NVIDIA does not document, `-d` with `-f`, or
    /// multi-user mode for a client is refused with why.
    pub fn from_args(args: &[String]) -> Result<Mode, String> {
        let (mut background, mut foreground, mut multi_user) = (false, false, false);
        for arg in args {
            match arg.as_str() {
                "-d" => background = true,
                "-f" => foreground = true,
                option if option == super::supervisor::MULTI_USER_OPTION => multi_user = true,
                other => {
                    return Err(format!(
                        "unrecognized option {other:?}: nvidia-cuda-mps-control takes {}",
                        OPTIONS.join(", ")
                    ))
                }
            }
        }
        match (background, foreground) {
            (true, true) => Err("-d and -f exclude each other".into()),
            (true, false) => Ok(Mode::Background { multi_user }),
            (false, true) => Ok(Mode::Foreground { multi_user }),
            (false, false) if multi_user => Err(format!(
                "{} starts a daemon: it goes with -d or -f",
                super::supervisor::MULTI_USER_OPTION
            )),
            (false, false) => Ok(Mode::Client),
        }
    }
}

/// Runs the stand-in; returns the process exit code.
pub fn run(mode: Mode) -> Result<i32, StandInError> {
    match mode {
        Mode::Background { multi_user } => background(multi_user),
        Mode::Foreground { multi_user } => foreground(multi_user),
        Mode::Client => client(),
    }
}

fn env_dir(name: &'static str) -> Result<PathBuf, StandInError> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .ok_or(StandInError::MissingEnv(name))
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StandInError {
    let path = path.to_path_buf();
    move |source| StandInError::Io {
        action,
        path,
        source,
    }
}

fn read_pid(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn background(multi_user: bool) -> Result<i32, StandInError> {
    let pipe = env_dir("CUDA_MPS_PIPE_DIRECTORY")?;
    env_dir("CUDA_MPS_LOG_DIRECTORY")?;
    let exe = std::env::current_exe().map_err(io_error("finding", Path::new("/proc/self/exe")))?;
    let mut child = Command::new(&exe)
        .args(["fake", "mps-control-daemon", "-f"])
        .args(multi_user.then_some(super::supervisor::MULTI_USER_OPTION))
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(io_error("starting", &exe))?;
    let pid_file = pipe.join(PID_FILE);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if read_pid(&pid_file) == Some(child.id()) {
            return Ok(0);
        }
        if let Ok(Some(status)) = child.try_wait() {
            eprintln!("the MPS control daemon exited while starting: {status}");
            return Ok(1);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("the MPS control daemon wrote no pid file within 10s");
            return Ok(1);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `control.log`, one line per event, in the real daemon's `[time Control pid] text` shape.
struct Log {
    file: Mutex<fs::File>,
}

impl Log {
    fn line(&self, text: &str) {
        let now = k8s_openapi::jiff::Timestamp::now();
        let line = format!("[{now} Control {}] {text}\n", std::process::id());
        if let Ok(mut file) = self.file.lock() {
            let _ = file.write_all(line.as_bytes());
        }
    }
}

/// The daemon's settings.
struct Settings {
    devices: Vec<String>,
    active_thread_percentage: f64,
    pinned_limits: BTreeMap<usize, String>,
}

enum Answer {
    Text(String),
    Quit,
}

impl Settings {
    fn apply(&mut self, line: &str) -> Answer {
        let words: Vec<&str> = line.split_whitespace().collect();
        let text = match words.as_slice() {
            ["quit"] => return Answer::Quit,
            ["get_default_active_thread_percentage"] => {
                format!("{:.1}", self.active_thread_percentage)
            }
            ["set_default_active_thread_percentage", value] => match value.parse::<f64>() {
                Ok(p) if p.is_finite() && p > 0.0 && p <= 100.0 => {
                    self.active_thread_percentage = p;
                    format!("{p:.1}")
                }
                _ => {
                    format!("Error: active thread percentage {value:?} is not a number in (0, 100]")
                }
            },
            ["set_default_device_pinned_mem_limit", device, value] => {
                match (self.ordinal(device), pinned_value(value)) {
                    (Some(ordinal), true) => {
                        self.pinned_limits.insert(ordinal, value.to_string());
                        String::new()
                    }
                    (None, _) => format!("Error: no device {device}"),
                    (_, false) => format!(
                        "Error: pinned memory limit {value:?} is not an integer followed by M or G"
                    ),
                }
            }
            ["get_default_device_pinned_mem_limit", device] => match self.ordinal(device) {
                Some(ordinal) => self
                    .pinned_limits
                    .get(&ordinal)
                    .cloned()
                    .unwrap_or_else(|| "0M".into()),
                None => format!("Error: no device {device}"),
            },
            _ => format!("Error: unrecognized command {line:?}"),
        };
        Answer::Text(text)
    }

    /// A device as the daemon's commands name it: its index in CUDA_VISIBLE_DEVICES, or its UUID.
    fn ordinal(&self, device: &str) -> Option<usize> {
        match device.parse::<usize>() {
            Ok(n) => (n < self.devices.len()).then_some(n),
            Err(_) => self.devices.iter().position(|uuid| uuid == device),
        }
    }
}

fn pinned_value(value: &str) -> bool {
    let digits = value.strip_suffix(['M', 'G']).unwrap_or("");
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

fn foreground(multi_user: bool) -> Result<i32, StandInError> {
    let pipe = env_dir("CUDA_MPS_PIPE_DIRECTORY")?;
    let log_dir = env_dir("CUDA_MPS_LOG_DIRECTORY")?;
    let log_path = log_dir.join("control.log");
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(io_error("opening", &log_path))?;
    let log = Arc::new(Log {
        file: Mutex::new(file),
    });
    let pid_file = pipe.join(PID_FILE);
    if let Some(pid) = read_pid(&pid_file).filter(|pid| Path::new(&format!("/proc/{pid}")).exists())
    {
        log.line(&format!(
            "An instance of this daemon (pid {pid}) is already running"
        ));
        eprintln!("An instance of this daemon is already running (pid {pid})");
        return Ok(1);
    }
    let shm = std::env::var_os(super::supervisor::STAND_IN_SHM_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/dev/shm"), PathBuf::from);
    if !super::shm::is_tmpfs(&shm) {
        log.line(&format!(
            "{} is not a tmpfs; MPS servers and clients cannot share memory",
            shm.display()
        ));
        eprintln!(
            "{} is not a tmpfs: MPS servers and clients share memory there",
            shm.display()
        );
        return Ok(1);
    }
    let devices: Vec<String> = std::env::var("CUDA_VISIBLE_DEVICES")
        .unwrap_or_default()
        .split(',')
        .filter(|d| !d.is_empty())
        .map(String::from)
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io_error("starting the runtime for", &pipe))?;
    let segment = shm.join(SHM_SEGMENT);
    let mode = if multi_user { "multi-user\n" } else { "" };
    write_atomically(
        &segment,
        format!("{}\n{mode}", devices.join(",")).as_bytes(),
        0o644,
    )
    .map_err(io_error("writing", &segment))?;
    if multi_user {
        log.line("Multi-user mode: clients of any user id share the server");
    }
    let result = runtime.block_on(serve(&pipe, devices, log.clone()));
    let _ = fs::remove_file(&segment);
    let _ = fs::remove_file(pipe.join(CONTROL_SOCKET));
    if read_pid(&pid_file) == Some(std::process::id()) {
        let _ = fs::remove_file(&pid_file);
    }
    log.line("Exiting");
    result.map(|()| 0)
}

async fn serve(pipe: &Path, devices: Vec<String>, log: Arc<Log>) -> Result<(), StandInError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term =
        signal(SignalKind::terminate()).map_err(io_error("handling SIGTERM in", pipe))?;
    let mut int = signal(SignalKind::interrupt()).map_err(io_error("handling SIGINT in", pipe))?;
    let socket = pipe.join(CONTROL_SOCKET);
    let _ = fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).map_err(io_error("listening on", &socket))?;
    // Clients of any user may connect, as to the real daemon's control socket.
    fs::set_permissions(&socket, fs::Permissions::from_mode(0o666))
        .map_err(io_error("setting the mode of", &socket))?;
    let pid_file = pipe.join(PID_FILE);
    write_atomically(
        &pid_file,
        format!("{}\n", std::process::id()).as_bytes(),
        0o644,
    )
    .map_err(io_error("writing", &pid_file))?;
    log.line(&format!(
        "Starting control daemon using socket {}",
        socket.display()
    ));
    log.line(&format!("CUDA_VISIBLE_DEVICES={}", devices.join(",")));
    let settings = Arc::new(Mutex::new(Settings {
        devices,
        active_thread_percentage: 100.0,
        pinned_limits: BTreeMap::new(),
    }));
    let quit = Arc::new(Notify::new());
    // Unlike the real daemon, the stand-in leaves when its pipe directory goes, so that a test whose
    // temporary directory is removed never leaves a daemon behind.
    let mut watchdog = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = watchdog.tick() => if !pipe.is_dir() {
                log.line("Pipe directory removed; exiting");
                return Ok(());
            },
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(session(stream, settings.clone(), log.clone(), quit.clone()));
                }
                Err(e) => log.line(&format!("accept failed: {e}")),
            },
            _ = quit.notified() => {
                log.line("Quit received");
                return Ok(());
            }
            _ = term.recv() => {
                log.line("SIGTERM received");
                return Ok(());
            }
            _ = int.recv() => {
                log.line("SIGINT received");
                return Ok(());
            }
        }
    }
}

async fn session(
    stream: UnixStream,
    settings: Arc<Mutex<Settings>>,
    log: Arc<Log>,
    quit: Arc<Notify>,
) {
    let (read, mut write) = stream.into_split();
    let mut lines = tokio::io::BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        log.line(&format!("Cmd:{line}"));
        let answer = match settings.lock() {
            Ok(mut settings) => settings.apply(line),
            Err(_) => Answer::Text("Error: internal".into()),
        };
        let text = match &answer {
            Answer::Text(text) => text.as_str(),
            Answer::Quit => "",
        };
        if text.starts_with("Error") {
            log.line(text);
        }
        let _ = write.write_all(format!("{text}\n").as_bytes()).await;
        if let Answer::Quit = answer {
            quit.notify_one();
            return;
        }
    }
}

fn client() -> Result<i32, StandInError> {
    let pipe = env_dir("CUDA_MPS_PIPE_DIRECTORY")?;
    let socket = pipe.join(CONTROL_SOCKET);
    let stream = match std::os::unix::net::UnixStream::connect(&socket) {
        Ok(stream) => stream,
        Err(e) => {
            eprintln!(
                "Cannot reach the MPS control daemon at {}: {e}",
                socket.display()
            );
            return Ok(1);
        }
    };
    let timeout = Some(Duration::from_secs(5));
    let _ = stream.set_read_timeout(timeout);
    let mut answers = BufReader::new(stream.try_clone().map_err(io_error("using", &socket))?);
    let mut to_daemon = stream;
    let mut failed = false;
    for line in io::stdin().lock().lines() {
        let line = line.map_err(io_error("reading", Path::new("stdin")))?;
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        let mut answer = String::new();
        let exchanged = to_daemon
            .write_all(format!("{command}\n").as_bytes())
            .and_then(|()| answers.read_line(&mut answer));
        match exchanged {
            Ok(n) if n > 0 => {}
            Ok(_) => {
                eprintln!("The MPS control daemon closed the connection");
                return Ok(1);
            }
            Err(e) => {
                eprintln!("No answer from the MPS control daemon: {e}");
                return Ok(1);
            }
        }
        let answer = answer.trim_end();
        if !answer.is_empty() {
            println!("{answer}");
        }
        failed |= answer.starts_with("Error");
        if command == "quit" {
            break;
        }
    }
    Ok(i32::from(failed))
}
