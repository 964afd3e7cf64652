//! The scheduler's own allocator test cases, reproduced: each test carries the name of its case in
//! `TestAllocator` (`staging/src/k8s.io/dynamic-resource-allocation/structured/internal/
//! allocatortesting/allocator_testing.go`, Kubernetes 1.36) and asserts the same devices or error.
//! Fixtures follow upstream's: nodes `node-1` (labels `region=region-1`, `planet=earth`) and `node-2`
//! (`region-2`), drivers `driver-a` and `driver-b` with classes `class-a` and `class-b` that select
//! them, slices of generation 1 and one slice per pool unless a case says otherwise.
//!
//! Not reproduced: cases that need a feature gate off (gpu-dra decides as a cluster with the DRA gates
//! on), several claims allocated together (the allocator takes one claim; cases that work claim by
//! claim are run that way), the result's node selector and configs (not part of the result here),
//! binding conditions and list-type attributes (not supported). Where gpu-dra decides differently on
//! purpose, the test says so.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceSlice};
use serde_json::{json, Value};

use super::search::run;
use super::{in_use, AllocationError, InUse, Node, Pools, DEFAULT_STEP_LIMIT};

mod all_mode;
mod basics;
mod constraints;
mod counters;
mod first_available;
mod first_available_all;
mod pools;
mod taints;

pub(super) const A: &str = "driver-a";
pub(super) const B: &str = "driver-b";

pub(super) fn node(name: &str, region: &str) -> Node {
    Node {
        name: name.to_string(),
        labels: BTreeMap::from([
            ("region".to_string(), region.to_string()),
            ("planet".to_string(), "earth".to_string()),
        ]),
    }
}

pub(super) fn node1() -> Node {
    node("node-1", "region-1")
}

pub(super) fn classes() -> BTreeMap<String, Vec<String>> {
    BTreeMap::from([
        ("class-a".into(), vec![format!("device.driver == {A:?}")]),
        ("class-b".into(), vec![format!("device.driver == {B:?}")]),
    ])
}

/// A slice of generation 1 and a pool of one slice. `on` is a node name, `"all"` (allNodes),
/// `"per-device"` (perDeviceNodeSelection) or a node selector.
pub(super) fn slice(name: &str, on: Value, pool: &str, driver: &str, devices: Vec<Value>) -> Value {
    let mut spec = json!({
        "driver": driver,
        "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
    });
    if !devices.is_empty() {
        spec["devices"] = Value::Array(devices);
    }
    match on {
        Value::String(s) if s == "all" => spec["allNodes"] = json!(true),
        Value::String(s) if s == "per-device" => spec["perDeviceNodeSelection"] = json!(true),
        Value::String(s) => spec["nodeName"] = json!(s),
        selector => spec["nodeSelector"] = selector,
    }
    json!({"metadata": {"name": name}, "spec": spec})
}

/// A slice of counter sets only (1.35+): `sets` is `[(name, {counter: value})]`.
pub(super) fn counter_slice(
    name: &str,
    on: Value,
    pool: &str,
    driver: &str,
    sets: &[(&str, Value)],
) -> Value {
    let mut slice = slice(name, on, pool, driver, Vec::new());
    slice["spec"]["sharedCounters"] = sets
        .iter()
        .map(|(set, counters)| json!({"name": set, "counters": values(counters)}))
        .collect();
    slice
}

/// The slice with its pool at `generation` of `count` slices.
pub(super) fn pool_of(mut slice: Value, generation: i64, count: i64) -> Value {
    slice["spec"]["pool"]["generation"] = json!(generation);
    slice["spec"]["pool"]["resourceSliceCount"] = json!(count);
    slice
}

pub(super) fn device(name: &str) -> Value {
    json!({"name": name})
}

/// `device` with more fields (attributes, capacity, taints, node selection).
pub(super) fn with(mut device: Value, fields: Value) -> Value {
    if let (Some(target), Value::Object(fields)) = (device.as_object_mut(), fields) {
        target.extend(fields);
    }
    device
}

