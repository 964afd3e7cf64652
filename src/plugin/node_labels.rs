//! Writes GPU feature discovery's classic labels on this node's Node while the GpuNodePolicy in force sets
//! `classicNodeLabels`, keeps them right as GPUs come and go and as others change them, and takes away
//! the labels it wrote once the setting is off. Best effort beside the plugin's real work: a refused or
//! failed write is logged, reported as a Node Event and retried with backoff; prepare never waits on it.
//!
//! Which labels are its own: those it last wrote, remembered in `<plugin-dir>/node-labels.json` so that a
//! plugin restarted with the setting off still knows them. A key is removed only while the Node still
//! holds the value written (see [`changes`]); with the setting off from the start and nothing
//! remembered, the plugin never touches a label, so a node labelled by GFD keeps GFD's labels.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use serde_json::json;
use thiserror::Error;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::devices::node_labels::{changes, classic_labels, Labels};
use crate::gpu::Inventory;

use super::node_events::NodeEvents;
use super::{NodePolicy, PluginConfig};

/// The file, in the plugin's directory, that remembers the labels written.
pub const RECORD_FILE: &str = "node-labels.json";
/// First and longest wait before a failed write is tried again.
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(300);
/// The Event reason of a write that failed (said once per message until a write succeeds).
const REASON_FAILED: &str = "NodeLabelsNotWritten";

#[derive(Debug, Error)]
pub enum NodeLabelError {
    #[error("Node {0} does not exist")]
    NodeNotFound(String),
    #[error("reading Node {node}: {source}")]
    Read { node: String, source: kube::Error },
    #[error("patching the labels of Node {node}: {source}")]
    Patch { node: String, source: kube::Error },
}

impl NodeLabelError {
    /// Someone else wrote the Node between our read and our patch: not worth an Event.
    fn is_conflict(&self) -> bool {
        matches!(self, NodeLabelError::Patch { source: kube::Error::Api(status), .. } if status.code == 409)
    }
}

/// Keeps this node's classic labels; see the module comment.
pub struct NodeLabeler {
    nodes: Api<Node>,
    node: String,
    record: PathBuf,
    /// What this plugin last wrote (and the Node held then); empty when it owns no label.
    written: Labels,
    events: Arc<NodeEvents>,
    watch: watcher::Config,
}

impl NodeLabeler {
    /// A labeler for the plugin's node, remembering in its directory; what an earlier run wrote is read
    /// back here.
    pub fn new(client: kube::Client, config: &PluginConfig, events: Arc<NodeEvents>) -> Self {
        let record = config.plugin_dir().join(RECORD_FILE);
        let written = read_record(&record);
        NodeLabeler {
            nodes: Api::all(client),
            node: config.node_name.clone(),
            record,
            written,
            events,
            watch: config.api.watcher_config(),
        }
    }

