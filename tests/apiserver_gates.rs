//! The API server double's feature gates, through the real `kube` client: a gate that is off drops its
//! ResourceSlice fields on create and update (before validation), unless the stored object already uses
//! them; `dryRun=All` answers what would be stored and stores nothing.

use std::time::Duration;

use futures::StreamExt;
use gpu_dra::support::apiserver::{ApiServer, FeatureGate, FeatureGates, ServerVersion};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use serde_json::{json, Value};

/// A 1.34 slice (counters beside the devices that consume them) using every gated field.
fn gated_slice(name: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.dra.dev",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "sharedCounters": [{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}],
            "devices": [{
                "name": "gpu-0",
                "allowMultipleAllocations": true,
                "capacity": {"memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi"}}},
                "consumesCounters": [{"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}],
                "taints": [{"key": "gpu.dra.dev/xid", "value": "79", "effect": "NoSchedule"}],
            }],
        },
    })
}

fn typed(value: Value) -> ResourceSlice {
    serde_json::from_value(value).expect("a ResourceSlice")
}

/// Which gated fields a stored slice holds.
fn gated_fields(slice: &Value) -> Vec<&'static str> {
    let device = &slice["spec"]["devices"][0];
    let mut fields = Vec::new();
    let present = |v: &Value| !v.is_null();
    if present(&slice["spec"]["sharedCounters"]) {
        fields.push("sharedCounters");
    }
    if present(&device["consumesCounters"]) {
        fields.push("consumesCounters");
    }
    if present(&device["taints"]) {
        fields.push("taints");
    }
    if present(&device["allowMultipleAllocations"]) {
        fields.push("allowMultipleAllocations");
    }
    if present(&device["capacity"]["memory"]["requestPolicy"]) {
        fields.push("requestPolicy");
    }
    fields
}

async fn start(gates: FeatureGates) -> (ApiServer, Api<ResourceSlice>) {
    let server = ApiServer::start_with_gates(ServerVersion::V1_34, gates)
        .await
        .expect("server starts");
    let api = Api::all(server.client());
    (server, api)
}

#[tokio::test]
async fn a_default_1_34_server_drops_the_alpha_fields_and_answers_with_what_it_stored() {
    let (server, api) = start(FeatureGates::defaults_of(ServerVersion::V1_34)).await;
    let created = api
        .create(&PostParams::default(), &typed(gated_slice("s")))
        .await
        .expect("created, not rejected");
    let stored = server.get("resourceslices", None, "s").unwrap();
    assert_eq!(gated_fields(&stored), Vec::<&str>::new(), "{stored:#}");
    assert_eq!(
        serde_json::to_value(&created).unwrap()["spec"],
        stored["spec"]
    );
    assert_eq!(stored["spec"]["devices"][0]["name"], "gpu-0");

    // One gate off drops only its own fields.
    let (server, api) = server_with(&[FeatureGate::DRADeviceTaints]).await;
    api.create(&PostParams::default(), &typed(gated_slice("s")))
        .await
        .unwrap();
    assert_eq!(
        gated_fields(&server.get("resourceslices", None, "s").unwrap()),
        vec![
            "sharedCounters",
            "consumesCounters",
            "allowMultipleAllocations",
            "requestPolicy"
        ]
    );

    // With every gate on, everything is kept; 1.36 has them on by default.
    assert_eq!(
        FeatureGates::defaults_of(ServerVersion::V1_36),
        FeatureGates::all_enabled()
    );
    let (server, api) = start(FeatureGates::all_enabled()).await;
    api.create(&PostParams::default(), &typed(gated_slice("s")))
        .await
        .unwrap();
    assert_eq!(
        gated_fields(&server.get("resourceslices", None, "s").unwrap()).len(),
        5
    );
}

async fn server_with(disabled: &[FeatureGate]) -> (ApiServer, Api<ResourceSlice>) {
    start(FeatureGates::disabling(disabled.iter().copied())).await
}

#[tokio::test]
async fn an_update_keeps_gated_fields_the_stored_object_already_uses() {
    let (server, api) = start(FeatureGates::all_enabled()).await;
    api.create(&PostParams::default(), &typed(gated_slice("s")))
        .await
        .unwrap();
    // The admin turns the gates off (a kube-apiserver restart); the stored slice still uses them.
    server.set_feature_gates(FeatureGates::defaults_of(ServerVersion::V1_34));
    let mut changed: ResourceSlice = api.get("s").await.unwrap();
    changed.spec.pool.generation = 2;
    let updated = api
        .replace("s", &PostParams::default(), &changed)
        .await
        .unwrap();
    assert_eq!(
        gated_fields(&serde_json::to_value(&updated).unwrap()).len(),
        5,
        "fields in use are kept"
    );

    // Once an update has left them out, adding them back is dropped again.
    let mut plain = updated.clone();
    plain.spec.shared_counters = None;
    for device in plain.spec.devices.iter_mut().flatten() {
        device.consumes_counters = None;
        device.taints = None;
        device.allow_multiple_allocations = None;
        device.capacity = None;
    }
    let plain = api
        .replace("s", &PostParams::default(), &plain)
        .await
        .unwrap();
    let mut again = typed(gated_slice("s"));
    again.metadata.resource_version = plain.metadata.resource_version.clone();
    let again = api
        .replace("s", &PostParams::default(), &again)
        .await
        .unwrap();
    assert_eq!(
        gated_fields(&serde_json::to_value(&again).unwrap()),
        Vec::<&str>::new()
    );
}

