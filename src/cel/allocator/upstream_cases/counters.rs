//! Partitionable devices: shared counters, also across slices, pools and nodes, and per-device node
//! selection.

use serde_json::json;

use super::*;

/// A device whose capacity is what it consumes of `counter-set-1`.
fn part(name: &str, counters: Value) -> Value {
    consuming(name, &[("counter-set-1", counters)], true)
}

/// Pool `pool` of `driver` on node-1: a slice of `devices` and a slice of `sets`.
fn partitioned(
    pool: &str,
    driver: &str,
    devices: Vec<Value>,
    sets: &[(&str, Value)],
) -> Vec<Value> {
    let (first, second) = if pool == "pool-1" {
        ("slice-1", "slice-2")
    } else {
        ("slice-3", "slice-4")
    };
    vec![
        pool_of(slice(first, json!("node-1"), pool, driver, devices), 1, 2),
        pool_of(
            counter_slice(second, json!("node-1"), pool, driver, sets),
            1,
            2,
        ),
    ]
}

fn memory_parts() -> Vec<Value> {
    partitioned(
        "pool-1",
        A,
        vec![
            part("device-1", json!({"memory": "4Gi"})),
            part("device-2", json!({"memory": "6Gi"})),
            part("device-3", json!({"memory": "4Gi"})),
        ],
        &[("counter-set-1", json!({"memory": "8Gi"}))],
    )
}

#[test]
fn partitionable_devices_single_device() {
    let case = Case::new(partitioned(
        "pool-1",
        A,
        vec![consuming(
            "device-1",
            &[("counter-set-1", json!({"memory": "4Gi"}))],
            false,
        )],
        &[("counter-set-1", json!({"memory": "8Gi"}))],
    ));
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 1)])),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

fn six_or_four() -> Value {
    first_available(
        "req-1",
        vec![
            sub_where("subReq-0", "class-a", 1, &memory_at_least("6Gi")),
            sub_where("subReq-1", "class-a", 1, &memory_at_least("4Gi")),
        ],
    )
}

#[test]
fn partitionable_devices_prioritized_list() {
    assert_allocated(
        Case::new(memory_parts()).allocate(json!([request("req-0", "class-a", 1), six_or_four()])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1/subReq-1 driver-a/pool-1/device-3",
        ],
    );
}

#[test]
fn partitionable_devices_multiple_devices() {
    // 4Gi + 6Gi is more than the 8Gi the set holds.
    assert_allocated(
        Case::new(memory_parts()).allocate(json!([
            request("req-0", "class-a", 1),
            request("req-1", "class-a", 1)
        ])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1 driver-a/pool-1/device-3",
        ],
    );
}

#[test]
fn partitionable_devices_multiple_capacity_pools() {
    // Memory would allow device-2, the cpus counter set does not.
    let two_sets = |name: &str, memory: &str, cpus: &str| {
        consuming(
            name,
            &[
                ("counter-set-1", json!({ "memory": memory })),
                ("counter-set-2", json!({ "cpus": cpus })),
            ],
            true,
        )
    };
    let case = Case::new(partitioned(
        "pool-1",
        A,
        vec![
            two_sets("device-1", "4Gi", "4"),
            two_sets("device-2", "6Gi", "6"),
            two_sets("device-3", "4Gi", "4"),
        ],
        &[
            ("counter-set-1", json!({"memory": "18Gi"})),
            ("counter-set-2", json!({"cpus": "8"})),
        ],
    ));
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 1), six_or_four()])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1/subReq-1 driver-a/pool-1/device-3",
        ],
    );
}

