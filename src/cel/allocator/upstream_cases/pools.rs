//! Pools: invalid pools (an error only when nothing else fits), incomplete pools, and pools whose
//! slices span nodes or move between nodes across generations.

use serde_json::json;

use super::*;

fn on(node: &str, pool: &str, generation: i64, count: i64, devices: &[&str]) -> Value {
    let name = format!("slice-{node}-{generation}-{}", devices.join("-"));
    let devices = devices.iter().map(|d| device(d)).collect();
    pool_of(
        slice(&name, json!(node), pool, A, devices),
        generation,
        count,
    )
}

fn one_request() -> Value {
    json!([request("req-0", "class-a", 1)])
}

#[test]
fn duplicate_slice() {
    // Two copies of one slice under different names, as a slice controller with an out-dated
    // cache might write them.
    let case = Case::new(vec![
        pool_of(
            slice(
                "slice-1",
                json!("node-1"),
                "pool-1",
                A,
                vec![device("device-1")],
            ),
            1,
            2,
        ),
        pool_of(
            slice(
                "slice-1-2",
                json!("node-1"),
                "pool-1",
                A,
                vec![device("device-1")],
            ),
            1,
            2,
        ),
    ]);
    assert_error(
        case.allocate(one_request()),
        "invalid resource pools were encountered: pool driver-a/pool-1: duplicate device name device-1",
    );
}

fn duplicate_pool_and_pool_2() -> Vec<Value> {
    vec![
        on("node-1", "pool-1", 1, 2, &["device-1"]),
        pool_of(
            slice(
                "slice-2",
                json!("node-1"),
                "pool-1",
                A,
                vec![device("device-1")],
            ),
            1,
            2,
        ),
        on("node-1", "pool-2", 1, 1, &["device-2"]),
    ]
}

#[test]
fn invalid_pool_is_ok_if_devices_can_be_allocated_from_other() {
    assert_allocated(
        Case::new(duplicate_pool_and_pool_2()).allocate(one_request()),
        &["req-0 driver-a/pool-2/device-2"],
    );
}

#[test]
fn invalid_pool_is_error_if_no_other_device_can_be_allocated() {
    let case = Case::new(duplicate_pool_and_pool_2()).allocated(&[(A, "pool-2", "device-2")]);
    assert_error(
        case.allocate(one_request()),
        "invalid resource pools were encountered",
    );
}

#[test]
fn no_allocation_from_incomplete_pools() {
    let case = Case::new(vec![on("node-1", "pool-1", 1, 2, &["device-1"])]);
    assert_not_allocated(case.allocate(one_request()));
}

#[test]
fn different_resourceslices_in_pool_can_target_different_nodes() {
    let case = Case::new(vec![
        on("node-2", "pool-1", 1, 2, &["device-1"]),
        on("node-1", "pool-1", 1, 2, &["device-2"]),
    ]);
    assert_allocated(
        case.allocate(one_request()),
        &["req-0 driver-a/pool-1/device-2"],
    );
}

