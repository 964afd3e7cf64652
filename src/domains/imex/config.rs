//! The files an IMEX daemon reads, rendered and parsed here (pure); the plugin writes them
//! (`daemons.rs`), the supervisor keeps the hosts file (`supervisor.rs`), the stand-in reads them with
//! the rules the real daemon documents.
//!
//! A node runs one IMEX daemon (one per OS instance, as NVIDIA's service), on NVIDIA's default ports:
//! `SERVER_PORT=50000` for its peers and `IMEX_CMD_PORT=50005` for `nvidia-imex-ctl`. Its
//! `nodes_config.cfg` does not list addresses but the [`MAX_NODES_PER_DOMAIN`] names
//! `compute-domain-daemon-0000` … `compute-domain-daemon-0017`, the same on every node and for good,
//! so the daemon never restarts for new peers. Each joined node has an index below that count, unique
//! in its clique; the plugin writes the peers file (`peers`: one `<ip>\t<name>` hosts line per peer)
//! and the supervisor merges those lines into the hosts file the daemon resolves the names with, then
//! sends it SIGUSR1. This is NVIDIA's ComputeDomain daemon's way (`IMEXDaemonsWithDNSNames`, on by
//! default), with its names.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use thiserror::Error;

/// The daemon's config file, in the domain's directory.
pub const CONFIG_FILE: &str = "config.cfg";
/// The node config: the names of every possible node of the IMEX domain, in the domain's directory.
pub const NODES_CONFIG_FILE: &str = "nodes_config.cfg";
/// The plugin's peers: the hosts lines that map the names of the joined nodes to their addresses.
pub const PEERS_FILE: &str = "peers";
/// The port the daemon's peers reach it at (NVIDIA's default).
pub const SERVER_PORT: u16 = 50000;
/// The port of the daemon's command service, which `nvidia-imex-ctl` asks (NVIDIA's template's).
pub const CMD_PORT: u16 = 50005;
/// Where the command service listens. NVIDIA's daemon Pod binds it to its Pod IP; ours runs on the
/// host network, where any address but loopback is the node's and reachable from the network, and
/// the service controls the daemon: only `nvidia-imex-ctl` on this node needs it.
pub const CMD_BIND_ADDRESS: &str = "127.0.0.1";
/// The most nodes one IMEX domain has on GB200 and GB300, NVIDIA's `--max-nodes-per-imex-domain`
/// default: the names `nodes_config.cfg` lists, and the bound of a peer's index.
pub const MAX_NODES_PER_DOMAIN: u32 = 18;
/// The start of every name in `nodes_config.cfg` (NVIDIA's); a hosts line that contains it is ours.
pub const DNS_NAME_PREFIX: &str = "compute-domain-daemon-";
/// The line above our entries in a hosts file. It contains [`DNS_NAME_PREFIX`], so a merge drops it
/// with the entries and writes it once (NVIDIA's comment has no prefix and piles up on every update).
pub const HOSTS_COMMENT: &str =
    "# compute-domain-daemon-NNNN: the IMEX daemons of this node's ComputeDomain (gpu-dra)";

/// The config keys the stand-in (and any reader) requires.
pub const KEY_NODE_CONFIG_FILE: &str = "IMEX_NODE_CONFIG_FILE";
pub const KEY_SERVER_PORT: &str = "SERVER_PORT";
pub const KEY_CMD_PORT: &str = "IMEX_CMD_PORT";

/// One node of the daemon's IMEX domain: its index (its name is `compute-domain-daemon-<index>`) and
/// its IP address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Peer {
    pub index: u32,
    pub address: String,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("peer {index}'s address {address:?} is not an IP address")]
    InvalidPeer { index: u32, address: String },
    #[error("peer {address} has index {index}, not below {MAX_NODES_PER_DOMAIN}, the most nodes of one IMEX domain")]
    IndexOutOfRange { index: u32, address: String },
    #[error("index {index} is given to two peers, {first} and {second}: each node of a clique has its own")]
    DuplicateIndex {
        index: u32,
        first: String,
        second: String,
    },
    #[error("no peers: the peers must list every node of the domain, this one included")]
    NoPeers,
    #[error("peers line {line}: {text:?} is not `<ip> compute-domain-daemon-NNNN`")]
    MalformedPeerLine { line: usize, text: String },
    #[error("line {line}: {text:?} is not KEY=VALUE")]
    MalformedLine { line: usize, text: String },
    #[error("{key} is missing")]
    MissingKey { key: &'static str },
    #[error("{key}={value:?} is not a port between 1 and 65535")]
    InvalidPort { key: &'static str, value: String },
}

/// The name of the node with `index`: `compute-domain-daemon-0007` (NVIDIA's `%04d`).
pub fn dns_name(index: u32) -> String {
    format!("{DNS_NAME_PREFIX}{index:04}")
}

/// The index a name of [`dns_name`]'s stands for; `None` for any other name.
pub fn dns_name_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(DNS_NAME_PREFIX)?;
    if digits.len() != 4 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits
        .parse()
        .ok()
        .filter(|index| *index < MAX_NODES_PER_DOMAIN)
}

