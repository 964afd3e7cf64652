//! Events on the Node as an operator lists them: two problems with one reason (two GPUs unreadable, two
//! feature gates off) are two Events with their own notes, and a repeat of one note counts up on its Event.

use gpu_dra::plugin::node_events::NodeEvents;
use gpu_dra::support::apiserver::ApiServer;
use serde_json::{json, Value};

fn events(api: &ApiServer) -> Vec<Value> {
    api.list("events")
        .into_iter()
        .filter(|e| e["regarding"]["name"] == "node-1")
        .collect()
}

fn note_count(events: &[Value], note: &str) -> usize {
    events.iter().filter(|e| e["note"] == note).count()
}

#[tokio::test]
async fn different_notes_under_one_reason_are_separate_events_and_repeats_count_up() {
    let api = ApiServer::start().await.expect("API server double");
    api.insert(
        "nodes",
        json!({"metadata": {"name": "node-1", "uid": "node-1-uid"}}),
    );
    let node_events = NodeEvents::new(api.client(), "gpu.dra.dev", "node-1");

    node_events
        .warn("GpuUnreadable", "Inventory", "gpu-0 cannot be read: lost")
        .await;
    node_events
        .warn("GpuUnreadable", "Inventory", "gpu-3 cannot be read: lost")
        .await;
    let listed = events(&api);
    assert_eq!(listed.len(), 2, "{listed:#?}");
    assert_eq!(note_count(&listed, "gpu-0 cannot be read: lost"), 1);
    assert_eq!(note_count(&listed, "gpu-3 cannot be read: lost"), 1);
    assert!(listed.iter().all(|e| e["type"] == "Warning"
        && e["reason"] == "GpuUnreadable"
        && e["regarding"]["uid"] == "node-1-uid"));

    // The same note again is the same Event, counted as a series.
    node_events
        .warn("GpuUnreadable", "Inventory", "gpu-0 cannot be read: lost")
        .await;
    let listed = events(&api);
    assert_eq!(listed.len(), 2, "{listed:#?}");
    let repeated = listed
        .iter()
        .find(|e| e["note"] == "gpu-0 cannot be read: lost")
        .expect("the gpu-0 Event");
    assert_eq!(repeated["series"]["count"], 2, "{repeated:#?}");

    // Once per note: a second `warn_once` of a note already reported records nothing.
    node_events
        .warn_once("FeatureGateDisabled", "Publish", "gate A is off")
        .await;
    node_events
        .warn_once("FeatureGateDisabled", "Publish", "gate A is off")
        .await;
    node_events
        .warn_once("FeatureGateDisabled", "Publish", "gate B is off")
        .await;
    let listed = events(&api);
    assert_eq!(note_count(&listed, "gate A is off"), 1, "{listed:#?}");
    assert_eq!(note_count(&listed, "gate B is off"), 1, "{listed:#?}");
    assert!(listed
        .iter()
        .filter(|e| e["reason"] == "FeatureGateDisabled")
        .all(|e| e.get("series").is_none() || e["series"].is_null()));
}
