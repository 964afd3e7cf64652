//! An in-process Kubernetes API server double: a real HTTP/1.1 server on loopback that speaks enough of the
//! Kubernetes REST/JSON protocol for the `kube` client and `kube::runtime::watcher`, stores nodes, pods,
//! ResourceSlices, ResourceClaims, ResourceClaimTemplates and DeviceClasses, and rejects invalid ResourceSlices as the real server does.
//!
//! Tests drive it over HTTP like a cluster, and reach around HTTP through the hooks on [`ApiServer`] to play
//! the kubelet or a controller (`insert`, `remove`), issue service account tokens that its SelfSubjectReview
//! answers for (`pod_bound_token`, `unbound_token`; see [`identity`]), inject faults (`fail_next`, `set_latency`, `hang_next`,
//! `freeze_watches`), turn feature gates off (`start_with_gates`, `set_feature_gates`, `upgrade`; see
//! [`gates`]) and observe what the driver did (`requests`, `writes`, `dry_runs`).
//!
//! ```ignore
//! let server = ApiServer::start().await?;
//! let slices: kube::Api<ResourceSlice> = kube::Api::all(server.client()?);
//! ```

mod gates;
mod hangs;
mod identity;
mod patch;
mod rest;
mod selectors;
mod validation;
mod watches;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

pub use gates::{FeatureGate, FeatureGates};
pub use hangs::HangSpec;
pub use identity::NODE_NAME_CLAIM;

/// How many watch events the server keeps for watches that resume from a resourceVersion; an older
/// resourceVersion gets `410 Gone`, as after an etcd compaction.
const HISTORY_LIMIT: usize = 10_000;
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

/// A kind of object the server stores.
#[derive(Debug, PartialEq, Eq)]
struct ResourceDef {
    plural: &'static str,
    kind: &'static str,
    group: &'static str,
    version: &'static str,
    namespaced: bool,
    /// Whether `status` is a subresource: the main resource ignores status changes and `/status`
    /// changes nothing else.
    status_subresource: bool,
    /// Whether a create keeps the status it is given (nodes) or starts with none (claims).
    status_on_create: bool,
}

impl ResourceDef {
    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `resourceslices.resource.k8s.io`, as error messages name a resource.
    fn qualified_plural(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `ResourceSlice.resource.k8s.io`, as validation errors name a kind.
    fn qualified_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_string()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }
}

const RESOURCES: [ResourceDef; 8] = [
    ResourceDef {
        plural: "nodes",
        kind: "Node",
        group: "",
        version: "v1",
        namespaced: false,
        status_subresource: true,
        status_on_create: true,
    },
    ResourceDef {
        plural: "resourceslices",
        kind: "ResourceSlice",
        group: "resource.k8s.io",
        version: "v1",
        namespaced: false,
        status_subresource: false,
        status_on_create: false,
    },
    ResourceDef {
        plural: "resourceclaims",
        kind: "ResourceClaim",
        group: "resource.k8s.io",
        version: "v1",
        namespaced: true,
        status_subresource: true,
        status_on_create: false,
    },
    ResourceDef {
        plural: "resourceclaimtemplates",
        kind: "ResourceClaimTemplate",
        group: "resource.k8s.io",
        version: "v1",
        namespaced: true,
        status_subresource: false,
        status_on_create: false,
    },
    // What `gpu-dra explain` reads about a pod: its claims, node selector, affinity and tolerations. Its
    // status (the claims made from templates) is written with `insert`, as the controllers would.
    ResourceDef {
        plural: "pods",
        kind: "Pod",
        group: "",
        version: "v1",
        namespaced: true,
        status_subresource: true,
        status_on_create: false,
    },
    ResourceDef {
        plural: "deviceclasses",
        kind: "DeviceClass",
        group: "resource.k8s.io",
        version: "v1",
        namespaced: false,
        status_subresource: false,
        status_on_create: false,
    },
    // What the plugin reports about DeviceClasses, on its Node (as kube's Recorder writes them).
    ResourceDef {
        plural: "events",
        kind: "Event",
        group: "events.k8s.io",
        version: "v1",
        namespaced: true,
        status_subresource: false,
        status_on_create: false,
    },
    // gpu-dra's own CRD (crd/), cluster-scoped with a status subresource.
    ResourceDef {
        plural: "gpunodepolicies",
        kind: "GpuNodePolicy",
        group: "gpu.dra.dev",
        version: "v1alpha1",
        namespaced: false,
        status_subresource: true,
        status_on_create: false,
    },
];

