//! The parts of the plugin, one function each, in the order [`start`](super::start) starts them. Each
//! takes what the parts before it handed on, spawns its tasks into its [`Part`] (so that it stops on
//! its own) and hands on what the parts after it need.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, watch};
use tracing::info;

use super::assembly::Part;
use super::monitor::{self, Monitor, MonitorChannels, NodePolicy};
use super::{
    claims_setup, feature_gates, gpu_reports, node_events, node_labels, open_backend, selftest,
    startup, PluginConfig, PluginError, PolicyAtStart,
};
use crate::cdi::CdiRegistry;
use crate::claims::{self, ClaimsConfig, DriverEdits, Preparer, Recovery};
use crate::devices::{node_devices, MigMode, NodeDevices};
use crate::gpu::{GpuBackend, Inventory};
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

/// What every part may use: the configuration, the API client, what operators watch, and one
/// recorder of Node Events for every reporter (so repeats of a note count up on one Event).
pub(super) struct Shared {
    pub config: PluginConfig,
    pub client: kube::Client,
    pub metrics: Arc<Metrics>,
    pub readiness: Arc<Readiness>,
    pub liveness: Arc<Liveness>,
    pub node_events: Arc<node_events::NodeEvents>,
    pub began: Instant,
}

impl Shared {
    pub(super) fn new(config: PluginConfig, client: kube::Client) -> Self {
        let node_events = Arc::new(node_events::NodeEvents::new(
            client.clone(),
            &config.driver_name,
            &config.node_name,
        ));
        Shared {
            config,
            client,
            metrics: Metrics::new(),
            readiness: Arc::new(Readiness::default()),
            liveness: Arc::new(Liveness::default()),
            node_events,
            began: Instant::now(),
        }
    }
}

/// `http`: `/healthz`, `/readyz` and `/metrics`, first, so that the kubelet's probes get an answer
/// while the rest starts. Returns the bound address (`None` where `--http-addr` is empty).
pub(super) async fn http(part: Part, shared: &Shared) -> Result<Option<SocketAddr>, PluginError> {
    let Some(addr) = shared.config.http_addr else {
        return Ok(None);
    };
    let (bound, server) = observability::serve_http(
        addr,
        shared.metrics.clone(),
        shared.readiness.clone(),
        shared.liveness.clone(),
        part.stop_signal(),
    )
    .await
    .map_err(|source| PluginError::Http { addr, source })?;
    part.keep(server);
    info!(addr = %bound, "serving /healthz, /readyz and /metrics");
    Ok(Some(bound))
}

/// The node's GPUs: the backend, the inventory (the rescans send on it) and the driver's files that
/// containers get.
pub(super) struct Gpus {
    pub backend: Arc<dyn GpuBackend>,
    pub inventory: watch::Sender<Arc<Inventory>>,
    pub driver_edits: DriverEdits,
}

/// `backend`: opens the backend and reads the GPUs, on a blocking thread (NVML's calls block), so
/// that `/healthz` answers meanwhile. Fails only when the backend cannot be used at all; a GPU it
/// cannot read is listed as unreadable, reported (gpu_reports) and left out, and the others are
/// published.
pub(super) async fn backend(_part: Part, shared: &Shared) -> Result<Gpus, PluginError> {
    let config = shared.config.clone();
    let (backend, inventory, driver_edits) = tokio::task::spawn_blocking(move || {
        let backend = open_backend(&config.backend, &config.node_name)?;
        let inventory = backend.inventory()?;
        let driver_edits = claims_setup::driver_edits(&config, &inventory)?;
        Ok::<_, PluginError>((backend, inventory, driver_edits))
    })
    .await
    .map_err(|error| PluginError::Part {
        part: "backend",
        reason: error.to_string(),
    })??;
    info!(
        backend = backend.name(),
        gpus = inventory.gpus.len(),
        unreadable = inventory.unreadable.len(),
        "GPU inventory read"
    );
    Ok(Gpus {
        backend,
        inventory: watch::channel(Arc::new(inventory)).0,
        driver_edits,
    })
}