/// A device with a `memory` capacity.
pub(super) fn memory(name: &str, quantity: &str) -> Value {
    with(
        device(name),
        json!({"capacity": {"memory": {"value": quantity}}}),
    )
}

/// `{counter: "4Gi"}` → `{counter: {"value": "4Gi"}}`.
fn values(counters: &Value) -> Value {
    counters
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), json!({ "value": v })))
                .collect()
        })
        .unwrap_or_else(|| json!({}))
}

/// A device that consumes `consumes` (`[(set, {counter: value})]`); with `capacity`, its capacity
/// equals what it consumes (upstream's `fromCounters`).
pub(super) fn consuming(name: &str, consumes: &[(&str, Value)], capacity: bool) -> Value {
    let mut device = device(name);
    device["consumesCounters"] = consumes
        .iter()
        .map(|(set, counters)| json!({"counterSet": set, "counters": values(counters)}))
        .collect();
    if capacity {
        let mut caps = serde_json::Map::new();
        for (_, counters) in consumes {
            for (name, value) in counters.as_object().into_iter().flatten() {
                caps.insert(name.clone(), json!({ "value": value }));
            }
        }
        device["capacity"] = Value::Object(caps);
    }
    device
}

pub(super) fn attribute(name: &str, attributes: Value) -> Value {
    with(device(name), json!({ "attributes": attributes }))
}

