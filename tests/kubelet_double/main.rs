//! Checks the kubelet double against small fake plugins served from this test: registration and service choice,
//! the kubelet's rejections (with NotifyRegistrationStatus(false) sent back), and the prepare/unprepare answer checks.
//! Here the fake plugin and a node's kubelet directories; the checks are in `registration`, `calls` and
//! `authority` (how the kubelet names the sockets it dials).

mod authority;
mod calls;
mod registration;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_dra::kubelet::lenient_incoming;
use gpu_dra::proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use gpu_dra::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use gpu_dra::proto::{dra_v1, dra_v1beta1};
use gpu_dra::support::kubelet::ClaimRef;
use tokio::net::UnixListener;
use tonic::{Request, Response, Status};

const DRIVER: &str = "gpu.example.com";
const SHORT_WAIT: Duration = Duration::from_secs(5);

/// How the fake plugin answers DRA calls.
#[derive(Clone, Debug, PartialEq)]
enum Behaviour {
    /// One device per claim, named after the claim.
    Answer,
    /// Leaves the first requested claim out of the answer.
    SkipFirstClaim,
    /// Adds a result for a UID nobody asked about.
    AddUnknownClaim,
    /// Fails the whole call with a gRPC error.
    FailCall,
    /// Reports a per-claim error for this UID.
    FailClaim(String),
    /// Answers only after this long.
    Stall(Duration),
}

/// Everything a fake plugin saw, for the test to inspect afterwards.
#[derive(Default)]
struct Seen {
    statuses: Vec<RegistrationStatus>,
    get_infos: usize,
    /// "v1 prepare", "v1beta1 unprepare", ... in call order.
    calls: Vec<String>,
}

#[derive(Clone)]
struct FakePlugin {
    info: PluginInfo,
    behaviour: Behaviour,
    /// How long each of the first GetInfo calls takes before it answers.
    get_info_delays: Vec<Duration>,
    seen: Arc<Mutex<Seen>>,
}

impl FakePlugin {
    fn record_call(&self, call: &str) {
        self.seen.lock().unwrap().calls.push(call.to_string());
    }
    fn statuses(&self) -> Vec<RegistrationStatus> {
        self.seen.lock().unwrap().statuses.clone()
    }
    fn calls(&self) -> Vec<String> {
        self.seen.lock().unwrap().calls.clone()
    }

    /// The v1 answer; the v1beta1 service converts it, dropping `share_id`.
    async fn prepare_answer(
        &self,
        claims: Vec<dra_v1::Claim>,
    ) -> Result<HashMap<String, dra_v1::NodePrepareResourceResponse>, Status> {
        if let Behaviour::Stall(delay) = self.behaviour {
            tokio::time::sleep(delay).await;
        }
        if self.behaviour == Behaviour::FailCall {
            return Err(Status::internal(
                "prepare resource claims: GPU driver unreachable",
            ));
        }
        let mut answer: HashMap<_, _> = claims
            .iter()
            .map(|claim| {
                let response = if self.behaviour == Behaviour::FailClaim(claim.uid.clone()) {
                    dra_v1::NodePrepareResourceResponse {
                        devices: vec![],
                        error: format!(
                            "claim {}/{}: device gpu-0 is in use",
                            claim.namespace, claim.name
                        ),
                    }
                } else {
                    dra_v1::NodePrepareResourceResponse {
                        devices: vec![device_for(claim)],
                        error: String::new(),
                    }
                };
                (claim.uid.clone(), response)
            })
            .collect();
        self.distort(&claims, &mut answer, Default::default);
        Ok(answer)
    }

    async fn unprepare_answer(
        &self,
        claims: Vec<dra_v1::Claim>,
    ) -> Result<HashMap<String, dra_v1::NodeUnprepareResourceResponse>, Status> {
        if self.behaviour == Behaviour::FailCall {
            return Err(Status::unavailable("unprepare resource claims: busy"));
        }
        let mut answer: HashMap<_, _> = claims
            .iter()
            .map(|claim| {
                let error = if self.behaviour == Behaviour::FailClaim(claim.uid.clone()) {
                    "CDI spec could not be removed".to_string()
                } else {
                    String::new()
                };
                (
                    claim.uid.clone(),
                    dra_v1::NodeUnprepareResourceResponse { error },
                )
            })
            .collect();
        self.distort(&claims, &mut answer, Default::default);
        Ok(answer)
    }

    fn distort<T>(
        &self,
        claims: &[dra_v1::Claim],
        answer: &mut HashMap<String, T>,
        extra: impl FnOnce() -> T,
    ) {
        match self.behaviour {
            Behaviour::SkipFirstClaim => {
                answer.remove(&claims[0].uid);
            }
            Behaviour::AddUnknownClaim => {
                answer.insert("uid-nobody-asked-for".to_string(), extra());
            }
            _ => {}
        }
    }
}

fn device_for(claim: &dra_v1::Claim) -> dra_v1::Device {
    dra_v1::Device {
        request_names: vec!["gpu".to_string()],
        pool_name: "node-a".to_string(),
        device_name: format!("gpu-{}", claim.name),
        cdi_device_ids: vec![format!("k8s.{DRIVER}/gpu={}-gpu-0", claim.uid)],
        share_id: Some(format!("share-{}", claim.uid)),
    }
}