/// The admin's policy for this node: as read at start, then as the GpuNodePolicy watcher follows it.
pub(super) struct Policy {
    pub at_start: PolicyAtStart,
    /// The policy in force (the watcher sends it); the monitor and the node labeler follow it.
    pub node: watch::Sender<NodePolicy>,
    /// Holds what the watcher sent while no part followed it yet, as a change.
    pub node_rx: watch::Receiver<NodePolicy>,
    /// The MIG mode in force (the policy's, else `--mig-mode`); the monitor sets it, prepares read it.
    pub mig_mode: watch::Sender<MigMode>,
    pub mig_mode_rx: watch::Receiver<MigMode>,
    pub mig_mode_at_start: MigMode,
    pub mps_shares_at_start: bool,
    /// The sharing in force (the policy's, else `--consumable-shares`); the monitor sets it, prepares
    /// read it.
    pub shares: watch::Sender<Option<crate::devices::Shares>>,
    pub shares_rx: watch::Receiver<Option<crate::devices::Shares>>,
}

/// `policy`: the GpuNodePolicy in force, read once within the start-up API timeout, because its MIG
/// mode must hold for recovery and the first publish, not only once the watcher catches up: recovery
/// in the wrong mode destroys an admin's static MIG devices. Then the watcher follows it.
pub(super) async fn policy(part: Part, shared: &Shared) -> Result<Policy, PluginError> {
    let config = &shared.config;
    let (start_policy, at_start) = startup::initial_policy(&shared.client, config).await;
    let node_policy = start_policy
        .as_ref()
        .map(NodePolicy::from_effective)
        .unwrap_or_default();
    let mig_mode = node_policy.mig_mode.unwrap_or(config.mig_mode);
    let shares = node_policy.shares.or(config.consumable_shares);
    let mps_shares_at_start = shares.is_some();
    let (shares_tx, shares_rx) = watch::channel(shares);
    let (mig_mode_tx, mig_mode_rx) = watch::channel(mig_mode);
    let (node, node_rx) = watch::channel(node_policy);
    // Starts from what was read above, so the watcher's first answer is compared with it.
    let (selected_tx, selected_rx) = watch::channel(start_policy);
    part.spawn(crate::api::PolicyWatcher::run_with(
        shared.client.clone(),
        config.node_name.clone(),
        selected_tx,
        part.stop_signal(),
        config.api.watcher_config(),
    ));
    part.spawn(monitor::follow_policies(selected_rx, node.clone()));
    Ok(Policy {
        at_start,
        node,
        node_rx,
        mig_mode: mig_mode_tx,
        mig_mode_rx,
        mig_mode_at_start: mig_mode,
        mps_shares_at_start,
        shares: shares_tx,
        shares_rx,
    })
}

/// The claim state machine, with what it recovered.
pub(super) struct Claims {
    pub preparer: Arc<Preparer>,
    pub recovery: Recovery,
    /// IMEX channels of ComputeDomains whose daemon is not ready, tainted.
    pub channel_taints: watch::Receiver<BTreeMap<String, &'static str>>,
}

/// `recovery`: the claims prepared before this start, recovered from the checkpoint (CDI specs, MIG
/// devices, MPS daemons, GPU modes; `claims::recovery_bound` says how long that may take), and the
/// node's ComputeDomain memberships followed from then on.
pub(super) async fn recovery(
    part: Part,
    shared: &Shared,
    gpus: &Gpus,
    policy: &Policy,
) -> Result<Claims, PluginError> {
    let (config, client) = (&shared.config, &shared.client);
    let plugin_dir = config.plugin_dir();
    create_private_dir(&plugin_dir)?;
    let daemon_image = claims_setup::daemon_image(config, client).await;
    let domains = claims_setup::domains(config, &plugin_dir, client, daemon_image.clone());
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
            mig_mode: policy.mig_mode_rx.clone(),
            shares: policy.shares_rx.clone(),
            driver_edits: gpus.driver_edits.clone(),
            startup_api_timeout: config.startup_api_timeout,
            claim_read_budget: config.api.claim_read,
            mps: claims_setup::mps_daemons(config, &plugin_dir, client, daemon_image),
            sharing_timeout: config.sharing_timeout,
            mig_timeout: config.mig_timeout,
            nvidia_namespace: config.mps.nvidia_namespace.clone(),
            domains: domains.clone(),
            call_budget: config.call_budget,
        },
        client.clone(),
        gpus.backend.clone(),
        gpus.inventory.subscribe(),
        shared.metrics.clone(),
    )
    .await?;
    startup::report_recovery(&shared.node_events, &recovery);
    startup::report_nvidia_claims(&shared.node_events, &recovery.nvidia);
    if let Some(domains) = domains {
        part.spawn(claims_setup::follow_domains(
            domains,
            preparer.clone(),
            gpus.inventory.subscribe(),
            part.stop_signal(),
        ));
    }
    shared.readiness.set_claims_recovered();
    Ok(Claims {
        preparer,
        recovery,
        channel_taints,
    })
}

