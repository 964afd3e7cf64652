//! matchAttribute and distinctAttribute constraints, and the search over combinations.

use serde_json::json;

use super::*;

fn attributed(devices: Vec<Value>) -> Case {
    Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        devices,
    )])
}

fn same_attributes(name: &str) -> Value {
    attribute(
        name,
        json!({
            "driverVersion": {"version": "1.0.0"},
            "numa": {"int": 1},
            "stringAttribute": {"string": "stringAttributeValue"},
            "boolAttribute": {"bool": true},
        }),
    )
}

#[test]
fn with_constraint() {
    let case = attributed(vec![
        same_attributes("device-1"),
        same_attributes("device-2"),
    ]);
    assert_allocated(
        case.allocate_with(
            json!([
                request("req-0", "class-a", 1),
                request("req-1", "class-a", 1)
            ]),
            json!([
                {"matchAttribute": "driver-a/numa"},
                {"matchAttribute": "driver-a/driverVersion"},
                {"matchAttribute": "driver-a/stringAttribute"},
                {"matchAttribute": "driver-a/boolAttribute"},
            ]),
        ),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1 driver-a/pool-1/device-2",
        ],
    );
}

#[test]
fn with_constraint_non_existent_attribute() {
    let case = attributed(vec![device("device-1")]);
    assert_not_allocated(case.allocate_with(
        json!([request("req-0", "class-a", 1)]),
        json!([{"matchAttribute": "driver-a/NonExistentAttribute"}]),
    ));
}

/// Two devices that differ in `name`: `req-0` for two of them cannot be allocated (an error only in
/// allocation mode All).
fn not_matching(name: &str, first: Value, second: Value) {
    let case = attributed(vec![
        attribute("device-1", json!({ name: first })),
        attribute("device-2", json!({ name: second })),
    ]);
    assert_not_allocated(case.allocate_with(
        json!([request("req-0", "class-a", 2)]),
        json!([{ "matchAttribute": format!("driver-a/{name}") }]),
    ));
}

#[test]
fn with_constraint_not_matching_int_attribute() {
    not_matching("numa", json!({"int": 1}), json!({"int": 2}));
}

#[test]
fn with_constraint_not_matching_string_attribute() {
    not_matching(
        "stringAttribute",
        json!({"string": "stringAttributeValue"}),
        json!({"string": "stringAttributeValue2"}),
    );
}

#[test]
fn with_constraint_not_matching_bool_attribute() {
    not_matching(
        "boolAttribute",
        json!({"bool": true}),
        json!({"bool": false}),
    );
}

#[test]
fn with_constraint_not_matching_version_attribute() {
    not_matching(
        "driverVersion",
        json!({"version": "1.0.0"}),
        json!({"version": "2.0.0"}),
    );
}

fn version_and_string(name: &str, version: &str, string: &str) -> Value {
    attribute(
        name,
        json!({"driverVersion": {"version": version}, "stringAttribute": {"string": string}}),
    )
}

#[test]
fn with_constraint_for_request() {
    let case = attributed(vec![
        attribute("device-1", json!({"driverVersion": {"version": "1.0.0"}})),
        attribute("device-2", json!({"driverVersion": {"version": "2.0.0"}})),
    ]);
    assert_allocated(
        case.allocate_with(
            json!([
                request("req-0", "class-a", 1),
                request("req-1", "class-a", 1)
            ]),
            json!([{"requests": ["req-0"], "matchAttribute": "driver-a/driverVersion"}]),
        ),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1 driver-a/pool-1/device-2",
        ],
    );
}

#[test]
fn with_constraint_for_request_retry() {
    let case = attributed(vec![
        version_and_string("device-1", "1.0.0", "a"),
        version_and_string("device-2", "2.0.0", "b"),
        version_and_string("device-3", "3.0.0", "b"),
    ]);
    assert_allocated(
        case.allocate_with(
            json!([
                request("req-0", "class-a", 1),
                request("req-1", "class-a", 1)
            ]),
            json!([
                {"requests": ["req-0"], "matchAttribute": "driver-a/driverVersion"},
                {"matchAttribute": "driver-a/stringAttribute"},
            ]),
        ),
        &[
            "req-0 driver-a/pool-1/device-2",
            "req-1 driver-a/pool-1/device-3",
        ],
    );
}

