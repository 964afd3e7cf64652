//! firstAvailable (prioritized lists): the first subrequest that leads to a full allocation wins;
//! one that asks for more than an allocation holds is passed over. With allocation mode All, see
//! `first_available_all`.

use serde_json::json;

use super::*;

fn one_each() -> Vec<Value> {
    vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![device("device-1")],
        ),
        slice(
            "slice-2",
            json!("node-1"),
            "pool-2",
            B,
            vec![device("device-1")],
        ),
    ]
}

#[test]
fn prioritized_list_first_unavailable() {
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![device("device-1")],
    )]);
    assert_allocated(
        case.allocate(json!([first_available(
            "req-0",
            vec![sub("subReq-0", "class-b", 1), sub("subReq-1", "class-a", 1)]
        )])),
        &["req-0/subReq-1 driver-a/pool-1/device-1"],
    );
}

#[test]
fn prioritized_list_non_available() {
    assert_not_allocated(Case::new(one_each()).allocate(json!([first_available(
        "req-0",
        vec![sub("subReq-0", "class-b", 2), sub("subReq-1", "class-a", 2)]
    )])));
}

#[test]
fn prioritized_list_too_many_in_first_subrequest() {
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![device("device-1")],
    )]);
    assert_allocated(
        case.allocate(json!([first_available(
            "req-0",
            vec![
                sub("subReq-0", "class-b", 500),
                sub("subReq-1", "class-a", 1)
            ]
        )])),
        &["req-0/subReq-1 driver-a/pool-1/device-1"],
    );
}

#[test]
fn prioritized_list_subrequests_with_expressions() {
    let devices = vec![
        memory("device-1", "2Gi"),
        memory("device-2", "2Gi"),
        memory("device-3", "1Gi"),
    ];
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        devices,
    )]);
    assert_allocated(
        case.allocate(json!([
            request_where("req-0", "class-a", 1, &memory_at_least("1Gi")),
            first_available(
                "req-1",
                vec![
                    sub_where("subReq-0", "class-a", 1, &memory_at_least("4Gi")),
                    sub_where("subReq-1", "class-a", 2, &memory_at_least("2Gi")),
                ]
            ),
        ])),
        &[
            "req-0 driver-a/pool-1/device-3",
            "req-1/subReq-1 driver-a/pool-1/device-1",
            "req-1/subReq-1 driver-a/pool-1/device-2",
        ],
    );
}

fn versioned(name: &str, memory: &str, version: &str) -> Value {
    with(
        device(name),
        json!({"capacity": {"memory": {"value": memory}},
               "attributes": {"driverVersion": {"version": version}}}),
    )
}

fn constrained_requests() -> Value {
    json!([
        request_where("req-0", "class-a", 1, &memory_at_least("8Gi")),
        first_available(
            "req-1",
            vec![
                sub_where("subReq-0", "class-a", 1, &memory_at_least("2Gi")),
                sub_where("subReq-1", "class-a", 1, &memory_at_least("1Gi")),
            ]
        ),
    ])
}

#[test]
fn prioritized_list_subrequests_with_constraints_ref_parent_request() {
    let case = Case::new(vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![versioned("device-1", "8Gi", "1.0.0")],
        ),
        slice(
            "slice-2",
            json!("node-1"),
            "pool-2",
            A,
            vec![
                versioned("device-2", "2Gi", "2.0.0"),
                versioned("device-3", "1Gi", "1.0.0"),
            ],
        ),
    ]);
    assert_allocated(
        case.allocate_with(
            constrained_requests(),
            json!([{"requests": ["req-0", "req-1"], "matchAttribute": "driver-a/driverVersion"}]),
        ),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1/subReq-1 driver-a/pool-2/device-3",
        ],
    );
}

#[test]
fn prioritized_list_subrequests_with_constraints_ref_sub_request() {
    // The constraint names subReq-0 only, so subReq-1 may take another version.
    let case = Case::new(vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![versioned("device-1", "8Gi", "1.0.0")],
        ),
        slice(
            "slice-2",
            json!("node-1"),
            "pool-2",
            A,
            vec![versioned("device-2", "2Gi", "2.0.0")],
        ),
    ]);
    assert_allocated(
        case.allocate_with(
            constrained_requests(),
            json!([{"requests": ["req-0", "req-1/subReq-0"], "matchAttribute": "driver-a/driverVersion"}]),
        ),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1/subReq-1 driver-a/pool-2/device-2",
        ],
    );
}

fn eight_and_four() -> Vec<Value> {
    vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![memory("device-1", "8Gi")],
        ),
        slice(
            "slice-2",
            json!("node-1"),
            "pool-2",
            A,
            vec![memory("device-2", "4Gi")],
        ),
    ]
}

