//! The two files an IMEX daemon reads: `config.cfg` (NVIDIA's `KEY=VALUE` format, `#` comments) and
//! the peers file it names, `nodes_config.cfg` (one IP address per line: every node of the domain,
//! this one included). Rendering is pure; the plugin writes the files (`daemons.rs`), the stand-in
//! parses them with the same rules the real daemon documents.
//!
//! Several domains may have a daemon on one node, all in the node's network namespace, so each gets
//! its own ports from its channel number, which is unique per domain within a clique:
//! `SERVER_PORT = 50000 + N` (the peers' port; channel 0 keeps NVIDIA's default 50000) and
//! `IMEX_CMD_PORT = 52048 + N` (the command service), so the two ranges of 2048 channels never meet.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use thiserror::Error;

use crate::domains::channels::MAX_CHANNELS;

/// The daemon's config file, in the domain's directory.
pub const CONFIG_FILE: &str = "config.cfg";
/// The peers file, in the domain's directory.
pub const NODES_CONFIG_FILE: &str = "nodes_config.cfg";
/// The port of channel 0's daemon for its peers; channel N listens on `SERVER_PORT_BASE + N`.
pub const SERVER_PORT_BASE: u32 = 50000;
/// The port of channel 0's command service; channel N's is `CMD_PORT_BASE + N`.
pub const CMD_PORT_BASE: u32 = SERVER_PORT_BASE + MAX_CHANNELS;
/// Where the command service listens: only `nvidia-imex-ctl` on this node asks it, and it controls
/// the daemon, so it stays off the network.
pub const CMD_BIND_ADDRESS: &str = "127.0.0.1";

