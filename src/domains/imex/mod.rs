//! This node's IMEX daemon. Memory shared over NVLink between nodes is brokered by NVIDIA's
//! `nvidia-imex`, one daemon per node (per OS instance, as NVIDIA's service), serving the one
//! ComputeDomain the node is in, each knowing all the others by name. The plugin calls
//! [`ImexDaemons`] when it prepares a domain's channel: it writes the daemon's files into
//! `<plugin-dir>/imex/<domainUID>/` (`config.rs`) and creates a Pod of the daemon's own (`pod.rs`), so
//! the daemon outlives plugin restarts and upgrades. It refuses while another domain's daemon still
//! runs on the node, and where the host runs NVIDIA's `nvidia-imex.service` (`host_service.rs`).
//! In the Pod, `gpu-dra imex-daemon` (`supervisor.rs`) runs `nvidia-imex`, asks `nvidia-imex-ctl`
//! whether it is ready, and keeps the daemon's hosts file in step with the peers, with SIGUSR1 to make
//! the daemon resolve them again (never a restart). The fake backend runs a stand-in for both
//! programs (`stand_in.rs`, only with the `doubles` feature).
//!
//! A domain's directory holds `config.cfg`, `nodes_config.cfg` (the 18 names) and `peers` (hosts lines
//! that map the joined nodes' names to their addresses), all the plugin's; and the supervisor's
//! `ready` (present while the daemon answers READY), `not-ready` (why not, for the plugin to report)
//! and, where the daemon does not resolve through the container's own `/etc/hosts`, `hosts`.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

pub mod config;
mod daemons;
pub mod host_managed;
pub mod host_service;
pub mod pod;
#[cfg(feature = "doubles")]
pub mod stand_in;
pub mod supervisor;

pub use config::{ConfigError, Peer};
pub use daemons::ImexDaemons;
pub use pod::{ImexPodTemplate, ImexProgram, ImexPrograms};

/// The file the supervisor keeps in the domain's directory while the daemon answers READY.
pub const READY_FILE: &str = "ready";
/// The file the supervisor keeps there while it does not: why, in one line.
pub const NOT_READY_FILE: &str = "not-ready";

/// The daemon one node runs for the domain it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImexDaemonSpec {
    /// The domain's UID: its directory and Pod are named by it.
    pub domain_uid: String,
    /// `namespace/name`, for messages.
    pub domain: String,
    /// Every joined node of the domain's clique, this one included: index and IP address.
    pub peers: Vec<Peer>,
}

/// Whether a domain's daemon on this node brokers memory now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DaemonState {
    Ready,
    /// Why not, in the kubelet's and the daemon's words, for people (domain status, events).
    NotReady {
        reason: String,
    },
}

#[derive(Debug, Error)]
pub enum ImexError {
    #[error("IMEX daemon of ComputeDomain UID {uid:?}: {reason}")]
    InvalidDomainUid { uid: String, reason: String },
    #[error("IMEX daemon of ComputeDomain {domain}: {source}")]
    Config { domain: String, source: ConfigError },
    #[error("IMEX daemon of ComputeDomain {domain}: {}", supervisor::NO_STAND_IN)]
    NoStandIn { domain: String },
    #[error("IMEX daemon of ComputeDomain {domain}: {action} {}: {source}", path.display())]
    Io {
        domain: String,
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("IMEX daemon of ComputeDomain {domain}: Pod {namespace}/{pod}: {action}: {source}")]
    Api {
        domain: String,
        namespace: String,
        pod: String,
        action: &'static str,
        source: Box<kube::Error>,
    },
    #[error("IMEX daemon of ComputeDomain {domain}: the IMEX daemon of ComputeDomain {other_uid} still runs on this node: a node runs one IMEX daemon, serving one ComputeDomain at a time (its Pod {namespace}/{pod}{})", being_deleted(.terminating))]
    OtherDomainRunning {
        domain: String,
        other_uid: String,
        namespace: String,
        pod: String,
        terminating: bool,
    },
    #[error("IMEX daemon of ComputeDomain {domain}: {reason}")]
    HostService { domain: String, reason: String },
    #[error("IMEX daemon of ComputeDomain {domain}: Pod {namespace}/{pod} still there {waited:?} after its deletion")]
    StillRunning {
        domain: String,
        namespace: String,
        pod: String,
        waited: Duration,
    },
}

fn being_deleted(terminating: &bool) -> &'static str {
    if *terminating {
        " is being deleted"
    } else {
        ""
    }
}

/// A domain UID is a Kubernetes UID (a lowercase UUID) before it names a directory or a Pod.
pub(crate) fn check_domain_uid(uid: &str) -> Result<(), ImexError> {
    crate::claims::names::check_uid(uid).map_err(|_| ImexError::InvalidDomainUid {
        uid: crate::claims::names::truncated(uid),
        reason: "not a lowercase UUID, as the API server makes UIDs".into(),
    })
}