#[tokio::test]
async fn fields_are_dropped_before_validation() {
    // Per-device node selection without the gate: the slice then names no node at all, which
    // validation refuses, as the real server does.
    let (_server, api) = server_with(&[FeatureGate::DRAPartitionableDevices]).await;
    let mut slice = gated_slice("s");
    let spec = slice["spec"].as_object_mut().unwrap();
    spec.remove("nodeName");
    spec.remove("sharedCounters");
    spec.insert("perDeviceNodeSelection".into(), json!(true));
    let device = spec["devices"][0].as_object_mut().unwrap();
    device.remove("consumesCounters");
    device.insert("nodeName".into(), json!("node-a"));
    let error = api
        .create(&PostParams::default(), &typed(slice.clone()))
        .await
        .expect_err("no node selection left");
    let kube::Error::Api(status) = error else {
        panic!("an API error: {error:?}")
    };
    assert_eq!(status.code, 422, "{status:?}");
    assert!(status.message.contains("nodeName"), "{}", status.message);

    // With the gate on, the same slice is valid.
    let (_server, api) = start(FeatureGates::all_enabled()).await;
    api.create(&PostParams::default(), &typed(slice))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_dry_run_answers_what_would_be_stored_and_stores_nothing() {
    let (server, api) = start(FeatureGates::defaults_of(ServerVersion::V1_34)).await;
    let mut watch = api
        .watch(&WatchParams::default().timeout(2), "0")
        .await
        .unwrap()
        .boxed();
    let dry_run = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let answer = api
        .create(&dry_run, &typed(gated_slice("s")))
        .await
        .unwrap();
    assert_eq!(
        gated_fields(&serde_json::to_value(&answer).unwrap()),
        Vec::<&str>::new()
    );
    assert!(server.list("resourceslices").is_empty());
    assert_eq!(server.writes("resourceslices"), 0);
    assert_eq!(server.dry_runs("resourceslices"), 1);

    // Validation still applies.
    let mut invalid = gated_slice("s");
    invalid["spec"]["devices"][0]["name"] = json!("Not_A_Label");
    assert!(api.create(&dry_run, &typed(invalid)).await.is_err());
    assert_eq!(server.dry_runs("resourceslices"), 2);

    // A real create afterwards is the first event any watch sees.
    api.create(&PostParams::default(), &typed(gated_slice("real")))
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .expect("an event")
        .expect("the watch is open")
        .expect("an event, not an error");
    match first {
        WatchEvent::Added(slice) => assert_eq!(slice.metadata.name.as_deref(), Some("real")),
        other => panic!("expected ADDED of the real slice, got {other:?}"),
    }
    assert_eq!(server.writes("resourceslices"), 1);
}

#[tokio::test]
async fn an_upgrade_changes_the_version_and_gates_and_keeps_the_objects() {
    let (server, api) = start(FeatureGates::defaults_of(ServerVersion::V1_34)).await;
    api.create(&PostParams::default(), &typed(gated_slice("old")))
        .await
        .unwrap();
    server.upgrade(
        ServerVersion::V1_36,
        FeatureGates::defaults_of(ServerVersion::V1_36),
    );
    let version = server.client().apiserver_version().await.unwrap();
    assert_eq!(version.minor, "36");
    assert!(server.get("resourceslices", None, "old").is_some());
    // 1.36 keeps what 1.34's defaults dropped; the counters go in a slice of their own from 1.35.
    let mut new = gated_slice("new");
    new["spec"]
        .as_object_mut()
        .unwrap()
        .remove("sharedCounters");
    api.create(&PostParams::default(), &typed(new))
        .await
        .unwrap();
    assert_eq!(
        gated_fields(&server.get("resourceslices", None, "new").unwrap()),
        vec![
            "consumesCounters",
            "taints",
            "allowMultipleAllocations",
            "requestPolicy"
        ]
    );
}

#[tokio::test]
async fn a_1_34_slice_may_consume_at_most_1024_counters_in_all() {
    // 1.34 caps the counters its devices consume together (ResourceSliceMaxDeviceCountersPerSlice),
    // as the real server's validation does: 64 devices consuming 16 each fit, one more counter does not.
    let (_server, api) = start(FeatureGates::all_enabled()).await;
    let slice = |extra: bool| {
        let counters: serde_json::Map<String, Value> = (0..16)
            .map(|i| (format!("c{i}"), json!({"value": "1"})))
            .collect();
        let mut devices: Vec<Value> = (0..64)
            .map(|i| {
                json!({"name": format!("d{i}"),
                "consumesCounters": [{"counterSet": "set", "counters": counters.clone()}]})
            })
            .collect();
        if extra {
            devices.push(json!({"name": "one-more",
                "consumesCounters": [{"counterSet": "set", "counters": {"c0": {"value": "1"}}}]}));
        }
        let mut slice = gated_slice(if extra { "over" } else { "at" });
        slice["spec"]["devices"] = json!(devices);
        slice["spec"]["sharedCounters"] = json!([{"name": "set", "counters": counters}]);
        typed(slice)
    };
    api.create(&PostParams::default(), &slice(false))
        .await
        .expect("1,024 counters are allowed");
    let error = api
        .create(&PostParams::default(), &slice(true))
        .await
        .expect_err("1,025 are not");
    let kube::Error::Api(status) = error else {
        panic!("an API error: {error:?}")
    };
    assert_eq!(status.code, 422, "{status:?}");
    assert!(
        status
            .message
            .contains("the total number of counters in devices must not exceed 1024"),
        "{}",
        status.message
    );
}
