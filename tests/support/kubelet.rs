//! A kubelet double: it finds a DRA plugin's registration socket, registers the plugin with the checks the kubelet
//! makes, and calls NodePrepareResources / NodeUnprepareResources with the kubelet's deadlines and answer checks.
//! Tests, the demo and the benchmark drive the driver through it, so it must fail wherever the real kubelet fails.
//! Here: the calls and their answer checks; registration is in `registration`, the health stream in `health`.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status};

pub use super::grpc_dial::Dial;
use super::grpc_dial::{unix_connector, UNIX_TARGET_URI};
use crate::proto::{dra_v1, dra_v1beta1, DRA_V1BETA1_SERVICE, DRA_V1_SERVICE};

/// What the plugin answered in `GetInfo`.
pub use crate::proto::pluginregistration::PluginInfo;

/// `servicesSupportedByKubelet` in Kubernetes 1.34 – 1.37, in the kubelet's order.
pub const SERVICES_SUPPORTED_BY_KUBELET: [&str; 2] = [DRA_V1_SERVICE, DRA_V1BETA1_SERVICE];
/// The kubelet's deadline for each NodePrepareResources / NodeUnprepareResources call (`defaultClientCallTimeout`).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// Why the kubelet double could not register a plugin or complete a call.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("no registration socket {socket} appeared within {waited:?}")]
    Timeout { socket: PathBuf, waited: Duration },
    #[error("could not dial {socket}: {reason}")]
    Transport { socket: PathBuf, reason: String },
    #[error("GetInfo on the registration socket failed: {0}")]
    GetInfo(Status),
    #[error("registration rejected: {0}")]
    Rejected(String),
    #[error("NotifyRegistrationStatus(registered) failed: {0}")]
    Notify(Status),
    #[error("whole call failed: {0}")]
    Status(Status),
    #[error("the plugin skipped {count} ResourceClaims: {0:?}", count = .0.len())]
    MissingClaims(Vec<String>),
    #[error("the plugin returned results for unknown claim UIDs {0:?}")]
    UnknownClaims(Vec<String>),
    #[error("the plugin advertises no resource-health service in {0:?}")]
    NoHealthService(Vec<String>),
    #[error("NodeWatchResources failed: {0}")]
    HealthStream(Status),
    #[error("bad health report for device {pool:?}/{device:?}: {reason}")]
    BadHealth {
        pool: String,
        device: String,
        reason: String,
    },
}

/// The claim identity the kubelet sends: the ResourceClaim may already be gone, so this is all a plugin gets.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ClaimRef {
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        uid: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
        }
    }
}

/// One device of a prepared claim, as the kubelet keeps it in its checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
    /// Always `None` over v1beta1, which has no such field.
    pub share_id: Option<String>,
}

/// The DRA gRPC service the kubelet chose at registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraService {
    V1,
    V1beta1,
}

#[derive(Clone)]
enum DraClient {
    V1(dra_v1::dra_plugin_client::DraPluginClient<Channel>),
    V1beta1(dra_v1beta1::dra_plugin_client::DraPluginClient<Channel>),
}

/// A registered plugin, ready for prepare/unprepare calls. Cloning is cheap and clones share one connection,
/// so many tasks can call the plugin at once, as the kubelet's pod workers do.
#[derive(Clone)]
pub struct KubeletDouble {
    info: PluginInfo,
    endpoint: PathBuf,
    /// The one connection to the DRA socket; the kubelet runs DRA calls and the health stream over it.
    channel: Channel,
    client: DraClient,
    call_timeout: Duration,
}

impl std::fmt::Debug for KubeletDouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletDouble")
            .field("info", &self.info)
            .field("endpoint", &self.endpoint)
            .field("service", &self.service())
            .field("call_timeout", &self.call_timeout)
            .finish()
    }
}

impl KubeletDouble {
    /// The same registered plugin reached over a new connection that names the DRA socket as `dial` says:
    /// `Dial::RawPath` is how older kubelets (and other grpc-go clients) dial it.
    pub fn redial(&self, dial: Dial) -> Self {
        let (channel, client) = dra_client(&self.endpoint, self.service(), dial);
        Self {
            info: self.info.clone(),
            endpoint: self.endpoint.clone(),
            channel,
            client,
            call_timeout: self.call_timeout,
        }
    }