/// `device.capacity["driver-a"].memory.compareTo(quantity(q)) >= 0`.
pub(super) fn memory_at_least(quantity: &str) -> String {
    format!(r#"device.capacity["{A}"].memory.compareTo(quantity("{quantity}")) >= 0"#)
}

pub(super) fn request(name: &str, class: &str, count: i64) -> Value {
    json!({"name": name, "exactly": {"deviceClassName": class, "count": count}})
}

pub(super) fn request_where(name: &str, class: &str, count: i64, expression: &str) -> Value {
    let mut request = request(name, class, count);
    request["exactly"]["selectors"] = json!([{"cel": {"expression": expression}}]);
    request
}

pub(super) fn all_of(name: &str, class: &str) -> Value {
    json!({"name": name, "exactly": {"deviceClassName": class, "allocationMode": "All"}})
}

pub(super) fn admin(mut request: Value) -> Value {
    request["exactly"]["adminAccess"] = json!(true);
    request
}

pub(super) fn first_available(name: &str, subrequests: Vec<Value>) -> Value {
    json!({"name": name, "firstAvailable": subrequests})
}

pub(super) fn sub(name: &str, class: &str, count: i64) -> Value {
    json!({"name": name, "deviceClassName": class, "count": count})
}

pub(super) fn sub_where(name: &str, class: &str, count: i64, expression: &str) -> Value {
    let mut sub = sub(name, class, count);
    sub["selectors"] = json!([{"cel": {"expression": expression}}]);
    sub
}

pub(super) fn sub_all(name: &str, class: &str, expression: Option<&str>) -> Value {
    let mut sub = json!({"name": name, "deviceClassName": class, "allocationMode": "All"});
    if let Some(expression) = expression {
        sub["selectors"] = json!([{"cel": {"expression": expression}}]);
    }
    sub
}

/// What a case runs: slices, devices other claims hold, the node and the claim.
pub(super) struct Case {
    pub(super) slices: Vec<Value>,
    pub(super) allocated: Vec<(&'static str, &'static str, &'static str)>,
    pub(super) node: Node,
    pub(super) classes: BTreeMap<String, Vec<String>>,
}

impl Case {
    pub(super) fn new(slices: Vec<Value>) -> Case {
        Case {
            slices,
            allocated: Vec::new(),
            node: node1(),
            classes: classes(),
        }
    }

    pub(super) fn allocated(
        mut self,
        devices: &[(&'static str, &'static str, &'static str)],
    ) -> Case {
        self.allocated = devices.to_vec();
        self
    }

    pub(super) fn on(mut self, node: Node) -> Case {
        self.node = node;
        self
    }

    fn pools(&self) -> Pools {
        let slices: Vec<ResourceSlice> = self
            .slices
            .iter()
            .map(|s| serde_json::from_value(s.clone()).expect("valid ResourceSlice"))
            .collect();
        Pools::from_slices(&slices, Some(&self.node))
    }

    fn in_use(&self, more: &[DeviceRequestAllocationResult]) -> InUse {
        let mut held = in_use(more);
        for (driver, pool, device) in &self.allocated {
            held.devices.insert(super::Candidate {
                driver: driver.to_string(),
                pool: pool.to_string(),
                device: device.to_string(),
            });
        }
        held
    }

    /// Allocates a claim with `requests` (and `constraints`), after the claims whose results are in
    /// `before`; the results as `request driver/pool/device` (` admin` for admin access), sorted as
    /// upstream compares them, and the search's steps.
    pub(super) fn claim_after(
        &self,
        before: &[DeviceRequestAllocationResult],
        requests: Value,
        constraints: Value,
    ) -> (
        Result<Vec<DeviceRequestAllocationResult>, AllocationError>,
        u64,
    ) {
        let spec = serde_json::from_value(
            json!({"devices": {"requests": requests, "constraints": constraints}}),
        )
        .expect("valid ResourceClaimSpec");
        run(
            &self.pools(),
            &self.classes,
            &self.in_use(before),
            &spec,
            DEFAULT_STEP_LIMIT,
        )
    }

    pub(super) fn allocate(&self, requests: Value) -> Result<Vec<String>, AllocationError> {
        self.allocate_with(requests, json!([]))
    }

    pub(super) fn allocate_with(
        &self,
        requests: Value,
        constraints: Value,
    ) -> Result<Vec<String>, AllocationError> {
        self.claim_after(&[], requests, constraints)
            .0
            .map(|r| names(&r))
    }

    /// The steps the search took for a claim that is expected to be allocated.
    pub(super) fn steps(&self, requests: Value, constraints: Value) -> u64 {
        self.claim_after(&[], requests, constraints).1
    }
}

pub(super) fn names(results: &[DeviceRequestAllocationResult]) -> Vec<String> {
    let mut names: Vec<String> = results
        .iter()
        .map(|r| {
            let admin = if r.admin_access == Some(true) {
                " admin"
            } else {
                ""
            };
            format!("{} {}/{}/{}{admin}", r.request, r.driver, r.pool, r.device)
        })
        .collect();
    names.sort();
    names
}

/// Asserts the devices, in any order (upstream compares with `ConsistOf`).
#[track_caller]
pub(super) fn assert_allocated(result: Result<Vec<String>, AllocationError>, expected: &[&str]) {
    let mut expected: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
    expected.sort();
    match result {
        Ok(results) => assert_eq!(results, expected),
        Err(error) => panic!("expected {expected:?}, got the error: {error}"),
    }
}

/// Asserts "not allocated" (upstream's nil result without an error).
#[track_caller]
pub(super) fn assert_not_allocated(result: Result<Vec<String>, AllocationError>) {
    match result {
        Err(AllocationError::NotEnoughDevices { .. } | AllocationError::Unsatisfiable { .. }) => {}
        other => panic!("expected not allocated, got {other:?}"),
    }
}

/// Asserts an error whose text contains `text`.
#[track_caller]
pub(super) fn assert_error(result: Result<Vec<String>, AllocationError>, text: &str) {
    match result {
        Err(
            error @ (AllocationError::NotEnoughDevices { .. }
            | AllocationError::Unsatisfiable { .. }),
        ) => panic!("expected an error with {text:?}, got not allocated: {error}"),
        Err(error) => assert!(error.to_string().contains(text), "{error}"),
        Ok(results) => panic!("expected an error with {text:?}, got {results:?}"),
    }
}
