//! The publisher: reconciles the API server's ResourceSlices of this driver on this node with the plan.
//! Nothing changed → zero writes; stale slices are deleted before others are written; slices deleted
//! behind its back (the kubelet wipes them when the plugin goes away) come back on the next watch event.
//! It also learns which gated fields the server keeps (a dry-run write at start and on a version change,
//! and every write's answer) and publishes that on a watch channel for whoever computes the devices.
//!
//! At rest it sends nothing but its watches: it syncs (reads the version, lists the node's slices) only
//! when the devices change, a slice of the node changes, the Node is re-created (a new UID) or a sync
//! failed. At 5,000 nodes a periodic re-list would be thousands of requests a minute for nothing, and
//! the watches already re-list after every interruption the server cannot resume.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::watcher;
use thiserror::Error;
use tokio::sync::{watch, Notify};
use tracing::{debug, info, info_span, warn, Instrument};

use super::kept_fields::{self, GatedField, KeptFields};
use super::planner::{plan, ServerVersion};
use super::reconcile::reconcile;
use crate::devices::NodeDevices;
use crate::observability::{Metrics, Readiness};

/// Longest wait between retries of a failed sync.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Device changes within this long after a write wait for its end and go out together: a burst of
/// faults is written at once and then at most once more per window (at most two writes a second).
const COALESCE_WINDOW: Duration = Duration::from_secs(1);
/// `MaxGeneratedNameLength` of the API server: longer generateName prefixes are cut by the server.
const MAX_GENERATE_NAME_PREFIX: usize = 58;
/// How long a sync deferred for devices recomputed to what the server keeps waits before it looks again.
const RECOMPUTE_WAIT: Duration = Duration::from_secs(1);

#[derive(Debug, Error)]
pub enum PublishError {
    #[error("reading Node {node}: {source}")]
    Node { node: String, source: kube::Error },
    #[error("reading the API server's version: {0}")]
    Version(String),
    #[error("listing ResourceSlices of driver {driver} on node {node}: {source}")]
    List {
        driver: String,
        node: String,
        source: kube::Error,
    },
    #[error("{verb} ResourceSlice {name}: {source}")]
    Write {
        verb: &'static str,
        name: String,
        source: kube::Error,
    },
}

impl PublishError {
    /// The server answered 404 to the list of slices: it does not serve `resource.k8s.io/v1` (see
    /// [`crate::apiclient::is_not_served`] for why the code decides).
    pub fn api_not_served(&self) -> bool {
        matches!(self, PublishError::List { source: kube::Error::Api(status), .. } if status.code == 404)
    }
}

/// What one sync wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncStats {
    pub created: usize,
    pub updated: usize,
    pub deleted: usize,
    /// Nothing was written because the devices use fields the server drops: they are being recomputed
    /// (see [`Publisher::kept_fields`]).
    pub deferred: bool,
}

impl SyncStats {
    pub fn writes(&self) -> usize {
        self.created + self.updated + self.deleted
    }
}

pub struct Publisher {
    client: kube::Client,
    slices: Api<ResourceSlice>,
    nodes: Api<Node>,
    driver: String,
    node_name: String,
    metrics: Arc<Metrics>,
    /// The slice watch's settings; its timeout decides how soon a half-open watch is noticed.
    watch: watcher::Config,
    /// What the server keeps of the gated fields, as last learned.
    kept: watch::Sender<KeptFields>,
    /// The server version the last successful dry-run probe ran against.
    probed: Mutex<Option<ServerVersion>>,
    /// The Node's UID as the Node watch last saw it: `None` before it has seen the Node, `Some(None)`
    /// after the Node was deleted.
    node_uid: Mutex<Option<Option<String>>>,
}

impl Publisher {
    pub fn new(client: kube::Client, driver: &str, node_name: &str, metrics: Arc<Metrics>) -> Self {
        Publisher {
            client: client.clone(),
            slices: Api::all(client.clone()),
            nodes: Api::all(client),
            driver: driver.to_string(),
            node_name: node_name.to_string(),
            metrics,
            watch: watcher::Config::default(),
            kept: watch::Sender::new(KeptFields::default()),
            probed: Mutex::new(None),
            node_uid: Mutex::new(None),
        }
    }

    /// What the server keeps of counters and taints, as the publisher learns it: the devices must be
    /// computed accordingly (a sync defers while they use a field the server drops).
    pub fn kept_fields(&self) -> watch::Receiver<KeptFields> {
        self.kept.subscribe()
    }