    /// Runs until `shutdown`: syncs at start when the setting is on or labels are remembered, then on
    /// every change of the setting, of the inventory and (while on) of the Node.
    pub async fn run(
        mut self,
        mut inventory: watch::Receiver<Arc<Inventory>>,
        mut policy: watch::Receiver<NodePolicy>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut enabled = policy.borrow_and_update().classic_node_labels;
        let mut node_updates: Option<BoxStream<'static, Result<Node, watcher::Error>>> = None;
        // The Node as last seen (from the watch or our own patch), so that a sync need not GET it.
        let mut seen: Option<Node> = None;
        let mut dirty = enabled || !self.written.is_empty();
        let mut retry_at: Option<Instant> = None;
        let mut delay = RETRY_MIN;
        loop {
            if enabled && node_updates.is_none() {
                let config = self
                    .watch
                    .clone()
                    .fields(&format!("metadata.name={}", self.node));
                node_updates = Some(
                    crate::apiclient::retried(watcher(self.nodes.clone(), config))
                        .applied_objects()
                        .boxed(),
                );
            } else if !enabled {
                node_updates = None;
            }
            // Off with nothing written: nothing to do, not even a read of the Node.
            if dirty && retry_at.is_none() && (enabled || !self.written.is_empty()) {
                dirty = false;
                let gpus = inventory.borrow_and_update().clone();
                match self.sync(enabled, &gpus, seen.take()).await {
                    Ok(node) => {
                        seen = node;
                        delay = RETRY_MIN;
                        self.events.forget(REASON_FAILED);
                    }
                    Err(error) => {
                        retry_at = Some(Instant::now() + delay);
                        delay = (delay * 2).min(RETRY_MAX);
                        if error.is_conflict() {
                            debug!(%error, "the Node changed under the label patch; reading it again");
                        } else {
                            warn!(%error, retry_s = delay.as_secs_f32(), "writing GPU feature discovery's labels failed; retrying with backoff");
                            let note = format!("could not write GPU feature discovery's labels (GpuNodePolicy classicNodeLabels): {error}; retrying");
                            self.events
                                .warn_once(REASON_FAILED, "LabelNode", &note)
                                .await;
                        }
                    }
                }
            }
            let retry = crate::api::watcher::sleep_until_retry(retry_at);
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|stop| *stop) => return,
                () = retry => {
                    retry_at = None;
                    dirty = true;
                }
                changed = policy.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let now = policy.borrow_and_update().classic_node_labels;
                    if now != enabled {
                        info!(enabled = now, "GPU feature discovery's labels turned {}", if now { "on" } else { "off" });
                        enabled = now;
                        dirty = true;
                        seen = None;
                    }
                }
                changed = inventory.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    dirty = true;
                }
                update = async {
                    match node_updates.as_mut() {
                        Some(stream) => stream.next().await,
                        None => std::future::pending().await,
                    }
                } => match update {
                    Some(Ok(node)) => {
                        seen = Some(node);
                        dirty = true;
                    }
                    Some(Err(error)) => debug!(%error, "watching the Node for its labels failed; retrying"),
                    // The watch stream does not end; should it, start a new one.
                    None => node_updates = None,
                },
            }
        }
    }

    /// Brings the Node's labels to what the setting asks for; returns the Node as it is now.
    async fn sync(
        &mut self,
        enabled: bool,
        inventory: &Inventory,
        seen: Option<Node>,
    ) -> Result<Option<Node>, NodeLabelError> {
        let node = match seen {
            Some(node) => node,
            None => self
                .nodes
                .get_opt(&self.node)
                .await
                .map_err(|source| NodeLabelError::Read {
                    node: self.node.clone(),
                    source,
                })?
                .ok_or_else(|| NodeLabelError::NodeNotFound(self.node.clone()))?,
        };
        let desired = enabled.then(|| classic_labels(inventory));
        let labels = changes(desired.as_ref(), &self.written, node.labels());
        if labels.is_empty() {
            self.remember(desired.unwrap_or_default());
            return Ok(Some(node));
        }
        // The resourceVersion makes the patch fail with a conflict if the Node changed since it was read,
        // so that a label someone else set in between is never removed.
        let patch = json!({
            "metadata": {"resourceVersion": node.resource_version(), "labels": labels}
        });
        let patched = self
            .nodes
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|source| NodeLabelError::Patch {
                node: self.node.clone(),
                source,
            })?;
        info!(node = %self.node, ?labels, "wrote GPU feature discovery's labels");
        self.remember(desired.unwrap_or_default());
        Ok(Some(patched))
    }

    /// Records `labels` as the ones this plugin owns now, on disk when they changed. A failed write is
    /// logged: the record in memory still serves this run.
    fn remember(&mut self, labels: Labels) {
        if labels == self.written {
            return;
        }
        let saved = if labels.is_empty() {
            match std::fs::remove_file(&self.record) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            }
        } else {
            let text = json!({ "labels": &labels }).to_string();
            crate::fsutil::write_atomically(&self.record, text.as_bytes(), 0o600)
        };
        if let Err(error) = saved {
            warn!(%error, path = %self.record.display(), "could not record the node labels written; a restart with classicNodeLabels off would leave them");
        }
        self.written = labels;
    }
}

/// The labels an earlier run wrote; none when the file is missing or unreadable (said in the log).
fn read_record(path: &std::path::Path) -> Labels {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Labels::new(),
        Err(error) => {
            warn!(%error, path = %path.display(), "could not read the node labels written earlier; none are removed");
            return Labels::new();
        }
    };
    #[derive(serde::Deserialize)]
    struct Record {
        labels: Labels,
    }
    match serde_json::from_str::<Record>(&text) {
        Ok(record) => record.labels,
        Err(error) => {
            warn!(%error, path = %path.display(), "the record of node labels written earlier is not valid; none are removed");
            Labels::new()
        }
    }
}
