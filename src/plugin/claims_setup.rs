//! What prepared claims get from this node's setup, made once at start for the claim state
//! machine: the NVIDIA driver's files and device nodes for containers, and the claims' MPS control
//! daemons with the Pods that run them.

use std::path::PathBuf;

use tracing::warn;

use super::{BackendChoice, PluginConfig, PluginError};
use crate::cdi::DriverRoot;
use crate::claims::{self, DriverEdits};
use crate::gpu::Inventory;

/// What containers get from the host driver: nothing for fake GPUs; on real ones the driver's files
/// and device nodes from the driver root, and the Toolkit's devices ([`DriverEdits::discover`]).
pub(super) fn driver_edits(
    config: &PluginConfig,
    inventory: &Inventory,
) -> Result<DriverEdits, PluginError> {
    let BackendChoice::Nvml {
        driver_root,
        host_driver_root,
    } = &config.backend
    else {
        return Ok(DriverEdits::default());
    };
    let root = DriverRoot::new(host_driver_root, driver_root)
        .map_err(|e| PluginError::DriverFiles(e.to_string()))?;
    DriverEdits::discover(&root, &inventory.driver_version, &config.cdi_root)
        .map_err(|e| PluginError::DriverFiles(e.to_string()))
}

/// The claims' MPS control daemons, under `<plugin-dir>/mps` (the DaemonSet mounts the plugins
/// directory at the host's own path, so the CDI mounts and the daemons' hostPath volumes name the same
/// path), each run by a Pod of this plugin's image. Without an image (the plugin runs outside a Pod
/// and none is configured) MPS claims fail at prepare with a clear error; nothing else is affected.
pub(super) fn mps_daemons(
    config: &PluginConfig,
    plugin_dir: &std::path::Path,
    client: &kube::Client,
    image: Option<String>,
) -> claims::mps::MpsDaemons {
    use claims::mps::{DaemonPods, MpsDaemons, MpsPrograms};
    let daemons = MpsDaemons::new(plugin_dir.join("mps"), config.mps.shm_size);
    if matches!(config.backend, BackendChoice::Fake { .. }) && !cfg!(feature = "doubles") {
        warn!(
            "{}: MPS claims will fail at prepare",
            claims::mps::supervisor::NO_STAND_IN
        );
    }
    let Some(image) = image else {
        warn!("no image for MPS daemon Pods (not running in a Pod, and no --mps-daemon-image): MPS claims will fail at prepare");
        return daemons;
    };
    daemons.with_pods(DaemonPods::new(
        client.clone(),
        daemon_pod_template::<MpsPrograms>(config, image),
    ))
}

/// Where and as what this plugin runs one kind of daemon's Pods: in its namespace, bound to its node,
/// from `image`, with the driver's programs of the backend's driver root (the fake backend's
/// stand-ins).
fn daemon_pod_template<P: claims::daemon_pod::DriverPrograms>(
    config: &PluginConfig,
    image: String,
) -> claims::daemon_pod::PodTemplate<P> {
    use claims::daemon_pod::DriverProgram;
    let (program, host_driver_root) = match &config.backend {
        BackendChoice::Nvml {
            driver_root,
            host_driver_root,
        } => (
            DriverProgram::for_root(driver_root),
            host_driver_root.clone(),
        ),
        BackendChoice::Fake { .. } => (DriverProgram::StandIn, PathBuf::from("/")),
    };
    claims::daemon_pod::PodTemplate {
        namespace: config.mps.namespace.clone(),
        node: config.node_name.clone(),
        driver: config.driver_name.clone(),
        image,
        host_driver_root,
        program,
    }
}

/// How long the start waits for the plugin's own Pod, for the daemons' image: longer than the
/// start-up API timeout, because without the image MPS and IMEX claims fail until the plugin restarts.
pub const OWN_IMAGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The image of the daemons' Pods (MPS and IMEX): `--mps-daemon-image`, else the plugin's own, read
/// within [`OWN_IMAGE_TIMEOUT`] (without it, MPS and IMEX claims fail at prepare, saying why).
pub(super) async fn daemon_image(config: &PluginConfig, client: &kube::Client) -> Option<String> {
    match (&config.mps.image, &config.mps.own_pod) {
        (Some(image), _) => Some(image.clone()),
        (None, Some(pod)) => {
            let read = own_image(client, &config.mps.namespace, pod);
            match tokio::time::timeout(OWN_IMAGE_TIMEOUT, read).await {
                Ok(image) => image,
                Err(_) => {
                    warn!(pod, namespace = %config.mps.namespace, timeout_s = OWN_IMAGE_TIMEOUT.as_secs(), "reading the plugin's own Pod for its image timed out");
                    None
                }
            }
        }
        (None, None) => None,
    }
}

