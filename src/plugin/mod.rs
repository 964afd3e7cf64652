//! `gpu-dra plugin`: wires the backend, the claim state machine, the gRPC servers, the ResourceSlice
//! publisher and the HTTP endpoints together, and takes them down cleanly (sockets removed) on shutdown.

mod claims_setup;
mod config;
pub mod feature_gates;
pub mod gpu_reports;
mod monitor;
pub mod node_events;
pub mod node_labels;
pub mod preflight;
pub mod reaper;
pub mod selftest;
pub mod startup;
mod supervise;

pub use config::{BackendChoice, MpsConfig, PluginConfig};
pub use monitor::NodePolicy;
use monitor::{Monitor, MonitorChannels};
pub use startup::PolicyAtStart;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::apiclient::{ApiClientError, ApiTimeouts};
use crate::cdi::CdiRegistry;
use crate::claims::{self, ClaimsConfig, Preparer, Recovery};
use crate::devices::node_devices;
use crate::gpu::{FakeBackend, GpuBackend, GpuError, Inventory, NvmlBackend, NvmlOptions};
use crate::kubelet::health::DEFAULT_HEALTH_TIMEOUT;
use crate::kubelet::{
    self, DeviceHealthReport, DraV1, DraV1beta1, HealthService, RegistrationService,
};
use crate::observability::{self, Liveness, Metrics, Readiness};
use crate::proto::dra_v1::dra_plugin_server::DraPluginServer as DraV1Server;
use crate::proto::dra_v1beta1::dra_plugin_server::DraPluginServer as DraV1beta1Server;
use crate::proto::health_v1::dra_resource_health_server::DraResourceHealthServer as HealthV1Server;
use crate::proto::health_v1alpha1::dra_resource_health_server::DraResourceHealthServer as HealthV1alpha1Server;
use crate::proto::pluginregistration::registration_server::RegistrationServer;
use crate::slices::Publisher;

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
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    vital: supervise::Vital,
    stop_events: Arc<AtomicBool>,
    event_reader: Option<std::thread::JoinHandle<()>>,
}

impl RunningPlugin {
    /// Cancels one of the vital tasks (`dra-server`, `registration-server`, `publisher`,
    /// `health-monitor`) as if it had died, so that tests can check what `/healthz` says then.
    /// Returns false for an unknown name.
    pub fn abort_vital_task(&self, name: &str) -> bool {
        self.vital.abort(name)
    }

    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        self.stop_events.store(true, Ordering::Relaxed);
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        if let Some(reader) = self.event_reader.take() {
            // The reader wakes at least every 100 ms to look at the stop flag.
            let _ = tokio::task::spawn_blocking(move || reader.join()).await;
        }
        kubelet::socket::remove_socket(&self.config.registration_socket());
        kubelet::socket::remove_socket(&self.config.dra_socket());
        info!("plugin stopped; sockets removed");
    }
}

