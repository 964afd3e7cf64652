//! firstAvailable (prioritized lists) with allocation mode All in a subrequest: "all" of no device
//! does not count, a device in use rules the "all" subrequest out, and "all" counts only this node's
//! matching devices (not other nodes' pools, not what the class rules out).

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
fn prioritized_list_subrequests_with_allocation_mode_all() {
    let case = Case::new(two_devices()).allocated(&[(A, "pool-1", "device-1")]);
    assert_allocated(
        case.allocate(json!([first_available(
            "req-0",
            vec![
                sub_all("subReq-0", "class-a", None),
                sub("subReq-1", "class-a", 1)
            ]
        )])),
        &["req-0/subReq-1 driver-a/pool-1/device-2"],
    );
}

#[test]
fn prioritized_list_allocation_mode_all() {
    let case = Case::new(two_devices()).allocated(&[(A, "pool-1", "device-2")]);
    assert_allocated(
        case.allocate(json!([first_available(
            "req-0",
            vec![
                sub_all("subReq-0", "class-a", None),
                sub("subReq-1", "class-a", 1)
            ]
        )])),
        &["req-0/subReq-1 driver-a/pool-1/device-1"],
    );
}

#[test]
fn prioritized_list_allocation_mode_all_multiple_requests() {
    assert_allocated(
        Case::new(two_devices()).allocate(json!([
            request("req-0", "class-a", 1),
            first_available(
                "req-1",
                vec![
                    sub_all("subReq-0", "class-a", None),
                    sub("subReq-1", "class-a", 1)
                ]
            ),
        ])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1/subReq-1 driver-a/pool-1/device-2",
        ],
    );
}

fn all_a_or_one_b() -> Value {
    json!([first_available(
        "req-0",
        vec![
            sub_all("subReq-0", "class-a", None),
            sub("subReq-1", "class-b", 1)
        ]
    )])
}

#[test]
fn all_devices_slice_without_devices_prioritized_list() {
    let case = Case::new(vec![
        slice("slice-1", json!("node-1"), "pool-1", A, vec![]),
        slice(
            "slice-2",
            json!("node-1"),
            "pool-2",
            B,
            vec![device("device-1")],
        ),
    ]);
    assert_allocated(
        case.allocate(all_a_or_one_b()),
        &["req-0/subReq-1 driver-b/pool-2/device-1"],
    );
}

#[test]
fn all_devices_no_slices_prioritized_list() {
    let case = Case::new(vec![slice(
        "slice-2",
        json!("node-1"),
        "pool-2",
        B,
        vec![device("device-1")],
    )]);
    assert_allocated(
        case.allocate(all_a_or_one_b()),
        &["req-0/subReq-1 driver-b/pool-2/device-1"],
    );
}

#[test]
fn all_devices_some_allocated_prioritized_list() {
    let mut slices = two_devices();
    slices.push(slice(
        "slice-2",
        json!("node-1"),
        "pool-2",
        B,
        vec![device("device-1")],
    ));
    let case = Case::new(slices).allocated(&[(A, "pool-1", "device-1")]);
    assert_allocated(
        case.allocate(all_a_or_one_b()),
        &["req-0/subReq-1 driver-b/pool-2/device-1"],
    );
}

fn generation(name: &str, value: &str) -> Value {
    attribute(name, json!({"generation": {"string": value}}))
}

fn all_v6_or_all_v5() -> Value {
    json!([first_available(
        "req-0",
        vec![
            sub_all(
                "subReq-0",
                "class-a",
                Some(r#"device.attributes["driver-a"].generation == "v6""#)
            ),
            sub_all(
                "subReq-1",
                "class-a",
                Some(r#"device.attributes["driver-a"].generation == "v5""#)
            ),
        ]
    )])
}

#[test]
fn prioritized_list_allocation_mode_all_with_selectors() {
    // "All" of no device does not count: subReq-0 matches nothing, subReq-1 gets device-1.
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![generation("device-1", "v5")],
    )]);
    assert_allocated(
        case.allocate(all_v6_or_all_v5()),
        &["req-0/subReq-1 driver-a/pool-1/device-1"],
    );
}

#[test]
fn prioritized_list_allocation_mode_all_with_selectors_multiple_pools() {
    let case = Case::new(vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![generation("device-1", "v5")],
        ),
        slice(
            "slice-2",
            json!("node-1"),
            "pool-2",
            A,
            vec![generation("device-1", "v5")],
        ),
    ]);
    assert_allocated(
        case.allocate(all_v6_or_all_v5()),
        &[
            "req-0/subReq-1 driver-a/pool-1/device-1",
            "req-0/subReq-1 driver-a/pool-2/device-1",
        ],
    );
}

#[test]
fn prioritized_list_allocation_mode_all_with_selectors_multiple_pools_across_nodes() {
    let case = Case::new(vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![generation("device-1", "v5")],
        ),
        slice(
            "slice-2",
            json!("node-2"),
            "pool-2",
            A,
            vec![generation("device-1", "v5"), generation("device-2", "v6")],
        ),
    ]);
    assert_allocated(
        case.allocate(all_v6_or_all_v5()),
        &["req-0/subReq-1 driver-a/pool-1/device-1"],
    );
}

#[test]
fn prioritized_list_allocation_mode_all_with_selectors_deviceclass_subset() {
    let selected = |name: &str, value: &str, selected: bool| {
        attribute(
            name,
            json!({"generation": {"string": value}, "selected": {"bool": selected}}),
        )
    };
    let mut case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        vec![
            selected("device-1", "v6", false),
            selected("device-2", "v5", false),
            selected("device-3", "v5", true),
        ],
    )]);
    case.classes.insert(
        "class-a".into(),
        vec![r#"device.driver == "driver-a" && device.attributes["driver-a"].selected"#.into()],
    );
    assert_allocated(
        case.allocate(all_v6_or_all_v5()),
        &["req-0/subReq-1 driver-a/pool-1/device-3"],
    );
}