/// The config keys the stand-in (and any reader) requires.
pub const KEY_NODE_CONFIG_FILE: &str = "IMEX_NODE_CONFIG_FILE";
pub const KEY_SERVER_PORT: &str = "SERVER_PORT";
pub const KEY_CMD_PORT: &str = "IMEX_CMD_PORT";

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("channel {channel} is not below {MAX_CHANNELS}, the most IMEX channels a node has")]
    ChannelOutOfRange { channel: u32 },
    #[error("peer address {address:?} is not an IP address")]
    InvalidPeer { address: String },
    #[error("no peers: the node config must list every node of the domain, this one included")]
    NoPeers,
    #[error("line {line}: {text:?} is not KEY=VALUE")]
    MalformedLine { line: usize, text: String },
    #[error("{key} is missing")]
    MissingKey { key: &'static str },
    #[error("{key}={value:?} is not a port between 1 and 65535")]
    InvalidPort { key: &'static str, value: String },
}

/// The ports of channel N's daemon.
pub fn server_port(channel: u32) -> Result<u16, ConfigError> {
    port(SERVER_PORT_BASE, channel)
}

pub fn cmd_port(channel: u32) -> Result<u16, ConfigError> {
    port(CMD_PORT_BASE, channel)
}

fn port(base: u32, channel: u32) -> Result<u16, ConfigError> {
    if channel >= MAX_CHANNELS {
        return Err(ConfigError::ChannelOutOfRange { channel });
    }
    // Both bases plus 2047 stay below 65536.
    u16::try_from(base + channel).map_err(|_| ConfigError::ChannelOutOfRange { channel })
}

/// `config.cfg` for one domain's daemon. `domain` (`namespace/name`) goes into a comment for people
/// who read the file; `nodes_config` is the peers file's path as the daemon sees it.
pub fn render_config(
    domain: &str,
    channel: u32,
    nodes_config: &Path,
) -> Result<String, ConfigError> {
    let server = server_port(channel)?;
    let cmd = cmd_port(channel)?;
    // The keys and values of NVIDIA's template for ComputeDomain daemons, with our ports. Comment
    // text is kept on lines of its own: the daemon reads no trailing comments.
    let domain = domain.replace(['\n', '\r'], " ");
    Ok(format!(
        "# The IMEX daemon of ComputeDomain {domain}, channel {channel}; written by gpu-dra.\n\
         LOG_LEVEL=4\n\
         LOG_FILE_NAME=\n\
         LOG_APPEND_TO_LOG=0\n\
         LOG_USE_SYSLOG=0\n\
         # In the foreground: the Pod's supervisor runs it.\n\
         DAEMONIZE=0\n\
         BIND_INTERFACE_IP=\n\
         {KEY_SERVER_PORT}={server}\n\
         {KEY_NODE_CONFIG_FILE}={}\n\
         NETWORK_INTERFACE=\n\
         IMEX_WAIT_FOR_QUORUM=RECOVERY\n\
         IMEX_ENABLE_AUTH_ENCRYPTION=0\n\
         IMEX_CMD_ENABLED=1\n\
         IMEX_CMD_BIND_INTERFACE_IP={CMD_BIND_ADDRESS}\n\
         {KEY_CMD_PORT}={cmd}\n\
         IMEX_CMD_UNIX_DOMAIN_PATH=\n\
         IMEX_NODE_DISCONNECTED_GRACE_TIME=-1\n",
        nodes_config.display()
    ))
}

/// The peers file: each address once, sorted, one a line. An address that does not parse is an
/// error that names it; so is an empty list.
pub fn render_peers(peers: &[String]) -> Result<String, ConfigError> {
    let mut addresses = Vec::with_capacity(peers.len());
    for peer in peers {
        let address: IpAddr = peer.trim().parse().map_err(|_| ConfigError::InvalidPeer {
            address: peer.clone(),
        })?;
        addresses.push(address);
    }
    addresses.sort();
    addresses.dedup();
    if addresses.is_empty() {
        return Err(ConfigError::NoPeers);
    }
    Ok(addresses.iter().map(|a| format!("{a}\n")).collect())
}

/// Reads a peers file: one address a line, blank lines and `#` comments skipped.
pub fn parse_peers(text: &str) -> Result<Vec<IpAddr>, ConfigError> {
    let mut peers = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        peers.push(line.parse().map_err(|_| ConfigError::InvalidPeer {
            address: line.to_string(),
        })?);
    }
    if peers.is_empty() {
        return Err(ConfigError::NoPeers);
    }
    Ok(peers)
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

    fn peers(list: &[&str]) -> Vec<String> {
        list.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn each_channel_has_ports_of_its_own_that_never_meet_another_channels() {
        assert_eq!(server_port(0), Ok(50000));
        assert_eq!(cmd_port(0), Ok(52048));
        assert_eq!(server_port(7), Ok(50007));
        assert_eq!(cmd_port(7), Ok(52055));
        let last = MAX_CHANNELS - 1;
        assert!(server_port(last).unwrap() < cmd_port(0).unwrap());
        assert_eq!(cmd_port(last), Ok(54095));
        assert_eq!(
            server_port(MAX_CHANNELS),
            Err(ConfigError::ChannelOutOfRange {
                channel: MAX_CHANNELS
            })
        );
    }

    #[test]
    fn the_config_names_the_peers_file_and_the_channels_ports_and_reads_back() {
        let text =
            render_config("team/training", 3, Path::new("/imex/u1/nodes_config.cfg")).unwrap();
        assert!(text.contains("DAEMONIZE=0\n"), "{text}");
        assert!(text.contains("IMEX_CMD_ENABLED=1\n"), "{text}");
        assert!(text.contains("IMEX_WAIT_FOR_QUORUM=RECOVERY\n"), "{text}");
        assert!(text.contains("ComputeDomain team/training"), "{text}");
        let parsed = parse_config(&text).unwrap();
        assert_eq!(parsed.nodes_config, "/imex/u1/nodes_config.cfg");
        assert_eq!(parsed.server_port, 50003);
        assert_eq!(parsed.cmd_port, 52051);
        assert_eq!(parsed.values["IMEX_CMD_BIND_INTERFACE_IP"], "127.0.0.1");
    }

    #[test]
    fn a_domain_name_cannot_add_lines_to_the_config() {
        let text = render_config("team/x\nSERVER_PORT=1", 0, Path::new("/n")).unwrap();
        assert_eq!(parse_config(&text).unwrap().server_port, 50000);
    }

    #[test]
    fn peers_are_sorted_once_each_and_every_one_must_be_an_address() {
        assert_eq!(
            render_peers(&peers(&["10.0.0.2", "10.0.0.10", "10.0.0.2", " 10.0.0.1"])).unwrap(),
            "10.0.0.1\n10.0.0.2\n10.0.0.10\n"
        );
        assert_eq!(render_peers(&peers(&["fd00::1"])).unwrap(), "fd00::1\n");
        assert_eq!(
            render_peers(&peers(&["10.0.0.1", "node-b"])),
            Err(ConfigError::InvalidPeer {
                address: "node-b".into()
            })
        );
        assert_eq!(render_peers(&[]), Err(ConfigError::NoPeers));
        let message = render_peers(&peers(&["10.0.0.300"]))
            .unwrap_err()
            .to_string();
        assert!(message.contains("\"10.0.0.300\""), "{message}");
    }

    #[test]
    fn a_peers_file_reads_back_and_a_bad_line_is_named() {
        let text = render_peers(&peers(&["10.0.0.2", "10.0.0.1"])).unwrap();
        let parsed = parse_peers(&format!("# peers\n\n{text}")).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!(
            parse_peers("10.0.0.1\n10.0.0.x\n"),
            Err(ConfigError::InvalidPeer {
                address: "10.0.0.x".into()
            })
        );
        assert_eq!(parse_peers("\n# none\n"), Err(ConfigError::NoPeers));
    }

    #[test]
    fn a_config_the_daemon_would_refuse_is_refused_with_the_reason() {
        let good = render_config("a/b", 1, Path::new("/n")).unwrap();
        let cases = [
            (good.replace("DAEMONIZE=0", "DAEMONIZE"), "line 7"),
            (
                good.replace("IMEX_NODE_CONFIG_FILE=/n", "IMEX_NODE_CONFIG_FILE="),
                "IMEX_NODE_CONFIG_FILE is missing",
            ),
            (
                good.replace("SERVER_PORT=50001", "SERVER_PORT=70000"),
                "SERVER_PORT=\"70000\"",
            ),
            (
                good.replace("SERVER_PORT=50001", "SERVER_PORT=0"),
                "SERVER_PORT=\"0\"",
            ),
            (
                good.replace("IMEX_CMD_PORT=52049\n", ""),
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