fn resource_def(plural: &str) -> Option<&'static ResourceDef> {
    RESOURCES.iter().find(|def| def.plural == plural)
}

/// The resource a test hook names; naming one the server does not serve is a bug in the test.
fn hook_resource(plural: &str) -> &'static ResourceDef {
    match resource_def(plural) {
        Some(def) => def,
        None => panic!("the API server double does not serve {plural:?}"),
    }
}

/// Where an object lives: resource, namespace ("" when cluster-scoped), name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ObjectKey {
    resource: &'static str,
    namespace: String,
    name: String,
}

impl ObjectKey {
    fn new(def: &ResourceDef, namespace: Option<&str>, name: &str) -> Self {
        let namespace = if def.namespaced {
            namespace.unwrap_or("default")
        } else {
            ""
        };
        ObjectKey {
            resource: def.plural,
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }

    fn of(def: &ResourceDef, obj: &Value) -> Self {
        ObjectKey::new(
            def,
            meta_str(obj, "namespace"),
            meta_str(obj, "name").unwrap_or_default(),
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change to the store, kept for watches. `previous` lets a filtered watch turn a change that moves
/// an object into or out of its selection into ADDED or DELETED, as the real server does.
#[derive(Debug)]
struct StoreEvent {
    revision: u64,
    resource: &'static str,
    kind: EventType,
    object: Value,
    previous: Option<Value>,
}

/// The objects, the global resourceVersion counter and the recent history of changes.
#[derive(Default)]
struct Store {
    revision: u64,
    objects: BTreeMap<ObjectKey, Value>,
    history: VecDeque<Arc<StoreEvent>>,
    /// The newest revision whose event is no longer in `history`.
    compacted_through: u64,
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
    fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    /// Stores `obj` (or removes it for `Deleted`) under a new resourceVersion and tells the watches.
    /// Returns the object as stored.
    fn commit(
        &self,
        store: &mut Store,
        def: &'static ResourceDef,
        kind: EventType,
        mut obj: Value,
    ) -> Value {
        store.revision += 1;
        let revision = store.revision;
        set_meta(&mut obj, "resourceVersion", json!(revision.to_string()));
        let key = ObjectKey::of(def, &obj);
        let previous = match kind {
            EventType::Deleted => store.objects.remove(&key),
            EventType::Added | EventType::Modified => store.objects.insert(key, obj.clone()),
        };
        let event = Arc::new(StoreEvent {
            revision,
            resource: def.plural,
            kind,
            object: obj.clone(),
            previous: if kind == EventType::Modified {
                previous
            } else {
                None
            },
        });
        store.history.push_back(event.clone());
        while store.history.len() > HISTORY_LIMIT {
            if let Some(dropped) = store.history.pop_front() {
                store.compacted_through = dropped.revision;
            }
        }
        // Nobody watching is fine: the event stays in the history.
        let _ = self.events.send(event);
        obj
    }

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

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().revision
    }

    /// A handle on the stored objects, for the doubles of other components (the pod runner plays the
    /// kubelet) that write as a controller or the kubelet would, without HTTP: their traffic is not among
    /// [`ApiServer::requests`], so tests of what the plugin sends see only the plugin.
    pub fn handle(&self) -> ApiHandle {
        ApiHandle {
            shared: self.shared.clone(),
        }
    }

    /// Creates or replaces an object without validation, as a controller or the kubelet would have written
    /// it; see [`ApiHandle::insert`].
    pub fn insert(&self, resource: &str, obj: Value) -> Value {
        self.handle().insert(resource, obj)
    }

    /// One stored object.
    pub fn get(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.handle().get(resource, namespace, name)
    }

    /// All stored objects of a resource, in namespace/name order.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        self.handle().list(resource)
    }

    /// Deletes an object at once (finalizers ignored), notifying watches. Returns what was stored.
    pub fn remove(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        self.handle().remove(resource, namespace, name)
    }

    /// Deletes every object of `resource` for which `pred` holds, as the kubelet wipes a node's slices.
    /// Returns the removed objects.
    pub fn remove_where(&self, resource: &str, pred: impl Fn(&Value) -> bool) -> Vec<Value> {
        let def = hook_resource(resource);
        let mut store = self.shared.store();
        let doomed: Vec<Value> = store
            .objects
            .iter()
            .filter(|(key, obj)| key.resource == def.plural && pred(obj))
            .map(|(_, obj)| obj.clone())
            .collect();
        doomed
            .into_iter()
            .map(|obj| self.shared.commit(&mut store, def, EventType::Deleted, obj))
            .collect()
    }

    /// Forgets the watch history, so that resuming a watch from any earlier resourceVersion gets
    /// `410 Gone` and the watcher must list again.
    pub fn compact(&self) {
        let mut store = self.shared.store();
        store.history.clear();
        store.compacted_through = store.revision;
    }

    /// Waits until `pred` holds for the objects of `resource` (in namespace/name order) and returns them,
    /// or `None` after `timeout`.
    pub async fn wait_for(
        &self,
        resource: &str,
        pred: impl Fn(&[Value]) -> bool,
        timeout: Duration,
    ) -> Option<Vec<Value>> {
        let mut events = self.shared.events.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let objects = self.list(resource);
            if pred(&objects) {
                return Some(objects);
            }
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Err(_elapsed) => return None,
                // A lag only means we missed events; the next round looks at the store anyway.
                Ok(Ok(_) | Err(broadcast::error::RecvError::Lagged(_))) => {}
                Ok(Err(broadcast::error::RecvError::Closed)) => return None,
            }
        }
    }

