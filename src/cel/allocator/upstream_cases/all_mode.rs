//! allocationMode All: every matching device of the node, which needs every pool complete and valid,
//! and a constraint that all of them cannot meet is an error.

use serde_json::json;

use super::*;

fn two_devices() -> Vec<Value> {
    vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![device("device-1"), device("device-2")],
    )]
}

#[test]
fn all_devices_single() {
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![device("device-1")],
    )]);
    assert_allocated(
        case.allocate(json!([all_of("req-0", "class-a")])),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn all_devices_with_consumed_counters() {
    let consumer = consuming(
        "device-1",
        &[("counter-set-1", json!({"memory": "4Gi"}))],
        false,
    );
    let set = [("counter-set-1", json!({"memory": "8Gi"}))];
    let case = Case::new(vec![
        pool_of(
            slice("slice-1", json!("node-1"), "pool-1", A, vec![consumer]),
            1,
            2,
        ),
        pool_of(
            counter_slice("slice-2", json!("node-1"), "pool-1", A, &set),
            1,
            2,
        ),
    ]);
    assert_allocated(
        case.allocate(json!([all_of("req-0", "class-a")])),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn all_devices_many() {
    let case = Case::new(vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![device("device-1")],
        ),
        slice(
            "slice-1",
            json!("node-1"),
            "pool-2",
            A,
            vec![device("device-1")],
        ),
    ]);
    assert_allocated(
        case.allocate(json!([all_of("req-0", "class-a")])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-0 driver-a/pool-2/device-1",
        ],
    );
}

#[test]
fn all_devices_of_the_incomplete_pool() {
    // Upstream: "claim claim-0, request req-0: asks for all devices, but resource pool
    // driver-a/pool-1 is currently being updated"; the CLI puts the claim first.
    let case = Case::new(vec![pool_of(
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![device("device-1")],
        ),
        1,
        2,
    )]);
    let mut request = all_of("req-0", "class-a");
    request["exactly"]["count"] = json!(1);
    assert_error(
        case.allocate(json!([request])),
        "request req-0: asks for all devices, but resource pool driver-a/pool-1 is currently being updated (incomplete: 1 of 2 slices at generation 1)",
    );
}

#[test]
fn all_devices_plus_another() {
    // Upstream allocates the two claims together, in either order (and -reversed); here one after
    // the other, in both orders.
    let case = Case::new(vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![device("device-1")],
        ),
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            B,
            vec![device("device-1")],
        ),
    ]);
    let all = json!([all_of("req-0", "class-a")]);
    let one = json!([request("req-0", "class-b", 1)]);
    for (first, second) in [(&all, &one), (&one, &all)] {
        let (before, _) = case.claim_after(&[], first.clone(), json!([]));
        let before = before.expect("first claim");
        let (after, _) = case.claim_after(&before, second.clone(), json!([]));
        let mut both = names(&before);
        both.extend(names(&after.expect("second claim")));
        both.sort();
        assert_eq!(
            both,
            [
                "req-0 driver-a/pool-1/device-1",
                "req-0 driver-b/pool-1/device-1"
            ]
        );
    }
}

#[test]
fn all_devices_slice_without_devices() {
    let case = Case::new(vec![slice("slice-1", json!("node-1"), "pool-1", A, vec![])]);
    assert_not_allocated(case.allocate(json!([all_of("req-0", "class-a")])));
}

#[test]
fn all_devices_no_slices() {
    assert_not_allocated(Case::new(vec![]).allocate(json!([all_of("req-0", "class-a")])));
}

#[test]
fn all_devices_some_allocated() {
    // "All" includes the device another claim holds, so the claim cannot have them all.
    let case = Case::new(two_devices()).allocated(&[(A, "pool-1", "device-1")]);
    assert_not_allocated(case.allocate(json!([all_of("req-0", "class-a")])));
}

#[test]
fn all_devices_some_allocated_admin_access() {
    let case = Case::new(two_devices()).allocated(&[(A, "pool-1", "device-1")]);
    assert_allocated(
        case.allocate(json!([admin(all_of("req-0", "class-a"))])),
        &[
            "req-0 driver-a/pool-1/device-1 admin",
            "req-0 driver-a/pool-1/device-2 admin",
        ],
    );
}

#[test]
fn all_devices_some_allocating_admin_access() {
    // The device req-0 takes is the claim's, so req-1 cannot have all.
    let case = Case::new(two_devices());
    assert_not_allocated(case.allocate(json!([
        admin(request("req-0", "class-a", 1)),
        admin(all_of("req-1", "class-a")),
    ])));
}

fn numa(name: &str, value: i64) -> Value {
    attribute(name, json!({"numa": {"int": value}}))
}

#[test]
fn with_constraint_not_matching_int_attribute_all_devices() {
    // Upstream: "claim claim-0, request req-0: cannot add device driver-a/pool-1/device-2 because
    // a claim constraint would not be satisfied".
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![numa("device-1", 1), numa("device-2", 2)],
    )]);
    assert_error(
        case.allocate_with(
            json!([all_of("req-0", "class-a")]),
            json!([{"matchAttribute": "driver-a/numa"}]),
        ),
        "request req-0: cannot add device driver-a/pool-1/device-2 because constraint #0 would not be satisfied",
    );
}

#[test]
fn invalid_cel_all_devices() {
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![device("device-1")],
    )]);
    let mut request = all_of("req-0", "class-a");
    request["exactly"]["selectors"] = json!([{"cel": {"expression": "noSuchVar"}}]);
    assert_error(
        case.allocate(json!([request])),
        "undeclared reference to 'noSuchVar'",
    );
}

#[test]
fn tainted_all_devices_single() {
    let tainted = with(
        device("device-1"),
        json!({"taints": [{"key": "taint-key", "value": "taint-value", "effect": "NoSchedule"}]}),
    );
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![tainted],
    )]);
    assert_not_allocated(case.allocate(json!([all_of("req-0", "class-a")])));
}
