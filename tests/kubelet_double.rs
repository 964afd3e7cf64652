//! Checks the kubelet double against small fake plugins served from this test: registration and service choice,
//! the kubelet's rejections (with NotifyRegistrationStatus(false) sent back), and the prepare/unprepare answer checks.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::TryStreamExt;
use gpu_dra::kubelet::authority::{lenient_policy, AuthorityPolicy};
use gpu_dra::kubelet::{lenient_incoming, LenientAuthority};
use gpu_dra::proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use gpu_dra::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use gpu_dra::proto::{dra_v1, dra_v1beta1};
use gpu_dra::support::grpc_dial::encode_authority;
use gpu_dra::support::kubelet::{
    ClaimRef, Dial, DraService, KubeletDouble, KubeletError, PreparedDevice,
};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
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

#[tokio::test]
async fn correct_plugin_registers_on_v1_and_round_trips() {
    let node = node();
    let plugin = plugin(
        info(
            &node,
            &[
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth",
            ],
        ),
        Behaviour::Answer,
    );
    serve(&node, &plugin);

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.service(), DraService::V1);
    assert_eq!(kubelet.plugin_info(), &plugin.info);
    assert_eq!(kubelet.endpoint(), node.dra_socket);
    assert_eq!(
        plugin.statuses(),
        vec![RegistrationStatus {
            plugin_registered: true,
            error: String::new()
        }]
    );

    let claims = claims(2);
    let prepared = kubelet.prepare(&claims).await.unwrap();
    assert_eq!(prepared.len(), 2);
    assert_eq!(
        prepared["uid-1"],
        Ok(vec![PreparedDevice {
            request_names: vec!["gpu".to_string()],
            pool_name: "node-a".to_string(),
            device_name: "gpu-claim-1".to_string(),
            cdi_device_ids: vec![format!("k8s.{DRIVER}/gpu=uid-1-gpu-0")],
            share_id: Some("share-uid-1".to_string()),
        }])
    );

    let unprepared = kubelet.unprepare(&claims).await.unwrap();
    assert_eq!(
        unprepared,
        HashMap::from([("uid-0".to_string(), Ok(())), ("uid-1".to_string(), Ok(()))])
    );
    assert_eq!(plugin.calls(), vec!["v1 prepare", "v1 unprepare"]);
}

#[tokio::test]
async fn registration_waits_for_the_socket_to_appear() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    let kubelet = tokio::spawn({
        let dir = node.registry_dir.clone();
        async move { KubeletDouble::register(&dir, DRIVER, SHORT_WAIT).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    serve(&node, &plugin);
    assert_eq!(kubelet.await.unwrap().unwrap().service(), DraService::V1);
}

#[tokio::test]
async fn plugin_advertising_only_v1beta1_is_called_over_v1beta1() {
    let node = node();
    let plugin = plugin(info(&node, &["v1beta1.DRAPlugin"]), Behaviour::Answer);
    serve(&node, &plugin);

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.service(), DraService::V1beta1);

    let claims = claims(1);
    let prepared = kubelet.prepare(&claims).await.unwrap();
    let devices = prepared["uid-0"].as_ref().unwrap();
    assert_eq!(devices[0].device_name, "gpu-claim-0");
    assert_eq!(devices[0].share_id, None, "v1beta1 has no share_id");
    assert_eq!(kubelet.unprepare(&claims).await.unwrap()["uid-0"], Ok(()));
    assert_eq!(plugin.calls(), vec!["v1beta1 prepare", "v1beta1 unprepare"]);
}

#[tokio::test]
async fn plugin_order_decides_between_supported_services() {
    let node = node();
    let plugin = plugin(
        info(
            &node,
            &[
                "v1alpha1.DRAResourceHealth",
                "v1beta1.DRAPlugin",
                "v1.DRAPlugin",
            ],
        ),
        Behaviour::Answer,
    );
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.service(), DraService::V1beta1);
}

