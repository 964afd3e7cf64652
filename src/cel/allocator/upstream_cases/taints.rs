//! Device taints and request tolerations.

use k8s_openapi::api::resource::v1::DeviceToleration;
use serde_json::json;

use super::*;

fn no_schedule() -> Value {
    json!({"key": "taint-key", "value": "taint-value", "effect": "NoSchedule"})
}

fn no_execute() -> Value {
    json!({"key": "taint-key", "value": "taint-value-2", "effect": "NoExecute"})
}

fn toleration_no_schedule() -> Value {
    json!({"operator": "Exists", "key": "taint-key", "effect": "NoSchedule"})
}

fn toleration_no_execute() -> Value {
    json!({"operator": "Equal", "key": "taint-key", "value": "taint-value-2", "effect": "NoExecute"})
}

fn tainted(name: &str, taints: Value) -> Value {
    with(device(name), json!({ "taints": taints }))
}

fn two_tainted() -> Case {
    Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![
            tainted("device-1", json!([no_schedule()])),
            tainted("device-2", json!([no_execute()])),
        ],
    )])
}

fn one_with_both() -> Case {
    Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![tainted("device-1", json!([no_schedule(), no_execute()]))],
    )])
}

fn tolerating(mut request: Value, tolerations: Value) -> Value {
    request["exactly"]["tolerations"] = tolerations;
    request
}

/// The allocation's tolerations, which the result records as the request has them.
fn tolerations(case: &Case, requests: Value) -> Vec<Vec<DeviceToleration>> {
    let (results, _) = case.claim_after(&[], requests, json!([]));
    results
        .expect("allocated")
        .into_iter()
        .map(|r| r.tolerations.unwrap_or_default())
        .collect()
}

#[test]
fn tainted_two_devices() {
    assert_not_allocated(two_tainted().allocate(json!([request("req-0", "class-a", 1)])));
}

#[test]
fn tainted_one_device_two_taints() {
    assert_not_allocated(one_with_both().allocate(json!([request("req-0", "class-a", 1)])));
}

#[test]
fn tainted_two_devices_tolerated() {
    let requests = json!([tolerating(
        request("req-0", "class-a", 1),
        json!([toleration_no_execute()])
    )]);
    assert_allocated(
        two_tainted().allocate(requests.clone()),
        &["req-0 driver-a/pool-1/device-2"],
    );
    let recorded = tolerations(&two_tainted(), requests);
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].len(), 1);
    assert_eq!(recorded[0][0].value.as_deref(), Some("taint-value-2"));
}

#[test]
fn tainted_two_devices_prioritized_list_tolerated() {
    let mut tolerant = sub("subReq-1", "class-a", 1);
    tolerant["tolerations"] = json!([toleration_no_execute()]);
    assert_allocated(
        two_tainted().allocate(json!([first_available(
            "req-0",
            vec![sub("subReq-0", "class-a", 1), tolerant]
        )])),
        &["req-0/subReq-1 driver-a/pool-1/device-2"],
    );
}

#[test]
fn tainted_no_effect() {
    let taint = json!({"key": "taint-key", "value": "taint-value", "effect": "None"});
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![tainted("device-1", json!([taint]))],
    )]);
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 1)])),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn tainted_one_device_two_taints_both_tolerated() {
    let requests = json!([tolerating(
        request("req-0", "class-a", 1),
        json!([toleration_no_schedule(), toleration_no_execute()])
    )]);
    assert_allocated(
        one_with_both().allocate(requests.clone()),
        &["req-0 driver-a/pool-1/device-1"],
    );
    assert_eq!(tolerations(&one_with_both(), requests)[0].len(), 2);
}

#[test]
fn tainted_prioritized_list() {
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![tainted("device-1", json!([no_schedule()]))],
    )]);
    assert_not_allocated(case.allocate(json!([first_available(
        "req-0",
        vec![sub("subReq-0", "class-b", 1), sub("subReq-1", "class-a", 1)]
    )])));
}

#[test]
fn tainted_admin_access() {
    // Admin access does not get past a taint.
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![tainted("device-1", json!([no_schedule()]))],
    )])
    .allocated(&[(A, "pool-1", "device-1"), (A, "pool-1", "device-2")]);
    assert_not_allocated(case.allocate(json!([admin(request("req-0", "class-a", 1))])));
}