    /// Asks the server, with a dry-run create of a slice that uses every gated field, what it would
    /// store; once per server version (a restart starts over). A failed probe is retried at the next
    /// sync; meanwhile each write's answer still shows what was dropped.
    async fn probe(&self, node_uid: &str, version: ServerVersion) {
        if *lock(&self.probed) == Some(version) {
            return;
        }
        let probe = kept_fields::probe_devices(&self.driver);
        let slices = desired_slices(&self.driver, &self.node_name, node_uid, &probe, version);
        let params = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let mut kept = KeptFields::default();
        for slice in &slices {
            match self.slices.create(&params, slice).await {
                Ok(stored) => kept = kept.without(&kept_fields::dropped(slice, &stored)),
                Err(error) => {
                    self.metrics.api_error("dry_run_slice");
                    warn!(%error, "a dry-run ResourceSlice write, to learn which fields the API server keeps, failed; retrying at the next sync");
                    return;
                }
            }
        }
        *lock(&self.probed) = Some(version);
        self.learn(kept, "a dry-run write");
    }

    /// Takes `kept` as what the server keeps, and says so when that changed.
    fn learn(&self, kept: KeptFields, seen_in: &str) {
        let previous = self.kept.send_replace(kept);
        for field in GatedField::ALL {
            if previous.keeps(field) != kept.keeps(field) {
                info!(
                    feature_gate = field.feature_gate(),
                    kept = kept.keeps(field),
                    seen_in,
                    "the API server's handling of a gated ResourceSlice field changed"
                );
            }
        }
    }

    /// After a write: whether the server stored everything that was sent. If it dropped gated fields,
    /// they are not sent again (the devices are recomputed without them) rather than rewritten forever.
    fn check_stored(&self, sent: &ResourceSlice, stored: &ResourceSlice) {
        let dropped = kept_fields::dropped(sent, stored);
        if !dropped.is_empty() {
            let kept = self.kept.borrow().without(&dropped);
            self.learn(kept, "a write's answer");
        }
    }

    /// Watches the slices with `config` (the field selector is added to it).
    pub fn with_watcher_config(mut self, config: watcher::Config) -> Self {
        self.watch = config;
        self
    }

    fn field_selector(&self) -> String {
        format!(
            "spec.driver={},spec.nodeName={}",
            self.driver, self.node_name
        )
    }

    /// The Node's UID, which the slices' owner reference names: a Node deleted and re-created under the
    /// same name has a new UID, and slices still owned by the old one would be garbage-collected over and
    /// over. Known from the Node watch ([`Publisher::run`]); read with a GET until the watch has seen it.
    async fn node_uid(&self) -> Result<String, PublishError> {
        if let Some(Some(uid)) = lock(&self.node_uid).clone() {
            return Ok(uid);
        }
        let node = self.nodes.get(&self.node_name).await.map_err(|source| {
            self.metrics.api_error("get_node");
            PublishError::Node {
                node: self.node_name.clone(),
                source,
            }
        })?;
        Ok(node.metadata.uid.unwrap_or_default())
    }

    /// Takes the UID the Node watch saw (`None`: deleted); true when it differs from the one seen before
    /// (a re-created Node), false the first time.
    fn saw_node_uid(&self, uid: Option<String>) -> bool {
        let mut known = lock(&self.node_uid);
        let changed = matches!(&*known, Some(previous) if *previous != uid);
        *known = Some(uid);
        changed
    }

    /// The server's Kubernetes version, read on every sync so that an upgrade to a version with
    /// another slice layout is followed without a restart.
    async fn server_version(&self) -> Result<ServerVersion, PublishError> {
        let info = self.client.apiserver_version().await.map_err(|e| {
            self.metrics.api_error("get_version");
            PublishError::Version(e.to_string())
        })?;
        ServerVersion::from_minor(&info.minor).ok_or_else(|| {
            PublishError::Version(format!("unreadable minor version {:?}", info.minor))
        })
    }