#[tokio::test]
async fn kubelet_knowing_only_v1beta1_uses_it() {
    let node = node();
    let plugin = plugin(
        info(&node, &["v1.DRAPlugin", "v1beta1.DRAPlugin"]),
        Behaviour::Answer,
    );
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register_with(
        &node.registry_dir,
        DRIVER,
        SHORT_WAIT,
        &["v1beta1.DRAPlugin"],
    )
    .await
    .unwrap();
    assert_eq!(kubelet.service(), DraService::V1beta1);
    kubelet.prepare(&claims(1)).await.unwrap();
    assert_eq!(plugin.calls(), vec!["v1beta1 prepare"]);
}

#[tokio::test]
async fn empty_endpoint_means_the_registration_socket() {
    let node = node();
    let mut info = info(&node, &["v1.DRAPlugin"]);
    info.endpoint = String::new();
    let plugin = plugin(info, Behaviour::Answer);
    // One server for everything, on the registration socket.
    let incoming = lenient_incoming(UnixListener::bind(registration_socket(&node)).unwrap());
    let router = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(plugin.clone()))
        .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ));
    tokio::spawn(router.serve_with_incoming(incoming));

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.endpoint(), registration_socket(&node));
    kubelet.prepare(&claims(1)).await.unwrap();
}

/// Registers a plugin whose `GetInfo` answer was edited by `edit`; expects a rejection that the plugin also heard of.
async fn assert_rejected(edit: impl FnOnce(&mut PluginInfo), reason_part: &str) {
    let node = node();
    let mut info = info(&node, &["v1.DRAPlugin"]);
    edit(&mut info);
    let plugin = plugin(info, Behaviour::Answer);
    serve(&node, &plugin);

    let error = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap_err();
    let KubeletError::Rejected(reason) = error else {
        panic!("expected a rejection, got {error:?}");
    };
    assert!(
        reason.contains(reason_part),
        "{reason:?} should mention {reason_part:?}"
    );
    let statuses = plugin.statuses();
    assert_eq!(statuses.len(), 1);
    assert!(!statuses[0].plugin_registered);
    assert_eq!(statuses[0].error, reason);
}

#[tokio::test]
async fn wrong_plugin_type_is_rejected() {
    assert_rejected(
        |info| info.r#type = "DevicePlugin".to_string(),
        "RegisterPlugin error -- no handler registered for plugin type: DevicePlugin at socket ",
    )
    .await;
}

#[tokio::test]
async fn the_plugin_name_is_taken_as_advertised() {
    // Nothing ties the name in GetInfo to the socket's file name: the kubelet registers what it is told.
    let node = node();
    let mut info = info(&node, &["v1.DRAPlugin"]);
    info.name = "other.example.com".to_string();
    let plugin = plugin(info, Behaviour::Answer);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert_eq!(kubelet.plugin_info().name, "other.example.com");
    assert!(plugin.statuses()[0].plugin_registered);
}

#[tokio::test]
async fn a_relative_endpoint_registers_and_then_fails_to_connect() {
    // The kubelet does not check the endpoint; `unix:` + a relative path resolves against its own working
    // directory, where no such socket exists.
    let node = node();
    let mut info = info(&node, &["v1.DRAPlugin"]);
    info.endpoint = "no-such-dir/dra.sock".to_string();
    let plugin = plugin(info, Behaviour::Answer);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    let error = kubelet.prepare(&claims(1)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::Status(s) if s.code() == tonic::Code::Unavailable),
        "{error:?}"
    );
}

#[tokio::test]
async fn empty_supported_versions_are_rejected() {
    assert_rejected(
        |info| info.supported_versions.clear(),
        "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA \
         driver plugin gpu.example.com at endpoint ",
    )
    .await;
    assert_rejected(
        |info| info.supported_versions.clear(),
        ": empty list of supported gRPC services (aka supported versions)",
    )
    .await;
}

