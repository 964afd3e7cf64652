//! Several fake GPU nodes on one API server double, for ComputeDomains in the tests and the demo: GB200
//! NVL72 compute trays whose GPUs joined NVLink cliques (and nodes without a fabric), each with its own
//! plugin, kubelet double and pod runner (which runs the IMEX daemons' Pods the plugin makes). A pod
//! goes to a node as the scheduler's Filter would choose one: the first node, in name order, on which
//! every claim of the pod can be allocated; then its claims are allocated there ([`pods`]) and the
//! node's kubelet prepares them ([`kubelet_pods`]).
//!
//! Not modelled: the scheduler's scoring (first fit by node name), pods that share a claim, a node that
//! goes away (a node's plugin stops only when the rack is dropped).

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::Api;

use super::apiserver::ApiServer;
use super::kubelet::KubeletDouble;
use super::kubelet_pods::{prepare_pod, PreparedPod};
use super::pod_runner::PodRunner;
use super::{pods, scheduler};
use crate::gpu::FakeProfile;
use crate::plugin::{PluginConfig, RunningPlugin};

pub const DRIVER: &str = "gpu.dra.dev";

/// What a node of the rack has: an NVLink clique of the GB200 cluster, or no fabric (a GPU node of
/// another kind: four L40S).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fabric {
    Clique(u32),
    None,
}

pub struct RackNode {
    pub name: String,
    pub ip: String,
    pub config: PluginConfig,
    pub profile_path: PathBuf,
    pub plugin: RunningPlugin,
    pub kubelet: KubeletDouble,
    _pods: PodRunner,
}

impl RackNode {
    /// Moves the node's GPUs into another clique (or out of any fabric) by editing its fake profile:
    /// what a node that leaves its NVLink partition reports.
    pub fn set_fabric(&self, fabric: Fabric) {
        write_profile(&self.profile_path, &profile(fabric));
    }

    /// The kubelet's part when the node's pods are gone: one NodeUnprepareResources call with every
    /// claim its plugin has prepared; the answer per claim UID.
    pub async fn unprepare_all(
        &self,
    ) -> Result<std::collections::HashMap<String, Result<(), String>>, super::kubelet::KubeletError>
    {
        let claims: Vec<super::kubelet::ClaimRef> = self
            .plugin
            .preparer
            .prepared_claims()
            .into_iter()
            .map(|(uid, r)| super::kubelet::ClaimRef::new(r.namespace, r.name, uid))
            .collect();
        self.kubelet.unprepare(&claims).await
    }

    /// Where the node's plugin keeps the IMEX daemon of a domain (its config, peers and state).
    pub fn imex_dir(&self, domain_uid: &str) -> PathBuf {
        self.config.plugin_dir().join("imex").join(domain_uid)
    }
}

pub struct Rack {
    pub nodes: Vec<RackNode>,
    client: kube::Client,
    _dir: tempfile::TempDir,
}

/// The loopback address of the rack's `i`th node (its IMEX daemons' address).
fn node_ip(i: usize) -> String {
    format!("127.0.0.{}", 10 + i)
}

fn profile(fabric: Fabric) -> FakeProfile {
    match fabric {
        Fabric::Clique(clique) => crate::gpu::gb200_tray(crate::gpu::GB200_CLUSTER_UUID, clique),
        Fabric::None => crate::gpu::builtin_profile("l40s-4").expect("built-in profile"),
    }
}

fn write_profile(path: &std::path::Path, profile: &FakeProfile) {
    std::fs::write(path, serde_yaml::to_string(profile).expect("profile YAML"))
        .expect("profile file written");
}

