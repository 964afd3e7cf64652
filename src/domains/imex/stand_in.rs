//! The fake backend's IMEX daemon and control program, with the interfaces of NVIDIA's:
//! `gpu-dra fake imex-daemon -c <config.cfg>` runs in the foreground and `gpu-dra fake imex-ctl -q -c
//! <config.cfg>` prints `READY` when that daemon answers.
//!
//! The daemon refuses what the real one would not run with, exiting 1 with the problem on stderr: a
//! missing or malformed config (a line that is not `KEY=VALUE`, no `IMEX_NODE_CONFIG_FILE`, a port
//! outside 1..65535), a missing or empty peers file, an address in it that does not parse, and a node
//! that is not among its peers. NVIDIA's daemon finds its own address among the node's interfaces;
//! fake nodes share one machine, so the stand-in takes it from `NODE_IP` (the Pod's).
//!
//! Its command service is a unix socket, `imex-cmd.sock` in the config's directory, where the real
//! daemon listens on TCP `IMEX_CMD_BIND_INTERFACE_IP:IMEX_CMD_PORT`: fake nodes on one machine share
//! one loopback address, and two domains of one channel on two fake nodes would collide there.
//! What it runs with is in `stand-in.json` beside it (its address, peers, ports, pid), for tests and
//! the demo; SIGHUP makes it read the peers file again.
//!
//! Failure injection: a file `fail` in the config's directory makes the daemon exit 1 with the file's
//! content on stderr, as a crashed daemon; it is checked at start and every 100 ms.
//! Not modelled: peer connections, quorum, memory import and export, the other `nvidia-imex-ctl`
//! queries, authentication.

use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

use super::config::{parse_config, parse_peers, ParsedConfig};
use crate::fsutil::write_for_this_boot;

/// The stand-in's command socket, in the config's directory.
pub const CMD_SOCKET: &str = "imex-cmd.sock";
/// What the running stand-in reads from its config and peers, in the config's directory.
pub const STATE_FILE: &str = "stand-in.json";
/// The file that makes the stand-in exit 1 with its content as the reason.
pub const FAIL_FILE: &str = "fail";
/// Where the stand-in learns this node's address.
pub const NODE_IP_ENV: &str = super::pod::NODE_IP_ENV;
const QUERY: &str = "query";
const WATCH_PERIOD: Duration = Duration::from_millis(100);

/// What `stand-in.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StandInState {
    pub pid: u32,
    pub address: String,
    pub peers: Vec<String>,
    pub server_port: u16,
    pub cmd_port: u16,
    /// How many times it read the peers (1 at start, one more per SIGHUP).
    pub peer_reads: u32,
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

/// `gpu-dra fake imex-daemon -c <config>`; returns the exit code.
pub fn daemon(config_path: &Path) -> i32 {
    let started = (|| {
        let (config, dir) = read_config(config_path)?;
        let peers = read_peers(&config)?;
        let address = node_address(&config, &peers)?;
        Ok((config, dir, peers, address))
    })();
    let (config, dir, peers, address) = match started {
        Ok(started) => started,
        Err(Refusal(reason)) => {
            eprintln!("IMEX stand-in: {reason}");
            return 1;
        }
    };
    if let Some(reason) = injected_failure(&dir) {
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
    let code = runtime.block_on(serve(&config, &dir, peers, address));
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

fn read_peers(config: &ParsedConfig) -> Result<Vec<IpAddr>, Refusal> {
    let path = &config.nodes_config;
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => return refuse(format!("cannot read the node config {path}: {e}")),
    };
    parse_peers(&text).or_else(|e| refuse(format!("the node config {path}: {e}")))
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
            "this node's address {address} is not in the node config {}",
            config.nodes_config
        ));
    }
    Ok(address)
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

async fn serve(config: &ParsedConfig, dir: &Path, peers: Vec<IpAddr>, address: IpAddr) -> i32 {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
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
        peer_reads: 1,
    };
    write_state(dir, &state);
    eprintln!(
        "IMEX stand-in: node {address}, peers {}, server port {}, command socket {}",
        state.peers.join(","),
        config.server_port,
        socket.display()
    );
    let mut watch = tokio::time::interval(WATCH_PERIOD);
    loop {
        tokio::select! {
            _ = watch.tick() => {
                if let Some(reason) = injected_failure(dir) {
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
            _ = hup.recv() => match read_peers(config).and_then(|peers| {
                node_address(config, &peers).map(|_| peers)
            }) {
                Ok(peers) => {
                    state.peers = peers.iter().map(ToString::to_string).collect();
                    state.peer_reads += 1;
                    write_state(dir, &state);
                    eprintln!("IMEX stand-in: SIGHUP: peers now {}", state.peers.join(","));
                }
                Err(Refusal(reason)) => {
                    eprintln!("IMEX stand-in: SIGHUP: keeping the peers it has: {reason}")
                }
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
