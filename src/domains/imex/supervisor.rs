//! `gpu-dra imex-daemon`: PID 1 of the node's IMEX daemon Pod (`pod.rs`). It enters the driver root
//! (chroot) where the Pod says so, runs `nvidia-imex -c <dir>/config.cfg` in the foreground, asks
//! `nvidia-imex-ctl -q` every second whether it is READY and keeps `<dir>/ready` (read by the Pod's
//! readiness probe) or `<dir>/not-ready` (why not, read by the plugin) accordingly.
//!
//! - Before the daemon starts: where another daemon holds port 50000 or 50005 (the host's
//!   `nvidia-imex.service`, most likely) it waits, not ready with that reason, and looks again every
//!   second.
//! - The peers (`<dir>/peers`, hosts lines for the names in `nodes_config.cfg`): merged into the hosts
//!   file the daemon resolves names with, before it starts and whenever they change; then SIGUSR1 makes
//!   the running daemon resolve them again and reconnect (never a restart), at most once per 5 s as
//!   IMEX handles it. NVIDIA's ComputeDomain daemon does the same (`IMEXDaemonsWithDNSNames`). The
//!   hosts file: the container's own `/etc/hosts` (the kubelet's copy for this Pod) for the driver's
//!   binaries run directly; `<dir>/hosts` bind-mounted over the root's `/etc/hosts`, in a mount
//!   namespace of the supervisor's own, in a chroot (the root's is the host's); `<dir>/hosts`, named
//!   in [`STAND_IN_HOSTS_ENV`], for the stand-in.
//! - SIGTERM (the Pod is deleted): passed on to the daemon; the supervisor exits 0 once it ended.
//! - The daemon exits by itself: the supervisor exits with its status, so the kubelet restarts the
//!   container and the Pod is not Ready meanwhile; the daemon's last stderr line goes into `not-ready`.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use super::config::{
    merge_hosts, parse_peers, Peer, CMD_PORT, CONFIG_FILE, PEERS_FILE, SERVER_PORT,
};
use super::host_service::HOST_SERVICE;
use super::{NOT_READY_FILE, READY_FILE};
use crate::claims::daemon_pod::supervisor::{
    program_command, runs_stand_in, ReadyFile, Supervised,
};
pub use crate::claims::daemon_pod::supervisor::{SupervisorError, STAND_IN_PROGRAM};
use crate::fsutil::write_for_this_boot;