impl Rack {
    /// Starts a plugin, a pod runner and a kubelet double for each node (Node objects made here, each
    /// with its own loopback address `127.0.0.<10+i>` as the address its IMEX daemons use).
    pub async fn start(api: &ApiServer, nodes: &[(&str, Fabric)], image: &str) -> Rack {
        for (i, (name, _)) in nodes.iter().enumerate() {
            api.insert(
                "nodes",
                serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                    "status": {"addresses": [{"type": "InternalIP", "address": node_ip(i)}],
                               "conditions": [{"type": "Ready", "status": "True"}]}}),
            );
        }
        let handle = api.handle();
        Self::start_on(api.client(), nodes, image, |node| {
            PodRunner::start(handle.clone(), node, PodRunner::binary())
        })
        .await
    }

    /// [`Rack::start`] against a real API server whose Nodes exist already (made Ready without a
    /// kubelet, as `../shared/realk8s/node.sh` does): the plugins, kubelet doubles and pod runners
    /// (for the Pods of namespace `gpu-dra`) run here, on loopback addresses as above.
    pub async fn start_live(client: kube::Client, nodes: &[(&str, Fabric)], image: &str) -> Rack {
        let live = client.clone();
        Self::start_on(client, nodes, image, |node| {
            PodRunner::start_live(live.clone(), "gpu-dra", node, PodRunner::binary())
        })
        .await
    }

    async fn start_on(
        client: kube::Client,
        nodes: &[(&str, Fabric)],
        image: &str,
        runner: impl Fn(&str) -> PodRunner,
    ) -> Rack {
        // Short: unix socket paths under it must fit 107 bytes.
        let dir = tempfile::Builder::new()
            .prefix("rk-")
            .tempdir()
            .expect("temp dir");
        let mut started = Vec::new();
        for (i, (name, fabric)) in nodes.iter().enumerate() {
            let ip = node_ip(i);
            let root = dir.path().join(format!("n{i}"));
            std::fs::create_dir_all(&root).expect("node dir");
            let profile_path = root.join("profile.yaml");
            write_profile(&profile_path, &profile(*fabric));
            let config = PluginConfig {
                rescan_interval: Duration::from_millis(200),
                mps: crate::plugin::MpsConfig {
                    image: Some(image.to_string()),
                    ..Default::default()
                },
                domains: crate::domains::membership::DomainsConfig {
                    node_ip: Some(ip.clone()),
                    ..Default::default()
                },
                ..PluginConfig::fake_node_under(
                    &root,
                    DRIVER,
                    name,
                    &profile_path.display().to_string(),
                )
            };
            let pods = runner(name);
            let plugin = crate::plugin::start(config.clone(), client.clone())
                .await
                .expect("plugin starts");
            let kubelet = KubeletDouble::register(
                &config.registry_dir,
                &config.driver_name,
                Duration::from_secs(10),
            )
            .await
            .expect("kubelet registers the plugin");
            started.push(RackNode {
                name: name.to_string(),
                ip,
                config,
                profile_path,
                plugin,
                kubelet,
                _pods: pods,
            });
        }
        Rack {
            nodes: started,
            client,
            _dir: dir,
        }
    }

    /// Stops a node's plugin and starts it again on the same directories (its checkpoint, CDI specs
    /// and IMEX daemons' files), as a DaemonSet upgrade does; the node's daemon Pods keep running.
    pub async fn restart_plugin(&mut self, name: &str) {
        let at = self
            .nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name} in the rack"));
        let RackNode {
            name,
            ip,
            config,
            profile_path,
            plugin,
            kubelet: _,
            _pods,
        } = self.nodes.remove(at);
        plugin.shutdown().await;
        let plugin = crate::plugin::start(config.clone(), self.client.clone())
            .await
            .expect("plugin starts again");
        let kubelet = KubeletDouble::register(
            &config.registry_dir,
            &config.driver_name,
            Duration::from_secs(10),
        )
        .await
        .expect("kubelet registers the plugin again");
        self.nodes.insert(
            at,
            RackNode {
                name,
                ip,
                config,
                profile_path,
                plugin,
                kubelet,
                _pods,
            },
        );
    }

    /// Stops every node's plugin as a node shutdown does (the daemons' Pods stay in the API).
    pub async fn shutdown(self) {
        for node in self.nodes {
            node.plugin.shutdown().await;
        }
    }

    pub fn node(&self, name: &str) -> &RackNode {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name} in the rack"))
    }

    /// Places the pod: the first node on which each of its claims (templates included) can be
    /// allocated now; its claims are then made, allocated there and reserved for it. The pod is not
    /// bound (the pod runners would run it): the node's name is returned. `Err` lists why each node
    /// was passed over.
    pub async fn schedule(
        &self,
        client: &kube::Client,
        namespace: &str,
        pod: &str,
    ) -> Result<String, String> {
        let pods_api: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let spec = pods_api
            .get(pod)
            .await
            .map_err(|e| e.to_string())?
            .spec
            .unwrap_or_default();
        let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), namespace);
        let claims: Api<k8s_openapi::api::resource::v1::ResourceClaim> =
            Api::namespaced(client.clone(), namespace);
        let mut specs = Vec::new();
        for pod_claim in spec.resource_claims.iter().flatten() {
            let claim_spec = match (
                &pod_claim.resource_claim_template_name,
                &pod_claim.resource_claim_name,
            ) {
                (Some(template), _) => templates
                    .get(template)
                    .await
                    .map_err(|e| {
                        format!("pod {namespace}/{pod}: ResourceClaimTemplate {template}: {e}")
                    })?
                    .spec
                    .and_then(|s| s.spec)
                    .unwrap_or_default(),
                (None, Some(name)) => claims
                    .get(name)
                    .await
                    .map_err(|e| e.to_string())?
                    .spec
                    .unwrap_or_default(),
                (None, None) => continue,
            };
            specs.push((pod_claim.name.clone(), claim_spec));
        }
        let mut passed_over = Vec::new();
        'nodes: for node in &self.nodes {
            for (name, claim_spec) in &specs {
                let label = format!("{namespace}/{pod}/{name}");
                if let Err(error) = scheduler::fits(client, &label, claim_spec, &node.name).await {
                    passed_over.push(format!("{}: {error}", node.name));
                    continue 'nodes;
                }
            }
            pods::schedule_pod(client, namespace, pod, &node.name)
                .await
                .map_err(|e| e.to_string())?;
            return Ok(node.name.clone());
        }
        Err(passed_over.join("; "))
    }

    /// The kubelet's part on the pod's node: prepares its claims.
    pub async fn start_pod(
        &self,
        client: &kube::Client,
        namespace: &str,
        pod: &str,
        node: &str,
    ) -> Result<PreparedPod, String> {
        prepare_pod(&self.node(node).kubelet, client, namespace, pod, false)
            .await
            .map_err(|e| e.to_string())
    }
}