#[tokio::test]
async fn only_unknown_services_are_rejected() {
    assert_rejected(
        |info| {
            info.supported_versions = vec![
                "v1alpha1.DRAResourceHealth".to_string(),
                "v2.DRAPlugin".to_string(),
            ]
        },
        "none of services supported by the plugin ([\"v1alpha1.DRAResourceHealth\" \"v2.DRAPlugin\"]) are \
         supported by the kubelet ([\"v1.DRAPlugin\" \"v1beta1.DRAPlugin\"])",
    )
    .await;
}

#[tokio::test]
async fn v1_only_plugin_is_rejected_by_a_v1beta1_kubelet() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve(&node, &plugin);
    let error = KubeletDouble::register_with(
        &node.registry_dir,
        DRIVER,
        SHORT_WAIT,
        &["v1beta1.DRAPlugin"],
    )
    .await
    .unwrap_err();
    assert!(matches!(error, KubeletError::Rejected(_)), "{error:?}");
    assert!(!plugin.statuses()[0].plugin_registered);
}

#[tokio::test]
async fn hidden_names_and_plain_files_are_not_registration_sockets() {
    let node = node();
    // A regular file with the right name (a leftover) and a socket with a hidden name are both ignored.
    std::fs::write(registration_socket(&node), b"not a socket").unwrap();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve_registration(
        &node.registry_dir.join(format!(".{DRIVER}-reg.sock")),
        &plugin,
    );

    let error = KubeletDouble::register(&node.registry_dir, DRIVER, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(error, KubeletError::Timeout { .. }), "{error:?}");
    assert!(plugin.statuses().is_empty());
}

#[tokio::test]
async fn answer_missing_a_claim_fails_the_call() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::SkipFirstClaim);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();

    let error = kubelet.prepare(&claims(3)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::MissingClaims(uids) if uids == &["uid-0"]),
        "{error:?}"
    );
    let error = kubelet.unprepare(&claims(3)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::MissingClaims(uids) if uids == &["uid-0"]),
        "{error:?}"
    );
}

#[tokio::test]
async fn answer_with_an_unknown_claim_fails_the_call() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::AddUnknownClaim);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();

    let error = kubelet.prepare(&claims(2)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::UnknownClaims(uids) if uids == &["uid-nobody-asked-for"]),
        "{error:?}"
    );
    let error = kubelet.unprepare(&claims(2)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::UnknownClaims(_)),
        "{error:?}"
    );
}

#[tokio::test]
async fn grpc_error_is_a_whole_call_failure() {
    for versions in [["v1.DRAPlugin"], ["v1beta1.DRAPlugin"]] {
        let node = node();
        let plugin = plugin(info(&node, &versions), Behaviour::FailCall);
        serve(&node, &plugin);
        let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
            .await
            .unwrap();

        let error = kubelet.prepare(&claims(1)).await.unwrap_err();
        let KubeletError::Status(status) = error else {
            panic!("expected a gRPC status, got {error:?}");
        };
        assert_eq!(status.code(), tonic::Code::Internal);
        assert!(status.message().contains("GPU driver unreachable"));
        let error = kubelet.unprepare(&claims(1)).await.unwrap_err();
        assert!(
            matches!(&error, KubeletError::Status(s) if s.code() == tonic::Code::Unavailable),
            "{error:?}"
        );
    }
}

#[tokio::test]
async fn per_claim_error_fails_only_that_claim() {
    let node = node();
    let plugin = plugin(
        info(&node, &["v1.DRAPlugin"]),
        Behaviour::FailClaim("uid-1".to_string()),
    );
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();

    let prepared = kubelet.prepare(&claims(2)).await.unwrap();
    assert!(prepared["uid-0"].is_ok());
    assert_eq!(
        prepared["uid-1"],
        Err("claim default/claim-1: device gpu-0 is in use".to_string())
    );
    let unprepared = kubelet.unprepare(&claims(2)).await.unwrap();
    assert_eq!(unprepared["uid-0"], Ok(()));
    assert_eq!(
        unprepared["uid-1"],
        Err("CDI spec could not be removed".to_string())
    );
}

