//! The plugin's DaemonSet in the base and the overlays: it mounts the kubelet and CDI directories at
//! their host paths and knows its node, its driver root volume is the driver root it is told of, the
//! fake overlay runs the fake backend without one, and its startup probe waits out the plugin's
//! worst-case start.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ConfigMap;

use super::{kustomize, manifests, one};

#[test]
fn plugin_daemonset_mounts_kubelet_and_cdi_dirs_and_knows_its_node() {
    let (objects, _) = manifests();
    let ds: DaemonSet = one(&objects, "DaemonSet", "gpu-dra-plugin").typed();
    let pod = ds
        .spec
        .template
        .spec
        .as_ref()
        .unwrap_or_else(|| panic!("DaemonSet gpu-dra-plugin has no pod spec"));
    let container = pod
        .containers
        .iter()
        .find(|c| c.name == "plugin")
        .unwrap_or_else(|| panic!("DaemonSet gpu-dra-plugin has no container `plugin`"));

    // Volume name → host path.
    let host_paths: BTreeMap<&str, &str> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.as_str(), v.host_path.as_ref()?.path.as_str())))
        .collect();
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    for dir in [
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
    ] {
        let mount = mounts
            .iter()
            .find(|m| host_paths.get(m.name.as_str()) == Some(&dir))
            .unwrap_or_else(|| panic!("host path {dir} is not mounted into the plugin"));
        assert_eq!(
            mount.mount_path, dir,
            "{dir} must be mounted at the same path in the container"
        );
    }
    let plugins = mounts
        .iter()
        .find(|m| m.mount_path == "/var/lib/kubelet/plugins")
        .and_then(|m| m.mount_propagation.as_deref());
    assert_eq!(plugins, Some("Bidirectional"));
    let privileged = container
        .security_context
        .as_ref()
        .and_then(|s| s.privileged);
    assert_eq!(
        privileged,
        Some(true),
        "Bidirectional propagation and MIG need a privileged container"
    );

    let node_name = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(node_name, Some("spec.nodeName"));
}

/// What the plugin's preflight checks at start (`src/plugin/preflight`), checked on the manifests: the
/// volume mounted at CONTAINER_DRIVER_ROOT is a hostPath of NVIDIA_DRIVER_ROOT.
fn assert_driver_root_volume_is_the_driver_root(ds: &DaemonSet, origin: &str) {
    let pod = ds.spec.template.spec.as_ref().expect("a pod spec");
    let container = pod
        .containers
        .iter()
        .find(|c| c.name == "plugin")
        .expect("the plugin container");
    let env = |name: &str| {
        container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
            .unwrap_or_else(|| panic!("{origin}: {name} is not set"))
    };
    let (host, seen_at) = (env("NVIDIA_DRIVER_ROOT"), env("CONTAINER_DRIVER_ROOT"));
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == seen_at)
        .unwrap_or_else(|| {
            panic!("{origin}: nothing is mounted at CONTAINER_DRIVER_ROOT {seen_at}")
        });
    let volume_path = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .and_then(|v| Some(v.host_path.as_ref()?.path.clone()));
    assert_eq!(
        volume_path.as_deref(),
        Some(host.as_str()),
        "{origin}: the hostPath volume at CONTAINER_DRIVER_ROOT must have NVIDIA_DRIVER_ROOT as its path"
    );
}

#[test]
fn the_driver_root_volume_is_the_driver_root_the_plugin_is_told() {
    let (objects, _) = manifests();
    let base: DaemonSet = one(&objects, "DaemonSet", "gpu-dra-plugin").typed();
    assert_driver_root_volume_is_the_driver_root(&base, "deploy/base");
    if let Some(docs) = kustomize("nvml") {
        let nvml: DaemonSet = one(&docs, "DaemonSet", "gpu-dra-plugin").typed();
        assert_driver_root_volume_is_the_driver_root(&nvml, "deploy/overlays/nvml");
    }
}

