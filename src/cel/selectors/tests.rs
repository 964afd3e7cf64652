use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use serde_json::{json, Value};

use super::simulate::{simulate, Decision, Simulation, SimulationError};
use super::{check, slice_devices};
use crate::cel::allocator::{Candidate, SelectorOrigin};
use crate::cel::input::NamedClaim;

const DRIVER: &str = "gpu.dra.dev";

fn class(name: &str, expressions: &[&str]) -> DeviceClass {
    let selectors: Vec<Value> = expressions
        .iter()
        .map(|e| json!({"cel": {"expression": e}}))
        .collect();
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"selectors": selectors}}))
        .expect("class")
}

fn slices() -> Vec<ResourceSlice> {
    let device = |name: &str, kind: &str, memory: &str| json!({"name": name, "attributes": {"type": {"string": kind}}, "capacity": {"memory": {"value": memory}}});
    vec![serde_json::from_value(json!({
        "metadata": {"name": "node-a-gpu"},
        "spec": {"driver": DRIVER, "nodeName": "node-a",
                 "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                 "devices": [device("gpu-0", "gpu", "80Gi"), device("gpu-1", "gpu", "40Gi"), device("gpu-0-mig", "mig", "10Gi")]}
    }))
    .expect("slice")]
}

fn claim(requests: Value) -> NamedClaim {
    NamedClaim {
        name: "ml/train".into(),
        spec: serde_json::from_value(json!({"devices": {"requests": requests}})).expect("spec"),
    }
}

const IS_GPU: &str = r#"device.attributes["gpu.dra.dev"].type == "gpu""#;
const BIG: &str = r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("64Gi")) >= 0"#;
const UNKNOWN: &str = r#"device.attributes["gpu.dra.dev"].cores >= 1"#;

#[test]
fn class_then_request_selectors_with_the_first_no() {
    let classes = [class("gpu", &[IS_GPU])];
    let claims = [claim(json!([
        {"name": "big", "exactly": {"deviceClassName": "gpu", "selectors": [{"cel": {"expression": BIG}}]}},
    ]))];
    let report = check(DRIVER, &classes, &claims, &slice_devices(&slices()));
    assert_eq!(report.subjects.len(), 2);
    let class_only = &report.subjects[0];
    assert_eq!(class_only.title(), "class gpu");
    assert_eq!(
        class_only.matches,
        ["gpu.dra.dev/node-a/gpu-0", "gpu.dra.dev/node-a/gpu-1"]
    );
    assert_eq!(
        class_only.no_match[0].device,
        "gpu.dra.dev/node-a/gpu-0-mig"
    );

    let request = &report.subjects[1];
    assert_eq!(request.title(), "claim ml/train request big (class gpu)");
    assert_eq!(request.matches, ["gpu.dra.dev/node-a/gpu-0"]);
    let said_no: Vec<_> = request
        .no_match
        .iter()
        .map(|m| {
            (
                m.device.as_str(),
                m.selector.origin.clone(),
                m.selector.index,
            )
        })
        .collect();
    assert_eq!(
        said_no,
        [
            (
                "gpu.dra.dev/node-a/gpu-1",
                SelectorOrigin::Request("big".into()),
                0
            ),
            // The class says no first, so the request's selector never runs on the MIG device.
            (
                "gpu.dra.dev/node-a/gpu-0-mig",
                SelectorOrigin::Class("gpu".into()),
                0
            ),
        ]
    );
    assert_eq!(report.exit_code(), 0);
    let table = report.to_table();
    assert!(
        table.contains("claim ml/train request big (class gpu): 1 of 3 devices match"),
        "{table}"
    );
    assert!(
        table.contains(&format!(
            "no match (request big selector #0: {BIG}): gpu.dra.dev/node-a/gpu-1"
        )),
        "{table}"
    );
}