    /// Makes the next matching requests fail; see [`FaultSpec`].
    pub fn fail_next(&self, fault: FaultSpec) {
        lock(&self.shared.faults).pending.push(fault);
    }

    /// Delays every request by `latency` before it is handled (a watch only before its response starts).
    pub fn set_latency(&self, latency: Duration) {
        lock(&self.shared.faults).latency = latency;
    }

    /// Changes the feature gates from the next request on, as restarting kube-apiserver with other
    /// `--feature-gates` would; the stored objects stay as they are.
    pub fn set_feature_gates(&self, gates: FeatureGates) {
        *lock(&self.shared.gates) = gates;
    }

    /// Upgrades (or downgrades) the server in place: `/version`, validation and the feature gates
    /// change from the next request on; the stored objects stay, as etcd's do.
    pub fn upgrade(&self, version: ServerVersion, gates: FeatureGates) {
        *lock(&self.shared.version) = version;
        self.set_feature_gates(gates);
    }

    /// Drops pending faults and latency.
    pub fn clear_faults(&self) {
        *lock(&self.shared.faults) = Faults::default();
    }

    /// Every request answered so far, in order (a watch is recorded when its response starts).
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.requests).clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.requests).clear();
    }

    /// Answers every request on `resource` (a plural) with a plain-text `404 page not found`, as a real
    /// kube-apiserver does for an API group it does not serve (a CRD alone in its group, not applied).
    /// Watches already open are not cut (a real server ends them when the CRD is deleted).
    /// [`ApiServer::serve`] undoes it.
    pub fn stop_serving(&self, resource: &str) {
        lock(&self.shared.unserved).insert(hook_resource(resource).plural);
    }

    /// Serves `resource` again (its CRD applied), with the objects it held.
    pub fn serve(&self, resource: &str) {
        lock(&self.shared.unserved).remove(hook_resource(resource).plural);
    }

    /// How many create, update, patch and delete requests on `resource` succeeded and were stored
    /// (dry runs store nothing and are not counted; see [`FaultSpec`] for how subresources match).
    pub fn writes(&self, resource: &str) -> usize {
        lock(&self.shared.requests)
            .iter()
            .filter(|r| {
                r.verb.is_write()
                    && !r.dry_run
                    && r.code < 300
                    && resource_matches(resource, &r.resource)
            })
            .count()
    }

    /// How many `dryRun=All` write requests on `resource` were answered, successful or not.
    pub fn dry_runs(&self, resource: &str) -> usize {
        lock(&self.shared.requests)
            .iter()
            .filter(|r| r.verb.is_write() && r.dry_run && resource_matches(resource, &r.resource))
            .count()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

fn meta<'a>(obj: &'a Value, field: &str) -> Option<&'a Value> {
    obj.get("metadata")?.get(field)
}