#[test]
fn allocation_mode_all_with_multi_host_resource_pool() {
    // Complete over both nodes; "all" is node-1's devices.
    let case = Case::new(vec![
        on("node-1", "pool-1", 1, 2, &["device-1"]),
        on("node-2", "pool-1", 1, 2, &["device-2"]),
    ]);
    assert_allocated(
        case.allocate(json!([all_of("req-0", "class-a")])),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn multi_host_resource_pool_with_stale_slice_for_current_node() {
    let case = Case::new(vec![
        on("node-1", "pool-1", 1, 2, &["device-1"]),
        on("node-2", "pool-1", 2, 2, &["device-2"]),
    ]);
    assert_not_allocated(case.allocate(one_request()));
}

#[test]
fn multi_host_resource_pool_complete_update_from_node_1_to_node_2() {
    // Node-1's own slices are complete at generation 1, so the scheduler allocates from them and does
    // not look for newer generations elsewhere (its test says it would rather not, but does).
    let case = Case::new(vec![
        on("node-1", "pool-1", 1, 2, &["device-1"]),
        on("node-1", "pool-1", 1, 2, &["device-2"]),
        on("node-2", "pool-1", 2, 2, &["device-1"]),
        on("node-2", "pool-1", 2, 2, &["device-2"]),
    ]);
    assert_allocated(
        case.allocate(one_request()),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn multi_host_resource_pool_complete_update_from_node_2_to_node_1() {
    let case = Case::new(vec![
        on("node-2", "pool-1", 1, 2, &["device-1"]),
        on("node-2", "pool-1", 1, 2, &["device-2"]),
        on("node-1", "pool-1", 2, 2, &["device-1"]),
        on("node-1", "pool-1", 2, 2, &["device-2"]),
    ]);
    assert_allocated(
        case.allocate(one_request()),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn multi_host_resource_pool_incomplete_update_from_node_1_to_node_2() {
    // As in the complete update above: node-1's own generation 1 is complete.
    let case = Case::new(vec![
        on("node-1", "pool-1", 1, 2, &["device-1"]),
        on("node-1", "pool-1", 1, 2, &["device-2"]),
        on("node-2", "pool-1", 2, 2, &["device-1"]),
    ]);
    assert_allocated(
        case.allocate(one_request()),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn multi_host_resource_pool_incomplete_update_from_node_2_to_node_1() {
    let case = Case::new(vec![
        on("node-2", "pool-1", 1, 2, &["device-1"]),
        on("node-2", "pool-1", 1, 2, &["device-2"]),
        on("node-1", "pool-1", 2, 2, &["device-1"]),
    ]);
    assert_not_allocated(case.allocate(one_request()));
}

#[test]
fn partitionable_devices_same_counter_set_name_in_different_resource_slices() {
    let set = [("counter-set-1", json!({}))];
    let case = Case::new(vec![
        pool_of(
            slice(
                "slice-1",
                json!("node-1"),
                "pool-1",
                A,
                vec![device("device-1")],
            ),
            1,
            4,
        ),
        pool_of(
            counter_slice("slice-2", json!("node-1"), "pool-1", A, &set),
            1,
            4,
        ),
        pool_of(
            slice(
                "slice-3",
                json!("node-1"),
                "pool-1",
                A,
                vec![device("device-2")],
            ),
            1,
            4,
        ),
        pool_of(
            counter_slice("slice-4", json!("node-1"), "pool-1", A, &set),
            1,
            4,
        ),
    ]);
    assert_error(
        case.allocate(one_request()),
        "invalid resource pools were encountered: pool driver-a/pool-1: duplicate counter set name counter-set-1",
    );
}

#[test]
fn partitionable_devices_device_counter_consumption_references_unknown_counter_set() {
    let consumer = consuming("device-1", &[("counter-set-2", json!({}))], false);
    let case = Case::new(vec![
        pool_of(
            slice("slice-1", json!("node-1"), "pool-1", A, vec![consumer]),
            1,
            2,
        ),
        pool_of(
            counter_slice(
                "slice-2",
                json!("node-1"),
                "pool-1",
                A,
                &[("counter-set-1", json!({}))],
            ),
            1,
            2,
        ),
    ]);
    assert_error(
        case.allocate(one_request()),
        "invalid resource pools were encountered: pool driver-a/pool-1: device device-1: counter set counter-set-2 not found",
    );
}

#[test]
fn partitionable_devices_device_counter_consumption_references_unknown_counter_in_counter_set() {
    let consumer = consuming(
        "device-1",
        &[("counter-set-1", json!({"memory": "8Gi"}))],
        false,
    );
    let set = [("counter-set-1", json!({"other-memory": "8Gi"}))];
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
    assert_error(
        case.allocate(one_request()),
        "device device-1: counter memory not found in counter set counter-set-1",
    );
}

#[test]
fn partitionable_devices_device_counter_consumption_references_counter_set_in_other_pool() {
    let consumer = consuming(
        "device-1",
        &[("counter-set-1", json!({"memory": "8Gi"}))],
        false,
    );
    let set = [("counter-set-1", json!({"memory": "8Gi"}))];
    let case = Case::new(vec![
        slice("slice-1", json!("node-1"), "pool-1", A, vec![consumer]),
        counter_slice("slice-2", json!("node-1"), "pool-2", A, &set),
    ]);
    assert_error(
        case.allocate(one_request()),
        "pool driver-a/pool-1: device device-1: counter set counter-set-1 not found",
    );
}

#[test]
fn partitionable_devices_validation_error_on_non_targeting_slice() {
    // The bad device is node-2's, and node-1's pool is invalid all the same.
    let set = [("counter-set-1", json!({"memory": "8Gi"}))];
    let good = consuming(
        "device-1",
        &[("counter-set-1", json!({"memory": "6Gi"}))],
        true,
    );
    let bad = consuming(
        "device-3",
        &[("counter-set-2", json!({"memory": "6Gi"}))],
        false,
    );
    let case = Case::new(vec![
        pool_of(
            counter_slice("slice-1", json!("node-1"), "pool-1", A, &set),
            1,
            3,
        ),
        pool_of(
            slice("slice-2", json!("node-1"), "pool-1", A, vec![good]),
            1,
            3,
        ),
        pool_of(
            slice("slice-3", json!("node-2"), "pool-1", A, vec![bad]),
            1,
            3,
        ),
    ]);
    assert_error(
        case.allocate(one_request()),
        "pool driver-a/pool-1: device device-3: counter set counter-set-2 not found",
    );
}

#[test]
fn partitionable_devices_devices_on_different_nodes_consume_same_counter_set() {
    // device-3 of node-2, held by another claim, leaves 2Gi of the shared 8Gi.
    let set = [("counter-set-1", json!({"memory": "8Gi"}))];
    let uses = |name: &str, memory: &str, capacity: bool| {
        consuming(
            name,
            &[("counter-set-1", json!({ "memory": memory }))],
            capacity,
        )
    };
    let case = Case::new(vec![
        pool_of(
            counter_slice("slice-1", json!("node-1"), "pool-1", A, &set),
            1,
            3,
        ),
        pool_of(
            slice(
                "slice-2",
                json!("node-1"),
                "pool-1",
                A,
                vec![uses("device-1", "6Gi", true), uses("device-2", "2Gi", true)],
            ),
            1,
            3,
        ),
        pool_of(
            slice(
                "slice-3",
                json!("node-2"),
                "pool-1",
                A,
                vec![uses("device-3", "6Gi", false)],
            ),
            1,
            3,
        ),
    ])
    .allocated(&[(A, "pool-1", "device-3")]);
    assert_allocated(
        case.allocate(json!([first_available(
            "req-0",
            vec![
                sub_where("subReq-0", "class-a", 1, &memory_at_least("6Gi")),
                sub_where("subReq-1", "class-a", 1, &memory_at_least("2Gi")),
            ]
        )])),
        &["req-0/subReq-1 driver-a/pool-1/device-2"],
    );
}
