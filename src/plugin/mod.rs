//! `gpu-dra plugin`: the kubelet plugin as an assembly of named parts (`assembly.rs`, `parts.rs`),
//! started in the order [`start`] states, each within a bound that `/healthz` watches, and stopped in
//! the reverse order on shutdown (sockets removed).

mod assembly;
mod claims_setup;
mod config;
pub mod feature_gates;
pub mod gpu_reports;
mod monitor;
pub mod node_events;
pub mod node_labels;
mod parts;
pub mod preflight;
pub mod reaper;
pub mod selftest;
pub mod startup;
mod supervise;

pub use assembly::{PartBounds, DEFAULT_PART_BOUNDS, STARTUP_BOUND};
pub use config::{BackendChoice, MpsConfig, PluginConfig};
pub use monitor::NodePolicy;
pub use startup::PolicyAtStart;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::apiclient::{ApiClientError, ApiTimeouts};
use crate::claims::{self, Preparer, Recovery};
use crate::gpu::{FakeBackend, GpuBackend, GpuError, Inventory, NvmlBackend, NvmlOptions};
use crate::kubelet;
use crate::observability::{Metrics, Readiness};
use assembly::Assembly;

#[derive(Debug, Error)]
pub enum PluginError {
    #[error("invalid --driver-name {0:?}: must be a DNS subdomain of at most 63 characters")]
    DriverName(String),
    #[error("invalid --node-name {0:?}: must be a DNS subdomain")]
    NodeName(String),
    #[error(transparent)]
    Backend(#[from] GpuError),
    #[error("API server timeouts: {0}")]
    ApiTimeouts(#[from] ApiClientError),
    #[error("creating {path}: {source}")]
    Directory {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Socket(#[from] kubelet::SocketError),
    #[error("the NVIDIA driver's files for containers: {0}; set --driver-root to the driver's root on the host and mount it at --container-driver-root, or install the NVIDIA Container Toolkit's CDI spec (nvidia-ctk cdi generate)")]
    DriverFiles(String),
    #[error("recovering prepared claims: {0}")]
    Recovery(#[from] claims::ClaimError),
    #[error("starting the GPU event reader: {0}")]
    EventReader(std::io::Error),
    #[error("serving HTTP on {addr}: {source}")]
    Http {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("starting the plugin's part {part}: {reason}")]
    Part { part: &'static str, reason: String },
}

/// Opens the configured backend.
pub fn open_backend(
    choice: &BackendChoice,
    node_name: &str,
) -> Result<Arc<dyn GpuBackend>, GpuError> {
    match choice {
        BackendChoice::Fake {
            profile,
            state_file,
        } => Ok(Arc::new(FakeBackend::with_state_file(
            node_name,
            profile,
            state_file.clone(),
        )?)),
        BackendChoice::Nvml { driver_root, .. } => Ok(Arc::new(NvmlBackend::open(NvmlOptions {
            library_path: None,
            driver_root: driver_root.clone(),
        })?)),
    }
}

/// A started plugin; [`RunningPlugin::shutdown`] stops it and removes its sockets.
pub struct RunningPlugin {
    pub config: PluginConfig,
    pub http_addr: Option<SocketAddr>,
    pub recovery: Recovery,
    /// Where the MIG mode the plugin started with came from.
    pub policy_at_start: PolicyAtStart,
    pub preparer: Arc<Preparer>,
    pub metrics: Arc<Metrics>,
    pub readiness: Arc<Readiness>,
    /// The admin's policy for this node as the plugin applies it (fed by the GpuNodePolicy watcher).
    pub policy: watch::Sender<NodePolicy>,
    parts: Assembly,
}

impl RunningPlugin {
    /// Cancels one of the vital tasks (`dra-server`, `registration-server`, `publisher`,
    /// `health-monitor`) as if it had died, so that tests can check what `/healthz` says then.
    /// Returns false for an unknown name.
    pub fn abort_vital_task(&self, name: &str) -> bool {
        self.parts.abort_vital(name)
    }

    /// Stops the parts in the reverse order of their start: readiness, the publisher, the
    /// registration socket (the kubelet stops dialling), the DRA socket, the health monitor, the
    /// claims' followers, the policy watcher, and `/healthz` last.
    pub async fn shutdown(self) {
        self.parts.stop().await;
        info!("plugin stopped; sockets removed");
    }
}

/// Starts the plugin, part after part; each part's bound is in [`PartBounds`], and `/healthz` fails
/// naming a part that runs past it. A part that fails to start stops those started before it.
///
/// `http` (liveness served first) → `backend` (GPUs read) → `policy` → `recovery` (prepared claims)
/// → `health-monitor` → `dra-socket` (DRA and health services) → `registration-socket` (only once
/// the DRA socket serves: the kubelet never dials a socket that does not answer) → `publisher`
/// (slices) → `readiness`.
pub async fn start(
    config: PluginConfig,
    client: kube::Client,
) -> Result<RunningPlugin, PluginError> {
    let shared = parts::Shared::new(checked(config)?, client);
    let bounds = PartBounds::for_config(&shared.config);
    let mut plugin = Assembly::new(shared.liveness.clone());
    let http_addr = plugin
        .start("http", bounds.http, |part| parts::http(part, &shared))
        .await?;
    let gpus = plugin
        .start("backend", bounds.backend, |part| {
            parts::backend(part, &shared)
        })
        .await?;
    let policy = plugin
        .start("policy", bounds.policy, |part| parts::policy(part, &shared))
        .await?;
    let claims = plugin
        .start("recovery", bounds.recovery, |part| {
            parts::recovery(part, &shared, &gpus, &policy)
        })
        .await?;
    let health = plugin
        .start("health-monitor", bounds.health_monitor, |part| {
            parts::health_monitor(part, &shared, &gpus, &policy, &claims)
        })
        .await?;
    plugin
        .start("dra-socket", bounds.dra_socket, |part| {
            parts::dra_socket(part, &shared, &claims, &health)
        })
        .await?;
    plugin
        .start("registration-socket", bounds.registration_socket, |part| {
            parts::registration_socket(part, &shared)
        })
        .await?;
    plugin
        .start("publisher", bounds.publisher, |part| {
            parts::publisher(part, &shared, &gpus, &policy, &health)
        })
        .await?;
    plugin
        .start("readiness", bounds.readiness, |part| {
            parts::readiness(part, &shared)
        })
        .await?;
    let took = plugin.all_started();
    info!(
        driver = %shared.config.driver_name,
        node = %shared.config.node_name,
        dra_socket = %shared.config.dra_socket().display(),
        registration_socket = %shared.config.registration_socket().display(),
        took_ms = took.as_millis() as u64,
        "plugin started"
    );
    Ok(RunningPlugin {
        config: shared.config,
        http_addr,
        recovery: claims.recovery,
        policy_at_start: policy.at_start,
        preparer: claims.preparer,
        metrics: shared.metrics,
        readiness: shared.readiness,
        policy: policy.node,
        parts: plugin,
    })
}

/// The configuration as the plugin runs with it: directories made absolute (the kubelet needs an
/// absolute endpoint in GetInfo; relative ones are taken from here), names and timeouts checked.
fn checked(mut config: PluginConfig) -> Result<PluginConfig, PluginError> {
    for dir in [
        &mut config.registry_dir,
        &mut config.plugins_dir,
        &mut config.cdi_root,
    ] {
        *dir = std::path::absolute(&*dir).map_err(|source| PluginError::Directory {
            path: dir.display().to_string(),
            source,
        })?;
    }
    if !claims::names::is_dns_subdomain(&config.driver_name, 63) {
        return Err(PluginError::DriverName(config.driver_name.clone()));
    }
    if !claims::names::is_dns_subdomain(&config.node_name, 253) {
        return Err(PluginError::NodeName(config.node_name.clone()));
    }
    config.api.check()?;
    Ok(config)
}

/// Asks the backend for the inventory every `interval` and passes on changes, so that a fake profile
/// edited on disk (or a GPU that appears) reaches the ResourceSlices (through the health monitor) and
/// the prepare checks.
async fn rescan(
    backend: Arc<dyn GpuBackend>,
    interval: Duration,
    inventory_tx: watch::Sender<Arc<Inventory>>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
        let reader = backend.clone();
        let latest = match tokio::task::spawn_blocking(move || reader.inventory()).await {
            Ok(Ok(latest)) => latest,
            Ok(Err(error)) => {
                // Keep publishing what we last knew; a broken profile edit must not unpublish the node.
                warn!(%error, "rescanning GPUs failed; keeping the previous inventory");
                continue;
            }
            Err(error) => {
                warn!(%error, "rescan task failed");
                continue;
            }
        };
        if **inventory_tx.borrow() != latest {
            info!(
                gpus = latest.gpus.len(),
                unreadable = latest.unreadable.len(),
                "GPU inventory changed"
            );
            // The health monitor turns it into devices; MIG devices created for claims change the
            // inventory but not what dynamic MIG publishes, so the slices stay as they are then.
            let _ = inventory_tx.send(Arc::new(latest));
        }
    }
}

async fn stopped(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// A client for `--kubeconfig`, or the in-cluster / `KUBECONFIG` configuration when none is given, with
/// the connect and read timeouts of `timeouts` (pass the plugin's [`PluginConfig::api`]).
pub async fn kube_client(
    kubeconfig: Option<&std::path::Path>,
    timeouts: &ApiTimeouts,
) -> Result<kube::Client, anyhow::Error> {
    Ok(crate::apiclient::kube_client(kubeconfig, timeouts).await?)
}

/// Serves a kubelet-facing gRPC server until it ends, or until the kubelet can no longer reach it
/// because the socket file it was bound as (`bound`, at `socket`) was removed or replaced; returns why,
/// for `/healthz`.
async fn serve_while_reachable(
    what: &'static str,
    server: impl std::future::Future<Output = Result<(), tonic::transport::Error>>,
    socket: PathBuf,
    bound: Option<kubelet::SocketFile>,
) -> String {
    tokio::select! {
        served = server => match served {
            Ok(()) => "ended".to_string(),
            Err(error) => {
                error!(%error, server = what, "gRPC server failed");
                format!("failed: {error}")
            }
        },
        lost = kubelet::socket_lost(socket, bound, kubelet::SOCKET_CHECK_INTERVAL) => {
            error!(server = what, why = %lost, "the kubelet can no longer reach this gRPC server");
            lost
        }
    }
}