#[tokio::test]
async fn slow_plugin_hits_the_call_deadline() {
    let node = node();
    let plugin = plugin(
        info(&node, &["v1.DRAPlugin"]),
        Behaviour::Stall(Duration::from_secs(5)),
    );
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap()
        .with_call_timeout(Duration::from_millis(200));

    let error = kubelet.prepare(&claims(1)).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::Status(s) if s.code() == tonic::Code::DeadlineExceeded),
        "{error:?}"
    );
}

#[tokio::test]
async fn missing_dra_socket_fails_calls_not_registration() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve_registration(&registration_socket(&node), &plugin);

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    let error = kubelet.prepare(&claims(1)).await.unwrap_err();
    assert!(matches!(error, KubeletError::Status(_)), "{error:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_prepares_share_one_kubelet() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve(&node, &plugin);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();

    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let kubelet = kubelet.clone();
            tokio::spawn(async move {
                let claim =
                    ClaimRef::new("default", format!("pod-{i}-claim"), format!("uid-pod-{i}"));
                kubelet.prepare(std::slice::from_ref(&claim)).await
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let prepared = task.await.unwrap().unwrap();
        assert_eq!(
            prepared[&format!("uid-pod-{i}")].as_ref().unwrap()[0].device_name,
            format!("gpu-pod-{i}-claim")
        );
    }
    assert_eq!(plugin.calls().len(), 16);
}

// ---- How the kubelet names the sockets it dials (`:authority`) ----

type Authorities = Arc<Mutex<Vec<String>>>;

/// Accepts like the driver does, and records every `:authority` the server was sent.
fn recording_incoming(
    socket: &Path,
    seen: Authorities,
    lenient: bool,
) -> impl futures::Stream<Item = std::io::Result<LenientAuthority<tokio::net::UnixStream>>> {
    let repair = lenient_policy();
    let policy: AuthorityPolicy = Arc::new(move |authority: &[u8]| {
        seen.lock()
            .unwrap()
            .push(String::from_utf8_lossy(authority).into_owned());
        if lenient {
            repair(authority)
        } else {
            None
        }
    });
    UnixListenerStream::new(UnixListener::bind(socket).unwrap())
        .map_ok(move |stream| LenientAuthority::with_policy(stream, policy.clone()))
}

/// Serves the fake plugin on both sockets, recording authorities; `lenient_dra: false` leaves the DRA socket
/// as strict as plain tonic.
fn serve_recording(
    node: &Node,
    plugin: &FakePlugin,
    lenient_dra: bool,
) -> (Authorities, Authorities) {
    let registration = Authorities::default();
    let dra = Authorities::default();
    let router = tonic::transport::Server::builder()
        .add_service(dra_v1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ))
        .add_service(dra_v1beta1::dra_plugin_server::DraPluginServer::new(
            plugin.clone(),
        ));
    tokio::spawn(router.serve_with_incoming(recording_incoming(
        &node.dra_socket,
        dra.clone(),
        lenient_dra,
    )));
    let router =
        tonic::transport::Server::builder().add_service(RegistrationServer::new(plugin.clone()));
    let socket = registration_socket(node);
    tokio::spawn(router.serve_with_incoming(recording_incoming(
        &socket,
        registration.clone(),
        true,
    )));
    (registration, dra)
}

#[test]
fn the_authority_is_encoded_as_grpc_go_encodes_it() {
    assert_eq!(
        encode_authority("/var/lib/kubelet/plugins_registry/gpu.dra.dev-reg.sock"),
        "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.dra.dev-reg.sock"
    );
    assert_eq!(
        encode_authority("/a b/c%d:[x]@y!~"),
        "%2Fa%20b%2Fc%25d:[x]@y!~"
    );
}

#[tokio::test]
async fn registration_is_dialled_by_raw_path_and_dra_by_unix_scheme() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    let (registration, dra) = serve_recording(&node, &plugin, true);

    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    kubelet.prepare(&claims(1)).await.unwrap();

    let encoded_path = encode_authority(&registration_socket(&node).display().to_string());
    assert!(encoded_path.starts_with("%2F"), "{encoded_path}");
    // GetInfo and NotifyRegistrationStatus.
    assert_eq!(*registration.lock().unwrap(), vec![encoded_path; 2]);
    assert_eq!(*dra.lock().unwrap(), vec!["localhost".to_string()]);
}

