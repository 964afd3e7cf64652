//! The search's pruning: how many steps hard claims take (steps, not time, so the numbers hold on any
//! machine).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{ResourceClaimSpec, ResourceSlice};
use serde_json::{json, Value};

use super::run;
use crate::cel::allocator::{AllocationError, InUse, Node, Pools, DEFAULT_STEP_LIMIT};

const DRIVER: &str = "gpu.dra.dev";
const NODE: &str = "node-a";

/// `gpu-0`, `gpu-1`, ... with their `index`, in one slice of node-a.
fn pool(devices: usize) -> Pools {
    pool_of(
        (0..devices)
            .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"index": {"int": i}}}))
            .collect(),
    )
}

fn pool_of(devices: Vec<Value>) -> Pools {
    let slice: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": "slice"},
        "spec": {"driver": DRIVER, "nodeName": NODE, "devices": devices,
                 "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}},
    }))
    .expect("slice");
    Pools::from_slices(&[slice], Some(&Node::named(NODE)))
}

fn classes() -> BTreeMap<String, Vec<String>> {
    BTreeMap::from([(
        "gpu".to_string(),
        vec![format!("device.driver == {DRIVER:?}")],
    )])
}

fn exactly(name: &str, count: usize) -> Value {
    json!({"name": name, "exactly": {"deviceClassName": "gpu", "count": count}})
}

fn first_available(name: &str, counts: &[usize]) -> Value {
    let subrequests: Vec<Value> = counts
        .iter()
        .enumerate()
        .map(|(i, count)| json!({"name": format!("sub-{i}"), "deviceClassName": "gpu", "count": count}))
        .collect();
    json!({"name": name, "firstAvailable": subrequests})
}

/// The results as `request: device` and the steps the search took.
fn search(pools: &Pools, requests: Value) -> (Result<Vec<String>, AllocationError>, u64) {
    let spec: ResourceClaimSpec =
        serde_json::from_value(json!({"devices": {"requests": requests}})).expect("claim");
    let (result, steps) = run(
        pools,
        &classes(),
        &InUse::default(),
        &spec,
        DEFAULT_STEP_LIMIT,
    );
    let results = result.map(|results| {
        results
            .iter()
            .map(|r| format!("{}: {}", r.request, r.device))
            .collect()
    });
    (results, steps)
}

fn gpus(request: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{request}: gpu-{i}")).collect()
}

// Before the pruning, the 31-device case and the firstAvailable case below stopped at the step limit
// (1,000,000 steps, the first after exploring ordered 16-device choices for `a`).

#[test]
fn two_requests_of_16_take_the_first_32_devices_at_once() {
    let (results, steps) = search(&pool(64), json!([exactly("a", 16), exactly("b", 16)]));
    let expected: Vec<String> = gpus("a", 0..16)
        .into_iter()
        .chain(gpus("b", 16..32))
        .collect();
    assert_eq!(results.expect("allocated"), expected);
    assert!(steps <= 34, "{steps} steps");
}

#[test]
fn two_requests_of_16_among_31_devices_fail_quickly() {
    let (results, steps) = search(&pool(31), json!([exactly("a", 16), exactly("b", 16)]));
    assert!(
        matches!(results, Err(AllocationError::Unsatisfiable { .. })),
        "{results:?}"
    );
    assert!(
        steps < 100,
        "{steps} steps, the limit is {DEFAULT_STEP_LIMIT}"
    );
}

#[test]
fn a_request_that_needs_the_first_devices_gets_them_after_backtracking() {
    // `b` takes only gpu-0..15, which `a` takes first: `a` must move to gpu-16..31, the last of its
    // C(32, 16) choices in search order.
    let low = json!({"name": "b", "exactly": {"deviceClassName": "gpu", "count": 16, "selectors": [
        {"cel": {"expression": "device.attributes[\"gpu.dra.dev\"].index < 16"}}]}});
    let (results, steps) = search(&pool(32), json!([exactly("a", 16), low]));
    let expected: Vec<String> = gpus("a", 16..32)
        .into_iter()
        .chain(gpus("b", 0..16))
        .collect();
    assert_eq!(results.expect("allocated"), expected);
    assert!(steps < 200, "{steps} steps");
}

#[test]
fn first_available_passes_over_subrequests_too_large_for_the_claim() {
    // Upstream's prioritized-list-max-allocation-limit-request: 32 for `a` leaves no room for `b`.
    let (results, steps) = search(
        &pool(64),
        json!([
            first_available("a", &[32, 16]),
            first_available("b", &[32, 16])
        ]),
    );
    let expected: Vec<String> = gpus("a/sub-1", 0..16)
        .into_iter()
        .chain(gpus("b/sub-1", 16..32))
        .collect();
    assert_eq!(results.expect("allocated"), expected);
    assert!(steps <= 100, "{steps} steps");
}

#[test]
fn pruning_does_not_hide_a_selector_error_the_search_would_reach() {
    // `c` fails once `a` and `b` hold gpu-0 and gpu-1; backtracking, `b` then reaches `x`, whose
    // missing attribute is a CEL runtime error, as it is in upstream's search. Counting alone would
    // have cut that branch: no other device is left for `b`.
    let mut devices: Vec<Value> = (0..2)
        .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"index": {"int": i}}}))
        .collect();
    devices.push(json!({"name": "x"}));
    let pools = pool_of(devices);
    let selecting = |name: &str, expression: &str| {
        json!({"name": name, "exactly": {"deviceClassName": "gpu",
            "selectors": [{"cel": {"expression": expression}}]}})
    };
    let (results, _) = search(
        &pools,
        json!([
            selecting("a", r#"device.attributes["gpu.dra.dev"].index == 0"#),
            selecting("b", r#"device.attributes["gpu.dra.dev"].index >= 1"#),
            selecting(
                "c",
                r#""index" in device.attributes["gpu.dra.dev"] && device.attributes["gpu.dra.dev"].index == 0"#,
            ),
        ]),
    );
    let error = results.expect_err("a CEL error");
    assert!(
        error.to_string().starts_with(
            "request b: selector #0 on device gpu.dra.dev/node-a/x: CEL runtime error"
        ),
        "{error}"
    );
}
