//! The publisher: reconciles the API server's ResourceSlices of this driver on this node with the plan.
//! Nothing changed → zero writes; stale slices are deleted before others are written; slices deleted
//! behind its back (the kubelet wipes them when the plugin goes away) come back on the next watch event.
//! It also learns which gated fields the server keeps (a dry-run write at start and on a version change,
//! and every write's answer) and publishes that on a watch channel for whoever computes the devices.
//!
//! This file holds one sync; when syncs run (watches, coalescing, retries) is in `run`, and the slices
//! the node should have (pure) in `desired`.

use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::watcher;
use thiserror::Error;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::kept_fields::{self, GatedField, KeptFields};
use super::planner::ServerVersion;
use super::reconcile::reconcile;
use crate::devices::NodeDevices;
use crate::observability::Metrics;

mod desired;
mod run;

pub use desired::desired_slices;

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
}

/// Locks a mutex, ignoring poisoning: the data behind it (a version) is always consistent.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