/// What the health monitor computes: the devices to publish and the health the kubelet hears.
pub(super) struct Health {
    pub devices: watch::Receiver<Arc<NodeDevices>>,
    pub reports: watch::Receiver<Arc<Vec<DeviceHealthReport>>>,
    /// Made here: the monitor computes the devices for what the publisher learns the server keeps.
    pub publisher: Arc<Publisher>,
}

/// `health-monitor`: the GPU event reader (a thread), the fault state of the previous run (so its
/// faults taint the devices before the publisher first looks at them), the monitor, the reports of
/// unreadable GPUs, and the rescans of the inventory.
pub(super) async fn health_monitor(
    part: Part,
    shared: &Shared,
    gpus: &Gpus,
    policy: &Policy,
    claims: &Claims,
) -> Result<Health, PluginError> {
    let config = &shared.config;
    let publisher = Arc::new(
        Publisher::new(
            shared.client.clone(),
            &config.driver_name,
            &config.node_name,
            shared.metrics.clone(),
        )
        .with_watcher_config(config.api.watcher_config()),
    );
    let inventory = gpus.inventory.borrow().clone();
    let (devices_tx, devices) =
        watch::channel(Arc::new(node_devices(&inventory, policy.mig_mode_at_start)));
    let (health_tx, reports) = watch::channel(Arc::new(Vec::<DeviceHealthReport>::new()));

    let (events_tx, events_rx) = mpsc::channel(1024);
    let stop_events = Arc::new(AtomicBool::new(false));
    let reader = monitor::spawn_event_reader(gpus.backend.clone(), events_tx, stop_events.clone())
        .map_err(PluginError::EventReader)?;
    let mut stop = part.stop_signal();
    part.spawn(async move {
        let _ = stop.wait_for(|stop| *stop).await;
        stop_events.store(true, Ordering::Relaxed);
        // The reader wakes at least every 100 ms to look at the stop flag.
        let _ = tokio::task::spawn_blocking(move || reader.join()).await;
    });
    part.spawn(gpu_reports::run(
        gpus.inventory.subscribe(),
        policy.mig_mode_rx.clone(),
        shared.node_events.clone(),
        shared.metrics.clone(),
        part.stop_signal(),
    ));

    let health_monitor = Monitor {
        driver: config.driver_name.clone(),
        pool: config.node_name.clone(),
        default_mig_mode: config.mig_mode,
        default_shares: config.consumable_shares,
        metrics: shared.metrics.clone(),
        imex_channels: config.domains.imex_channels,
    };
    let plugin_dir = config.plugin_dir();
    let mut fault_store = startup::FaultStore::in_dir(&plugin_dir);
    let fault_state = fault_store.load(&inventory, &shared.metrics);
    let monitor_channels = MonitorChannels {
        inventory: gpus.inventory.subscribe(),
        policy: policy.node_rx.clone(),
        events: events_rx,
        devices: devices_tx,
        health: health_tx,
        mig_mode: policy.mig_mode.clone(),
        shares: policy.shares.clone(),
        kept_fields: publisher.kept_fields(),
        channel_taints: claims.channel_taints.clone(),
        held_ways: claims.preparer.held_ways(),
    };
    health_monitor.recompute(&fault_state, &monitor_channels);
    part.spawn_vital(
        "health-monitor",
        health_monitor.run(
            fault_state,
            fault_store,
            monitor_channels,
            part.stop_signal(),
        ),
    );
    part.spawn(super::rescan(
        gpus.backend.clone(),
        config.rescan_interval,
        gpus.inventory.clone(),
        part.stop_signal(),
    ));
    Ok(Health {
        devices,
        reports,
        publisher,
    })
}