/// Waits (polling every 200 ms) until `check` gives a value; panics naming `what` after `timeout`.
pub async fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn domains(client: &kube::Client, namespace: &str) -> Api<kube::api::DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        namespace,
        &crate::domains::api::DomainGroup::Ours.api_resource(),
    )
}

/// A ComputeDomain of our group as the controller and plugins see it now.
pub async fn domain(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> crate::domains::api::DomainObject {
    let object = domains(client, namespace)
        .get(name)
        .await
        .expect("domain exists");
    crate::domains::api::DomainObject::from_dynamic(crate::domains::api::DomainGroup::Ours, &object)
        .expect("domain parses")
}

/// Creates ComputeDomain `name` of `nodes` nodes, whose channel template is `<name>-channel`.
/// The clique the controller placed a domain on (its ComputeDomainPlacement), once it did.
pub async fn placement(client: &kube::Client, namespace: &str, name: &str) -> Option<String> {
    let domain = domain(client, namespace, name).await;
    let placements: Api<crate::domains::api::ComputeDomainPlacement> = Api::all(client.clone());
    let placement = placements.get_opt(&domain.uid).await.ok()??;
    placement
        .is_for(&domain)
        .then(|| placement.spec.clique.clone())
}

pub async fn create_domain(client: &kube::Client, namespace: &str, name: &str, nodes: u32) {
    let object: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"numNodes": nodes,
                 "channel": {"resourceClaimTemplate": {"name": format!("{name}-channel")}}},
    }))
    .expect("domain object");
    domains(client, namespace)
        .create(&kube::api::PostParams::default(), &object)
        .await
        .expect("domain created");
}

/// A worker of a job: container `worker` gets the claims of `gpus_template` and `channel_template`.
pub async fn create_worker(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    gpus_template: &str,
    channel_template: &str,
) {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "containers": [{"name": "worker", "image": "nvbandwidth",
                "resources": {"claims": [{"name": "gpus"}, {"name": "channel"}]}}],
            "resourceClaims": [
                {"name": "gpus", "resourceClaimTemplateName": gpus_template},
                {"name": "channel", "resourceClaimTemplateName": channel_template},
            ],
        },
    }))
    .expect("pod object");
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&kube::api::PostParams::default(), &pod)
        .await
        .expect("pod created");
}

/// A template of `count` whole GPUs of our driver.
pub async fn create_gpus_template(client: &kube::Client, namespace: &str, name: &str, count: u32) {
    let template: ResourceClaimTemplate = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu.dra.dev", "allocationMode": "ExactCount", "count": count}}]}}},
    }))
    .expect("template object");
    Api::<ResourceClaimTemplate>::namespaced(client.clone(), namespace)
        .create(&kube::api::PostParams::default(), &template)
        .await
        .expect("template created");
}

/// `gpu-dra controller` in this process, re-listing every `resync`; stopped (and awaited) by
/// [`RunningController::stop`], as a Deployment's rollout stops it.
pub struct RunningController {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningController {
    pub fn start(client: &kube::Client, resync: Duration) -> RunningController {
        let mut config = crate::domains::controller::ControllerConfig::new(DRIVER);
        config.resync = resync;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let controller = crate::domains::controller::Controller::new(client.clone(), config);
        let task = tokio::spawn(controller.run(async move {
            let _ = stopped.await;
        }));
        RunningController { stop, task }
    }

    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}