#[test]
fn partitionable_devices_multiple_counters() {
    let two_sets = |name: &str, first: Value, second: Value| {
        consuming(
            name,
            &[("counter-set-1", first), ("counter-set-2", second)],
            true,
        )
    };
    let case = Case::new(partitioned(
        "pool-1",
        A,
        vec![
            two_sets(
                "device-1",
                json!({"memory": "4Gi", "cpus": "6"}),
                json!({"cpus": "4", "memory": "2Gi"}),
            ),
            two_sets(
                "device-2",
                json!({"memory": "6Gi", "cpus": "4"}),
                json!({"cpus": "6", "memory": "6Gi"}),
            ),
            two_sets(
                "device-3",
                json!({"memory": "4Gi", "cpus": "4"}),
                json!({"cpus": "4", "memory": "4Gi"}),
            ),
        ],
        &[
            ("counter-set-1", json!({"cpus": "8", "memory": "18Gi"})),
            ("counter-set-2", json!({"cpus": "12", "memory": "18Gi"})),
        ],
    ));
    assert_allocated(
        case.allocate(json!([
            request("req-0", "class-a", 1),
            request("req-1", "class-a", 1)
        ])),
        &[
            "req-0 driver-a/pool-1/device-2",
            "req-1 driver-a/pool-1/device-3",
        ],
    );
}

#[test]
fn partitionable_devices_multiple_pools() {
    // Devices other claims hold count against their pool's counters.
    let set = [("counter-set-1", json!({"cpus": "8", "memory": "18Gi"}))];
    let mut slices = partitioned(
        "pool-1",
        A,
        vec![
            part("device-1", json!({"cpus": "6", "memory": "4Gi"})),
            part("device-2", json!({"cpus": "4", "memory": "6Gi"})),
            part("device-3", json!({"cpus": "4", "memory": "4Gi"})),
        ],
        &set,
    );
    slices.extend(partitioned(
        "pool-2",
        A,
        vec![
            part("device-1", json!({"cpus": "6", "memory": "4Gi"})),
            part("device-2", json!({"cpus": "1", "memory": "7Gi"})),
            part("device-3", json!({"cpus": "1", "memory": "7Gi"})),
        ],
        &set,
    ));
    let case = Case::new(slices).allocated(&[
        (A, "pool-1", "device-2"),
        (A, "pool-1", "device-3"),
        (A, "pool-2", "device-1"),
    ]);
    assert_allocated(
        case.allocate(json!([
            request("req-0", "class-a", 1),
            request("req-1", "class-a", 1)
        ])),
        &[
            "req-0 driver-a/pool-2/device-2",
            "req-1 driver-a/pool-2/device-3",
        ],
    );
}

#[test]
fn partitionable_devices_unused_counters_in_counter_set() {
    let uses = |name: &str, memory: &str| {
        consuming(
            name,
            &[("counter-set-1", json!({ "memory": memory }))],
            false,
        )
    };
    let case = Case::new(partitioned(
        "pool-1",
        A,
        vec![
            uses("device-1", "5Gi"),
            uses("device-2", "4Gi"),
            uses("device-3", "4Gi"),
        ],
        &[("counter-set-1", json!({"memory": "8Gi", "unused": "1Gi"}))],
    ));
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 2)])),
        &[
            "req-0 driver-a/pool-1/device-2",
            "req-0 driver-a/pool-1/device-3",
        ],
    );
}

/// device-2, held by another claim, consumes `held` of the 18Gi.
fn held_by_another(held: &str) -> Case {
    Case::new(partitioned(
        "pool-1",
        A,
        vec![
            part("device-1", json!({"memory": "4Gi"})),
            part("device-2", json!({ "memory": held })),
        ],
        &[("counter-set-1", json!({"memory": "18Gi"}))],
    ))
    .allocated(&[(A, "pool-1", "device-2")])
}

#[test]
fn partitionable_devices_no_capacity_available() {
    assert_not_allocated(held_by_another("16Gi").allocate(json!([request("req-0", "class-a", 1)])));
}

#[test]
fn partitionable_devices_overallocated_capacity_pool() {
    // 20Gi of 18Gi: nothing is left, not a negative amount that would wrap around.
    assert_not_allocated(held_by_another("20Gi").allocate(json!([request("req-0", "class-a", 1)])));
}