#[test]
fn runtime_and_compile_errors_block_and_are_counted_once() {
    let classes = [
        class("gpu", &[IS_GPU]),
        class("broken", &["device.driver =="]),
    ];
    let claims = [claim(json!([
        {"name": "odd", "firstAvailable": [
            {"name": "a", "deviceClassName": "gpu", "selectors": [{"cel": {"expression": UNKNOWN}}]},
            {"name": "b", "deviceClassName": "gpu"}]},
        {"name": "lost", "exactly": {"deviceClassName": "no-such-class"}},
    ]))];
    let report = check(DRIVER, &classes, &claims, &slice_devices(&slices()));
    assert_eq!(report.exit_code(), 2);
    let by_title: BTreeMap<String, &super::Subject> =
        report.subjects.iter().map(|s| (s.title(), s)).collect();

    let broken = by_title["class broken"];
    assert_eq!(broken.errors.len(), 1, "a compile error is reported once");
    assert!(broken.errors[0]
        .message
        .starts_with("class broken: selector #0: CEL compile error"));
    assert!(broken.errors[0].device.is_none() && broken.errors[0].blocking);

    let odd_a = by_title["claim ml/train request odd/a (class gpu)"];
    assert_eq!(odd_a.errors.len(), 2, "one runtime error per GPU");
    assert!(
        odd_a.errors[0].message.starts_with(
            "request odd/a: selector #0 on device gpu.dra.dev/node-a/gpu-0: CEL runtime error: no such key: cores"
        ),
        "{}",
        odd_a.errors[0].message
    );
    assert_eq!(
        by_title["claim ml/train request odd/b (class gpu)"].matching,
        2
    );
    let lost = &by_title["claim ml/train request lost (class no-such-class)"];
    assert!(lost.errors[0]
        .message
        .contains("DeviceClass no-such-class does not exist"));

    let json: Value = serde_json::from_str(&report.to_json()).expect("JSON");
    assert_eq!(json["exitCode"], 2);
    assert_eq!(
        json["subjects"][1]["errors"][0]["selector"]["origin"],
        json!({"kind": "class", "name": "broken"})
    );
    assert!(report
        .to_table()
        .contains("BLOCKING error: request odd/a: selector #0 on device"));
}