/// `dra-socket`: the DRA services (v1, v1beta1) and the resource health services, on the DRA socket.
pub(super) async fn dra_socket(
    part: Part,
    shared: &Shared,
    claims: &Claims,
    health: &Health,
) -> Result<(), PluginError> {
    let socket = shared.config.dra_socket();
    let health = HealthService::new(health.reports.clone(), DEFAULT_HEALTH_TIMEOUT);
    let listener = kubelet::bind_private_socket(&socket)?;
    remove_on_stop(&part, &socket);
    let bound = kubelet::SocketFile::at(&socket);
    let server = tonic::transport::Server::builder()
        .add_service(DraV1Server::new(DraV1::new(claims.preparer.clone())))
        .add_service(DraV1beta1Server::new(DraV1beta1::new(
            claims.preparer.clone(),
        )))
        .add_service(HealthV1alpha1Server::new(health.clone()))
        .add_service(HealthV1Server::new(health))
        .serve_with_incoming_shutdown(
            kubelet::lenient_incoming(listener),
            super::stopped(part.stop_signal()),
        );
    part.spawn_vital_explained(
        "dra-server",
        super::serve_while_reachable("DRA", server, socket, bound),
    );
    shared.readiness.set_serving();
    Ok(())
}

/// `registration-socket`: plugin registration, which tells the kubelet where the DRA socket is; only
/// once that serves, so that the kubelet never dials a socket that does not answer.
pub(super) async fn registration_socket(part: Part, shared: &Shared) -> Result<(), PluginError> {
    let config = &shared.config;
    let socket = config.registration_socket();
    let registration = RegistrationService::new(
        &config.driver_name,
        &config.dra_socket(),
        shared.readiness.clone(),
    );
    let listener = kubelet::bind_private_socket(&socket)?;
    remove_on_stop(&part, &socket);
    let bound = kubelet::SocketFile::at(&socket);
    let server = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(registration))
        .serve_with_incoming_shutdown(
            kubelet::lenient_incoming(listener),
            super::stopped(part.stop_signal()),
        );
    part.spawn_vital_explained(
        "registration-server",
        super::serve_while_reachable("registration", server, socket, bound),
    );
    Ok(())
}

/// `publisher`: what the node tells the cluster: its ResourceSlices, the feature gates the server
/// drops their fields for, GPU feature discovery's node labels (a courtesy: not vital, and retried)
/// and the DeviceClass self-test.
pub(super) async fn publisher(
    part: Part,
    shared: &Shared,
    gpus: &Gpus,
    policy: &Policy,
    health: &Health,
) -> Result<(), PluginError> {
    let publisher = health.publisher.clone();
    part.spawn(feature_gates::report(
        publisher.kept_fields(),
        policy.mig_mode_at_start,
        policy.mps_shares_at_start,
        shared.node_events.clone(),
        shared.metrics.clone(),
        part.stop_signal(),
    ));
    part.spawn_vital(
        "publisher",
        publisher.run(
            health.devices.clone(),
            shared.readiness.clone(),
            part.stop_signal(),
        ),
    );
    let labeler = node_labels::NodeLabeler::new(
        shared.client.clone(),
        &shared.config,
        shared.node_events.clone(),
    );
    part.spawn(labeler.run(
        gpus.inventory.subscribe(),
        policy.node.subscribe(),
        part.stop_signal(),
    ));
    part.spawn(selftest::run(
        shared.client.clone(),
        shared.config.driver_name.clone(),
        shared.node_events.clone(),
        health.devices.clone(),
        shared.metrics.clone(),
        part.stop_signal(),
        shared.config.api.watcher_config(),
    ));
    Ok(())
}

/// `readiness`: `/readyz` turns ready on its own once claims are recovered, the DRA socket serves,
/// the kubelet registered the plugin and the slices are published; this part says so in the log,
/// with the time since the start.
pub(super) async fn readiness(part: Part, shared: &Shared) -> Result<(), PluginError> {
    let readiness = shared.readiness.clone();
    let began = shared.began;
    let mut stop = part.stop_signal();
    part.spawn(async move {
        tokio::select! {
            _ = readiness.wait_ready() => {
                info!(since_start_ms = began.elapsed().as_millis() as u64, "plugin ready: claims recovered, sockets served, registered with the kubelet, slices published");
            }
            _ = stop.wait_for(|stop| *stop) => {}
        }
    });
    Ok(())
}

fn remove_on_stop(part: &Part, socket: &std::path::Path) {
    let socket = socket.to_path_buf();
    part.on_stop(move || kubelet::socket::remove_socket(&socket));
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