/// The image of the plugin's own container: an upgrade of the DaemonSet then also upgrades the
/// daemons it starts from then on (running ones keep theirs).
async fn own_image(client: &kube::Client, namespace: &str, pod: &str) -> Option<String> {
    use k8s_openapi::api::core::v1::Pod;
    use kube::Api;
    let own_pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    match own_pods.get(pod).await {
        Ok(pod) => pod.spec.and_then(|spec| {
            spec.containers
                .into_iter()
                .find(|c| c.name == "plugin")
                .and_then(|c| c.image)
        }),
        Err(error) => {
            warn!(%error, pod, namespace, "reading the plugin's own Pod for its image failed");
            None
        }
    }
}

/// This node's side of ComputeDomains: its IMEX daemon runs in a Pod of this plugin's image, with its
/// files under `<plugin-dir>/imex`, or (`--imex-mode host`) is the host's, which the plugin only asks.
/// `None` (IMEX channel claims then fail at prepare with a reason) where the node publishes no channels
/// or no image is known for the daemon.
pub(super) fn domains(
    config: &PluginConfig,
    plugin_dir: &std::path::Path,
    client: &kube::Client,
    image: Option<String>,
) -> Option<std::sync::Arc<crate::domains::membership::Membership>> {
    if config.domains.imex_channels == 0 {
        return None;
    }
    let node_ip = config.domains.node_ip.clone();
    if config.domains.imex_mode == crate::domains::membership::ImexMode::Host {
        use crate::domains::imex::host_managed::HostImex;
        let host = match (&config.domains.host_ctl, &config.backend) {
            (Some(program), _) => {
                HostImex::with_program(program.clone(), &config.domains.host_socket)
            }
            (None, BackendChoice::Nvml { driver_root, .. }) => {
                HostImex::new(driver_root, &config.domains.host_socket)
            }
            // The fake backend's root has no nvidia-imex-ctl: channel claims fail with that reason.
            (None, BackendChoice::Fake { .. }) => HostImex::new(
                std::path::Path::new("/nonexistent"),
                &config.domains.host_socket,
            ),
        };
        return Some(std::sync::Arc::new(
            crate::domains::membership::Membership::new(
                client.clone(),
                &config.driver_name,
                &config.node_name,
                node_ip.as_deref(),
                std::sync::Arc::new(host),
            ),
        ));
    }
    use crate::domains::imex::{ImexDaemons, ImexPodTemplate};
    // Where the driver root is the host's `/`, this process sees the host's systemd state in it, and
    // the daemons are refused while the host runs nvidia-imex.service.
    let host_system_root = match &config.backend {
        BackendChoice::Nvml {
            driver_root,
            host_driver_root,
        } => (host_driver_root.as_path() == std::path::Path::new("/")).then(|| driver_root.clone()),
        BackendChoice::Fake { .. } => None,
    };
    // The daemons run this plugin's image, as the MPS daemons do.
    let Some(image) = image else {
        warn!("no image for IMEX daemon Pods (not running in a Pod, and no --mps-daemon-image): IMEX channel claims will fail at prepare");
        return None;
    };
    let mut daemons = ImexDaemons::new(
        client.clone(),
        plugin_dir.join("imex"),
        ImexPodTemplate {
            pod: daemon_pod_template(config, image),
            // Unknown: the daemon's Pod gets the kubelet's status.hostIP.
            node_ip: node_ip.clone(),
        },
    );
    if let Some(root) = host_system_root {
        daemons = daemons.with_host_system_root(root);
    }
    Some(std::sync::Arc::new(
        crate::domains::membership::Membership::new(
            client.clone(),
            &config.driver_name,
            &config.node_name,
            node_ip.as_deref(),
            std::sync::Arc::new(daemons),
        ),
    ))
}

/// How long a daemon that no prepared claim holds is kept after a prepare last tried to join its
/// domain: the kubelet retries a failed prepare within seconds, and gives up when the pod goes.
const UNHELD_DAEMON_GRACE: std::time::Duration = std::time::Duration::from_secs(120);

/// Keeps the ComputeDomains this node's claims hold in step (peers, daemon health, clique) and
/// stops daemons no claim holds, until shutdown.
pub(super) async fn follow_domains(
    domains: std::sync::Arc<crate::domains::membership::Membership>,
    preparer: std::sync::Arc<claims::Preparer>,
    inventory: tokio::sync::watch::Receiver<std::sync::Arc<Inventory>>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    // The first sweep finds the daemons a restart lost track of; later ones run only while a
    // prepare's daemon is not held by a claim, so an idle node lists no Pods.
    let mut first = true;
    loop {
        let members = preparer.domain_members();
        let clique = crate::domains::channels::node_clique(&inventory.borrow());
        domains.sync(&members, &clique).await;
        let held = members.iter().map(|m| m.domain_uid.clone()).collect();
        if first || domains.has_unheld_attempts(&held) {
            for stopped in domains.sweep(&held, UNHELD_DAEMON_GRACE).await {
                tracing::info!(domain_uid = %stopped, "stopped an IMEX daemon no claim holds");
            }
        }
        first = false;
        tokio::select! {
            _ = tokio::time::sleep(crate::domains::membership::SYNC_PERIOD) => {}
            _ = shutdown.changed() => return,
        }
    }
}