#[test]
fn a_class_that_matches_nothing_exits_1() {
    let classes = [class(
        "vgpu",
        &[r#"device.attributes["gpu.dra.dev"].type == "vgpu""#],
    )];
    let report = check(DRIVER, &classes, &[], &slice_devices(&slices()));
    assert_eq!(report.exit_code(), 1);
    assert!(report.to_table().contains("NOTHING MATCHES"));
}

fn simulation(requests: Value) -> Simulation {
    Simulation {
        claim: claim(requests),
        classes: vec![class("gpu", &[IS_GPU])],
        slices: slices(),
        node: None,
        node_labels: BTreeMap::new(),
        in_use: Default::default(),
    }
}

#[test]
fn allocate_decides_like_the_scheduler() {
    let two = json!([{"name": "gpus", "exactly": {"deviceClassName": "gpu", "count": 2}}]);
    let decision = simulate(&simulation(two.clone())).expect("decision");
    assert_eq!(decision.exit_code(), 0);
    let json: Value = serde_json::from_str(&decision.to_json()).expect("JSON");
    assert_eq!(json["allocated"], true);
    assert_eq!(
        json["results"][1],
        json!({"request": "gpus", "driver": DRIVER, "pool": "node-a", "device": "gpu-1"})
    );

    let mut busy = simulation(two);
    busy.in_use.devices.insert(Candidate {
        driver: DRIVER.into(),
        pool: "node-a".into(),
        device: "gpu-1".into(),
    });
    let decision = simulate(&busy).expect("decision");
    assert_eq!(decision.exit_code(), 1);
    match &decision {
        Decision::Unallocatable { node, reason } => {
            assert_eq!(node, "node-a");
            assert!(reason.contains("gpu-1 is in use"), "{reason}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(decision
        .to_text()
        .starts_with("not allocatable on node node-a: request gpus: not enough devices"));

    // Another node's name leaves no devices.
    let mut elsewhere = simulation(json!([{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]));
    elsewhere.node = Some("node-b".into());
    assert_eq!(simulate(&elsewhere).expect("decision").exit_code(), 1);
}

#[test]
fn allocate_errors_exit_2_naming_claim_selector_and_device() {
    let requests = json!([{"name": "odd", "exactly": {"deviceClassName": "gpu", "selectors": [{"cel": {"expression": UNKNOWN}}]}}]);
    let error = simulate(&simulation(requests)).expect_err("CEL error");
    assert_eq!(error.exit_code(), 2);
    let message = error.to_string();
    assert!(
        message.starts_with(
            "claim ml/train: request odd: selector #0 on device gpu.dra.dev/node-a/gpu-0: CEL runtime error: no such key: cores"
        ),
        "{message}"
    );

    let mut two_nodes = simulation(json!([{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]));
    let mut other = two_nodes.slices[0].clone();
    other.spec.node_name = Some("node-b".into());
    other.spec.pool.name = "node-b".into();
    two_nodes.slices.push(other);
    assert!(matches!(
        simulate(&two_nodes),
        Err(SimulationError::SeveralNodes { .. })
    ));
    two_nodes.node = Some("node-b".into());
    match simulate(&two_nodes).expect("decision") {
        Decision::Allocated { results, .. } => assert_eq!(results[0].pool, "node-b"),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn the_table_lists_a_few_devices_and_counts_the_rest() {
    let names: Vec<String> = (0..20).map(|i| format!("gpu-{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let text = super::shorten(&names);
    assert!(text.starts_with("gpu-0, gpu-1,"), "{text}");
    assert!(
        text.contains("gpu-7 ... and 12 more (-o json lists them all)"),
        "{text}"
    );
    assert!(!text.contains("gpu-8"), "{text}");
    assert_eq!(super::shorten(&names[..3]), "gpu-0, gpu-1, gpu-2");
}

#[test]
fn config_errors_name_the_object_and_do_not_block_allocation() {
    let mut gpu = class("gpu", &[IS_GPU]);
    gpu.spec.get_or_insert_with(Default::default).config = Some(
        serde_json::from_value(json!([{"opaque": {"driver": DRIVER, "parameters":
            {"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {}}}}]))
        .expect("config"),
    );
    // A claim without requests has a subject of its own for its config errors.
    let bare = NamedClaim {
        name: "ml/bare".into(),
        spec: serde_json::from_value(json!({"devices": {"config": [
            {"opaque": {"driver": "nic.example.com", "parameters": {"x": 1}}},
            {"opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig"}}}]}}))
        .expect("spec"),
    };
    let report = check(DRIVER, &[gpu], &[bare], &slice_devices(&slices()));
    assert_eq!(report.exit_code(), 2);
    let messages: Vec<(String, Option<usize>, bool, &str)> = report
        .subjects
        .iter()
        .flat_map(|s| {
            s.errors
                .iter()
                .map(move |e| (s.title(), e.config, e.blocking, e.message.as_str()))
        })
        .collect();
    assert_eq!(
        messages,
        [
            (
                "class gpu".to_string(),
                Some(0),
                false,
                "DeviceClass gpu: config[0] (GpuConfig): sharing.strategy: required"
            ),
            (
                "claim ml/bare".to_string(),
                Some(1),
                false,
                "claim ml/bare: config[1] (GpuConfig): apiVersion: must be gpu.dra.dev/v1alpha1"
            ),
        ]
    );
    // The class's selectors are still evaluated.
    assert_eq!(report.subjects[0].matching, 2);
    let table = report.to_table();
    assert!(table.contains("claim ml/bare: no requests\n"), "{table}");
    assert!(!table.contains("BLOCKING"), "{table}");
    assert!(!table.contains("NOTHING MATCHES"), "{table}");
}
