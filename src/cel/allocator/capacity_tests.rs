//! Consumable capacity: shared devices go to several claims while their capacity lasts, requests are
//! rounded by the request policy, exclusive devices stay exclusive.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceSlice};
use serde_json::{json, Value};

use super::super::{allocate, in_use, AllocationError, InUse, Node, Pools};
use crate::quantity::Quantity;

const DRIVER: &str = "gpu.dra.dev";
const NODE: &str = "node-a";

fn slices(devices: Value, counters: Option<Value>) -> Vec<ResourceSlice> {
    let mut spec = json!({
        "driver": DRIVER,
        "nodeName": NODE,
        "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
        "devices": devices,
    });
    if let Some(counters) = counters {
        spec["sharedCounters"] = counters;
    }
    let slice = json!({"metadata": {"name": "node-a-gpus"}, "spec": spec});
    vec![serde_json::from_value(slice).expect("valid ResourceSlice")]
}

/// An 80Gi GPU shared by memory from 1Gi in 1Gi steps (as a GpuNodePolicy publishes it).
fn shared_gpu(name: &str) -> Value {
    json!({
        "name": name,
        "allowMultipleAllocations": true,
        "attributes": {"type": {"string": "gpu"}, "sharing": {"string": "MPS"}},
        "capacity": {"memory": {"value": "80Gi", "requestPolicy": {
            "default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}
        }}},
    })
}

fn exclusive_gpu(name: &str) -> Value {
    json!({
        "name": name,
        "attributes": {"type": {"string": "gpu"}},
        "capacity": {"memory": {"value": "80Gi"}},
    })
}

