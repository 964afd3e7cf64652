//! The plugin's DeviceClass self-test against the API server double: a class that errors on this node's
//! devices, or names the driver and matches none of them, becomes an Event on the Node and a metric; a
//! fixed class drops out of the metric; other drivers' classes that match nothing stay quiet.

use std::time::Duration;

use serde_json::{json, Value};

use gpu_dra::support::harness::{Harness, NODE};

const WAIT: Duration = Duration::from_secs(10);

fn class(name: &str, expression: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    })
}

/// Waits for an Event with `reason` whose `related` object is DeviceClass `class`.
async fn event_for(harness: &Harness, reason: &str, class: &str) -> Value {
    let found = harness
        .api
        .wait_for(
            "events",
            |events| events.iter().any(|e| is_event_for(e, reason, class)),
            WAIT,
        )
        .await
        .unwrap_or_else(|| panic!("no {reason} Event for DeviceClass {class}"));
    found
        .into_iter()
        .find(|e| is_event_for(e, reason, class))
        .expect("the event just seen")
}

fn is_event_for(event: &Value, reason: &str, class: &str) -> bool {
    event["reason"] == reason && event["related"]["name"] == class
}

async fn metrics_where(
    plugin: &gpu_dra::plugin::RunningPlugin,
    check: impl Fn(&str) -> bool,
) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let text = plugin.metrics.encode();
        if check(&text) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "metrics never got there:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_and_empty_device_classes_are_reported_on_the_node() {
    // dgx-h100 with MIG left alone (static mode): whole GPUs only, so deploy/'s MIG class matches nothing.
    let harness = Harness::new("dgx-h100").await;
    let node_uid = harness.api.get("nodes", None, NODE).expect("node")["metadata"]["uid"].clone();
    let plugin = harness.start_plugin().await;

    let empty = event_for(&harness, "DeviceClassMatchesNothing", "mig.gpu.dra.dev").await;
    assert_eq!(empty["type"], "Normal");
    assert_eq!(empty["regarding"]["kind"], "Node");
    assert_eq!(empty["regarding"]["name"], NODE);
    assert_eq!(empty["regarding"]["uid"], node_uid);
    let note = empty["note"].as_str().expect("note");
    assert!(note.contains("matches none of its 8 devices"), "{note}");

    harness.api.insert(
        "deviceclasses",
        class(
            "broken",
            r#"device.driver == "gpu.dra.dev" && device.attributes["gpu.dra.dev"].nosuch == "x""#,
        ),
    );
    harness.api.insert(
        "deviceclasses",
        class("other-vendor", r#"device.driver == "other.example.com""#),
    );
    let broken = event_for(&harness, "DeviceClassSelectorError", "broken").await;
    assert_eq!(broken["type"], "Warning");
    let note = broken["note"].as_str().expect("note");
    assert!(note.contains("selector #0 on device gpu-0"), "{note}");
    assert!(note.contains("no such key: nosuch"), "{note}");

    let text = metrics_where(&plugin, |t| t.contains("class=\"broken\"")).await;
    assert!(
        text.contains(
            "gpu_dra_device_class_problems{class=\"broken\",problem=\"DeviceClassSelectorError\"} 1"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "gpu_dra_device_class_problems{class=\"mig.gpu.dra.dev\",problem=\"DeviceClassMatchesNothing\"} 1"
        ),
        "{text}"
    );
    // The whole-GPU class matches, and another driver's class is expected to match nothing here.
    assert!(!text.contains("class=\"gpu.dra.dev\""), "{text}");
    assert!(!text.contains("class=\"other-vendor\""), "{text}");
    let events = harness.api.list("events");
    assert!(
        !events
            .iter()
            .any(|e| e["related"]["name"] == "other-vendor"),
        "{events:?}"
    );

    // Fixing the class clears its metric without a restart.
    harness.api.insert(
        "deviceclasses",
        class(
            "broken",
            r#"device.driver == "gpu.dra.dev" && device.attributes["gpu.dra.dev"].type == "gpu""#,
        ),
    );
    metrics_where(&plugin, |t| !t.contains("class=\"broken\"")).await;
    plugin.shutdown().await;
}