    /// Replaces the 45 s per-call deadline, so a test can see a slow plugin hit DeadlineExceeded quickly.
    pub fn with_call_timeout(mut self, call_timeout: Duration) -> Self {
        self.call_timeout = call_timeout;
        self
    }

    pub fn service(&self) -> DraService {
        match self.client {
            DraClient::V1(_) => DraService::V1,
            DraClient::V1beta1(_) => DraService::V1beta1,
        }
    }

    pub fn plugin_info(&self) -> &PluginInfo {
        &self.info
    }

    /// The DRA socket the kubelet talks to: the advertised endpoint, or the registration socket if that was empty.
    pub fn endpoint(&self) -> &Path {
        &self.endpoint
    }

    /// One NodePrepareResources call with these claims, as the kubelet makes for one pod. A gRPC error is a
    /// whole-call failure; otherwise each claim UID maps to its devices or its per-claim error.
    pub async fn prepare(
        &self,
        claims: &[ClaimRef],
    ) -> Result<HashMap<String, Result<Vec<PreparedDevice>, String>>, KubeletError> {
        let answers: HashMap<String, (String, Vec<PreparedDevice>)> = match &self.client {
            DraClient::V1(client) => {
                let mut client = client.clone();
                let request = dra_v1::NodePrepareResourcesRequest {
                    claims: claims.iter().map(v1_claim).collect(),
                };
                let response = with_deadline(
                    self.call_timeout,
                    |r| client.node_prepare_resources(r),
                    request,
                )
                .await
                .map_err(KubeletError::Status)?;
                response
                    .claims
                    .into_iter()
                    .map(|(uid, claim)| {
                        (
                            uid,
                            (
                                claim.error,
                                claim.devices.into_iter().map(from_v1).collect(),
                            ),
                        )
                    })
                    .collect()
            }
            DraClient::V1beta1(client) => {
                let mut client = client.clone();
                let request = dra_v1beta1::NodePrepareResourcesRequest {
                    claims: claims.iter().map(v1beta1_claim).collect(),
                };
                let response = with_deadline(
                    self.call_timeout,
                    |r| client.node_prepare_resources(r),
                    request,
                )
                .await
                .map_err(KubeletError::Status)?;
                response
                    .claims
                    .into_iter()
                    .map(|(uid, claim)| {
                        (
                            uid,
                            (
                                claim.error,
                                claim.devices.into_iter().map(from_v1beta1).collect(),
                            ),
                        )
                    })
                    .collect()
            }
        };
        check_claim_uids(claims, answers.keys())?;
        Ok(answers
            .into_iter()
            .map(|(uid, (error, devices))| (uid, per_claim(error, devices)))
            .collect())
    }

    /// One NodeUnprepareResources call with these claims, checked like [`prepare`](Self::prepare).
    pub async fn unprepare(
        &self,
        claims: &[ClaimRef],
    ) -> Result<HashMap<String, Result<(), String>>, KubeletError> {
        let answers: HashMap<String, String> = match &self.client {
            DraClient::V1(client) => {
                let mut client = client.clone();
                let request = dra_v1::NodeUnprepareResourcesRequest {
                    claims: claims.iter().map(v1_claim).collect(),
                };
                let response = with_deadline(
                    self.call_timeout,
                    |r| client.node_unprepare_resources(r),
                    request,
                )
                .await
                .map_err(KubeletError::Status)?;
                response
                    .claims
                    .into_iter()
                    .map(|(uid, claim)| (uid, claim.error))
                    .collect()
            }
            DraClient::V1beta1(client) => {
                let mut client = client.clone();
                let request = dra_v1beta1::NodeUnprepareResourcesRequest {
                    claims: claims.iter().map(v1beta1_claim).collect(),
                };
                let response = with_deadline(
                    self.call_timeout,
                    |r| client.node_unprepare_resources(r),
                    request,
                )
                .await
                .map_err(KubeletError::Status)?;
                response
                    .claims
                    .into_iter()
                    .map(|(uid, claim)| (uid, claim.error))
                    .collect()
            }
        };
        check_claim_uids(claims, answers.keys())?;
        Ok(answers
            .into_iter()
            .map(|(uid, error)| (uid, per_claim(error, ())))
            .collect())
    }
}