fn classes() -> BTreeMap<String, Vec<String>> {
    BTreeMap::from([(
        "gpu".to_string(),
        vec![format!(r#"device.driver == "{DRIVER}""#)],
    )])
}

/// A request named `name` for one device; `memory` asks for that much.
fn request(name: &str, memory: Option<&str>) -> Value {
    let mut exactly = json!({"deviceClassName": "gpu"});
    if let Some(memory) = memory {
        exactly["capacity"] = json!({"requests": {"memory": memory}});
    }
    json!({"name": name, "exactly": exactly})
}

fn allocate_requests(
    slices: &[ResourceSlice],
    in_use: &InUse,
    requests: Vec<Value>,
) -> Result<Vec<DeviceRequestAllocationResult>, AllocationError> {
    let pools = Pools::from_slices(slices, Some(&Node::named(NODE)));
    let claim = serde_json::from_value(json!({"devices": {"requests": requests}})).unwrap();
    allocate(&pools, &classes(), in_use, &claim)
}

fn memory(result: &DeviceRequestAllocationResult) -> Option<&str> {
    result
        .consumed_capacity
        .as_ref()
        .and_then(|c| c.get("memory"))
        .map(|q| q.0.as_str())
}

/// Allocates one claim per entry of `memory` in turn, each seeing what the earlier ones hold.
fn claims_in_turn(
    slices: &[ResourceSlice],
    memory: &[Option<&str>],
) -> Vec<Result<Vec<DeviceRequestAllocationResult>, AllocationError>> {
    let mut held: Vec<DeviceRequestAllocationResult> = Vec::new();
    let mut outcomes = Vec::new();
    for asked in memory {
        let outcome = allocate_requests(slices, &in_use(&held), vec![request("gpu", *asked)]);
        if let Ok(results) = &outcome {
            held.extend(results.iter().cloned());
        }
        outcomes.push(outcome);
    }
    outcomes
}

fn is_uuid(text: &str) -> bool {
    uuid::Uuid::parse_str(text).is_ok_and(|u| u.hyphenated().to_string() == text)
}

#[test]
fn claims_share_a_gpu_while_its_memory_lasts() {
    let slices = slices(json!([shared_gpu("gpu-0")]), None);
    let outcomes = claims_in_turn(&slices, &[Some("40Gi"), Some("30Gi"), Some("20Gi")]);
    let first = outcomes[0].as_ref().expect("40Gi fits");
    let second = outcomes[1].as_ref().expect("30Gi fits beside it");
    assert_eq!(
        (first[0].device.as_str(), memory(&first[0])),
        ("gpu-0", Some("40Gi"))
    );
    assert_eq!(
        (second[0].device.as_str(), memory(&second[0])),
        ("gpu-0", Some("30Gi"))
    );
    let share_ids = [&first[0].share_id, &second[0].share_id].map(|id| id.clone().unwrap());
    assert!(share_ids.iter().all(|id| is_uuid(id)), "{share_ids:?}");
    assert_ne!(share_ids[0], share_ids[1]);

    let error = outcomes[2]
        .as_ref()
        .expect_err("20Gi does not fit in the 10Gi left");
    let text = error.to_string();
    assert!(
        matches!(error, AllocationError::NotEnoughDevices { .. }),
        "{text}"
    );
    assert!(
        text.contains("gpu-0 needs 20Gi of capacity memory, which has 10Gi left"),
        "{text}"
    );
}

#[test]
fn a_claim_that_asks_no_memory_gets_the_default_share() {
    let slices = slices(json!([shared_gpu("gpu-0")]), None);
    let outcomes = claims_in_turn(&slices, &[None, None]);
    for outcome in &outcomes {
        let results = outcome.as_ref().expect("a default share fits");
        assert_eq!(memory(&results[0]), Some("1Gi"));
    }
}

#[test]
fn requests_round_up_to_the_minimum_plus_whole_steps() {
    let mut gpu = shared_gpu("gpu-0");
    gpu["capacity"]["memory"]["requestPolicy"] = json!({
        "default": "2Gi", "validRange": {"min": "2Gi", "step": "4Gi", "max": "26Gi"}
    });
    let slices = slices(json!([gpu]), None);
    let consumed = |asked: &str| {
        allocate_requests(
            &slices,
            &InUse::default(),
            vec![request("gpu", Some(asked))],
        )
        .map(|r| memory(&r[0]).map(str::to_string))
    };
    assert_eq!(
        consumed("1Gi").unwrap().as_deref(),
        Some("2Gi"),
        "below min"
    );
    assert_eq!(
        consumed("6Gi").unwrap().as_deref(),
        Some("6Gi"),
        "on a step"
    );
    assert_eq!(
        consumed("7Gi").unwrap().as_deref(),
        Some("10Gi"),
        "rounded up"
    );
    assert_eq!(consumed("6442450945").unwrap().as_deref(), Some("10Gi"));
    assert_eq!(
        consumed("26Gi").unwrap().as_deref(),
        Some("26Gi"),
        "max itself"
    );
    let text = consumed("27Gi")
        .expect_err("rounds to 30Gi, beyond max")
        .to_string();
    assert!(
        text.contains(
            "gpu-0 cannot give 30Gi of capacity memory: more than the request policy's max 26Gi"
        ),
        "{text}"
    );
}

#[test]
fn valid_values_round_up_to_the_next_and_refuse_beyond_the_last() {
    let mut gpu = shared_gpu("gpu-0");
    gpu["capacity"]["memory"]["requestPolicy"] =
        json!({"default": "10Gi", "validValues": ["10Gi", "20Gi", "40Gi"]});
    let slices = slices(json!([gpu]), None);
    let results = allocate_requests(
        &slices,
        &InUse::default(),
        vec![request("gpu", Some("15Gi"))],
    )
    .expect("rounded to 20Gi");
    assert_eq!(memory(&results[0]), Some("20Gi"));
    let error = allocate_requests(
        &slices,
        &InUse::default(),
        vec![request("gpu", Some("50Gi"))],
    )
    .expect_err("no valid value that large")
    .to_string();
    assert!(
        error.contains("not one of the request policy's valid values 10Gi, 20Gi, 40Gi"),
        "{error}"
    );
}

#[test]
fn an_exclusive_device_is_never_shared() {
    let slices = slices(json!([exclusive_gpu("gpu-0")]), None);
    let outcomes = claims_in_turn(&slices, &[Some("10Gi"), Some("10Gi")]);
    let first = outcomes[0].as_ref().expect("the GPU, whole");
    assert_eq!(first[0].device, "gpu-0");
    assert_eq!(first[0].share_id, None);
    assert_eq!(first[0].consumed_capacity, None);
    let text = outcomes[1].as_ref().expect_err("held whole").to_string();
    assert!(text.contains("gpu-0 is in use"), "{text}");

    // Nor by two requests of one claim, and its capacity still bounds what a request asks.
    let two = allocate_requests(
        &slices,
        &InUse::default(),
        vec![request("a", None), request("b", None)],
    );
    assert!(two.is_err(), "{two:?}");
    let too_much = allocate_requests(&slices, &InUse::default(), vec![request("a", Some("81Gi"))])
        .expect_err("more than the GPU has")
        .to_string();
    assert!(
        too_much.contains("needs 81Gi of capacity memory, which has 80Gi left"),
        "{too_much}"
    );
}

#[test]
fn requests_of_one_claim_share_a_device_and_a_whole_result_blocks_it() {
    let slices = slices(json!([shared_gpu("gpu-0")]), None);
    let results = allocate_requests(
        &slices,
        &InUse::default(),
        vec![
            request("train", Some("50Gi")),
            request("serve", Some("30Gi")),
        ],
    )
    .expect("both requests on gpu-0");
    assert_eq!(results.len(), 2);
    assert!(results.iter().all(|r| r.device == "gpu-0"));
    assert_ne!(results[0].share_id, results[1].share_id);
    let over = allocate_requests(
        &slices,
        &InUse::default(),
        vec![
            request("train", Some("50Gi")),
            request("serve", Some("31Gi")),
        ],
    );
    assert!(over.is_err(), "81Gi of 80Gi: {over:?}");

    // A result without a shareID (say, from before the gate was on) holds the device whole.
    let whole = DeviceRequestAllocationResult {
        request: "old".into(),
        driver: DRIVER.into(),
        pool: NODE.into(),
        device: "gpu-0".into(),
        ..Default::default()
    };
    let text = allocate_requests(&slices, &in_use([&whole]), vec![request("gpu", None)])
        .expect_err("held whole")
        .to_string();
    assert!(text.contains("gpu-0 is in use"), "{text}");
}

#[test]
fn a_request_for_a_capacity_the_device_lacks_cannot_have_it() {
    let slices = slices(json!([shared_gpu("gpu-0")]), None);
    let mut asks = request("gpu", None);
    asks["exactly"]["capacity"] = json!({"requests": {"bandwidth": "1"}});
    let text = allocate_requests(&slices, &InUse::default(), vec![asks])
        .expect_err("no bandwidth")
        .to_string();
    assert!(text.contains("gpu-0 has no capacity bandwidth"), "{text}");

    let mut bad = request("gpu", None);
    bad["exactly"]["capacity"] = json!({"requests": {"memory": "lots"}});
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    let claim = serde_json::from_value(json!({"devices": {"requests": [bad]}})).unwrap();
    let error = allocate(&pools, &classes(), &InUse::default(), &claim).expect_err("invalid");
    assert!(
        matches!(error, AllocationError::InvalidRequest { .. })
            && error.to_string().contains("capacity.requests[memory]"),
        "{error}"
    );
}

#[test]
fn a_shared_device_takes_its_counters_once() {
    // gpu-0 (shared) and gpu-1 (exclusive) consume the same single counter: either one, not both.
    let counters = json!([{"name": "card", "counters": {"whole": {"value": "1"}}}]);
    let consumes = json!([{"counterSet": "card", "counters": {"whole": {"value": "1"}}}]);
    let mut shared = shared_gpu("gpu-0");
    shared["consumesCounters"] = consumes.clone();
    let mut exclusive = exclusive_gpu("gpu-1");
    exclusive["consumesCounters"] = consumes;
    let slices = slices(json!([shared, exclusive]), Some(counters));
    let outcomes = claims_in_turn(&slices, &[Some("10Gi"), Some("10Gi")]);
    assert!(outcomes
        .iter()
        .all(|o| o.as_ref().is_ok_and(|r| r[0].device == "gpu-0")));

    let mut held = InUse::default();
    held.add_share(
        super::super::Candidate {
            driver: DRIVER.into(),
            pool: NODE.into(),
            device: "gpu-0".into(),
        },
        BTreeMap::from([("memory".to_string(), Quantity::parse("10Gi").unwrap())]),
    );
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    let left = pools.remaining_counters(&held);
    assert_eq!(left.values().next(), Some(&Quantity::zero()));
    let mut only_exclusive = request("gpu", None);
    only_exclusive["exactly"]["selectors"] =
        json!([{"cel": {"expression": "device.allowMultipleAllocations == false"}}]);
    let text = allocate_requests(&slices, &held, vec![only_exclusive])
        .expect_err("the shared GPU holds the counter")
        .to_string();
    assert!(
        text.contains("gpu-1 needs 1 of counter card/whole, which has 0 left"),
        "{text}"
    );
}

#[test]
fn all_mode_leaves_out_devices_without_room() {
    let slices = slices(json!([shared_gpu("gpu-0"), shared_gpu("gpu-1")]), None);
    let held = DeviceRequestAllocationResult {
        request: "other".into(),
        driver: DRIVER.into(),
        pool: NODE.into(),
        device: "gpu-1".into(),
        share_id: Some(uuid::Uuid::new_v4().to_string()),
        consumed_capacity: Some(BTreeMap::from([(
            "memory".to_string(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("75Gi".into()),
        )])),
        ..Default::default()
    };
    let mut all = request("gpus", Some("10Gi"));
    all["exactly"]["allocationMode"] = json!("All");
    let results = allocate_requests(&slices, &in_use([&held]), vec![all]).expect("gpu-0 only");
    let devices: Vec<&str> = results.iter().map(|r| r.device.as_str()).collect();
    assert_eq!(devices, ["gpu-0"]);
}

#[test]
fn shares_left_on_a_gpu_published_exclusive_again_keep_it_from_a_whole_claim() {
    // The admin dropped the policy while two claims hold shares: the GPU is exclusive now, and a claim
    // for it whole would take the memory the shares use.
    let slices = slices(json!([exclusive_gpu("gpu-0")]), None);
    let share = |id: &str| DeviceRequestAllocationResult {
        request: "gpu".into(),
        driver: DRIVER.into(),
        pool: NODE.into(),
        device: "gpu-0".into(),
        share_id: Some(id.into()),
        consumed_capacity: Some(BTreeMap::from([(
            "memory".to_string(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("5Gi".into()),
        )])),
        ..Default::default()
    };
    let held = in_use([&share("a"), &share("b")]);
    let text = allocate_requests(&slices, &held, vec![request("gpu", None)])
        .expect_err("the shares still use 10Gi")
        .to_string();
    assert!(
        text.contains("gpu-0 needs 80Gi of capacity memory, which has 70Gi left"),
        "{text}"
    );
}
