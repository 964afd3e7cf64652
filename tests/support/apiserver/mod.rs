//! An in-process Kubernetes API server double: a real HTTP/1.1 server on loopback that speaks enough of the
//! Kubernetes REST/JSON protocol for the `kube` client and `kube::runtime::watcher`, stores nodes, pods,
//! ResourceSlices, ResourceClaims, ResourceClaimTemplates, DeviceClasses, Leases and the other kinds of
//! [`resources`], and rejects invalid ResourceSlices as the real server does.
//!
//! Tests drive it over HTTP like a cluster, and reach around HTTP through the hooks on [`ApiServer`] to play
//! the kubelet or a controller (`insert`, `remove`), issue service account tokens that its SelfSubjectReview
//! answers for (`pod_bound_token`, `unbound_token`; see [`identity`]), inject faults (`fail_next`, `set_latency`, `hang_next`,
//! `freeze_watches`), turn feature gates off (`start_with_gates`, `set_feature_gates`, `upgrade`; see
//! [`gates`]) and observe what the driver did (`requests`, `writes`, `dry_runs`).
//!
//! Its parts: [`resources`] (the kinds served), [`store`] (objects, watch history, server-owned metadata),
//! [`rest`] (routing, faults and reads), [`writes`] with [`admission`] and [`validation`] (the write path),
//! [`watches`], [`errors`] (the `Status` answers) and [`hooks`] (the test hooks on [`ApiServer`]).
//!
//! ```ignore
//! let server = ApiServer::start().await?;
//! let slices: kube::Api<ResourceSlice> = kube::Api::all(server.client()?);
//! ```

mod admission;
mod errors;
mod gates;
mod hangs;
mod hooks;
mod identity;
mod patch;
mod resources;
mod rest;
mod selectors;
mod store;
mod validation;
mod watches;
mod writes;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::json;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

pub use gates::{FeatureGate, FeatureGates};
pub use hangs::HangSpec;
pub use identity::NODE_NAME_CLAIM;
pub use store::ApiHandle;

use resources::{hook_resource, ResourceDef};
use store::{
    fill_system_meta, fill_type_meta, meta, meta_str, now_timestamp, remove_meta, set_meta,
    EventType, ObjectKey, Store, StoreEvent,
};

/// Capacity of the live event channel; a watcher that falls this far behind gets `410 Gone`.
const EVENT_CHANNEL_CAPACITY: usize = 4_096;

/// The Kubernetes minor version whose validation rules the server applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum ServerVersion {
    V1_34,
    #[default]
    V1_35,
    V1_36,
}

impl ServerVersion {
    fn minor(self) -> u32 {
        match self {
            ServerVersion::V1_34 => 34,
            ServerVersion::V1_35 => 35,
            ServerVersion::V1_36 => 36,
        }
    }
}

/// The API verb of a request, as in RBAC rules and audit logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
}

impl Verb {
    fn is_write(self) -> bool {
        matches!(
            self,
            Verb::Create | Verb::Update | Verb::Patch | Verb::Delete
        )
    }
}

/// Makes the next `count` requests that match `verb` and `resource` (`None` matches any) fail with `code`
/// without being applied. `resource` is a plural such as `resourceslices`; `resourceclaims` also matches
/// the `resourceclaims/status` subresource, `resourceclaims/status` matches only that.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultSpec {
    pub verb: Option<Verb>,
    pub resource: Option<String>,
    pub code: u16,
    pub count: usize,
}

/// One request the server answered. `resource` names the subresource too (`resourceclaims/status`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestRecord {
    pub verb: Verb,
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub code: u16,
    /// `dryRun=All`: validated and answered, nothing stored.
    pub dry_run: bool,
    /// Length of the request body: what a write sent (0 for reads and watches).
    pub body_bytes: usize,
}

/// Whether `pattern` (a plural, or plural/subresource) covers the request resource `resource`.
fn resource_matches(pattern: &str, resource: &str) -> bool {
    pattern == resource || resource.split('/').next() == Some(pattern)
}

#[derive(Default)]
struct Faults {
    pending: Vec<FaultSpec>,
    latency: Duration,
}

/// What the HTTP handlers and the hooks share.
struct Shared {
    /// The version a test may change, as an upgrade of the control plane would.
    version: Mutex<ServerVersion>,
    /// Which gates are off; a test may change them, as an admin restarting the server with new flags.
    gates: Mutex<FeatureGates>,
    store: Mutex<Store>,
    events: broadcast::Sender<Arc<StoreEvent>>,
    faults: Mutex<Faults>,
    requests: Mutex<Vec<RequestRecord>>,
    /// Resources answered with 404 as if their API were not installed (a CRD not applied).
    unserved: Mutex<BTreeSet<&'static str>>,
    shutdown: watch::Receiver<bool>,
    hangs: hangs::Hangs,
    /// The bearer tokens the double issued (see [`identity`]).
    tokens: Mutex<identity::Tokens>,
}