/// A non-empty string field of `metadata`.
fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    meta(obj, field)?.as_str().filter(|s| !s.is_empty())
}

/// Sets a `metadata` field, creating `metadata` if the object has none. Non-objects are left alone
/// (request bodies are checked to be objects before this is called).
fn set_meta(obj: &mut Value, field: &str, value: Value) {
    if let Some(map) = obj.as_object_mut() {
        let metadata = map.entry("metadata").or_insert_with(|| json!({}));
        if !metadata.is_object() {
            *metadata = json!({});
        }
        if let Some(metadata) = metadata.as_object_mut() {
            metadata.insert(field.to_string(), value);
        }
    }
}

fn remove_meta(obj: &mut Value, field: &str) {
    if let Some(metadata) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata.remove(field);
    }
}

fn fill_type_meta(def: &ResourceDef, obj: &mut Value) {
    if let Some(map) = obj.as_object_mut() {
        map.insert("apiVersion".into(), json!(def.api_version()));
        map.insert("kind".into(), json!(def.kind));
    }
}

/// Gives a new object the fields the server owns: uid, creationTimestamp, generation.
fn fill_system_meta(obj: &mut Value) {
    if meta_str(obj, "uid").is_none() {
        set_meta(obj, "uid", json!(uuid::Uuid::new_v4().to_string()));
    }
    if meta_str(obj, "creationTimestamp").is_none() {
        set_meta(obj, "creationTimestamp", json!(now_timestamp()));
    }
    if meta(obj, "generation").and_then(Value::as_i64).is_none() {
        set_meta(obj, "generation", json!(1));
    }
}

/// The stored objects of a running [`ApiServer`], shared with the doubles of other components.
#[derive(Clone)]
pub struct ApiHandle {
    shared: Arc<Shared>,
}

impl ApiHandle {
    /// Creates or replaces an object without validation, as a controller or the kubelet would have written
    /// it. Fills kind, apiVersion, uid, creationTimestamp and generation where missing; bumps the
    /// resourceVersion and notifies watches. Returns the stored object.
    pub fn insert(&self, resource: &str, mut obj: Value) -> Value {
        let def = hook_resource(resource);
        fill_type_meta(def, &mut obj);
        if def.namespaced && meta_str(&obj, "namespace").is_none() {
            set_meta(&mut obj, "namespace", json!("default"));
        }
        let mut store = self.shared.store();
        let existing = store.objects.get(&ObjectKey::of(def, &obj)).cloned();
        let kind = match &existing {
            Some(old) => {
                for field in ["uid", "creationTimestamp"] {
                    if let (None, Some(value)) = (meta(&obj, field), meta(old, field)) {
                        set_meta(&mut obj, field, value.clone());
                    }
                }
                EventType::Modified
            }
            None => EventType::Added,
        };
        fill_system_meta(&mut obj);
        self.shared.commit(&mut store, def, kind, obj)
    }

    /// One stored object.
    pub fn get(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let key = ObjectKey::new(hook_resource(resource), namespace, name);
        self.shared.store().objects.get(&key).cloned()
    }

    /// All stored objects of a resource, in namespace/name order.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        let def = hook_resource(resource);
        let store = self.shared.store();
        store
            .objects
            .iter()
            .filter(|(key, _)| key.resource == def.plural)
            .map(|(_, obj)| obj.clone())
            .collect()
    }

    /// Deletes an object at once (finalizers ignored), notifying watches. Returns what was stored.
    pub fn remove(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let def = hook_resource(resource);
        let mut store = self.shared.store();
        let obj = store
            .objects
            .get(&ObjectKey::new(def, namespace, name))?
            .clone();
        Some(self.shared.commit(&mut store, def, EventType::Deleted, obj))
    }
}

/// The current time as Kubernetes writes a `metav1.Time`: RFC 3339 in UTC, whole seconds.
fn now_timestamp() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}