    /// Makes the stored slices match `node`'s devices; returns what it wrote.
    pub async fn sync(&self, node: &NodeDevices) -> Result<SyncStats, PublishError> {
        let node_uid = self.node_uid().await?;
        let version = self.server_version().await?;
        self.probe(&node_uid, version).await;
        if !kept_fields::fits(node, *self.kept.borrow()) {
            debug!(
                "the devices use fields the API server drops; waiting for them to be recomputed"
            );
            return Ok(SyncStats {
                deferred: true,
                ..Default::default()
            });
        }
        let stored = self
            .slices
            .list(&ListParams::default().fields(&self.field_selector()))
            .await
            .map_err(|source| {
                self.metrics.api_error("list_slices");
                PublishError::List {
                    driver: self.driver.clone(),
                    node: self.node_name.clone(),
                    source,
                }
            })?
            .items;
        let desired = desired_slices(&self.driver, &self.node_name, &node_uid, node, version);
        let reconciliation = reconcile(&stored, &desired, &self.node_name);
        if reconciliation.is_noop {
            self.metrics.set_published_devices(node.device_count());
            return Ok(SyncStats::default());
        }

        let mut stats = SyncStats::default();
        // Stale slices go first, so that consumers never see two slices claiming the same device.
        for slice in &reconciliation.stale {
            self.delete(slice).await?;
            stats.deleted += 1;
        }
        for (mut slice, existing) in reconciliation.writes {
            slice.spec.pool.generation = reconciliation.generation;
            match existing {
                Some(existing) => {
                    slice.metadata.name = existing.metadata.name.clone();
                    slice.metadata.resource_version = existing.metadata.resource_version.clone();
                    let name = slice.metadata.name.clone().unwrap_or_default();
                    let stored = self
                        .slices
                        .replace(&name, &PostParams::default(), &slice)
                        .await
                        .map_err(|source| self.write_error("updating", &name, source))?;
                    self.check_stored(&slice, &stored);
                    stats.updated += 1;
                }
                None => {
                    let created = self
                        .slices
                        .create(&PostParams::default(), &slice)
                        .await
                        .map_err(|source| {
                            let prefix = slice.metadata.generate_name.clone().unwrap_or_default();
                            self.write_error("creating", &format!("{prefix}*"), source)
                        })?;
                    debug!(
                        slice = created.metadata.name.as_deref(),
                        "created ResourceSlice"
                    );
                    self.check_stored(&slice, &created);
                    stats.created += 1;
                }
            }
        }
        self.metrics.set_published_devices(node.device_count());
        info!(
            created = stats.created,
            updated = stats.updated,
            deleted = stats.deleted,
            generation = reconciliation.generation,
            "published ResourceSlices"
        );
        Ok(stats)
    }