/// Locks a mutex, ignoring poisoning: a test that panicked while holding it must not hide its own
/// failure behind a second panic here, and every critical section leaves the data consistent.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    fn record(&self, record: RequestRecord) {
        lock(&self.requests).push(record);
    }

    /// Takes one matching injected fault, if any.
    fn take_fault(&self, verb: Verb, resource: &str) -> Option<u16> {
        let mut faults = lock(&self.faults);
        let index = faults.pending.iter().position(|fault| {
            fault.count > 0
                && fault.verb.is_none_or(|v| v == verb)
                && fault
                    .resource
                    .as_deref()
                    .is_none_or(|r| resource_matches(r, resource))
        })?;
        let fault = &mut faults.pending[index];
        fault.count -= 1;
        let code = fault.code;
        if fault.count == 0 {
            faults.pending.remove(index);
        }
        Some(code)
    }

    fn unserved(&self, plural: &str) -> bool {
        lock(&self.unserved).contains(plural)
    }

    fn latency(&self) -> Duration {
        lock(&self.faults).latency
    }

    fn version(&self) -> ServerVersion {
        *lock(&self.version)
    }

    fn feature_gates(&self) -> FeatureGates {
        lock(&self.gates).clone()
    }
}

/// Clients for the server, built once at start so that handing one out cannot fail.
struct Clients {
    retrying: kube::Client,
    plain: kube::Client,
}

impl Clients {
    fn new(addr: SocketAddr) -> Result<Clients, ::http::uri::InvalidUri> {
        let url: ::http::Uri = format!("http://{addr}").parse()?;
        Ok(Clients {
            retrying: plain_http_client(&url, true),
            plain: plain_http_client(&url, false),
        })
    }
}

/// A kube client over plain HTTP with the layers of kube's default stack that matter here (base URL,
/// optional retries). It is assembled by hand because kube's own builder always sets up rustls, which
/// panics when the process links two crypto providers (as test builds with `aws-lc-rs` dependencies do).
fn plain_http_client(url: &::http::Uri, retry: bool) -> kube::Client {
    use kube::client::ConfigExt;
    let config = kube::Config::new(url.clone());
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, kube::client::Body>(
        hyper_util::client::legacy::connect::HttpConnector::new(),
    );
    let retries = retry
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retries)
        .map_err(tower::BoxError::from)
        .service(http);
    kube::Client::new(service, config.default_namespace)
}

/// The running server. Dropping it (or [`ApiServer::shutdown`]) stops it and ends open watches.
pub struct ApiServer {
    addr: SocketAddr,
    clients: Clients,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Starts a server with Kubernetes 1.35 rules on a random loopback port.
    pub async fn start() -> std::io::Result<ApiServer> {
        ApiServer::start_with(ServerVersion::default()).await
    }

    /// Starts a server that validates by the rules of `version`, with every feature gate on.
    pub async fn start_with(version: ServerVersion) -> std::io::Result<ApiServer> {
        ApiServer::start_with_gates(version, FeatureGates::all_enabled()).await
    }

    /// Starts a server of `version` with the given feature gates; a gate that is off makes the server
    /// drop that gate's ResourceSlice fields ([`FeatureGates::defaults_of`] gives a default cluster's).
    pub async fn start_with_gates(
        version: ServerVersion,
        gates: FeatureGates,
    ) -> std::io::Result<ApiServer> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (stop, shutdown) = watch::channel(false);
        let (events, _) = broadcast::channel(EVENT_CHANNEL_CAPACITY);
        let shared = Arc::new(Shared {
            version: Mutex::new(version),
            gates: Mutex::new(gates),
            store: Mutex::new(Store::default()),
            events,
            faults: Mutex::new(Faults::default()),
            requests: Mutex::new(Vec::new()),
            unserved: Mutex::new(BTreeSet::new()),
            shutdown: shutdown.clone(),
            hangs: hangs::Hangs::default(),
            tokens: Mutex::new(identity::Tokens::default()),
        });
        let clients = Clients::new(addr).map_err(std::io::Error::other)?;
        let router = rest::router(shared.clone());
        let mut signal = shutdown;
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
                let _ = signal.wait_for(|stopped| *stopped).await;
            });
            if let Err(err) = serve.await {
                tracing::warn!(error = %err, "API server double stopped with an error");
            }
        });
        Ok(ApiServer {
            addr,
            clients,
            shared,
            stop,
            task: Some(task),
        })
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client configured as a driver would be from a kubeconfig, including kube's default retries of
    /// 429, 503 and 504 (which honour `Retry-After`).
    pub fn client(&self) -> kube::Client {
        self.clients.retrying.clone()
    }

    /// A client that does not retry, so that every injected fault reaches the caller.
    pub fn client_without_retries(&self) -> kube::Client {
        self.clients.plain.clone()
    }

    /// Writes a kubeconfig (JSON, which is YAML) with one context that points at this server, no auth.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let kubeconfig = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "apiserver-double", "cluster": {"server": self.url()}}],
            "users": [{"name": "apiserver-double", "user": {}}],
            "contexts": [{
                "name": "apiserver-double",
                "context": {"cluster": "apiserver-double", "user": "apiserver-double"},
            }],
            "current-context": "apiserver-double",
        });
        let text = serde_json::to_string_pretty(&kubeconfig).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }

    /// Stops the server and waits until it has stopped; open watches end.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}
