//! Basics: one device, other nodes, backtracking, several slices and pools, classes, selectors,
//! limits, node selection and admin access (upstream's cases of the same names).

use serde_json::json;

use super::*;

fn one(slice_name: &str, on: Value, pool: &str, driver: &str) -> Value {
    slice(slice_name, on, pool, driver, vec![device("device-1")])
}

#[test]
fn simple() {
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 1)])),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn other_node() {
    let case = Case::new(vec![
        one("slice-1", json!("node-1"), "pool-1", B),
        one("slice-2", json!("node-2"), "pool-2", A),
    ])
    .on(node("node-2", "region-2"));
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 1)])),
        &["req-0 driver-a/pool-2/device-1"],
    );
}

fn small_and_large_requests() -> Value {
    json!([
        request_where("req-0", "class-a", 1, &memory_at_least("1Gi")),
        request_where("req-1", "class-a", 1, &memory_at_least("2Gi")),
    ])
}

#[test]
fn small_and_large() {
    let devices = vec![memory("device-1", "1Gi"), memory("device-2", "2Gi")];
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        devices,
    )]);
    assert_allocated(
        case.allocate(small_and_large_requests()),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1 driver-a/pool-1/device-2",
        ],
    );
}

#[test]
fn small_and_large_backtrack_requests() {
    // The large device comes first, so the small request takes it and must give it back.
    let devices = vec![memory("device-2", "2Gi"), memory("device-1", "1Gi")];
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        devices,
    )]);
    assert_allocated(
        case.allocate(small_and_large_requests()),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-1 driver-a/pool-1/device-2",
        ],
    );
}

#[test]
fn devices_split_across_different_slices() {
    let case = Case::new(vec![
        one("slice-1", json!("node-1"), "pool-1", A),
        one("slice-2", json!("node-1"), "pool-2", A),
    ]);
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 2)])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-0 driver-a/pool-2/device-1",
        ],
    );
}

#[test]
fn obsolete_slice() {
    // Generation 2 replaces generation 1 but has only one of its two slices: nothing to allocate.
    let case = Case::new(vec![
        pool_of(
            slice(
                "slice-1-obsolete",
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
                "slice-1-obsolete",
                json!("node-1"),
                "pool-1",
                A,
                vec![device("device-2")],
            ),
            2,
            2,
        ),
    ]);
    assert_not_allocated(case.allocate(json!([request("req-0", "class-a", 1)])));
}

#[test]
fn no_slices() {
    assert_not_allocated(Case::new(vec![]).allocate(json!([request("req-0", "class-a", 1)])));
}

#[test]
fn not_enough_suitable_devices() {
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    assert_not_allocated(case.allocate(json!([
        request("req-0", "class-a", 1),
        request("req-1", "class-a", 1)
    ])));
}

#[test]
fn no_classes() {
    let mut case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    case.classes.clear();
    assert_error(
        case.allocate(json!([request("req-0", "class-a", 1)])),
        "request req-0: DeviceClass class-a does not exist",
    );
}

#[test]
fn unknown_class() {
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    assert_error(
        case.allocate(json!([request("req-0", "unknown-class", 1)])),
        "DeviceClass unknown-class does not exist",
    );
}

#[test]
fn empty_class() {
    // Upstream: "missing device class name (unsupported request type?)".
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    assert_error(
        case.allocate(json!([request("req-0", "", 1)])),
        "request req-0: deviceClassName is empty",
    );
}

#[test]
fn several_different_drivers() {
    // Upstream allocates the two claims together; here one after the other.
    let case = Case::new(vec![
        slice(
            "slice-1",
            json!("node-1"),
            "pool-1",
            A,
            vec![device("device-1"), device("device-2")],
        ),
        one("slice-1", json!("node-1"), "pool-1", B),
    ]);
    let (first, _) = case.claim_after(&[], json!([request("req-0", "class-a", 1)]), json!([]));
    let first = first.expect("claim-0");
    assert_eq!(names(&first), ["req-0 driver-a/pool-1/device-1"]);
    let (second, _) = case.claim_after(&first, json!([request("req-0", "class-b", 1)]), json!([]));
    assert_eq!(
        names(&second.expect("claim-1")),
        ["req-0 driver-b/pool-1/device-1"]
    );
}