    async fn delete(&self, slice: &ResourceSlice) -> Result<(), PublishError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: slice.metadata.uid.clone(),
                resource_version: slice.metadata.resource_version.clone(),
            }),
            ..Default::default()
        };
        match self.slices.delete(&name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
            Err(source) => Err(self.write_error("deleting", &name, source)),
        }
    }

    fn write_error(&self, verb: &'static str, name: &str, source: kube::Error) -> PublishError {
        self.metrics.api_error(verb);
        PublishError::Write {
            verb,
            name: name.to_string(),
            source,
        }
    }

    /// Keeps the slices published until `shutdown` turns true: syncs when the devices change, when a
    /// watch event says the stored slices changed or the Node was re-created; retries failures with
    /// exponential backoff. Nothing else wakes it: an idle node sends no request but its watches.
    pub async fn run(
        self: Arc<Self>,
        mut devices: watch::Receiver<Arc<NodeDevices>>,
        readiness: Arc<Readiness>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let changed = Arc::new(Notify::new());
        let watch_task = tokio::spawn(watch_slices(
            self.slices.clone(),
            self.watch.clone().fields(&self.field_selector()),
            changed.clone(),
        ));
        let node_task = tokio::spawn(self.clone().watch_node(changed.clone()));
        let mut backoff = Backoff::new();
        let mut said_not_served = false;
        let mut last_write: Option<tokio::time::Instant> = None;
        loop {
            // Whatever woke us (a device change, a watch event, the resync), no sync starts within
            // the window after a write: the changes of a burst go out together.
            if let Some(window_end) = last_write.map(|at| at + COALESCE_WINDOW) {
                tokio::select! {
                    _ = tokio::time::sleep_until(window_end) => {}
                    _ = shutdown.changed() => break,
                }
            }
            let snapshot = devices.borrow_and_update().clone();
            let span = info_span!("slice_sync", driver = %self.driver, node = %self.node_name, devices = snapshot.device_count());
            match self.sync(&snapshot).instrument(span).await {
                Ok(stats) if stats.deferred => {
                    // The monitor recomputes the devices for what the server keeps; sync those.
                    tokio::select! {
                        result = devices.changed() => if result.is_err() { break },
                        _ = tokio::time::sleep(RECOMPUTE_WAIT) => {}
                        _ = shutdown.changed() => break,
                    }
                    continue;
                }
                Ok(stats) => {
                    if stats.writes() > 0 {
                        last_write = Some(tokio::time::Instant::now());
                    }
                    backoff.reset();
                    readiness.set_slices_published();
                }
                Err(error) => {
                    let not_served = error.api_not_served();
                    let delay = if not_served {
                        backoff.next_delay_up_to(crate::apiclient::NOT_SERVED_RETRY_MAX)
                    } else {
                        backoff.next_delay()
                    };
                    if !not_served {
                        warn!(%error, retry_in_ms = delay.as_millis() as u64, "publishing ResourceSlices failed");
                    } else if !said_not_served {
                        warn!(%error, retry_max_s = crate::apiclient::NOT_SERVED_RETRY_MAX.as_secs(), "the API server does not serve resource.k8s.io/v1 ResourceSlices (Kubernetes 1.34 or later with DRA is needed); looking again with backoff up to 5 minutes, without saying so again");
                    }
                    said_not_served = not_served;
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.changed() => break,
                    }
                    continue;
                }
            }
            tokio::select! {
                result = devices.changed() => if result.is_err() { break },
                _ = changed.notified() => {
                    // Let a burst of watch events (our own writes echoing back) settle into one sync.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ = shutdown.changed() => break,
            }
            if *shutdown.borrow() {
                break;
            }
        }
        watch_task.abort();
        node_task.abort();
    }

    /// Follows this node's Node object for its UID; notifies `changed` when a re-created Node brings a
    /// new one. Status updates (the kubelet's heartbeats) change nothing here and wake nobody.
    async fn watch_node(self: Arc<Self>, changed: Arc<Notify>) {
        let config = self
            .watch
            .clone()
            .fields(&format!("metadata.name={}", self.node_name));
        let mut events = crate::apiclient::retried(watcher(self.nodes.clone(), config)).boxed();
        while let Some(event) = events.next().await {
            let uid = match event {
                Ok(watcher::Event::Apply(node)) | Ok(watcher::Event::InitApply(node)) => {
                    node.metadata.uid
                }
                Ok(watcher::Event::Delete(_)) => None,
                Ok(_) => continue,
                Err(error) => {
                    debug!(%error, "Node watch interrupted");
                    continue;
                }
            };
            if self.saw_node_uid(uid.clone()) && uid.is_some() {
                info!(node = %self.node_name, "the Node was re-created; its slices follow its new UID");
                changed.notify_one();
            }
        }
    }
}

/// Notifies `changed` on every change to the watched slices.
async fn watch_slices(api: Api<ResourceSlice>, config: watcher::Config, changed: Arc<Notify>) {
    let mut events = crate::apiclient::retried(watcher(api, config)).boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Delete(_))
            | Ok(watcher::Event::Apply(_))
            | Ok(watcher::Event::InitDone) => changed.notify_one(),
            Ok(_) => {}
            Err(error) => debug!(%error, "ResourceSlice watch interrupted"),
        }
    }
}

/// The slices this node should have, without pool generation (the publisher sets it).
pub fn desired_slices(
    driver: &str,
    node_name: &str,
    node_uid: &str,
    node: &NodeDevices,
    version: ServerVersion,
) -> Vec<ResourceSlice> {
    let planned = plan(node, version);
    let count = planned.len() as i64;
    planned
        .into_iter()
        .map(|slice| ResourceSlice {
            metadata: ObjectMeta {
                generate_name: Some(generate_name_prefix(node_name, driver)),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".to_string(),
                    kind: "Node".to_string(),
                    name: node_name.to_string(),
                    uid: node_uid.to_string(),
                    controller: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: driver.to_string(),
                node_name: Some(node_name.to_string()),
                pool: ResourcePool {
                    name: node_name.to_string(),
                    generation: 0,
                    resource_slice_count: count,
                },
                // Counter-only slices leave `devices` out: from 1.35 a slice holds one or the other.
                devices: (!slice.devices.is_empty() || slice.shared_counters.is_empty())
                    .then_some(slice.devices),
                shared_counters: (!slice.shared_counters.is_empty())
                    .then_some(slice.shared_counters),
                ..Default::default()
            },
        })
        .collect()
}