fn eight_or_four(name: &str) -> Value {
    first_available(
        name,
        vec![
            sub_where("subReq-0", "class-a", 1, &memory_at_least("8Gi")),
            sub_where("subReq-1", "class-a", 1, &memory_at_least("4Gi")),
        ],
    )
}

#[test]
fn prioritized_list_multi_request() {
    assert_allocated(
        Case::new(eight_and_four()).allocate(json!([
            request_where("req-1", "class-a", 1, &memory_at_least("8Gi")),
            eight_or_four("req-0"),
        ])),
        &[
            "req-0/subReq-1 driver-a/pool-2/device-2",
            "req-1 driver-a/pool-1/device-1",
        ],
    );
}

#[test]
fn prioritized_list_with_backtracking() {
    assert_allocated(
        Case::new(eight_and_four()).allocate(json!([
            eight_or_four("req-0"),
            request_where("req-1", "class-a", 1, &memory_at_least("8Gi")),
        ])),
        &[
            "req-0/subReq-1 driver-a/pool-2/device-2",
            "req-1 driver-a/pool-1/device-1",
        ],
    );
}

fn numbered(driver: &str, pool: &str, count: usize) -> Value {
    let devices = (0..count).map(|i| device(&format!("device-{i}"))).collect();
    slice("slice-1", json!("node-1"), pool, driver, devices)
}

#[test]
fn prioritized_list_max_allocation_limit_request() {
    // Upstream's incubating allocator takes 75 steps, its stable one "falls over with excessive
    // runtime".
    let case = Case::new(vec![numbered(A, "pool-1", 64)]);
    let requests = json!([
        first_available(
            "req-0",
            vec![
                sub("subReq-0", "class-a", 32),
                sub("subReq-1", "class-a", 16)
            ]
        ),
        first_available(
            "req-1",
            vec![
                sub("subReq-0", "class-a", 32),
                sub("subReq-1", "class-a", 16)
            ]
        ),
    ]);
    let expected: Vec<String> = (0..32)
        .map(|i| {
            let request = if i < 16 { "req-0" } else { "req-1" };
            format!("{request}/subReq-1 driver-a/pool-1/device-{i}")
        })
        .collect();
    let expected: Vec<&str> = expected.iter().map(String::as_str).collect();
    assert_allocated(case.allocate(requests.clone()), &expected);
    let steps = case.steps(requests, json!([]));
    assert!(steps <= 75, "{steps} steps");
}

#[test]
fn prioritized_list_max_allocation_allocation_mode_all() {
    // Upstream's incubating allocator takes 42 steps.
    let case = Case::new(vec![numbered(A, "pool-1", 31), numbered(B, "pool-2", 2)]);
    let requests = json!([
        first_available(
            "req-0",
            vec![
                sub_all("subReq-0", "class-a", None),
                sub("subReq-1", "class-a", 2)
            ]
        ),
        request("req-1", "class-b", 2),
    ]);
    assert_allocated(
        case.allocate(requests.clone()),
        &[
            "req-0/subReq-1 driver-a/pool-1/device-0",
            "req-0/subReq-1 driver-a/pool-1/device-1",
            "req-1 driver-b/pool-2/device-0",
            "req-1 driver-b/pool-2/device-1",
        ],
    );
    let steps = case.steps(requests, json!([]));
    assert!(steps <= 42, "{steps} steps");
}

#[test]
fn check_combinations_with_prioritized_list() {
    // Upstream: 26 steps incubating, 32 stable.
    let typed = |name: &str, value: &str| attribute(name, json!({"type": {"string": value}}));
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![
            typed("device-1", "X"),
            typed("device-2", "Y"),
            typed("device-3", "Y"),
        ],
    )]);
    let requests = json!([
        first_available(
            "req-1",
            vec![
                sub_where(
                    "subReq-0",
                    "class-a",
                    3,
                    r#"device.attributes["driver-a"].type == "Y""#
                ),
                sub("subReq-1", "class-a", 2),
            ]
        ),
        first_available(
            "req-2",
            vec![
                sub("subReq-0", "class-a", 2),
                sub_where(
                    "subReq-1",
                    "class-a",
                    1,
                    r#"device.attributes["driver-a"].type == "X""#
                ),
            ]
        ),
    ]);
    assert_allocated(
        case.allocate(requests.clone()),
        &[
            "req-1/subReq-1 driver-a/pool-1/device-2",
            "req-1/subReq-1 driver-a/pool-1/device-3",
            "req-2/subReq-1 driver-a/pool-1/device-1",
        ],
    );
    let steps = case.steps(requests, json!([]));
    assert!(steps <= 26, "{steps} steps");
}