/// A lazily connecting client for the DRA service `service` on `endpoint`.
fn dra_client(endpoint: &Path, service: DraService, dial: Dial) -> (Channel, DraClient) {
    let channel = Endpoint::from_static(UNIX_TARGET_URI)
        .connect_with_connector_lazy(unix_connector(endpoint, dial));
    let client = match service {
        DraService::V1 => DraClient::V1(dra_v1::dra_plugin_client::DraPluginClient::new(
            channel.clone(),
        )),
        DraService::V1beta1 => DraClient::V1beta1(
            dra_v1beta1::dra_plugin_client::DraPluginClient::new(channel.clone()),
        ),
    };
    (channel, client)
}

/// Makes one unary call with the kubelet's deadline: the deadline travels to the plugin as `grpc-timeout`, and is
/// also enforced here so a plugin that never answers still ends the call with DeadlineExceeded.
async fn with_deadline<M, T, F, Fut>(deadline: Duration, call: F, message: M) -> Result<T, Status>
where
    F: FnOnce(Request<M>) -> Fut,
    Fut: Future<Output = Result<Response<T>, Status>>,
{
    let mut request = Request::new(message);
    request.set_timeout(deadline);
    let started = tokio::time::Instant::now();
    let expired = || Status::deadline_exceeded(format!("no answer within {deadline:?}"));
    match tokio::time::timeout(deadline, call(request)).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        // tonic's channel enforces `grpc-timeout` itself and reports Cancelled; grpc-go reports DeadlineExceeded.
        Ok(Err(status)) if status.code() == Code::Cancelled && started.elapsed() >= deadline => {
            Err(expired())
        }
        Ok(Err(status)) => Err(status),
        Err(_) => Err(expired()),
    }
}

/// The kubelet's answer checks: a result for a UID it did not ask about is reported first, then skipped claims.
fn check_claim_uids<'a>(
    claims: &[ClaimRef],
    answered: impl Iterator<Item = &'a String>,
) -> Result<(), KubeletError> {
    let requested: HashSet<&str> = claims.iter().map(|claim| claim.uid.as_str()).collect();
    let answered: HashSet<&str> = answered.map(String::as_str).collect();

    let mut unknown: Vec<String> = answered
        .difference(&requested)
        .map(|uid| uid.to_string())
        .collect();
    if !unknown.is_empty() {
        unknown.sort();
        return Err(KubeletError::UnknownClaims(unknown));
    }
    let mut missing: Vec<String> = requested
        .difference(&answered)
        .map(|uid| uid.to_string())
        .collect();
    if !missing.is_empty() {
        missing.sort();
        return Err(KubeletError::MissingClaims(missing));
    }
    Ok(())
}

/// A non-empty per-claim error means the claim failed and its devices are ignored, as the kubelet does.
fn per_claim<T>(error: String, value: T) -> Result<T, String> {
    if error.is_empty() {
        Ok(value)
    } else {
        Err(error)
    }
}

fn v1_claim(claim: &ClaimRef) -> dra_v1::Claim {
    dra_v1::Claim {
        namespace: claim.namespace.clone(),
        uid: claim.uid.clone(),
        name: claim.name.clone(),
    }
}

fn v1beta1_claim(claim: &ClaimRef) -> dra_v1beta1::Claim {
    dra_v1beta1::Claim {
        namespace: claim.namespace.clone(),
        uid: claim.uid.clone(),
        name: claim.name.clone(),
    }
}

fn from_v1(device: dra_v1::Device) -> PreparedDevice {
    PreparedDevice {
        request_names: device.request_names,
        pool_name: device.pool_name,
        device_name: device.device_name,
        cdi_device_ids: device.cdi_device_ids,
        share_id: device.share_id,
    }
}

/// The kubelet's v1beta1 wrapper converts to v1, where `share_id` simply stays unset.
fn from_v1beta1(device: dra_v1beta1::Device) -> PreparedDevice {
    PreparedDevice {
        request_names: device.request_names,
        pool_name: device.pool_name,
        device_name: device.device_name,
        cdi_device_ids: device.cdi_device_ids,
        share_id: None,
    }
}

/// Transport errors hide their cause (e.g. "connection refused") in the source chain.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[path = "kubelet_health.rs"]
mod health;
#[path = "kubelet_registration.rs"]
mod registration;
pub use health::{
    DeviceHealth, HealthApi, HealthCache, HealthMonitor, HealthStatus, HealthWatch,
    DEFAULT_HEALTH_TIMEOUT, MAX_HEALTH_MESSAGE_CHARS,
};