#[test]
fn already_allocated_devices() {
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)])
        .allocated(&[(A, "pool-1", "device-1"), (A, "pool-1", "device-2")]);
    assert_not_allocated(case.allocate(json!([request("req-0", "class-a", 1)])));
}

#[test]
fn unknown_selector() {
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    let mut request = request("req-0", "class-a", 1);
    request["exactly"]["selectors"] = json!([{}]);
    assert_error(
        case.allocate(json!([request])),
        "CEL expression empty (unsupported selector type?)",
    );
}

#[test]
fn unknown_allocation_mode() {
    // Upstream: "unsupported count mode future-mode".
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    let mut request = request("req-0", "class-a", 1);
    request["exactly"]["allocationMode"] = json!("future-mode");
    assert_error(
        case.allocate(json!([request])),
        "unsupported allocationMode future-mode",
    );
}

#[test]
fn unknown_constraint() {
    // Upstream: "empty constraint (unsupported constraint type?)".
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    assert_error(
        case.allocate_with(json!([request("req-0", "class-a", 1)]), json!([{}])),
        "constraint #0: needs exactly one of matchAttribute and distinctAttribute",
    );
}

#[test]
fn invalid_cel_one_device() {
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    assert_error(
        case.allocate(json!([request_where("req-0", "class-a", 1, "noSuchVar")])),
        "request req-0: selector #0: CEL compile error: undeclared reference to 'noSuchVar'",
    );
}

#[test]
fn invalid_cel_one_device_class() {
    let mut case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)]);
    case.classes
        .insert("class-a".into(), vec!["noSuchVar".into()]);
    assert_error(
        case.allocate(json!([request("req-0", "class-a", 1)])),
        "class class-a: selector #0: CEL compile error: undeclared reference to 'noSuchVar'",
    );
}

#[test]
fn too_many_devices_single_request() {
    // Upstream: "claim claim-0: number of requested devices 500 exceeds the claim limit of 32".
    assert_error(
        Case::new(vec![]).allocate(json!([request("req-0", "class-a", 500)])),
        "the claim asks for at least 500 devices, more than the 32 an allocation holds",
    );
}

#[test]
fn many_devices_okay() {
    assert_not_allocated(Case::new(vec![]).allocate(json!([request("req-0", "class-a", 32)])));
}

fn numbered(count: usize) -> Vec<Value> {
    (0..count).map(|i| device(&format!("device-{i}"))).collect()
}

#[test]
fn too_many_devices_total() {
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        numbered(33),
    )]);
    assert_error(
        case.allocate(json!([
            request("req-0", "class-a", 32),
            request("req-1", "class-a", 1)
        ])),
        "at least 33 devices",
    );
}

#[test]
fn max_number_devices() {
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        numbered(32),
    )]);
    let expected: Vec<String> = (0..32)
        .map(|i| format!("req-0 driver-a/pool-1/device-{i}"))
        .collect();
    let expected: Vec<&str> = expected.iter().map(String::as_str).collect();
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 32)])),
        &expected,
    );
}

#[test]
fn interrupt() {
    // Six devices of five. Upstream's "off" finds nothing; its timeout, deadline and cancel
    // variants end with the context's error, which the step limit stands for here.
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        numbered(5),
    )]);
    let requests = json!([request("req-0", "class-a", 6)]);
    assert_not_allocated(case.allocate(requests.clone()));
    let spec = serde_json::from_value(json!({"devices": {"requests": requests}})).expect("claim");
    let (result, _) = run(&case.pools(), &case.classes, &InUse::default(), &spec, 1);
    assert!(
        matches!(result, Err(AllocationError::StepLimit { limit: 1 })),
        "{result:?}"
    );
}