/// How often the daemon is asked whether it is ready, and the peers file compared.
const CHECK_PERIOD: Duration = Duration::from_secs(1);
/// IMEX handles one SIGUSR1 per 5 s and ignores the others within that window (NVIDIA's IMEX docs,
/// "signals").
pub const SIGUSR1_WINDOW: Duration = Duration::from_secs(5);
/// How far apart the supervisor sends them: the window and a margin, as the daemon's window starts
/// when it handles the signal, a little after it was sent.
const SIGUSR1_SPACING: Duration = Duration::from_millis(5500);
/// The hosts file the supervisor keeps in the domain's directory, where the daemon does not resolve
/// through the container's own.
pub const HOSTS_FILE: &str = "hosts";
/// The container's hosts file: the kubelet's copy for this Pod.
const CONTAINER_HOSTS: &str = "/etc/hosts";
/// The variable that names the stand-in's hosts file (it resolves names through no other).
pub const STAND_IN_HOSTS_ENV: &str = "GPU_DRA_IMEX_HOSTS";
const CTL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the daemon has to end after SIGTERM (the Pod's grace period is 15 s).
const STOP_WAIT: Duration = Duration::from_secs(10);
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

impl Supervised for SupervisorArgs {
    fn daemon(&self) -> String {
        format!("IMEX daemon in {}", self.dir.display())
    }
}

impl SupervisorArgs {
    fn config(&self) -> PathBuf {
        self.dir.join(CONFIG_FILE)
    }

    fn is_stand_in(&self) -> bool {
        self.program == STAND_IN_PROGRAM
    }

    /// The hosts file the daemon resolves its peers' names with, as the supervisor sees it once in
    /// the driver root.
    fn hosts_file(&self) -> PathBuf {
        if self.is_stand_in() || self.driver_root.is_some() {
            self.dir.join(HOSTS_FILE)
        } else {
            PathBuf::from(CONTAINER_HOSTS)
        }
    }

    /// `program` with `args`; the stand-ins are this binary's `fake` commands.
    fn command(&self, program: &str, stand_in: &str, args: &[&str]) -> Command {
        let mut command = program_command(program, self.library_path.as_deref(), stand_in);
        if runs_stand_in(program) {
            command.env(STAND_IN_HOSTS_ENV, self.hosts_file());
        }
        command.args(args);
        command
    }

    fn daemon_name(&self) -> &str {
        if self.is_stand_in() {
            "the IMEX stand-in"
        } else {
            "nvidia-imex"
        }
    }
}

/// `ready` and `not-ready` in the domain's directory: one or the other.
struct Readiness {
    ready: ReadyFile,
    not_ready: PathBuf,
    is_ready: bool,
}

impl Readiness {
    fn new(dir: &Path) -> Self {
        Self {
            ready: ReadyFile::new(dir.join(READY_FILE)),
            not_ready: dir.join(NOT_READY_FILE),
            is_ready: false,
        }
    }

    fn ready(&mut self) {
        if self.is_ready && self.ready.exists() {
            return;
        }
        match self.ready.mark(std::process::id()) {
            Ok(()) => {
                let _ = fs::remove_file(&self.not_ready);
                if !self.is_ready {
                    tracing::info!("IMEX daemon ready");
                }
                self.is_ready = true;
            }
            Err(e) => {
                tracing::warn!(path = %self.ready.path().display(), error = %e, "cannot write the ready file")
            }
        }
    }

    fn not_ready(&mut self, reason: &str) {
        self.ready.clear();
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

    /// SIGUSR1: resolve the peers' names again and reconnect. A failure is only logged, as NVIDIA's
    /// daemon does: the daemon itself, if gone, is seen at once.
    fn reload(&self, peers: &[Peer]) {
        let Some(pid) = self.child.id().and_then(|id| i32::try_from(id).ok()) else {
            return;
        };
        match nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGUSR1,
        ) {
            Ok(()) => {
                tracing::info!(pid, peers = %describe(peers), "SIGUSR1: the IMEX daemon resolves its peers again")
            }
            Err(error) => tracing::warn!(pid, %error, "sending SIGUSR1 to the IMEX daemon"),
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
}

/// Runs the supervisor; returns the exit code.
pub async fn supervise(args: SupervisorArgs) -> Result<i32, SupervisorError> {
    use tokio::signal::unix::{signal, SignalKind};
    let stand_in = args.is_stand_in() || args.ctl_program == STAND_IN_PROGRAM;
    if stand_in && !cfg!(feature = "doubles") {
        return Err(args.failed(NO_STAND_IN.to_string()));
    }
    if let Some(root) = &args.driver_root {
        // The root's /etc/hosts is the host's: the daemon gets its own over it, before the chroot
        // hides the domain's directory at its path outside.
        let dir = root.join(args.dir.strip_prefix("/").unwrap_or(&args.dir));
        let peers = read_peers(&dir.join(PEERS_FILE)).map_err(|detail| args.failed(detail))?;
        mount_hosts_in_root(root, &dir.join(HOSTS_FILE), &peers)
            .map_err(|detail| args.failed(detail))?;
        args.enter_driver_root(root)?;
    }
    let mut term =
        signal(SignalKind::terminate()).map_err(args.io("handling SIGTERM in", Path::new("/")))?;
    let mut readiness = Readiness::new(&args.dir);
    // A restarted container finds the last run's files; the reason why it ended stays until the
    // daemon answers (or says something else).
    readiness.ready.clear();
    if !readiness.not_ready.exists() {
        readiness.not_ready("starting");
    }
    let hosts = HostsFile {
        peers: args.dir.join(PEERS_FILE),
        hosts: args.hosts_file(),
    };
    let mut check = tokio::time::interval(CHECK_PERIOD);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Another IMEX daemon on the node's ports (the host's service, most likely) would make ours fail
    // to bind them, or answer its readiness queries for it. Stand-ins use no ports: tests run many.
    if !args.is_stand_in() {
        while let Some(taken) = port_in_use(&imex_ports()) {
            readiness.not_ready(&port_taken_reason(taken));
            tokio::select! {
                _ = term.recv() => return Ok(0),
                _ = check.tick() => {}
            }
        }
    }
    let applied = match hosts.sync() {
        Ok(peers) => peers,
        Err(detail) => {
            readiness.not_ready(&detail);
            return Err(args.failed(detail));
        }
    };
    let mut daemon = Daemon::start(&args)?;
    let mut reload = Reload::new(applied, Instant::now());
    let outcome = loop {
        tokio::select! {
            _ = term.recv() => break Outcome::Terminated,
            status = daemon.child.wait() => match status {
                Ok(status) => break Outcome::Exited(status),
                Err(e) => return Err(args.io("waiting for", Path::new(&args.program))(e)),
            },
            _ = check.tick() => {
                match hosts.sync() {
                    Ok(peers) if reload.due(&peers, Instant::now()) => {
                        daemon.reload(&peers);
                        reload.sent(peers, Instant::now());
                    }
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "keeping the daemon's hosts file as it is"),
                }
                match query_ready(&args).await {
                    Ok(()) => {
                        reload.answered = true;
                        readiness.ready();
                    }
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
            Ok(0)
        }
        Outcome::Exited(status) => {
            let reason = daemon.exit_reason(args.daemon_name(), &status).await;
            tracing::error!(%reason, "the IMEX daemon exited; the kubelet starts it again");
            readiness.not_ready(&reason);
            // A daemon that exits is a failure even with status 0: it should run until told.
            Ok(match (status.code(), status.signal()) {
                (Some(code), _) if code != 0 => code,
                (_, Some(signal)) => 128 + signal,
                _ => 1,
            })
        }
    }
}

/// When the daemon hears of new peers. It resolved their names at its start and resolves them again
/// on SIGUSR1, which IMEX handles at most once per [`SIGUSR1_WINDOW`] and ignores within it: a change
/// that comes sooner waits for the window to pass, so the last one always reaches the daemon.
#[derive(Debug)]
struct Reload {
    /// The peers the daemon last resolved (at its start, or the last SIGUSR1).
    applied: Vec<Peer>,
    started: Instant,
    last_signal: Option<Instant>,
    /// Whether the daemon answered READY since its start: it handles signals by then.
    answered: bool,
}

impl Reload {
    fn new(applied: Vec<Peer>, started: Instant) -> Self {
        Reload {
            applied,
            started,
            last_signal: None,
            answered: false,
        }
    }

    /// Whether to send SIGUSR1 now for `peers`.
    fn due(&self, peers: &[Peer], now: Instant) -> bool {
        if peers == self.applied.as_slice() {
            return false;
        }
        match self.last_signal {
            Some(at) => now.saturating_duration_since(at) >= SIGUSR1_SPACING,
            // SIGUSR1's default action ends a process: not before the daemon handles it (it answered,
            // or has had a window's time to start).
            None => self.answered || now.saturating_duration_since(self.started) >= SIGUSR1_SPACING,
        }
    }

    fn sent(&mut self, peers: Vec<Peer>, now: Instant) {
        self.applied = peers;
        self.last_signal = Some(now);
    }
}

/// The daemon's hosts file, kept in step with the plugin's peers file.
struct HostsFile {
    peers: PathBuf,
    hosts: PathBuf,
}

impl HostsFile {
    /// Merges the peers into the hosts file where they are not there yet; the peers.
    fn sync(&self) -> Result<Vec<Peer>, String> {
        let peers = read_peers(&self.peers)?;
        let text = match fs::read_to_string(&self.hosts) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(format!("reading {}: {e}", self.hosts.display())),
        };
        let merged = merge_hosts(&text, &peers)
            .map_err(|e| format!("the peers in {}: {e}", self.peers.display()))?;
        if merged != text {
            write_in_place(&self.hosts, &merged)
                .map_err(|e| format!("writing {}: {e}", self.hosts.display()))?;
            tracing::info!(hosts = %self.hosts.display(), peers = %describe(&peers), "the daemon's hosts file now maps the peers");
        }
        Ok(peers)
    }
}

fn read_peers(path: &Path) -> Result<Vec<Peer>, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    parse_peers(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn describe(peers: &[Peer]) -> String {
    peers
        .iter()
        .map(|p| format!("{}={}", p.index, p.address))
        .collect::<Vec<_>>()
        .join(",")
}

/// Rewrites `path` in place (the same file, never a new one renamed over it): the file may be a bind
/// mount's source or target, which a rename would leave behind.
fn write_in_place(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(path)?;
    file.write_all(text.as_bytes())
}

/// The chrooted daemon resolves through the driver root's `/etc/hosts`: the host's own file (or its
/// driver container's), which this Pod must never write. In a mount namespace of its own, private so
/// that nothing propagates out, `hosts` (the domain directory's, seeded from that file and the peers)
/// is bind-mounted over it; updates then rewrite `hosts` in place. Needs CAP_SYS_ADMIN (the Pod is
/// privileged). Called before any other thread exists: a mount namespace is a thread's.
fn mount_hosts_in_root(root: &Path, hosts: &Path, peers: &[Peer]) -> Result<(), String> {
    use nix::mount::{mount, MsFlags};
    use nix::sched::{unshare, CloneFlags};
    let target = root.join("etc/hosts");
    match fs::symlink_metadata(&target) {
        Ok(meta) if meta.file_type().is_file() => {}
        // A link would resolve outside the root here.
        Ok(_) => return Err(format!("{} is not a regular file", target.display())),
        Err(e) => {
            return Err(format!(
                "the driver root's hosts file {}: {e}",
                target.display()
            ))
        }
    }
    unshare(CloneFlags::CLONE_NEWNS)
        .map_err(|e| format!("entering a mount namespace of its own: {e}"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| format!("making its mounts private: {e}"))?;
    let seed =
        fs::read_to_string(&target).map_err(|e| format!("reading {}: {e}", target.display()))?;
    let merged = merge_hosts(&seed, peers).map_err(|e| e.to_string())?;
    write_in_place(hosts, &merged).map_err(|e| format!("writing {}: {e}", hosts.display()))?;
    mount(
        Some(hosts),
        &target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| {
        format!(
            "mounting {} over {}: {e}",
            hosts.display(),
            target.display()
        )
    })
}

/// Where the daemon listens: [`SERVER_PORT`] on the node's address (any, to be sure) and [`CMD_PORT`]
/// on loopback.
fn imex_ports() -> [SocketAddr; 2] {
    [
        SocketAddr::from((Ipv4Addr::UNSPECIFIED, SERVER_PORT)),
        SocketAddr::from((Ipv4Addr::LOCALHOST, CMD_PORT)),
    ]
}

/// The first of `addresses` that another socket listens on (binding it fails with EADDRINUSE); any
/// other failure to bind is not this check's to report.
pub fn port_in_use(addresses: &[SocketAddr]) -> Option<SocketAddr> {
    addresses.iter().copied().find(|address| {
        matches!(std::net::TcpListener::bind(address),
                 Err(e) if e.kind() == std::io::ErrorKind::AddrInUse)
    })
}

fn port_taken_reason(taken: SocketAddr) -> String {
    format!(
        "port {} ({taken}) is in use: another IMEX daemon holds it, most likely the host's {HOST_SERVICE} (`systemctl disable --now {HOST_SERVICE} && systemctl mask {HOST_SERVICE}`); nvidia-imex starts once it is free",
        taken.port()
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(list: &[(u32, &str)]) -> Vec<Peer> {
        list.iter()
            .map(|(index, address)| Peer {
                index: *index,
                address: address.to_string(),
            })
            .collect()
    }

    #[test]
    fn sigusr1_goes_out_once_per_window_and_the_last_change_is_never_lost() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let two = peers(&[(0, "10.0.0.1"), (1, "10.0.0.2")]);
        let three = peers(&[(0, "10.0.0.1"), (1, "10.0.0.2"), (2, "10.0.0.3")]);
        let four = peers(&[
            (0, "10.0.0.1"),
            (1, "10.0.0.2"),
            (2, "10.0.0.3"),
            (3, "10.0.0.4"),
        ]);
        let mut reload = Reload::new(two.clone(), start);
        assert!(!reload.due(&two, at(100)), "what it started with");
        // Before the daemon answered, not until a window after its start (it may not handle the
        // signal yet).
        assert!(!reload.due(&three, at(1000)));
        assert!(reload.due(&three, at(5500)));
        reload.answered = true;
        assert!(
            reload.due(&three, at(1000)),
            "it answered: it handles signals"
        );
        reload.sent(three.clone(), at(1000));
        assert!(!reload.due(&three, at(2000)), "nothing new");
        // A fourth peer 1 s later waits for the window to pass, then goes out.
        for ms in [2000, 4000, 6000, 6499] {
            assert!(!reload.due(&four, at(ms)), "within the window at {ms} ms");
        }
        assert!(reload.due(&four, at(6500)));
        reload.sent(four.clone(), at(6500));
        // Back to three within the window: it waits too, and still goes.
        assert!(!reload.due(&three, at(7000)));
        assert!(reload.due(&three, at(12000)));
    }

    #[test]
    fn a_port_another_socket_listens_on_is_found_and_a_free_one_is_not() {
        let held = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = held.local_addr().unwrap().port();
        let on_loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let anywhere = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
        assert_eq!(port_in_use(&[on_loopback]), Some(on_loopback));
        assert_eq!(
            port_in_use(&[anywhere]),
            Some(anywhere),
            "a listener on loopback holds the port on every address"
        );
        let reason = port_taken_reason(anywhere);
        assert!(
            reason.contains(&format!("port {port} ")) && reason.contains("nvidia-imex.service"),
            "{reason}"
        );
        drop(held);
        assert_eq!(port_in_use(&[on_loopback, anywhere]), None);
    }

    #[test]
    fn the_hosts_file_follows_the_peers_in_place_and_keeps_its_other_lines() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let file = HostsFile {
            peers: dir.path().join(PEERS_FILE),
            hosts: dir.path().join(HOSTS_FILE),
        };
        assert!(file.sync().unwrap_err().contains("peers"), "no peers file");
        fs::write(&file.peers, "10.0.0.1\tcompute-domain-daemon-0000\n").unwrap();
        fs::write(&file.hosts, "127.0.0.1\tlocalhost\n").unwrap();
        let inode = fs::metadata(&file.hosts).unwrap().ino();
        assert_eq!(file.sync().unwrap(), peers(&[(0, "10.0.0.1")]));
        fs::write(
            &file.peers,
            "10.0.0.1\tcompute-domain-daemon-0000\n10.0.0.2\tcompute-domain-daemon-0001\n",
        )
        .unwrap();
        assert_eq!(
            file.sync().unwrap(),
            peers(&[(0, "10.0.0.1"), (1, "10.0.0.2")])
        );
        let text = fs::read_to_string(&file.hosts).unwrap();
        assert!(
            text.starts_with("127.0.0.1\tlocalhost\n")
                && text.ends_with(
                    "10.0.0.1\tcompute-domain-daemon-0000\n10.0.0.2\tcompute-domain-daemon-0001\n"
                ),
            "{text}"
        );
        assert_eq!(fs::metadata(&file.hosts).unwrap().ino(), inode, "in place");
        // A broken peers file leaves the hosts file as it was.
        fs::write(&file.peers, "10.0.0.1 node-a\n").unwrap();
        assert!(file.sync().unwrap_err().contains("peers line 1"));
        assert_eq!(fs::read_to_string(&file.hosts).unwrap(), text);
    }
}
