//! The API server double, driven through the real `kube` client: CRUD, preconditions, selectors, watches,
//! ResourceSlice validation, the status subresource, faults and the test hooks.

use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use gpu_dra::support::apiserver::{ApiServer, FaultSpec, ServerVersion, Verb};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, ResourceClaim, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions, WatchEvent,
    WatchParams,
};
use kube::runtime::watcher;
use serde_json::{json, Value};

const DRIVER: &str = "gpu.dra.dev";

fn slice(name: &str, node: &str, driver: &str, devices: usize) -> ResourceSlice {
    let devices = (0..devices)
        .map(|i| Device {
            name: format!("gpu-{i}"),
            attributes: Some(
                [
                    (
                        "type".to_string(),
                        DeviceAttribute {
                            string: Some("gpu".into()),
                            ..Default::default()
                        },
                    ),
                    (
                        "driverVersion".to_string(),
                        DeviceAttribute {
                            version: Some("580.95.5".into()),
                            ..Default::default()
                        },
                    ),
                ]
                .into(),
            ),
            ..Default::default()
        })
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 0,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

fn slice_value(name: &str) -> Value {
    serde_json::to_value(slice(name, "node-a", DRIVER, 2)).expect("a slice serializes")
}

async fn start() -> (ApiServer, Api<ResourceSlice>) {
    let server = ApiServer::start().await.expect("server starts");
    let api = Api::all(server.client());
    (server, api)
}

/// The API status of a failed call.
fn status(result: Result<impl std::fmt::Debug, kube::Error>) -> Box<kube::core::Status> {
    match result {
        Err(kube::Error::Api(status)) => status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn crud_round_trip() {
    let (server, api) = start().await;
    let created = api
        .create(
            &PostParams::default(),
            &slice("node-a-gpu", "node-a", DRIVER, 2),
        )
        .await
        .unwrap();
    let meta = &created.metadata;
    assert!(meta.uid.is_some() && meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    assert_eq!(meta.resource_version.as_deref(), Some("1"));

    let fetched = api.get("node-a-gpu").await.unwrap();
    assert_eq!(fetched.spec, created.spec);
    let listed = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.metadata.resource_version.as_deref(), Some("1"));

    let mut changed = fetched.clone();
    changed.spec.pool.generation = 1;
    let replaced = api
        .replace("node-a-gpu", &PostParams::default(), &changed)
        .await
        .unwrap();
    assert_eq!(replaced.metadata.generation, Some(2));
    assert_eq!(replaced.metadata.resource_version.as_deref(), Some("2"));
    assert_eq!(replaced.metadata.uid, created.metadata.uid);

    let deleted = api
        .delete("node-a-gpu", &DeleteParams::default())
        .await
        .unwrap();
    assert!(
        deleted.is_right(),
        "an immediate delete answers with a Success status"
    );
    assert_eq!(status(api.get("node-a-gpu").await).code, 404);
    assert_eq!(
        status(api.delete("node-a-gpu", &DeleteParams::default()).await).code,
        404
    );
    assert_eq!(server.writes("resourceslices"), 3);
    assert_eq!(
        status(
            api.replace("node-a-gpu", &PostParams::default(), &changed)
                .await
        )
        .code,
        404
    );
}

#[tokio::test]
async fn create_conflicts_and_generate_name() {
    let (_server, api) = start().await;
    let mut template = slice("", "node-a", DRIVER, 1);
    template.metadata.name = None;
    template.metadata.generate_name = Some("node-a-gpu.dra.dev-".into());
    let first = api.create(&PostParams::default(), &template).await.unwrap();
    let second = api.create(&PostParams::default(), &template).await.unwrap();
    let name = first.metadata.name.clone().unwrap();
    assert!(
        name.starts_with("node-a-gpu.dra.dev-") && name.len() == "node-a-gpu.dra.dev-".len() + 5,
        "{name}"
    );
    assert_ne!(first.metadata.name, second.metadata.name);

    let existing = slice(&name, "node-a", DRIVER, 1);
    let err = status(api.create(&PostParams::default(), &existing).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "AlreadyExists"));
}

#[tokio::test]
async fn stale_resource_version_conflicts() {
    let (_server, api) = start().await;
    let created = api
        .create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let mut newer = created.clone();
    newer.spec.pool.generation = 1;
    api.replace("s", &PostParams::default(), &newer)
        .await
        .unwrap();
    let mut stale = created;
    stale.spec.pool.generation = 2;
    let err = status(api.replace("s", &PostParams::default(), &stale).await);
    assert_eq!((err.code, err.reason.as_str()), (409, "Conflict"));
    assert!(
        err.message.contains("the object has been modified"),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn delete_preconditions() {
    let (server, api) = start().await;
    let created = api
        .create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let with = |uid: Option<&str>, rv: Option<&str>| DeleteParams {
        preconditions: Some(Preconditions {
            uid: uid.map(Into::into),
            resource_version: rv.map(Into::into),
        }),
        ..Default::default()
    };
    let err = status(
        api.delete(
            "s",
            &with(Some("00000000-0000-0000-0000-000000000000"), None),
        )
        .await,
    );
    assert_eq!(err.code, 409);
    assert!(
        err.message.contains("Precondition failed: UID"),
        "{}",
        err.message
    );
    assert_eq!(
        status(api.delete("s", &with(None, Some("999"))).await).code,
        409
    );
    assert!(server.get("resourceslices", None, "s").is_some());
    let uid = created.metadata.uid.as_deref();
    api.delete(
        "s",
        &with(uid, created.metadata.resource_version.as_deref()),
    )
    .await
    .unwrap();
    assert!(server.get("resourceslices", None, "s").is_none());
}

#[tokio::test]
async fn field_and_label_selectors() {
    let (server, api) = start().await;
    for (name, node, driver) in [
        ("a1", "node-a", DRIVER),
        ("a2", "node-a", "other.example.com"),
        ("b1", "node-b", DRIVER),
    ] {
        let mut s = slice(name, node, driver, 1);
        s.metadata.labels = Some([("node".to_string(), node.to_string())].into());
        api.create(&PostParams::default(), &s).await.unwrap();
    }
    let names = |list: kube::core::ObjectList<ResourceSlice>| -> Vec<String> {
        list.items
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .collect()
    };
    let both = ListParams::default().fields(&format!("spec.nodeName=node-a,spec.driver=={DRIVER}"));
    assert_eq!(names(api.list(&both).await.unwrap()), ["a1"]);
    let not_b = ListParams::default().fields("spec.nodeName!=node-b");
    assert_eq!(names(api.list(&not_b).await.unwrap()), ["a1", "a2"]);
    let pool = ListParams::default().fields("spec.pool.name=node-b,metadata.name=b1");
    assert_eq!(names(api.list(&pool).await.unwrap()), ["b1"]);
    let labels = ListParams::default().labels("node in (node-b,node-c)");
    assert_eq!(names(api.list(&labels).await.unwrap()), ["b1"]);
    let err = status(
        api.list(&ListParams::default().fields("spec.devices=x"))
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (400, "BadRequest"));
    assert!(
        err.message
            .contains("field label not supported: spec.devices"),
        "{}",
        err.message
    );
    assert_eq!(
        server
            .requests()
            .iter()
            .filter(|r| r.verb == Verb::List)
            .count(),
        5
    );
}

async fn next_event(
    events: &mut futures::stream::BoxStream<
        'static,
        watcher::Result<watcher::Event<ResourceSlice>>,
    >,
) -> watcher::Event<ResourceSlice> {
    let event = tokio::time::timeout(Duration::from_secs(10), events.try_next()).await;
    event
        .expect("an event in time")
        .expect("no watch error")
        .expect("stream goes on")
}

#[tokio::test]
async fn watcher_sees_slices_wiped_by_the_kubelet() {
    let (server, api) = start().await;
    api.create(&PostParams::default(), &slice("mine", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let config = watcher::Config::default().fields("spec.nodeName=node-a");
    let mut events = watcher(api.clone(), config).boxed();
    let mut seen = Vec::new();
    loop {
        match next_event(&mut events).await {
            watcher::Event::InitApply(s) => seen.push(s.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(seen, ["mine"]);
    server.insert(
        "resourceslices",
        serde_json::to_value(slice("other-node", "node-b", DRIVER, 1)).unwrap(),
    );
    server.insert(
        "resourceslices",
        serde_json::to_value(slice("second", "node-a", DRIVER, 1)).unwrap(),
    );
    match next_event(&mut events).await {
        watcher::Event::Apply(s) => assert_eq!(s.metadata.name.as_deref(), Some("second")),
        other => panic!("expected the inserted slice, got {other:?}"),
    }
    let wiped = server.remove_where("resourceslices", |s| s["spec"]["nodeName"] == "node-a");
    assert_eq!(wiped.len(), 2);
    let mut deleted = Vec::new();
    while deleted.len() < 2 {
        if let watcher::Event::Delete(s) = next_event(&mut events).await {
            deleted.push(s.metadata.name.unwrap());
        }
    }
    deleted.sort();
    assert_eq!(deleted, ["mine", "second"]);
    assert!(server
        .requests()
        .iter()
        .any(|r| r.verb == Verb::Watch && r.code == 200));
}

#[tokio::test]
async fn watcher_with_streaming_lists() {
    let (_server, api) = start().await;
    api.create(&PostParams::default(), &slice("mine", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let config = watcher::Config::default().streaming_lists();
    let mut events = watcher(api.clone(), config).boxed();
    let mut seen = Vec::new();
    loop {
        match next_event(&mut events).await {
            watcher::Event::InitApply(s) => seen.push(s.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(seen, ["mine"]);
    api.delete("mine", &DeleteParams::default()).await.unwrap();
    assert!(matches!(
        next_event(&mut events).await,
        watcher::Event::Delete(_)
    ));
}

#[tokio::test]
async fn watch_from_a_compacted_version_is_gone_and_ends_at_timeout() {
    let (server, api) = start().await;
    api.create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let mut stream = api
        .watch(&WatchParams::default().timeout(1), "0")
        .await
        .unwrap()
        .boxed();
    assert!(matches!(
        stream.try_next().await.unwrap(),
        Some(WatchEvent::Added(_))
    ));
    let started = Instant::now();
    assert!(
        stream.try_next().await.unwrap().is_none(),
        "the stream ends at timeoutSeconds"
    );
    assert!(started.elapsed() < Duration::from_secs(3));

    server.insert("resourceslices", slice_value("t"));
    server.compact();
    let mut expired = api
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    match expired.try_next().await.unwrap() {
        Some(WatchEvent::Error(status)) => assert_eq!(status.code, 410),
        other => panic!("expected 410 Gone, got {other:?}"),
    }
}

/// One invalid ResourceSlice per rule: the JSON pointer to change in a valid slice, the new value, and
/// what the error message must say (the field path first).
#[rustfmt::skip]
fn invalid_cases() -> Vec<(&'static str, &'static str, Value, &'static str)> {
    let long = |n: usize| "a".repeat(n);
    let devices = |n: usize| {
        json!((0..n)
            .map(|i| json!({"name": format!("gpu-{i}")}))
            .collect::<Vec<_>>())
    };
    let mut tainted = devices(65);
    tainted[0]["taints"] = json!([{"key": "k", "effect": "NoSchedule"}]);
    let attributes: serde_json::Map<String, Value> = (0..33)
        .map(|i| (format!("a{i}"), json!({"int": i})))
        .collect();
    let taints = json!((0..17)
        .map(|i| json!({"key": format!("k{i}"), "effect": "NoSchedule"}))
        .collect::<Vec<_>>());
    let counters = json!([{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}]);
    vec![
        ("bad name", "/metadata/name", json!("Not_A_Name"), "metadata.name: Invalid value"),
        ("bad label value", "/metadata/labels", json!({"nvidia.com/gpu.product": "NVIDIA H100"}), "metadata.labels: Invalid value: \"NVIDIA H100\": a valid label must"),
        ("long label value", "/metadata/labels", json!({"team": long(64)}), "metadata.labels: Invalid value: \"aaaa"),
        ("bad label key", "/metadata/labels", json!({"nvidia.com/gpu product": "x"}), "metadata.labels: Invalid value: \"nvidia.com/gpu product\": name part"),
        ("no driver", "/spec/driver", json!(""), "spec.driver: Required value"),
        ("bad driver", "/spec/driver", json!("gpu_dra"), "spec.driver: Invalid value"),
        ("long driver", "/spec/driver", json!(long(64)), "spec.driver: Too long"),
        ("no pool", "/spec/pool/name", json!(""), "spec.pool.name: Required"),
        ("bad pool", "/spec/pool/name", json!("a//b"), "spec.pool.name: Invalid"),
        ("long pool", "/spec/pool/name", json!(long(254)), "spec.pool.name: Too long"),
        ("zero slices", "/spec/pool/resourceSliceCount", json!(0), "spec.pool.resourceSliceCount: Invalid"),
        ("negative generation", "/spec/pool/generation", json!(-1), "spec.pool.generation: Invalid"),
        ("no placement", "/spec/nodeName", Value::Null, "spec: Required value: exactly one of"),
        ("two placements", "/spec/allNodes", json!(true), "but multiple fields are set"),
        ("too many devices", "/spec/devices", devices(129), "spec.devices: Too many: 129: must have at most 128"),
        ("too many tainted devices", "/spec/devices", tainted, "spec.devices: Too many: 65: must have at most 64"),
        ("bad device name", "/spec/devices/1/name", json!("GPU.1"), "spec.devices[1].name: Invalid value: \"GPU.1\""),
        ("duplicate device", "/spec/devices/1/name", json!("gpu-0"), "spec.devices[1]: Duplicate value: \"gpu-0\""),
        ("too many attributes", "/spec/devices/0/attributes", json!(attributes), "spec.devices[0]: Invalid value: 33"),
        ("bad attribute id", "/spec/devices/0/attributes/9lives", json!({"int": 1}), "attributes[9lives]: Invalid"),
        ("long attribute id", concat!( "/spec/devices/0/attributes/", "abcdefghijklmnopqrstuvwxyz_123456" ), json!({"int": 1}), "Too long: may not be more than 32 bytes"),
        ("no attribute value", "/spec/devices/0/attributes/x", json!({}), "attributes[x]: Required value: exactly one value"),
        ("bad attribute domain", "/spec/devices/0/attributes/Bad_Domain~1x", json!({"int": 1}), "attributes[Bad_Domain/x]: Invalid"),
        ("two values", "/spec/devices/0/attributes/type/int", json!(1), "attributes[type]: Invalid value"),
        ("long string", "/spec/devices/0/attributes/type/string", json!(long(65)), "attributes[type].string: Too long"),
        ("not semver", "/spec/devices/0/attributes/driverVersion/version", json!("580.95.05"), "attributes[driverVersion].version: Invalid"),
        ("bad quantity", "/spec/devices/0/capacity", json!({"memory": {"value": "80GB"}}), "capacity[memory].value: Invalid value: \"80GB\""),
        ("too many taints", "/spec/devices/0/taints", taints, "spec.devices[0].taints: Too many: 17: must have at most 16"),
        ("bad effect", "/spec/devices/0/taints", json!([{"key": "k", "effect": "PreferNoSchedule"}]), "taints[0].effect: Unsupported value"),
        ("devices and counters", "/spec/sharedCounters", counters, "spec.sharedCounters: Forbidden"),
    ]
}

/// Sets the value at a JSON pointer whose parent exists.
fn set_at(doc: &mut Value, pointer: &str, value: Value) {
    let (parent, key) = pointer.rsplit_once('/').expect("a pointer below the root");
    match doc.pointer_mut(parent).expect("the parent exists") {
        Value::Object(map) => drop(map.insert(key.replace("~1", "/"), value)),
        Value::Array(items) => items[key.parse::<usize>().expect("an index")] = value,
        other => panic!("cannot set {key} in {other}"),
    }
}

#[tokio::test]
async fn validation_rejects_each_rule_with_the_field() {
    let (server, api) = start().await;
    for (case, pointer, new, field) in invalid_cases() {
        let mut value = slice_value("s");
        set_at(&mut value, pointer, new);
        let typed: ResourceSlice =
            serde_json::from_value(value).unwrap_or_else(|e| panic!("{case}: {e}"));
        let err = status(api.create(&PostParams::default(), &typed).await);
        assert_eq!(
            (err.code, err.reason.as_str()),
            (422, "Invalid"),
            "{case}: {}",
            err.message
        );
        assert!(
            err.message.contains(field),
            "{case}: {:?} does not name {field:?}",
            err.message
        );
    }
    assert_eq!(server.writes("resourceslices"), 0);
    assert!(server.list("resourceslices").is_empty());
}

#[tokio::test]
async fn validation_follows_the_server_version() {
    let taints = |n: usize, effect: &str| {
        let mut value = slice_value("s");
        value["spec"]["devices"][0]["taints"] = json!((0..n)
            .map(|i| json!({"key": format!("k{i}"), "effect": effect}))
            .collect::<Vec<_>>());
        serde_json::from_value::<ResourceSlice>(value).unwrap()
    };
    let old = ApiServer::start_with(ServerVersion::V1_34).await.unwrap();
    let api: Api<ResourceSlice> = Api::all(old.client());
    assert_eq!(
        status(
            api.create(&PostParams::default(), &taints(5, "NoSchedule"))
                .await
        )
        .code,
        422
    );
    assert_eq!(
        status(api.create(&PostParams::default(), &taints(1, "None")).await).code,
        422
    );
    let (_new, api) = start().await;
    let created = api
        .create(&PostParams::default(), &taints(5, "None"))
        .await
        .unwrap();
    let taint = &created.spec.devices.unwrap()[0].taints.clone().unwrap()[0];
    assert!(taint.time_added.is_some(), "the server stamps timeAdded");
}

#[tokio::test]
async fn immutable_fields_on_update() {
    let (_server, api) = start().await;
    let created = api
        .create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    for change in [
        |s: &mut ResourceSlice| s.spec.driver = "other.example.com".into(),
        |s: &mut ResourceSlice| s.spec.node_name = Some("node-b".into()),
        |s: &mut ResourceSlice| s.spec.pool.name = "node-b".into(),
    ] {
        let mut changed = created.clone();
        change(&mut changed);
        let err = status(api.replace("s", &PostParams::default(), &changed).await);
        assert_eq!(err.code, 422);
        assert!(
            err.message.contains("field is immutable"),
            "{}",
            err.message
        );
    }
}

#[tokio::test]
async fn injected_faults_reach_the_client() {
    let (server, api) = start().await;
    server.fail_next(FaultSpec {
        verb: Some(Verb::Create),
        resource: Some("resourceslices".into()),
        code: 500,
        count: 1,
    });
    let err = status(
        api.create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
            .await,
    );
    assert_eq!((err.code, err.reason.as_str()), (500, "InternalError"));
    assert!(
        server.list("resourceslices").is_empty(),
        "a failed request is not applied"
    );

    server.fail_next(FaultSpec {
        verb: Some(Verb::Get),
        resource: None,
        code: 409,
        count: 2,
    });
    api.create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    assert_eq!(status(api.get("s").await).code, 409);
    assert_eq!(status(api.get("s").await).code, 409);
    api.get("s").await.unwrap();

    let no_retries: Api<ResourceSlice> = Api::all(server.client_without_retries());
    server.fail_next(FaultSpec {
        verb: None,
        resource: Some("resourceslices".into()),
        code: 503,
        count: 1,
    });
    let err = status(no_retries.get("s").await);
    assert_eq!((err.code, err.reason.as_str()), (503, "ServiceUnavailable"));

    // kube's default client retries 429 after Retry-After and succeeds.
    server.clear_requests();
    server.fail_next(FaultSpec {
        verb: Some(Verb::List),
        resource: None,
        code: 429,
        count: 1,
    });
    api.list(&ListParams::default()).await.unwrap();
    let codes: Vec<u16> = server.requests().iter().map(|r| r.code).collect();
    assert_eq!(codes, [429, 200]);
    server.fail_next(FaultSpec {
        verb: Some(Verb::Delete),
        resource: None,
        code: 500,
        count: 1,
    });
    server.clear_faults();
    api.delete("s", &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn latency_delays_requests() {
    let (server, api) = start().await;
    server.set_latency(Duration::from_millis(300));
    let started = Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    server.clear_faults();
    let started = Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(300));
}

#[tokio::test]
async fn claim_status_is_a_subresource() {
    let (server, _) = start().await;
    let claims: Api<ResourceClaim> = Api::namespaced(server.client(), "team-a");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "claim-1"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}}]}},
        "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]},
    }))
    .unwrap();
    let created = claims.create(&PostParams::default(), &claim).await.unwrap();
    assert!(created.status.is_none(), "status is dropped on create");

    let device_status = json!({"status": {"devices": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-0", "data": {"k": "v"}}]}});
    let patched = claims
        .patch_status(
            "claim-1",
            &PatchParams::default(),
            &Patch::Merge(&device_status),
        )
        .await
        .unwrap();
    let devices = patched
        .status
        .as_ref()
        .and_then(|s| s.devices.clone())
        .unwrap();
    assert_eq!(devices[0].device, "gpu-0");
    assert_eq!(
        patched.metadata.generation,
        Some(1),
        "a status change keeps the generation"
    );

    let mut replaced = patched.clone();
    replaced.status = None;
    replaced.metadata.labels = Some([("a".to_string(), "b".to_string())].into());
    let updated = claims
        .replace("claim-1", &PostParams::default(), &replaced)
        .await
        .unwrap();
    assert!(
        updated.status.is_some(),
        "the main resource ignores status changes"
    );
    assert!(updated.metadata.labels.is_some());

    let stored = server
        .get("resourceclaims", Some("team-a"), "claim-1")
        .unwrap();
    assert_eq!(stored["status"]["devices"][0]["data"]["k"], "v");
    assert_eq!(server.writes("resourceclaims/status"), 1);
    assert_eq!(server.writes("resourceclaims"), 3);

    let json_patch = json!([{"op": "remove", "path": "/status/devices"}]);
    let patch = Patch::<Value>::Json(serde_json::from_value(json_patch).unwrap());
    let cleared = claims
        .patch_status("claim-1", &PatchParams::default(), &patch)
        .await
        .unwrap();
    assert!(cleared.status.and_then(|s| s.devices).is_none());
    let everywhere: Api<ResourceClaim> = Api::all(server.client());
    assert_eq!(
        everywhere
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}

#[tokio::test]
async fn kubeconfig_points_at_the_server() {
    let (server, _) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    // `Client::try_from(config)` is what a plugin process does with this; it is not called here because
    // kube's rustls setup panics in test builds that link both ring and aws-lc-rs.
    assert_eq!(
        config.cluster_url.to_string().trim_end_matches('/'),
        server.url()
    );
    assert!(config.auth_info.token.is_none() && config.root_cert.is_none());
}

#[tokio::test]
async fn hooks_and_wait_for() {
    let (server, api) = start().await;
    let waiter = {
        let api = api.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            api.create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
                .await
                .unwrap();
        })
    };
    let found = server
        .wait_for("resourceslices", |s| s.len() == 1, Duration::from_secs(5))
        .await;
    assert_eq!(found.unwrap()[0]["metadata"]["name"], "s");
    waiter.await.unwrap();
    assert!(server
        .wait_for(
            "resourceslices",
            |s| s.is_empty(),
            Duration::from_millis(50)
        )
        .await
        .is_none());
    let version = server.resource_version();
    assert!(server.remove("resourceslices", None, "s").is_some());
    assert_eq!(server.resource_version(), version + 1);
    server.shutdown().await;
    assert!(api.list(&ListParams::default()).await.is_err());
}

#[tokio::test]
async fn finalizers_delay_deletion() {
    let (server, _) = start().await;
    let nodes: Api<Node> = Api::all(server.client());
    let node: Node = serde_json::from_value(
        json!({"metadata": {"name": "node-a", "finalizers": ["example.com/keep"]}}),
    )
    .unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let pending = nodes
        .delete("node-a", &DeleteParams::default())
        .await
        .unwrap();
    let pending = pending
        .left()
        .expect("a pending delete answers with the object");
    assert!(pending.metadata.deletion_timestamp.is_some());
    assert!(server.get("nodes", None, "node-a").is_some());
    let release = json!({"metadata": {"finalizers": null}});
    nodes
        .patch("node-a", &PatchParams::default(), &Patch::Merge(&release))
        .await
        .unwrap();
    assert!(server.get("nodes", None, "node-a").is_none());
}

/// `kubectl auth whoami` as kube-apiserver v1.34 answers it (realk8s): `201` with `status.userInfo`; a
/// token bound to a Pod carries the Pod's and its node's claims in `extra`, one bound to nothing only
/// its credential id; a token the server did not issue is `401`.
#[tokio::test]
async fn self_subject_reviews_answer_who_the_token_is() {
    use gpu_dra::support::apiserver::NODE_NAME_CLAIM;
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let api = ApiServer::start().await.expect("API server double");
    let who = |client: kube::Client| async move {
        Api::<SelfSubjectReview>::all(client)
            .create(&PostParams::default(), &SelfSubjectReview::default())
            .await
            .map(|review| review.status.and_then(|s| s.user_info).expect("userInfo"))
    };

    let bound = api.pod_bound_token("gpu-dra", "gpu-dra-plugin", "plugin-x", "node-1");
    let user = who(api.client_with_token(&bound)).await.unwrap();
    assert_eq!(
        user.username.as_deref(),
        Some("system:serviceaccount:gpu-dra:gpu-dra-plugin")
    );
    assert_eq!(
        user.groups.unwrap_or_default(),
        [
            "system:serviceaccounts",
            "system:serviceaccounts:gpu-dra",
            "system:authenticated"
        ]
    );
    assert!(user.uid.is_some_and(|uid| !uid.is_empty()));
    let extra = user.extra.unwrap_or_default();
    let keys: Vec<&str> = extra.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "authentication.kubernetes.io/credential-id",
            NODE_NAME_CLAIM,
            "authentication.kubernetes.io/node-uid",
            "authentication.kubernetes.io/pod-name",
            "authentication.kubernetes.io/pod-uid",
        ]
    );
    assert_eq!(extra[NODE_NAME_CLAIM], ["node-1"]);
    assert_eq!(extra["authentication.kubernetes.io/pod-name"], ["plugin-x"]);

    let unbound = api.unbound_token("gpu-dra", "gpu-dra-plugin");
    let user = who(api.client_with_token(&unbound)).await.unwrap();
    let extra = user.extra.unwrap_or_default();
    assert_eq!(
        extra.keys().collect::<Vec<_>>(),
        ["authentication.kubernetes.io/credential-id"]
    );

    // No token: the admin of the double's kubeconfig.
    let user = who(api.client()).await.unwrap();
    assert_eq!(user.username.as_deref(), Some("admin"));
    assert!(user.extra.is_none());

    let refused = status(who(api.client_with_token("not-issued")).await);
    assert_eq!(
        (refused.code, refused.reason.as_str()),
        (401, "Unauthorized")
    );
    let codes: Vec<u16> = api
        .requests()
        .iter()
        .filter(|r| r.resource == "selfsubjectreviews" && r.verb == Verb::Create)
        .map(|r| r.code)
        .collect();
    assert_eq!(codes, [201, 201, 201, 401]);
}