fn region(value: &str) -> Value {
    json!({"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "region", "operator": "In", "values": [value]}]}]})
}

#[test]
fn network_attached_device() {
    let case = Case::new(vec![one("slice-1", region("region-1"), "pool-1", A)]);
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 1)])),
        &["req-0 driver-a/pool-1/device-1"],
    );
}

#[test]
fn unsuccessful_allocation_network_attached_device() {
    let case = Case::new(vec![one("slice-1", region("region-1"), "pool-1", A)])
        .on(node("node-2", "region-2"));
    assert_not_allocated(case.allocate(json!([request("req-0", "class-a", 1)])));
}

#[test]
fn many_network_attached_devices() {
    let planet = json!({"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "planet", "operator": "In", "values": ["earth"]}]}]});
    let local = json!({"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]});
    let case = Case::new(vec![
        one("slice-1", region("region-1"), "pool-1", A),
        one("slice-1", json!("all"), "pool-2", A),
        one("slice-1", planet, "pool-3", A),
        one("slice-1", local, "pool-4", A),
    ]);
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 4)])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-0 driver-a/pool-2/device-1",
            "req-0 driver-a/pool-3/device-1",
            "req-0 driver-a/pool-4/device-1",
        ],
    );
}

#[test]
fn local_and_network_attached_devices() {
    let case = Case::new(vec![
        one("slice-1", region("region-1"), "pool-1", A),
        one("slice-1", json!("node-1"), "pool-2", A),
    ]);
    assert_allocated(
        case.allocate(json!([request("req-0", "class-a", 2)])),
        &[
            "req-0 driver-a/pool-1/device-1",
            "req-0 driver-a/pool-2/device-1",
        ],
    );
}

#[test]
fn admin_access_enabled() {
    let case = Case::new(vec![one("slice-1", json!("node-1"), "pool-1", A)])
        .allocated(&[(A, "pool-1", "device-1"), (A, "pool-1", "device-2")]);
    assert_allocated(
        case.allocate(json!([admin(request("req-0", "class-a", 1))])),
        &["req-0 driver-a/pool-1/device-1 admin"],
    );
}

#[test]
fn count_devices_some_allocated_admin_access() {
    let devices = vec![device("device-1"), device("device-2")];
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        devices,
    )])
    .allocated(&[(A, "pool-1", "device-1")]);
    assert_allocated(
        case.allocate(json!([admin(request("req-0", "class-a", 2))])),
        &[
            "req-0 driver-a/pool-1/device-1 admin",
            "req-0 driver-a/pool-1/device-2 admin",
        ],
    );
}

#[test]
fn separate_claims_share_device_admin_access() {
    let devices = vec![device("device-1"), device("device-2")];
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        devices,
    )]);
    let claim = json!([admin(request("req-0", "class-a", 1))]);
    let (first, _) = case.claim_after(&[], claim.clone(), json!([]));
    let first = first.expect("claim-0");
    let (second, _) = case.claim_after(&first, claim, json!([]));
    assert_eq!(names(&first), ["req-0 driver-a/pool-1/device-1 admin"]);
    assert_eq!(
        names(&second.expect("claim-1")),
        ["req-0 driver-a/pool-1/device-1 admin"]
    );
}

#[test]
fn admin_access_claims_device_allocating_for_non_admin_access() {
    let devices = vec![device("device-1"), device("device-2")];
    let case = Case::new(vec![slice(
        "slice-1",
        json!("node-1"),
        "pool-1",
        A,
        devices,
    )]);
    let (first, _) = case.claim_after(&[], json!([request("req-0", "class-a", 1)]), json!([]));
    let first = first.expect("claim-0");
    let (second, _) = case.claim_after(
        &first,
        json!([admin(request("req-0", "class-a", 1))]),
        json!([]),
    );
    assert_eq!(names(&first), ["req-0 driver-a/pool-1/device-1"]);
    assert_eq!(
        names(&second.expect("claim-1")),
        ["req-0 driver-a/pool-1/device-1 admin"]
    );
}