#[test]
fn fake_overlay_runs_the_fake_backend_without_the_driver_root() {
    let Some(docs) = kustomize("fake") else {
        return;
    };
    let ds: DaemonSet = one(&docs, "DaemonSet", "gpu-dra-plugin").typed();
    let pod = ds
        .spec
        .template
        .spec
        .unwrap_or_else(|| panic!("the fake DaemonSet has no pod spec"));
    let container = &pod.containers[0];
    let env: BTreeMap<&str, &str> = container
        .env
        .iter()
        .flatten()
        .filter_map(|e| Some((e.name.as_str(), e.value.as_deref()?)))
        .collect();
    assert_eq!(env.get("GPU_BACKEND"), Some(&"fake"));
    assert_eq!(env.get("MIG_MODE"), Some(&"dynamic"));
    assert!(!env.contains_key("NVIDIA_DRIVER_ROOT"));
    // The preflight refuses a CONTAINER_DRIVER_ROOT that is not there, with the fake backend too.
    assert!(!env.contains_key("CONTAINER_DRIVER_ROOT"));
    let profile = env
        .get("FAKE_GPU_PROFILE")
        .unwrap_or_else(|| panic!("FAKE_GPU_PROFILE is not set"));
    let mounts = container.volume_mounts.as_deref().unwrap_or_default();
    assert!(
        mounts.iter().all(|m| m.mount_path != "/driver-root"),
        "the fake overlay still mounts the host root"
    );
    let profile_mount = mounts
        .iter()
        .find(|m| profile.starts_with(&format!("{}/", m.mount_path)))
        .unwrap_or_else(|| panic!("{profile} is on no volume"));
    let config_map = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == profile_mount.name)
        .and_then(|v| v.config_map.as_ref())
        .map(|c| c.name.as_str());
    assert_eq!(config_map, Some("gpu-dra-fake-profile"));
    let cm: ConfigMap = one(&docs, "ConfigMap", "gpu-dra-fake-profile").typed();
    let file = profile.rsplit('/').next().unwrap_or_default();
    assert!(
        cm.data.unwrap_or_default().contains_key(file),
        "ConfigMap gpu-dra-fake-profile has no key {file}"
    );
    assert_eq!(pod.affinity, None, "kind nodes have no NFD labels");
    let selector = pod.node_selector.unwrap_or_default();
    assert_eq!(
        selector.get("gpu-dra.dev/fake").map(String::as_str),
        Some("true")
    );
}

/// The kubelet waits for the plugin's first answer on /healthz at most the startup probe's
/// `periodSeconds x failureThreshold`; that must cover the plugin's worst-case start (the sum of its
/// parts' bounds, recovery's among them) with the timeouts the DaemonSet gives it, or a node that
/// recovers many claims could be restarted while the plugin is still busy with them. After the first
/// answer, the liveness probe watches /healthz, which fails naming a part past its bound.
fn assert_startup_probe_covers_the_start(ds: &DaemonSet, origin: &str) {
    use std::time::Duration;
    let container = ds
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|pod| pod.containers.iter().find(|c| c.name == "plugin"))
        .unwrap_or_else(|| panic!("{origin}: no container `plugin`"));
    let probe = container
        .startup_probe
        .as_ref()
        .unwrap_or_else(|| panic!("{origin}: the plugin has no startupProbe"));
    let path = probe.http_get.as_ref().and_then(|get| get.path.as_deref());
    assert_eq!(path, Some("/healthz"), "{origin}");
    let seconds =
        |value: Option<i32>, default: i32| u64::try_from(value.unwrap_or(default)).unwrap();
    let budget = Duration::from_secs(
        seconds(probe.period_seconds, 10) * seconds(probe.failure_threshold, 3),
    );
    let startup_api_timeout = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "STARTUP_API_TIMEOUT_SECONDS")
        .and_then(|e| e.value.as_deref()?.parse().ok())
        .map_or(
            gpu_dra::plugin::startup::DEFAULT_STARTUP_API_TIMEOUT,
            Duration::from_secs,
        );
    let bounds = gpu_dra::plugin::PartBounds::for_timeouts(
        startup_api_timeout,
        gpu_dra::claims::SHARING_TIMEOUT,
    );
    let recovery =
        gpu_dra::claims::recovery_bound(startup_api_timeout, gpu_dra::claims::SHARING_TIMEOUT);
    assert!(
        budget >= bounds.total() && budget >= recovery,
        "{origin}: the startup probe allows {budget:?}, the plugin's start may take {:?} (recovery {recovery:?}); \
         raise failureThreshold (and the arithmetic in its comment)",
        bounds.total()
    );
    if startup_api_timeout == gpu_dra::plugin::startup::DEFAULT_STARTUP_API_TIMEOUT {
        assert_eq!(bounds.total(), gpu_dra::plugin::STARTUP_BOUND, "{origin}");
    }
    // The liveness probe stays as it was for the running plugin: three failures, 30 s apart.
    let liveness = container
        .liveness_probe
        .as_ref()
        .unwrap_or_else(|| panic!("{origin}: the plugin has no livenessProbe"));
    assert_eq!(
        liveness
            .http_get
            .as_ref()
            .and_then(|get| get.path.as_deref()),
        Some("/healthz"),
        "{origin}"
    );
    assert_eq!(
        (liveness.period_seconds, liveness.failure_threshold),
        (Some(30), Some(3)),
        "{origin}"
    );
}

#[test]
fn the_startup_probe_covers_the_plugins_worst_case_start() {
    let (objects, _) = manifests();
    let base: DaemonSet = one(&objects, "DaemonSet", "gpu-dra-plugin").typed();
    assert_startup_probe_covers_the_start(&base, "deploy/base");
    for overlay in ["nvml", "fake"] {
        if let Some(docs) = kustomize(overlay) {
            let ds: DaemonSet = one(&docs, "DaemonSet", "gpu-dra-plugin").typed();
            assert_startup_probe_covers_the_start(&ds, &format!("deploy/overlays/{overlay}"));
        }
    }
}