/// `config.cfg` of this node's daemon, for domain `domain` (`namespace/name`, in a comment for people
/// who read the file); `nodes_config` is the node config's path as the daemon sees it.
pub fn render_config(domain: &str, nodes_config: &Path) -> String {
    // The keys and values of NVIDIA's template for ComputeDomain daemons. Comment text is kept on
    // lines of its own: the daemon reads no trailing comments.
    let domain = domain.replace(['\n', '\r'], " ");
    format!(
        "# The IMEX daemon of this node, for ComputeDomain {domain}; written by gpu-dra.\n\
         LOG_LEVEL=4\n\
         LOG_FILE_NAME=\n\
         LOG_APPEND_TO_LOG=0\n\
         LOG_USE_SYSLOG=0\n\
         # In the foreground: the Pod's supervisor runs it.\n\
         DAEMONIZE=0\n\
         BIND_INTERFACE_IP=\n\
         {KEY_SERVER_PORT}={SERVER_PORT}\n\
         {KEY_NODE_CONFIG_FILE}={}\n\
         NETWORK_INTERFACE=\n\
         IMEX_WAIT_FOR_QUORUM=RECOVERY\n\
         IMEX_ENABLE_AUTH_ENCRYPTION=0\n\
         IMEX_CMD_ENABLED=1\n\
         IMEX_CMD_BIND_INTERFACE_IP={CMD_BIND_ADDRESS}\n\
         {KEY_CMD_PORT}={CMD_PORT}\n\
         IMEX_CMD_UNIX_DOMAIN_PATH=\n\
         IMEX_NODE_DISCONNECTED_GRACE_TIME=-1\n",
        nodes_config.display()
    )
}

/// `nodes_config.cfg`: every name a node of the domain may have, one a line. The same on every node
/// and for every domain, so it never changes under a running daemon.
pub fn render_nodes_config() -> String {
    (0..MAX_NODES_PER_DOMAIN)
        .map(|index| format!("{}\n", dns_name(index)))
        .collect()
}

/// The peers file: one hosts line `<ip>\t<name>` per peer, by index. An index out of range, an index
/// given twice and an address that is not an IP are errors that name them; so is an empty list.
pub fn render_peers(peers: &[Peer]) -> Result<String, ConfigError> {
    let mut by_index: BTreeMap<u32, IpAddr> = BTreeMap::new();
    for peer in peers {
        let address: IpAddr =
            peer.address
                .trim()
                .parse()
                .map_err(|_| ConfigError::InvalidPeer {
                    index: peer.index,
                    address: peer.address.clone(),
                })?;
        if peer.index >= MAX_NODES_PER_DOMAIN {
            return Err(ConfigError::IndexOutOfRange {
                index: peer.index,
                address: peer.address.clone(),
            });
        }
        if let Some(first) = by_index.insert(peer.index, address) {
            return Err(ConfigError::DuplicateIndex {
                index: peer.index,
                first: first.to_string(),
                second: address.to_string(),
            });
        }
    }
    if by_index.is_empty() {
        return Err(ConfigError::NoPeers);
    }
    Ok(by_index
        .iter()
        .map(|(index, address)| format!("{address}\t{}\n", dns_name(*index)))
        .collect())
}

/// Reads a peers file back (the supervisor does, before it puts the lines into a hosts file):
/// `<ip> <name>` lines, blank lines and `#` comments skipped; checked as [`render_peers`] checks.
pub fn parse_peers(text: &str) -> Result<Vec<Peer>, ConfigError> {
    let mut peers = Vec::new();
    for (at, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let mut words = trimmed.split_whitespace();
        let (Some(address), Some(name), None) = (words.next(), words.next(), words.next()) else {
            return Err(ConfigError::MalformedPeerLine {
                line: at + 1,
                text: line.to_string(),
            });
        };
        let index = dns_name_index(name).ok_or_else(|| ConfigError::MalformedPeerLine {
            line: at + 1,
            text: line.to_string(),
        })?;
        peers.push(Peer {
            index,
            address: address.to_string(),
        });
    }
    render_peers(&peers)?;
    peers.sort();
    Ok(peers)
}

