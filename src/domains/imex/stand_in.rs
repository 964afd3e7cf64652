//! The fake backend's IMEX daemon and control program, with the interfaces of NVIDIA's:
//! `gpu-dra fake imex-daemon -c <config.cfg>` runs in the foreground and `gpu-dra fake imex-ctl -q -c
//! <config.cfg>` prints `READY` when that daemon answers.
//!
//! What it models, as strictly as the real daemon for what the plugin relies on:
//! - It refuses (exits 1 with the problem on stderr) a missing or malformed config: a line that is not
//!   `KEY=VALUE`, no `SERVER_PORT`, `IMEX_CMD_PORT` or `IMEX_NODE_CONFIG_FILE`, a port outside
//!   1..65535; a missing or empty node config; and a node whose own address is not among those the
//!   node config resolves to. NVIDIA's daemon finds its own address among the node's interfaces; fake
//!   nodes share one machine, so the stand-in takes it from `NODE_IP` (the Pod's).
//! - The node config lists names (or addresses); it resolves names only through the hosts file the
//!   supervisor names in `GPU_DRA_IMEX_HOSTS` (a name with no line there is a peer it cannot reach,
//!   not an error), at its start and on SIGUSR1.
//! - It handles at most one SIGUSR1 per 5 s and ignores the others within that window, as IMEX does.
//! - What it runs with is in `stand-in.json` beside its config, for tests and the demo: its address,
//!   its peers (the addresses it resolved), ports, pid, and how many SIGUSR1 it handled and ignored.
//!
//! Its command service is a unix socket, `imex-cmd.sock` in the config's directory, where the real
//! daemon listens on TCP `IMEX_CMD_BIND_INTERFACE_IP:IMEX_CMD_PORT`: fake nodes on one machine share
//! one loopback address and would collide on the port.
//!
//! Failure injection: a file `fail` in the config's directory makes the daemon exit 1 with the file's
//! content on stderr, as a crashed daemon; it is checked at start and every 100 ms.
//! Not modelled: ports and peer connections (it is ready without its peers), quorum, memory import and
//! export, the other `nvidia-imex-ctl` queries, authentication, SIGHUP's log dump, DNS beyond the
//! hosts file.

use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

use super::config::{parse_config, ParsedConfig};
use super::supervisor::SIGUSR1_WINDOW;
use crate::fsutil::write_for_this_boot;

/// The stand-in's command socket, in the config's directory.
pub const CMD_SOCKET: &str = "imex-cmd.sock";
/// What the running stand-in reads from its config and peers, in the config's directory.
pub const STATE_FILE: &str = "stand-in.json";
/// The file that makes the stand-in exit 1 with its content as the reason.
pub const FAIL_FILE: &str = "fail";
/// Where the stand-in learns this node's address.
pub const NODE_IP_ENV: &str = super::pod::NODE_IP_ENV;
/// Where the stand-in learns its hosts file.
pub const HOSTS_ENV: &str = super::supervisor::STAND_IN_HOSTS_ENV;
const QUERY: &str = "query";
const WATCH_PERIOD: Duration = Duration::from_millis(100);

/// What `stand-in.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StandInState {
    pub pid: u32,
    pub address: String,
    /// The addresses the node config's entries resolved to, in its order: the peers it would reach.
    pub peers: Vec<String>,
    pub server_port: u16,
    pub cmd_port: u16,
    /// SIGUSR1 it handled (resolving the peers again) and ignored (within 5 s of the last handled).
    pub usr1_handled: u32,
    pub usr1_ignored: u32,
}

impl StandInState {
    /// The state of the stand-in that runs with the config in `dir`, if one wrote it.
    pub fn read(dir: &Path) -> Option<StandInState> {
        serde_json::from_slice(&fs::read(dir.join(STATE_FILE)).ok()?).ok()
    }
}

/// A problem that keeps the daemon from starting, said as the daemon's one line on stderr.
struct Refusal(String);

fn refuse<T>(reason: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal(reason.into()))
}

/// What the daemon started with.
struct Started {
    config: ParsedConfig,
    dir: PathBuf,
    nodes: Vec<String>,
    hosts: PathBuf,
    address: IpAddr,
    peers: Vec<IpAddr>,
}

/// `gpu-dra fake imex-daemon -c <config>`; returns the exit code.
pub fn daemon(config_path: &Path) -> i32 {
    let started = (|| {
        let (config, dir) = read_config(config_path)?;
        let nodes = read_nodes(&config)?;
        let hosts = match std::env::var_os(HOSTS_ENV) {
            Some(path) if !path.is_empty() => PathBuf::from(path),
            _ => {
                return refuse(format!(
                    "{HOSTS_ENV} is not set: the stand-in resolves the node config's names through that hosts file only"
                ))
            }
        };
        let peers = resolve(&nodes, &read_hosts(&hosts));
        let address = node_address(&config, &peers)?;
        Ok(Started {
            config,
            dir,
            nodes,
            hosts,
            address,
            peers,
        })
    })();
    let started = match started {
        Ok(started) => started,
        Err(Refusal(reason)) => {
            eprintln!("IMEX stand-in: {reason}");
            return 1;
        }
    };
    if let Some(reason) = injected_failure(&started.dir) {
        eprintln!("{reason}");
        return 1;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("IMEX stand-in: starting its runtime: {e}");
            return 1;
        }
    };
    let dir = started.dir.clone();
    let code = runtime.block_on(serve(started));
    let _ = fs::remove_file(dir.join(CMD_SOCKET));
    let _ = fs::remove_file(dir.join(STATE_FILE));
    code
}

