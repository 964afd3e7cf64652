//! Events on this node's Node object: what an operator sees in `kubectl describe node` when the plugin
//! degrades (a feature gate off, a GPU it cannot read, a checkpoint set aside, a DeviceClass that matches
//! nothing). Events are best effort: a failure to record one is logged and never stops the plugin.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::warn;

/// The API's limit on an Event's note.
const MAX_NOTE: usize = 1024;
/// An Event is not worth holding up the caller for long: a hung API server gets this much.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);
/// Recorders kept for repeats of one note; past this many distinct notes the oldest series are forgotten
/// (a repeat then starts a new Event instead of counting on the old one).
const MAX_SERIES: usize = 256;

/// Records Events about this node, each reason and note once if asked (`warn_once`).
///
/// kube's `Recorder` folds an Event into an earlier one with the same type, reason, action and objects,
/// whatever its note, so two GPUs unreadable or two feature gates off would show as one Event with the
/// first note and a count of 2. Each distinct note gets a recorder of its own here: repeats of one note
/// still count up on one Event, different notes are different Events.
pub struct NodeEvents {
    client: kube::Client,
    reporter: Reporter,
    series: Mutex<HashMap<String, Recorder>>,
    nodes: Api<Node>,
    node: String,
    reported: Mutex<BTreeSet<(String, String)>>,
}

impl NodeEvents {
    pub fn new(client: kube::Client, driver: &str, node: &str) -> Self {
        NodeEvents {
            client: client.clone(),
            reporter: plugin_reporter(driver, node),
            series: Mutex::new(HashMap::new()),
            nodes: Api::all(client),
            node: node.to_string(),
            reported: Mutex::new(BTreeSet::new()),
        }
    }

    /// A Warning Event, every time it is called.
    pub async fn warn(&self, reason: &str, action: &str, note: &str) {
        self.publish(EventType::Warning, reason, action, note, None)
            .await
    }

    /// A Warning Event, only the first time this reason is given with this note (until `forget`).
    pub async fn warn_once(&self, reason: &str, action: &str, note: &str) {
        if self.first_time(reason, note) {
            self.warn(reason, action, note).await
        }
    }

    /// A Normal Event, only the first time this reason is given with this note (until `forget`).
    pub async fn normal_once(&self, reason: &str, action: &str, note: &str) {
        if self.first_time(reason, note) {
            self.publish(EventType::Normal, reason, action, note, None)
                .await
        }
    }

    /// Lets every note of `reason` be reported again (the condition ended; a recurrence is news).
    pub fn forget(&self, reason: &str) {
        if let Ok(mut reported) = self.reported.lock() {
            reported.retain(|(r, _)| r != reason);
        }
    }

    fn first_time(&self, reason: &str, note: &str) -> bool {
        match self.reported.lock() {
            Ok(mut reported) => reported.insert((reason.to_string(), note.to_string())),
            // A panic elsewhere poisoned the set: report rather than stay silent.
            Err(_) => true,
        }
    }

    /// The recorder whose Events carry `note`.
    fn recorder_for(&self, note: &str) -> Recorder {
        let Ok(mut series) = self.series.lock() else {
            // A panic elsewhere poisoned the map: a fresh recorder still records the Event.
            return Recorder::new(self.client.clone(), self.reporter.clone());
        };
        if series.len() >= MAX_SERIES && !series.contains_key(note) {
            series.clear();
        }
        series
            .entry(note.to_string())
            .or_insert_with(|| Recorder::new(self.client.clone(), self.reporter.clone()))
            .clone()
    }

    /// Records one Event on the Node, with `secondary` as the related object.
    pub async fn publish(
        &self,
        type_: EventType,
        reason: &str,
        action: &str,
        note: &str,
        secondary: Option<ObjectReference>,
    ) {
        let note = truncate_note(note);
        let recorder = self.recorder_for(&note);
        let recorded = tokio::time::timeout(PUBLISH_TIMEOUT, async {
            // The Node's UID makes `kubectl describe node` show the Event; without it the Event still lists.
            let uid = match self.nodes.get_opt(&self.node).await {
                Ok(found) => found.and_then(|n| n.metadata.uid),
                Err(_) => None,
            };
            let reference = ObjectReference {
                api_version: Some("v1".to_string()),
                kind: Some("Node".to_string()),
                name: Some(self.node.clone()),
                uid,
                ..Default::default()
            };
            let event = Event {
                type_,
                reason: reason.to_string(),
                note: Some(note.clone()),
                action: action.to_string(),
                secondary,
            };
            recorder.publish(&event, &reference).await
        })
        .await;
        match recorded {
            Ok(Ok(())) => {}
            Ok(Err(error)) => warn!(%error, reason, "could not record an Event on the Node"),
            Err(_) => warn!(
                reason,
                "could not record an Event on the Node: the API server did not answer in time"
            ),
        }
    }
}

/// Who posts the plugin's Events: the driver's kubelet plugin, on this node.
pub(super) fn plugin_reporter(driver: &str, node: &str) -> Reporter {
    Reporter {
        controller: format!("{driver}/kubelet-plugin"),
        instance: Some(format!("{driver}/{node}")),
    }
}

/// `note` cut to the API's limit on an Event's note, on a character boundary.
pub(super) fn truncate_note(note: &str) -> String {
    let mut note = note.to_string();
    if note.len() > MAX_NOTE {
        let mut end = MAX_NOTE - 3;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push_str("...");
    }
    note
}

#[cfg(test)]
mod tests {
    use super::truncate_note;

    #[test]
    fn long_notes_are_cut_on_a_character_boundary_within_the_api_limit() {
        let note = "é".repeat(600);
        let cut = truncate_note(&note);
        assert!(cut.len() <= 1024, "{}", cut.len());
        assert!(cut.ends_with("..."));
        assert_eq!(truncate_note("short"), "short");
    }
}