fn per_device(devices: Vec<Value>) -> Vec<Value> {
    vec![
        pool_of(
            slice("slice-1", json!("per-device"), "pool-1", A, devices),
            1,
            2,
        ),
        pool_of(
            counter_slice(
                "slice-2",
                json!("per-device"),
                "pool-1",
                A,
                &[("counter-set-1", json!({"memory": "18Gi"}))],
            ),
            1,
            2,
        ),
    ]
}

#[test]
fn partitionable_devices_per_device_node_selection_nodename() {
    let case = Case::new(per_device(vec![
        with(
            part("device-1", json!({"memory": "4Gi"})),
            json!({"nodeName": "node-1"}),
        ),
        with(
            part("device-2", json!({"memory": "6Gi"})),
            json!({"nodeName": "node-2"}),
        ),
    ]));
    assert_allocated(
        case.allocate(json!([first_available(
            "req-0",
            vec![
                sub_where("subReq-0", "class-a", 1, &memory_at_least("6Gi")),
                sub_where("subReq-1", "class-a", 1, &memory_at_least("4Gi")),
            ]
        )])),
        &["req-0/subReq-1 driver-a/pool-1/device-1"],
    );
}

fn region_1() -> Value {
    json!({"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "region", "operator": "In", "values": ["region-1"]}]}]})
}

#[test]
fn partitionable_devices_per_device_node_selection_node_selector() {
    let case = Case::new(per_device(vec![with(
        part("device-1", json!({"memory": "4Gi"})),
        json!({ "nodeSelector": region_1() }),
    )]));
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 1)])),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn partitionable_devices_per_device_node_selection_node_selector_multiple_devices() {
    let mut slices = per_device(vec![
        with(
            part("device-1", json!({"memory": "4Gi"})),
            json!({ "nodeSelector": region_1() }),
        ),
        with(
            part("device-2", json!({"memory": "4Gi"})),
            json!({"nodeName": "node-1"}),
        ),
        with(
            part("device-3", json!({"memory": "4Gi"})),
            json!({"allNodes": true}),
        ),
    ]);
    let b = |name: &str| consuming(name, &[("counter-set-2", json!({"memory": "4Gi"}))], true);
    slices.extend(partitioned(
        "pool-2",
        B,
        vec![b("device-1"), b("device-2"), b("device-3")],
        &[("counter-set-2", json!({"memory": "12Gi"}))],
    ));
    assert_allocated(
        Case::new(slices).allocate(json!([
            request("req-0", "class-a", 3),
            request("req-1", "class-b", 3)
        ])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-0 driver-a/pool-1/device-2",
            "req-0 driver-a/pool-1/device-3",
            "req-1 driver-b/pool-2/device-1",
            "req-1 driver-b/pool-2/device-2",
            "req-1 driver-b/pool-2/device-3",
        ],
    );
}

#[test]
fn partitionable_devices_with_attribute_selector() {
    let special = |name: &str, cpu: &str, special: bool| {
        with(
            consuming(
                name,
                &[
                    ("counter-set-1", json!({ cpu: "1" })),
                    ("counter-set-2", json!({"mem": "10Gi"})),
                ],
                false,
            ),
            json!({"attributes": {"special": {"bool": special}}}),
        )
    };
    let case = Case::new(partitioned(
        "pool-1",
        A,
        vec![
            special("device-1", "cpu1", true),
            special("device-2", "cpu2", false),
            special("device-3", "cpu3", false),
        ],
        &[
            (
                "counter-set-1",
                json!({"cpu1": "1", "cpu2": "1", "cpu3": "1"}),
            ),
            ("counter-set-2", json!({"mem": "30Gi"})),
        ],
    ));
    assert_allocated(
        case.allocate(json!([
            request("req-0", "class-a", 2),
            request_where(
                "req-1",
                "class-a",
                1,
                r#"device.attributes["driver-a"].special"#
            ),
        ])),
        &[
            "req-0 driver-a/pool-1/device-2",
            "req-0 driver-a/pool-1/device-3",
            "req-1 driver-a/pool-1/device-1",
        ],
    );
}
