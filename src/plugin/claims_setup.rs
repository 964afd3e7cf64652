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
pub(super) async fn mps_daemons(
    config: &PluginConfig,
    plugin_dir: &std::path::Path,
    client: &kube::Client,
) -> claims::mps::MpsDaemons {
    use claims::mps::{DaemonPodTemplate, DaemonPods, DaemonProgram, MpsDaemons};
    let daemons = MpsDaemons::new(plugin_dir.join("mps"), config.mps.shm_size);
    let (program, host_driver_root) = match &config.backend {
        BackendChoice::Nvml {
            driver_root,
            host_driver_root,
        } => (
            claims::mps::pod::program_for_root(driver_root),
            host_driver_root.clone(),
        ),
        BackendChoice::Fake { .. } => (DaemonProgram::StandIn, PathBuf::from("/")),
    };
    if program == DaemonProgram::StandIn && !cfg!(feature = "doubles") {
        warn!(
            "{}: MPS claims will fail at prepare",
            claims::mps::supervisor::NO_STAND_IN
        );
    }
    let image = match (&config.mps.image, &config.mps.own_pod) {
        (Some(image), _) => Some(image.clone()),
        (None, Some(pod)) => own_image(client, &config.mps.namespace, pod).await,
        (None, None) => None,
    };
    let Some(image) = image else {
        warn!("no image for MPS daemon Pods (not running in a Pod, and no --mps-daemon-image): MPS claims will fail at prepare");
        return daemons;
    };
    daemons.with_pods(DaemonPods::new(
        client.clone(),
        DaemonPodTemplate {
            namespace: config.mps.namespace.clone(),
            node: config.node_name.clone(),
            driver: config.driver_name.clone(),
            image,
            host_driver_root,
            program,
        },
    ))
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