#[test]
fn with_distinct_constraints() {
    // Upstream gives each request a share of one of four devices that allow multiple allocations;
    // the distinct attributes spread them over all four.
    let shared = |name: &str, b: bool, version: &str, int: i64| {
        with(
            attribute(
                name,
                json!({"boolAttribute": {"bool": b}, "driverVersion": {"version": version},
                       "numa": {"int": int}}),
            ),
            json!({"allowMultipleAllocations": true}),
        )
    };
    let case = attributed(vec![
        shared("device-1", true, "1.0.0", 0),
        shared("device-2", false, "1.0.1", 1),
        shared("device-3", true, "1.0.2", 2),
        shared("device-4", true, "1.0.0", 3),
    ]);
    assert_allocated(
        case.allocate_with(
            json!([
                request("req-0", "class-a", 1),
                request("req-1", "class-a", 1),
                request("req-2", "class-a", 1),
                request("req-3", "class-a", 1),
            ]),
            json!([
                {"requests": ["req-0", "req-1"], "distinctAttribute": "driver-a/boolAttribute"},
                {"requests": ["req-0", "req-1", "req-2"], "distinctAttribute": "driver-a/driverVersion"},
                {"requests": ["req-0", "req-1", "req-2", "req-3"], "distinctAttribute": "driver-a/numa"},
            ]),
        ),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1 driver-a/pool-1/device-2",
            "req-2 driver-a/pool-1/device-3",
            "req-3 driver-a/pool-1/device-4",
        ],
    );
}

fn typed(name: &str, value: &str) -> Value {
    attribute(name, json!({"type": {"string": value}}))
}

#[test]
fn check_combinations_with_backtracking() {
    // req-1 first takes device-1, which req-2 needs; {device-2, device-1} is not tried again.
    // Upstream: 12 steps incubating, 14 stable.
    let case = attributed(vec![
        typed("device-1", "X"),
        typed("device-2", "Y"),
        typed("device-3", "Y"),
    ]);
    let requests = json!([
        request("req-1", "class-a", 2),
        request_where(
            "req-2",
            "class-a",
            1,
            r#"device.attributes["driver-a"].type == "X""#
        ),
    ]);
    assert_allocated(
        case.allocate(requests.clone()),
        &[
            "req-1 driver-a/pool-1/device-2",
            "req-1 driver-a/pool-1/device-3",
            "req-2 driver-a/pool-1/device-1",
        ],
    );
    let steps = case.steps(requests, json!([]));
    assert!(steps <= 12, "{steps} steps");
}

/// Five devices wanted of four, laid out as `slices`: upstream's incubating allocator tries every
/// combination in 16 steps, its stable one every ordering in 65.
fn five_of_four(slices: Vec<Value>) {
    let case = Case::new(slices);
    let requests = json!([request("req-0", "class-a", 5)]);
    assert_not_allocated(case.allocate(requests.clone()));
    let steps = case.steps(requests, json!([]));
    assert!(steps <= 16, "{steps} steps");
}

fn devices(names: &[&str]) -> Vec<Value> {
    names.iter().map(|n| device(n)).collect()
}

#[test]
fn check_combinations_within_single_request_single_pool_single_slice() {
    five_of_four(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        devices(&["device-1", "device-2", "device-3", "device-4"]),
    )]);
}

#[test]
fn check_combinations_within_single_request_single_pool_multiple_slices() {
    five_of_four(vec![
        pool_of(
            slice(
                "slice-1",
                json!("node-1"),
                "pool-1",
                A,
                devices(&["device-1", "device-2"]),
            ),
            1,
            2,
        ),
        pool_of(
            slice(
                "slice-2",
                json!("node-1"),
                "pool-1",
                A,
                devices(&["device-3", "device-4"]),
            ),
            1,
            2,
        ),
    ]);
}

#[test]
fn check_combinations_within_single_request_multiple_pools_multiple_slices() {
    five_of_four(vec![
        pool_of(
            slice(
                "slice-1",
                json!("node-1"),
                "pool-1",
                A,
                devices(&["device-1"]),
            ),
            1,
            2,
        ),
        pool_of(
            slice(
                "slice-2",
                json!("node-1"),
                "pool-1",
                A,
                devices(&["device-2"]),
            ),
            1,
            2,
        ),
        slice(
            "slice-3",
            json!("node-1"),
            "pool-2",
            A,
            devices(&["device-3", "device-4"]),
        ),
    ]);
}

#[test]
fn check_combinations_within_single_request_many_pools() {
    five_of_four(vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            devices(&["device-1"]),
        ),
        slice(
            "slice-2",
            json!("node-1"),
            "pool-2",
            A,
            devices(&["device-2"]),
        ),
        slice(
            "slice-3",
            json!("node-1"),
            "pool-3",
            A,
            devices(&["device-3"]),
        ),
        slice(
            "slice-4",
            json!("node-1"),
            "pool-4",
            A,
            devices(&["device-4"]),
        ),
    ]);
}