/// Starts the plugin: recovery first, then the DRA server, then registration (so the kubelet never
/// dials a socket that does not answer), then publishing.
pub async fn start(
    mut config: PluginConfig,
    client: kube::Client,
) -> Result<RunningPlugin, PluginError> {
    // The kubelet needs an absolute endpoint in GetInfo; relative directories are taken from here.
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
    let backend = open_backend(&config.backend, &config.node_name)?;
    // Fails only when the backend cannot be used at all; a GPU it cannot read is listed as
    // unreadable, reported (gpu_reports) and left out, and the others are published.
    let inventory = Arc::new(backend.inventory()?);
    info!(
        backend = backend.name(),
        gpus = inventory.gpus.len(),
        unreadable = inventory.unreadable.len(),
        "GPU inventory read"
    );

    let plugin_dir = config.plugin_dir();
    create_private_dir(&plugin_dir)?;
    // The policy's MIG mode must hold for recovery and the first publish, not only once the
    // watcher catches up: recovery in the wrong mode destroys an admin's static MIG devices.
    let (start_policy, policy_at_start) = startup::initial_policy(&client, &config).await;
    let start_node_policy = start_policy
        .as_ref()
        .map(NodePolicy::from_effective)
        .unwrap_or_default();
    let mig_mode = start_node_policy.mig_mode.unwrap_or(config.mig_mode);
    let mps_shares_at_start = start_node_policy.mps_memory_shares.is_some();
    let metrics = Metrics::new();
    let readiness = Arc::new(Readiness::default());
    let liveness = Arc::new(Liveness::default());
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut vital = supervise::Vital::new(liveness.clone(), shutdown_rx.clone());
    let (inventory_tx, inventory_rx) = watch::channel(inventory.clone());
    let (devices_tx, devices_rx) = watch::channel(Arc::new(node_devices(&inventory, mig_mode)));
    let class_check_devices = devices_tx.subscribe();
    let (health_tx, health_rx) = watch::channel(Arc::new(Vec::<DeviceHealthReport>::new()));
    let (mig_mode_tx, mig_mode_rx) = watch::channel(mig_mode);
    let (policy_tx, policy_rx) = watch::channel(start_node_policy);
    let reports_mig_mode = mig_mode_tx.subscribe();
    let (events_tx, events_rx) = mpsc::channel(1024);

    // One recorder of Node Events for every reporter, so repeats of a note count up on one Event.
    let node_events = Arc::new(node_events::NodeEvents::new(
        client.clone(),
        &config.driver_name,
        &config.node_name,
    ));
    let daemon_image = claims_setup::daemon_image(&config, &client).await;
    let domains = claims_setup::domains(&config, &plugin_dir, &client, daemon_image.clone());
    let channel_taints = match &domains {
        Some(domains) => domains.taints(),
        None => watch::channel(Default::default()).1,
    };
    let (preparer, recovery) = Preparer::start(
        ClaimsConfig {
            driver_name: config.driver_name.clone(),
            pool: config.node_name.clone(),
            cdi: CdiRegistry::new(&config.cdi_root, &config.driver_name),
            checkpoint_path: claims::checkpoint_path(&plugin_dir, &config.driver_name),
            mig_mode: mig_mode_rx,
            driver_edits: claims_setup::driver_edits(&config, &inventory)?,
            startup_api_timeout: config.startup_api_timeout,
            claim_read_budget: config.api.claim_read,
            mps: claims_setup::mps_daemons(&config, &plugin_dir, &client, daemon_image),
            sharing_timeout: config.sharing_timeout,
            mig_timeout: config.mig_timeout,
            nvidia_namespace: config.mps.nvidia_namespace.clone(),
            domains: domains.clone(),
            call_budget: config.call_budget,
        },
        client.clone(),
        backend.clone(),
        inventory_rx,
        metrics.clone(),
    )
    .await?;
    startup::report_recovery(&node_events, &recovery);
    startup::report_nvidia_claims(&node_events, &recovery.nvidia);

    // Made before the monitor, which computes the devices for what the publisher learns the server keeps.
    let publisher = Arc::new(
        Publisher::new(
            client.clone(),
            &config.driver_name,
            &config.node_name,
            metrics.clone(),
        )
        .with_watcher_config(config.api.watcher_config()),
    );
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(feature_gates::report(
        publisher.kept_fields(),
        mig_mode,
        mps_shares_at_start,
        node_events.clone(),
        metrics.clone(),
        shutdown_rx.clone(),
    )));
    let stop_events = Arc::new(AtomicBool::new(false));
    let event_reader = monitor::spawn_event_reader(backend.clone(), events_tx, stop_events.clone())
        .map_err(PluginError::EventReader)?;
    tasks.push(tokio::spawn(gpu_reports::run(
        inventory_tx.subscribe(),
        reports_mig_mode,
        node_events.clone(),
        metrics.clone(),
        shutdown_rx.clone(),
    )));
    let health_monitor = Monitor {
        driver: config.driver_name.clone(),
        pool: config.node_name.clone(),
        default_mig_mode: config.mig_mode,
        metrics: metrics.clone(),
        imex_channels: config.domains.imex_channels,
    };
    // The faults of the previous run taint the devices before the publisher first looks at them.
    let mut fault_store = startup::FaultStore::in_dir(&plugin_dir);
    let fault_state = fault_store.load(&inventory, &metrics);
    let monitor_channels = MonitorChannels {
        inventory: inventory_tx.subscribe(),
        policy: policy_rx,
        events: events_rx,
        devices: devices_tx,
        health: health_tx,
        mig_mode: mig_mode_tx,
        kept_fields: publisher.kept_fields(),
        channel_taints: channel_taints.clone(),
    };
    health_monitor.recompute(&fault_state, &monitor_channels);
    tasks.push(vital.spawn(
        "health-monitor",
        health_monitor.run(
            fault_state,
            fault_store,
            monitor_channels,
            shutdown_rx.clone(),
        ),
    ));

    if let Some(domains) = domains.clone() {
        tasks.push(tokio::spawn(claims_setup::follow_domains(
            domains,
            preparer.clone(),
            inventory_tx.subscribe(),
            shutdown_rx.clone(),
        )));
    }

    // Starts from what was read above, so the watcher's first answer is compared with it.
    let (selected_tx, selected_rx) = watch::channel(start_policy);
    tasks.push(tokio::spawn(crate::api::PolicyWatcher::run_with(
        client.clone(),
        config.node_name.clone(),
        selected_tx,
        shutdown_rx.clone(),
        config.api.watcher_config(),
    )));
    tasks.push(tokio::spawn(monitor::follow_policies(
        selected_rx,
        policy_tx.clone(),
    )));
    // Not vital: labels for device-plugin nodeSelectors are a courtesy, and their failures are retried.
    let labeler = node_labels::NodeLabeler::new(client.clone(), &config, node_events.clone());
    let (labeled_gpus, labels_policy) = (inventory_tx.subscribe(), policy_tx.subscribe());
    tasks.push(tokio::spawn(labeler.run(
        labeled_gpus,
        labels_policy,
        shutdown_rx.clone(),
    )));

    let health = HealthService::new(health_rx, DEFAULT_HEALTH_TIMEOUT);
    let dra_listener = kubelet::bind_private_socket(&config.dra_socket())?;
    let dra_socket_file = kubelet::SocketFile::at(&config.dra_socket());
    let dra_server = tonic::transport::Server::builder()
        .add_service(DraV1Server::new(DraV1::new(preparer.clone())))
        .add_service(DraV1beta1Server::new(DraV1beta1::new(preparer.clone())))
        .add_service(HealthV1alpha1Server::new(health.clone()))
        .add_service(HealthV1Server::new(health))
        .serve_with_incoming_shutdown(
            kubelet::lenient_incoming(dra_listener),
            stopped(shutdown_rx.clone()),
        );
    tasks.push(vital.spawn_explained(
        "dra-server",
        serve_while_reachable("DRA", dra_server, config.dra_socket(), dra_socket_file),
    ));
    readiness.set_serving();

    let registration =
        RegistrationService::new(&config.driver_name, &config.dra_socket(), readiness.clone());
    let registration_listener = kubelet::bind_private_socket(&config.registration_socket())?;
    let registration_socket_file = kubelet::SocketFile::at(&config.registration_socket());
    let registration_server = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(registration))
        .serve_with_incoming_shutdown(
            kubelet::lenient_incoming(registration_listener),
            stopped(shutdown_rx.clone()),
        );
    tasks.push(vital.spawn_explained(
        "registration-server",
        serve_while_reachable(
            "registration",
            registration_server,
            config.registration_socket(),
            registration_socket_file,
        ),
    ));

    tasks.push(tokio::spawn(selftest::run(
        client.clone(),
        config.driver_name.clone(),
        node_events.clone(),
        class_check_devices,
        metrics.clone(),
        shutdown_rx.clone(),
        config.api.watcher_config(),
    )));

    tasks.push(vital.spawn(
        "publisher",
        publisher.run(devices_rx, readiness.clone(), shutdown_rx.clone()),
    ));
    tasks.push(tokio::spawn(rescan(
        backend,
        config.rescan_interval,
        inventory_tx,
        shutdown_rx.clone(),
    )));

    let http_addr = match config.http_addr {
        Some(addr) => Some(
            observability::serve_http(
                addr,
                metrics.clone(),
                readiness.clone(),
                liveness.clone(),
                shutdown_rx.clone(),
            )
            .await
            .map_err(|source| PluginError::Http { addr, source })?,
        ),
        None => None,
    };
    info!(
        driver = %config.driver_name,
        node = %config.node_name,
        dra_socket = %config.dra_socket().display(),
        registration_socket = %config.registration_socket().display(),
        "plugin started"
    );
    Ok(RunningPlugin {
        config,
        http_addr,
        recovery,
        policy_at_start,
        preparer,
        metrics,
        readiness,
        policy: policy_tx,
        shutdown: shutdown_tx,
        tasks,
        vital,
        stop_events,
        event_reader: Some(event_reader),
    })
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

fn create_private_dir(dir: &std::path::Path) -> Result<(), PluginError> {
    use std::os::unix::fs::PermissionsExt;
    let error = |source| PluginError::Directory {
        path: dir.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(error)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).map_err(error)
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