#[tokio::test]
async fn a_strict_http2_server_refuses_the_kubelets_registration() {
    // What the real kubelet saw from gpu-dra before the repair: tonic alone resets the stream.
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    serve_dra(&node.dra_socket, &plugin);
    let incoming = UnixListenerStream::new(UnixListener::bind(registration_socket(&node)).unwrap());
    let router =
        tonic::transport::Server::builder().add_service(RegistrationServer::new(plugin.clone()));
    tokio::spawn(router.serve_with_incoming(incoming));

    let error = KubeletDouble::register(&node.registry_dir, DRIVER, Duration::from_millis(1200))
        .await
        .unwrap_err();
    let KubeletError::GetInfo(status) = &error else {
        panic!("expected GetInfo to fail, got {error:?}");
    };
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    assert!(
        format!("{status:?}")
            .to_lowercase()
            .contains("protocol error"),
        "{status:?}"
    );
    // h2 reset every stream before tonic saw a request, so GetInfo never ran.
    assert_eq!(plugin.seen.lock().unwrap().get_infos, 0);
    assert!(plugin.statuses().is_empty());
}

#[tokio::test]
async fn the_dra_socket_dialled_by_raw_path_needs_the_repair() {
    let node = node();
    let plugin = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    let (_, dra) = serve_recording(&node, &plugin, false);
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    // `localhost` is fine for plain tonic; the raw path is not.
    kubelet.prepare(&claims(1)).await.unwrap();
    let error = kubelet
        .redial(Dial::RawPath)
        .prepare(&claims(1))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, KubeletError::Status(s) if s.code() == tonic::Code::Internal),
        "{error:?}"
    );
    let encoded_path = encode_authority(&node.dra_socket.display().to_string());
    assert_eq!(
        *dra.lock().unwrap(),
        vec!["localhost".to_string(), encoded_path]
    );

    // With the repair in front, the same dial works.
    let repaired = self::node();
    let plugin = self::plugin(info(&repaired, &["v1.DRAPlugin"]), Behaviour::Answer);
    let (_, dra) = serve_recording(&repaired, &plugin, true);
    let kubelet = KubeletDouble::register(&repaired.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap()
        .redial(Dial::RawPath);
    kubelet.prepare(&claims(2)).await.unwrap();
    kubelet.unprepare(&claims(2)).await.unwrap();
    assert_eq!(dra.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn get_info_has_one_second_and_a_failed_registration_is_retried() {
    let node = node();
    let mut slow = plugin(info(&node, &["v1.DRAPlugin"]), Behaviour::Answer);
    // The first GetInfo misses the kubelet's 1 s deadline; the retry 500 ms later is answered.
    slow.get_info_delays = vec![Duration::from_millis(1500)];
    serve(&node, &slow);
    let started = std::time::Instant::now();
    let kubelet = KubeletDouble::register(&node.registry_dir, DRIVER, SHORT_WAIT)
        .await
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(kubelet.service(), DraService::V1);
    assert_eq!(slow.seen.lock().unwrap().get_infos, 2);
    let statuses = slow.statuses();
    assert_eq!(statuses.len(), 1);
    assert!(statuses[0].plugin_registered);

    // A plugin that is always too slow fails with the deadline once the caller's time is up.
    let other = self::node();
    let mut stuck = plugin(info(&other, &["v1.DRAPlugin"]), Behaviour::Answer);
    stuck.get_info_delays = vec![Duration::from_secs(3); 10];
    serve(&other, &stuck);
    let error = KubeletDouble::register(&other.registry_dir, DRIVER, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, KubeletError::GetInfo(s) if s.code() == tonic::Code::DeadlineExceeded),
        "{error:?}"
    );
    assert_eq!(stuck.seen.lock().unwrap().get_infos, 2);
    assert!(stuck.statuses().is_empty());
}