fn read_config(path: &Path) -> Result<(ParsedConfig, PathBuf), Refusal> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => return refuse(format!("cannot read the config {}: {e}", path.display())),
    };
    let config =
        parse_config(&text).or_else(|e| refuse(format!("the config {}: {e}", path.display())))?;
    let dir = path
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    Ok((config, dir))
}

/// The node config's entries: names or addresses, one a line; blank lines and `#` comments skipped.
fn read_nodes(config: &ParsedConfig) -> Result<Vec<String>, Refusal> {
    let path = &config.nodes_config;
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => return refuse(format!("cannot read the node config {path}: {e}")),
    };
    let nodes: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(str::to_string)
        .collect();
    if nodes.is_empty() {
        return refuse(format!("the node config {path} lists no nodes"));
    }
    Ok(nodes)
}

/// The hosts file's text; an unreadable one resolves nothing.
fn read_hosts(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| {
        eprintln!(
            "IMEX stand-in: cannot read the hosts file {}: {e}",
            path.display()
        );
        String::new()
    })
}

/// The addresses of the node config's entries, in its order and each once: an address is itself, a
/// name what the first hosts line that lists it says (case-insensitively, as glibc's `files`
/// lookup); a name with none is left out.
fn resolve(nodes: &[String], hosts: &str) -> Vec<IpAddr> {
    let mut resolved = Vec::new();
    for node in nodes {
        let address = node.parse::<IpAddr>().ok().or_else(|| {
            hosts.lines().find_map(|line| {
                let line = line.split('#').next().unwrap_or_default();
                let mut words = line.split_whitespace();
                let address = words.next()?.parse::<IpAddr>().ok()?;
                words
                    .any(|name| name.eq_ignore_ascii_case(node))
                    .then_some(address)
            })
        });
        if let Some(address) = address.filter(|a| !resolved.contains(a)) {
            resolved.push(address);
        }
    }
    resolved
}

fn node_address(config: &ParsedConfig, peers: &[IpAddr]) -> Result<IpAddr, Refusal> {
    let value = std::env::var(NODE_IP_ENV).unwrap_or_default();
    if value.trim().is_empty() {
        return refuse(format!(
            "{NODE_IP_ENV} is not set: the stand-in takes this node's address from it"
        ));
    }
    let address: IpAddr = match value.trim().parse() {
        Ok(address) => address,
        Err(_) => return refuse(format!("{NODE_IP_ENV}={value:?} is not an IP address")),
    };
    if !peers.contains(&address) {
        return refuse(format!(
            "this node's address {address} is not in the node config {} (resolved: {})",
            config.nodes_config,
            list(peers)
        ));
    }
    Ok(address)
}