/// `<node>-<driver>-`, cut so the server does not have to, and never ending in a character that would
/// make the generated name invalid.
fn generate_name_prefix(node_name: &str, driver: &str) -> String {
    let mut prefix = format!("{node_name}-{driver}");
    prefix.truncate(MAX_GENERATE_NAME_PREFIX - 1);
    let trimmed = prefix.trim_end_matches(['-', '.']);
    format!("{trimmed}-")
}

/// Locks a mutex, ignoring poisoning: the data behind it (a version) is always consistent.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Exponential backoff from 0.5 s up to [`MAX_BACKOFF`], with jitter so that many nodes retrying
/// after an API server outage do not all come back at once.
struct Backoff {
    attempt: u32,
}

impl Backoff {
    fn new() -> Self {
        Backoff { attempt: 0 }
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }

    fn next_delay(&mut self) -> Duration {
        self.next_delay_up_to(MAX_BACKOFF)
    }

    /// The next delay, capped at `max` instead of [`MAX_BACKOFF`] (minutes for an API not served).
    fn next_delay_up_to(&mut self, max: Duration) -> Duration {
        let base = Duration::from_millis(500).saturating_mul(1 << self.attempt.min(10));
        self.attempt += 1;
        let capped = base.min(max);
        let jitter = fastrand::f64() * 0.2 + 0.9;
        capped.mul_f64(jitter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{self, MigMode};
    use crate::gpu::{FakeBackend, GpuBackend};

    const V1_35: ServerVersion = ServerVersion { minor: 35 };

    fn node(profile: &str, mig_mode: MigMode) -> NodeDevices {
        devices::node_devices(
            &FakeBackend::new("node-a", profile)
                .unwrap()
                .inventory()
                .unwrap(),
            mig_mode,
        )
    }

    fn h100_devices() -> NodeDevices {
        node("dgx-h100", MigMode::Static)
    }

    #[test]
    fn owner_is_the_node_and_prefix_fits_generate_name() {
        let desired = desired_slices("gpu.dra.dev", "node-a", "uid-1", &h100_devices(), V1_35);
        let owner = &desired[0].metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("Node", "uid-1", Some(true))
        );
        assert_eq!(desired[0].spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(desired[0].spec.pool.resource_slice_count, 1);
        let long = generate_name_prefix(&"n".repeat(200), "gpu.dra.dev");
        assert!(long.len() <= MAX_GENERATE_NAME_PREFIX && long.ends_with('-'));
        assert_eq!(
            generate_name_prefix("node-a", "gpu.dra.dev"),
            "node-a-gpu.dra.dev-"
        );
    }

    #[test]
    fn backoff_grows_and_caps() {
        let mut backoff = Backoff::new();
        let first = backoff.next_delay();
        assert!(first >= Duration::from_millis(450) && first <= Duration::from_millis(550));
        for _ in 0..20 {
            assert!(backoff.next_delay() <= MAX_BACKOFF.mul_f64(1.1));
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(550));
    }

    #[test]
    fn only_a_404_on_the_slice_list_means_the_api_is_not_served() {
        let status = |code| {
            kube::Error::Api(Box::new(
                kube::core::Status::failure(
                    "x",
                    if code == 404 {
                        "NotFound"
                    } else {
                        "InternalError"
                    },
                )
                .with_code(code),
            ))
        };
        let list = |code| PublishError::List {
            driver: "d".into(),
            node: "n".into(),
            source: status(code),
        };
        assert!(list(404).api_not_served());
        assert!(!list(500).api_not_served());
        let node = PublishError::Node {
            node: "n".into(),
            source: status(404),
        };
        assert!(
            !node.api_not_served(),
            "a missing Node is not a missing API"
        );
    }

    #[test]
    fn an_api_not_served_is_retried_up_to_minutes() {
        let mut backoff = Backoff::new();
        let longest = (0..20)
            .map(|_| backoff.next_delay_up_to(crate::apiclient::NOT_SERVED_RETRY_MAX))
            .max()
            .unwrap();
        assert!(longest > MAX_BACKOFF.mul_f64(1.1), "{longest:?}");
        assert!(longest <= crate::apiclient::NOT_SERVED_RETRY_MAX.mul_f64(1.1));
    }
}