fn v1beta1_to_v1(claims: Vec<dra_v1beta1::Claim>) -> Vec<dra_v1::Claim> {
    claims
        .into_iter()
        .map(|claim| dra_v1::Claim {
            namespace: claim.namespace,
            uid: claim.uid,
            name: claim.name,
        })
        .collect()
}

#[tonic::async_trait]
impl Registration for FakePlugin {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        let call = {
            let mut seen = self.seen.lock().unwrap();
            seen.get_infos += 1;
            seen.get_infos
        };
        if let Some(delay) = self.get_info_delays.get(call - 1) {
            tokio::time::sleep(*delay).await;
        }
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        self.seen
            .lock()
            .unwrap()
            .statuses
            .push(request.into_inner());
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

#[tonic::async_trait]
impl dra_v1::dra_plugin_server::DraPlugin for FakePlugin {
    async fn node_prepare_resources(
        &self,
        request: Request<dra_v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra_v1::NodePrepareResourcesResponse>, Status> {
        self.record_call("v1 prepare");
        let claims = self.prepare_answer(request.into_inner().claims).await?;
        Ok(Response::new(dra_v1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<dra_v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra_v1::NodeUnprepareResourcesResponse>, Status> {
        self.record_call("v1 unprepare");
        let claims = self.unprepare_answer(request.into_inner().claims).await?;
        Ok(Response::new(dra_v1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

#[tonic::async_trait]
impl dra_v1beta1::dra_plugin_server::DraPlugin for FakePlugin {
    async fn node_prepare_resources(
        &self,
        request: Request<dra_v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra_v1beta1::NodePrepareResourcesResponse>, Status> {
        self.record_call("v1beta1 prepare");
        let claims = self
            .prepare_answer(v1beta1_to_v1(request.into_inner().claims))
            .await?;
        let claims = claims
            .into_iter()
            .map(|(uid, claim)| {
                let devices = claim
                    .devices
                    .into_iter()
                    .map(|device| dra_v1beta1::Device {
                        request_names: device.request_names,
                        pool_name: device.pool_name,
                        device_name: device.device_name,
                        cdi_device_ids: device.cdi_device_ids,
                    })
                    .collect();
                let claim = dra_v1beta1::NodePrepareResourceResponse {
                    devices,
                    error: claim.error,
                };
                (uid, claim)
            })
            .collect();
        Ok(Response::new(dra_v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<dra_v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra_v1beta1::NodeUnprepareResourcesResponse>, Status> {
        self.record_call("v1beta1 unprepare");
        let claims = self
            .unprepare_answer(v1beta1_to_v1(request.into_inner().claims))
            .await?;
        let claims = claims
            .into_iter()
            .map(|(uid, claim)| {
                (
                    uid,
                    dra_v1beta1::NodeUnprepareResourceResponse { error: claim.error },
                )
            })
            .collect();
        Ok(Response::new(dra_v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

/// A node's two kubelet directories in a temporary tree.
struct Node {
    _root: tempfile::TempDir,
    registry_dir: PathBuf,
    dra_socket: PathBuf,
}

fn node() -> Node {
    let root = tempfile::tempdir().unwrap();
    let registry_dir = root.path().join("plugins_registry");
    let plugin_dir = root.path().join("plugins").join(DRIVER);
    std::fs::create_dir_all(&registry_dir).unwrap();
    std::fs::create_dir_all(&plugin_dir).unwrap();
    Node {
        dra_socket: plugin_dir.join("dra.sock"),
        registry_dir,
        _root: root,
    }
}

fn info(node: &Node, versions: &[&str]) -> PluginInfo {
    PluginInfo {
        r#type: "DRAPlugin".to_string(),
        name: DRIVER.to_string(),
        endpoint: node.dra_socket.display().to_string(),
        supported_versions: versions.iter().map(|v| v.to_string()).collect(),
    }
}

fn plugin(info: PluginInfo, behaviour: Behaviour) -> FakePlugin {
    FakePlugin {
        info,
        behaviour,
        get_info_delays: Vec::new(),
        seen: Arc::default(),
    }
}

fn registration_socket(node: &Node) -> PathBuf {
    node.registry_dir.join(format!("{DRIVER}-reg.sock"))
}

/// Serves the DRA services (v1 and v1beta1, as the Go library does) and then the registration service, each on
/// its own socket; the DRA server starts first so the kubelet never finds a registration without a DRA socket.
fn serve(node: &Node, plugin: &FakePlugin) {
    serve_dra(&node.dra_socket, plugin);
    serve_registration(&registration_socket(node), plugin);
}

/// The fake plugin's sockets accept any `:authority`, as the driver's do; see `strict_*` below for what
/// tonic does without that.
fn serve_dra(socket: &Path, plugin: &FakePlugin) {
    let incoming = lenient_incoming(UnixListener::bind(socket).unwrap());
    let router = tonic::transport::Server::builder()
        .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ))
        .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ));
    tokio::spawn(router.serve_with_incoming(incoming));
}

fn serve_registration(socket: &Path, plugin: &FakePlugin) {
    let incoming = lenient_incoming(UnixListener::bind(socket).unwrap());
    let router =
        tonic::transport::Server::builder().add_service(RegistrationServer::new(plugin.clone()));
    tokio::spawn(router.serve_with_incoming(incoming));
}

fn claims(count: usize) -> Vec<ClaimRef> {
    (0..count)
        .map(|i| ClaimRef::new("default", format!("claim-{i}"), format!("uid-{i}")))
        .collect()
}