/// A hosts file's text with our names mapped to `peers`, as NVIDIA's daemon updates `/etc/hosts`:
/// every line that contains [`DNS_NAME_PREFIX`] goes (the last update's entries and comment), the
/// others stay as they are, and [`HOSTS_COMMENT`] and the peers' lines follow. Merging twice gives
/// the same text.
pub fn merge_hosts(hosts: &str, peers: &[Peer]) -> Result<String, ConfigError> {
    let ours = render_peers(peers)?;
    let mut merged: String = hosts
        .lines()
        .filter(|line| !line.contains(DNS_NAME_PREFIX))
        .map(|line| format!("{line}\n"))
        .collect();
    merged.push_str(HOSTS_COMMENT);
    merged.push('\n');
    merged.push_str(&ours);
    Ok(merged)
}

/// What a daemon reads from `config.cfg`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedConfig {
    pub values: BTreeMap<String, String>,
    pub nodes_config: String,
    pub server_port: u16,
    pub cmd_port: u16,
}

/// Reads `config.cfg` as the daemon does: `KEY=VALUE` lines, blank lines and `#` comments; the peers
/// file and both ports are required.
pub fn parse_config(text: &str) -> Result<ParsedConfig, ConfigError> {
    let mut values = BTreeMap::new();
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let malformed = || ConfigError::MalformedLine {
            line: index + 1,
            text: line.to_string(),
        };
        let (key, value) = trimmed.split_once('=').ok_or_else(malformed)?;
        let key = key.trim();
        if key.is_empty()
            || !key
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(malformed());
        }
        values.insert(key.to_string(), value.trim().to_string());
    }
    let required = |key: &'static str| {
        values
            .get(key)
            .filter(|v| !v.is_empty())
            .cloned()
            .ok_or(ConfigError::MissingKey { key })
    };
    let parse_port = |key: &'static str| -> Result<u16, ConfigError> {
        let value = required(key)?;
        value
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or(ConfigError::InvalidPort { key, value })
    };
    Ok(ParsedConfig {
        nodes_config: required(KEY_NODE_CONFIG_FILE)?,
        server_port: parse_port(KEY_SERVER_PORT)?,
        cmd_port: parse_port(KEY_CMD_PORT)?,
        values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(index: u32, address: &str) -> Peer {
        Peer {
            index,
            address: address.into(),
        }
    }

    #[test]
    fn the_config_has_nvidias_ports_and_names_the_node_config_and_reads_back() {
        let text = render_config("team/training", Path::new("/imex/u1/nodes_config.cfg"));
        assert!(text.contains("DAEMONIZE=0\n"), "{text}");
        assert!(text.contains("IMEX_CMD_ENABLED=1\n"), "{text}");
        assert!(text.contains("IMEX_WAIT_FOR_QUORUM=RECOVERY\n"), "{text}");
        assert!(text.contains("ComputeDomain team/training"), "{text}");
        let parsed = parse_config(&text).unwrap();
        assert_eq!(parsed.nodes_config, "/imex/u1/nodes_config.cfg");
        assert_eq!((parsed.server_port, parsed.cmd_port), (50000, 50005));
        assert_eq!(parsed.values["IMEX_CMD_BIND_INTERFACE_IP"], "127.0.0.1");
    }

    #[test]
    fn a_domain_name_cannot_add_lines_to_the_config() {
        let text = render_config("team/x\nSERVER_PORT=1", Path::new("/n"));
        assert_eq!(parse_config(&text).unwrap().server_port, 50000);
    }

    #[test]
    fn the_node_config_lists_the_eighteen_names_in_nvidias_format() {
        let text = render_nodes_config();
        let names: Vec<&str> = text.lines().collect();
        assert_eq!(names.len(), 18);
        assert_eq!(names[0], "compute-domain-daemon-0000");
        assert_eq!(names[7], "compute-domain-daemon-0007");
        assert_eq!(names[17], "compute-domain-daemon-0017");
        assert_eq!(dns_name_index("compute-domain-daemon-0017"), Some(17));
        for other in [
            "compute-domain-daemon-0018",
            "compute-domain-daemon-7",
            "compute-domain-daemon-00a1",
            "node-a",
        ] {
            assert_eq!(dns_name_index(other), None, "{other}");
        }
    }

    #[test]
    fn peers_are_hosts_lines_by_index_and_every_one_is_checked() {
        assert_eq!(
            render_peers(&[peer(2, "10.0.0.3"), peer(0, " 10.0.0.1"), peer(1, "fd00::2")]).unwrap(),
            "10.0.0.1\tcompute-domain-daemon-0000\nfd00::2\tcompute-domain-daemon-0001\n10.0.0.3\tcompute-domain-daemon-0002\n"
        );
        let cases = [
            (
                vec![peer(0, "10.0.0.1"), peer(1, "node-b")],
                "peer 1's address \"node-b\"",
            ),
            (
                vec![peer(18, "10.0.0.1")],
                "peer 10.0.0.1 has index 18, not below 18",
            ),
            (
                vec![peer(3, "10.0.0.1"), peer(3, "10.0.0.2")],
                "index 3 is given to two peers, 10.0.0.1 and 10.0.0.2",
            ),
            (vec![peer(0, "10.0.0.300")], "\"10.0.0.300\""),
            (vec![], "no peers"),
        ];
        for (peers, expected) in cases {
            let error = render_peers(&peers).unwrap_err().to_string();
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
        }
    }

    #[test]
    fn a_peers_file_reads_back_and_a_bad_line_is_named() {
        let peers = [peer(4, "10.0.0.5"), peer(1, "10.0.0.2")];
        let text = render_peers(&peers).unwrap();
        assert_eq!(
            parse_peers(&format!("# peers\n\n{text}")).unwrap(),
            [peer(1, "10.0.0.2"), peer(4, "10.0.0.5")]
        );
        for (text, expected) in [
            ("10.0.0.1 node-a\n", "peers line 1"),
            (
                "10.0.0.1 compute-domain-daemon-0000\n10.0.0.2\n",
                "peers line 2",
            ),
            ("10.0.0.x compute-domain-daemon-0000\n", "\"10.0.0.x\""),
            (
                "10.0.0.1 compute-domain-daemon-0000\n10.0.0.2 compute-domain-daemon-0000\n",
                "index 0 is given to two peers",
            ),
            ("\n# none\n", "no peers"),
        ] {
            let error = parse_peers(text).unwrap_err().to_string();
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
        }
    }

    #[test]
    fn a_merge_replaces_our_lines_keeps_the_rest_and_writes_the_comment_once() {
        let kubelet = "# Kubernetes-managed hosts file (host network).\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n10.0.0.1\tnode-a\n";
        let first = merge_hosts(kubelet, &[peer(1, "10.0.0.2"), peer(0, "10.0.0.1")]).unwrap();
        assert_eq!(
            first,
            format!("{kubelet}{HOSTS_COMMENT}\n10.0.0.1\tcompute-domain-daemon-0000\n10.0.0.2\tcompute-domain-daemon-0001\n")
        );
        assert_eq!(
            merge_hosts(&first, &[peer(0, "10.0.0.1"), peer(1, "10.0.0.2")]).unwrap(),
            first,
            "merging again changes nothing"
        );
        // A peer leaves and one joins: the old mapping goes, the comment stays one line.
        let second = merge_hosts(&first, &[peer(0, "10.0.0.1"), peer(2, "10.0.0.9")]).unwrap();
        assert_eq!(
            second,
            format!("{kubelet}{HOSTS_COMMENT}\n10.0.0.1\tcompute-domain-daemon-0000\n10.0.0.9\tcompute-domain-daemon-0002\n")
        );
        assert_eq!(second.matches(HOSTS_COMMENT).count(), 1);
        // NVIDIA's daemon's lines (its comment has no prefix and stays) and a file without a final
        // newline.
        let nvidia = "127.0.0.1 localhost\n# Compute Domain Daemon mappings\n10.0.0.7\tcompute-domain-daemon-0003";
        assert_eq!(
            merge_hosts(nvidia, &[peer(0, "10.0.0.1")]).unwrap(),
            format!("127.0.0.1 localhost\n# Compute Domain Daemon mappings\n{HOSTS_COMMENT}\n10.0.0.1\tcompute-domain-daemon-0000\n")
        );
        assert_eq!(
            merge_hosts("", &[peer(0, "10.0.0.1")]).unwrap(),
            format!("{HOSTS_COMMENT}\n10.0.0.1\tcompute-domain-daemon-0000\n")
        );
        assert!(merge_hosts(kubelet, &[peer(20, "10.0.0.1")]).is_err());
    }

    #[test]
    fn a_config_the_daemon_would_refuse_is_refused_with_the_reason() {
        let good = render_config("a/b", Path::new("/n"));
        let cases = [
            (good.replace("DAEMONIZE=0", "DAEMONIZE"), "line 7"),
            (
                good.replace("IMEX_NODE_CONFIG_FILE=/n", "IMEX_NODE_CONFIG_FILE="),
                "IMEX_NODE_CONFIG_FILE is missing",
            ),
            (
                good.replace("SERVER_PORT=50000", "SERVER_PORT=70000"),
                "SERVER_PORT=\"70000\"",
            ),
            (
                good.replace("SERVER_PORT=50000", "SERVER_PORT=0"),
                "SERVER_PORT=\"0\"",
            ),
            (
                good.replace("SERVER_PORT=50000\n", ""),
                "SERVER_PORT is missing",
            ),
            (
                good.replace("IMEX_CMD_PORT=50005\n", ""),
                "IMEX_CMD_PORT is missing",
            ),
            ("lower=1\n".to_string(), "line 1"),
        ];
        for (text, expected) in cases {
            let error = parse_config(&text).unwrap_err().to_string();
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
        }
    }
}