fn list(addresses: &[IpAddr]) -> String {
    if addresses.is_empty() {
        return "none".into();
    }
    addresses
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn injected_failure(dir: &Path) -> Option<String> {
    let text = fs::read_to_string(dir.join(FAIL_FILE)).ok()?;
    let text = text.trim();
    Some(if text.is_empty() {
        "IMEX stand-in: failing as asked (an empty fail file)".to_string()
    } else {
        text.to_string()
    })
}

fn write_state(dir: &Path, state: &StandInState) {
    let path = dir.join(STATE_FILE);
    let text = serde_json::to_vec_pretty(state).unwrap_or_default();
    if let Err(e) = write_for_this_boot(&path, &text, 0o644) {
        eprintln!("IMEX stand-in: writing {}: {e}", path.display());
    }
}

/// IMEX's SIGUSR1 rule: one handled per window, the others within it ignored.
#[derive(Debug, Default)]
struct Usr1Window {
    last_handled: Option<Instant>,
}

impl Usr1Window {
    /// Whether a SIGUSR1 that arrives at `now` is handled.
    fn handles(&mut self, now: Instant) -> bool {
        if self
            .last_handled
            .is_some_and(|at| now.saturating_duration_since(at) < SIGUSR1_WINDOW)
        {
            return false;
        }
        self.last_handled = Some(now);
        true
    }
}

async fn serve(started: Started) -> i32 {
    use tokio::signal::unix::{signal, SignalKind};
    let Started {
        config,
        dir,
        nodes,
        hosts,
        address,
        peers,
    } = started;
    let (Ok(mut term), Ok(mut int), Ok(mut usr1)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::user_defined1()),
    ) else {
        eprintln!("IMEX stand-in: cannot handle signals");
        return 1;
    };
    let socket = dir.join(CMD_SOCKET);
    let _ = fs::remove_file(&socket);
    let listener = match UnixListener::bind(&socket) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!(
                "IMEX stand-in: cannot listen for commands on {}: {e}",
                socket.display()
            );
            return 1;
        }
    };
    let mut state = StandInState {
        pid: std::process::id(),
        address: address.to_string(),
        peers: peers.iter().map(ToString::to_string).collect(),
        server_port: config.server_port,
        cmd_port: config.cmd_port,
        usr1_handled: 0,
        usr1_ignored: 0,
    };
    write_state(&dir, &state);
    eprintln!(
        "IMEX stand-in: node {address}, peers {}, server port {}, command socket {}",
        list(&peers),
        config.server_port,
        socket.display()
    );
    let mut window = Usr1Window::default();
    let mut watch = tokio::time::interval(WATCH_PERIOD);
    loop {
        tokio::select! {
            _ = watch.tick() => {
                if let Some(reason) = injected_failure(&dir) {
                    eprintln!("{reason}");
                    return 1;
                }
                // Unlike the real daemon, it leaves when its directory goes, so that a test whose
                // temporary directory is removed leaves no daemon behind.
                if !dir.is_dir() {
                    return 0;
                }
            }
            accepted = listener.accept() => if let Ok((stream, _)) = accepted {
                tokio::spawn(answer(stream));
            },
            _ = usr1.recv() => {
                if !window.handles(Instant::now()) {
                    state.usr1_ignored += 1;
                    write_state(&dir, &state);
                    eprintln!("IMEX stand-in: SIGUSR1 within {SIGUSR1_WINDOW:?} of the last: ignored");
                    continue;
                }
                state.usr1_handled += 1;
                let peers = resolve(&nodes, &read_hosts(&hosts));
                if peers.contains(&address) {
                    state.peers = peers.iter().map(ToString::to_string).collect();
                    eprintln!("IMEX stand-in: SIGUSR1: peers now {}", list(&peers));
                } else {
                    eprintln!(
                        "IMEX stand-in: SIGUSR1: keeping the peers it has: this node's address {address} no longer resolves (resolved: {})",
                        list(&peers)
                    );
                }
                write_state(&dir, &state);
            },
            _ = term.recv() => return 0,
            _ = int.recv() => return 0,
        }
    }
}

/// One command connection: every `query` line is answered `READY`.
async fn answer(stream: tokio::net::UnixStream) {
    let (read, mut write) = stream.into_split();
    let mut lines = tokio::io::BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = if line.trim() == QUERY {
            "READY\n".to_string()
        } else {
            format!("ERROR unknown command {:?}\n", line.trim())
        };
        if write.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// `gpu-dra fake imex-ctl -q -c <config>`: prints the daemon's state; exits 1 when it cannot ask.
pub fn ctl_query(config_path: &Path) -> i32 {
    let dir = match read_config(config_path) {
        Ok((_, dir)) => dir,
        Err(Refusal(reason)) => {
            eprintln!("IMEX ctl stand-in: {reason}");
            return 1;
        }
    };
    let socket = dir.join(CMD_SOCKET);
    let asked = (|| -> io::Result<String> {
        let mut stream = std::os::unix::net::UnixStream::connect(&socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        stream.write_all(format!("{QUERY}\n").as_bytes())?;
        let mut reply = String::new();
        BufReader::new(stream).read_line(&mut reply)?;
        Ok(reply.trim().to_string())
    })();
    match asked {
        Ok(reply) if !reply.is_empty() => {
            println!("{reply}");
            0
        }
        Ok(_) => {
            eprintln!(
                "the IMEX daemon at {} closed the connection",
                socket.display()
            );
            1
        }
        Err(e) => {
            eprintln!(
                "cannot connect to the IMEX daemon's command service at {}: {e}",
                socket.display()
            );
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_through_the_hosts_file_only_and_an_unknown_one_is_a_peer_out_of_reach() {
        let nodes: Vec<String> = super::super::config::render_nodes_config()
            .lines()
            .map(String::from)
            .chain(["10.0.0.9".to_string()])
            .collect();
        let hosts = "127.0.0.1 localhost\n# 10.0.0.8 compute-domain-daemon-0000\n10.0.0.2\tCOMPUTE-DOMAIN-DAEMON-0001 # b\n10.0.0.1\tcompute-domain-daemon-0000\n10.0.0.7\tcompute-domain-daemon-0000\nbad compute-domain-daemon-0002\n";
        let resolved = resolve(&nodes, hosts);
        let strings: Vec<String> = resolved.iter().map(ToString::to_string).collect();
        assert_eq!(strings, ["10.0.0.1", "10.0.0.2", "10.0.0.9"]);
        assert_eq!(resolve(&nodes[..18], ""), Vec::<IpAddr>::new());
    }

    #[test]
    fn one_sigusr1_is_handled_per_window_and_the_rest_ignored() {
        let start = Instant::now();
        let mut window = Usr1Window::default();
        assert!(window.handles(start));
        assert!(!window.handles(start + Duration::from_millis(10)));
        assert!(!window.handles(start + Duration::from_millis(4999)));
        assert!(window.handles(start + Duration::from_secs(5)));
        assert!(!window.handles(start + Duration::from_secs(6)));
    }
}
