//! ResourceSlice validation as the real server words it: one invalid slice per rule with the field
//! path first, rules that follow the server version, and fields that cannot change on update.

use gpu_dra::support::apiserver::{ApiServer, ServerVersion};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, PostParams};
use serde_json::{json, Value};

use super::{slice, slice_value, start, status, DRIVER};

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
    // A device that allows multiple allocations with one capacity.
    let shared = |name: &str, capacity: Value| {
        json!({"name": "gpu-0", "allowMultipleAllocations": true, "capacity": {name: capacity}})
    };
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
        ("request policy, one allocation", "/spec/devices/0/capacity", json!({"memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi"}}}}), "capacity[memory].requestPolicy: Forbidden: allowMultipleAllocations must be true"),
        ("a step above an empty capacity", "/spec/devices/0", shared("encoders", json!({"value": "0", "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1"}}})), "capacity[encoders].requestPolicy.validRange.step: Invalid value: \"1\": one step 1 is larger than capacity value: 0"),
        ("default off the steps", "/spec/devices/0", shared("memory", json!({"value": "80Gi", "requestPolicy": {"default": "2Gi", "validRange": {"min": "1Gi", "step": "2Gi"}}})), "validRange.step: Invalid value: \"2Gi\": value is not a multiple of a given step (2Gi) from (1Gi)"),
        ("default above max", "/spec/devices/0", shared("memory", json!({"value": "80Gi", "requestPolicy": {"default": "8Gi", "validRange": {"min": "1Gi", "max": "4Gi"}}})), "validRange.max: Invalid value: \"8Gi\": default is more than max: 4Gi"),
        ("values and range", "/spec/devices/0", shared("memory", json!({"value": "80Gi", "requestPolicy": {"default": "1Gi", "validValues": ["1Gi"], "validRange": {"min": "1Gi"}}})), "capacity[memory].requestPolicy: Forbidden: exactly one policy"),
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
