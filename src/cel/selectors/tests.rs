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
    assert_eq!(odd_a.errors.len(), 1, "one error for both GPUs");
    assert!(
        odd_a.errors[0].message.starts_with(
            "request odd/a: selector #0 on all 2 devices: CEL runtime error: no such key: cores"
        ),
        "{}",
        odd_a.errors[0].message
    );
    assert_eq!(
        odd_a.errors[0].devices,
        ["gpu.dra.dev/node-a/gpu-0", "gpu.dra.dev/node-a/gpu-1"]
    );
    assert_eq!(odd_a.errors[0].evaluated, Some(2));
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
    assert!(report.to_table().contains(
        "BLOCKING error: request odd/a: selector #0 on all 2 devices: CEL runtime error"
    ));
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
    let text = super::report::shorten(&names);
    assert!(text.starts_with("gpu-0, gpu-1,"), "{text}");
    assert!(
        text.contains("gpu-7 ... and 12 more (-o json lists them all)"),
        "{text}"
    );
    assert!(!text.contains("gpu-8"), "{text}");
    assert_eq!(super::report::shorten(&names[..3]), "gpu-0, gpu-1, gpu-2");
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
                "claim ml/bare: config[1] (GpuConfig): apiVersion: must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1"
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

/// One slice of `devices`, each `(name, attributes, capacity)` in the JSON shape of a Device.
fn slice_of(devices: &[(&str, Value, Value)]) -> Vec<ResourceSlice> {
    let devices: Vec<Value> = devices
        .iter()
        .map(|(name, attributes, capacity)| {
            json!({"name": name, "attributes": attributes, "capacity": capacity})
        })
        .collect();
    vec![serde_json::from_value(json!({
        "metadata": {"name": "node-a-gpu"},
        "spec": {"driver": DRIVER, "nodeName": "node-a",
                 "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                 "devices": devices}
    }))
    .expect("slice")]
}

/// The lines of `table` that start (after indentation) with `prefix`.
fn lines_starting<'a>(table: &'a str, prefix: &str) -> Vec<&'a str> {
    table
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with(prefix))
        .collect()
}

#[test]
fn an_error_on_some_devices_is_one_line_naming_a_few_of_them() {
    // Six GPUs without a profile and two MIG devices with one: the class errors on the six.
    let mut devices: Vec<(String, Value)> = (0..6)
        .map(|i| (format!("gpu-{i}"), json!({"type": {"string": "gpu"}})))
        .collect();
    for i in 0..2 {
        devices.push((
            format!("gpu-0-mig-{i}"),
            json!({"type": {"string": "mig"}, "profile": {"string": "1g.10gb"}}),
        ));
    }
    let devices: Vec<(&str, Value, Value)> = devices
        .iter()
        .map(|(n, a)| (n.as_str(), a.clone(), json!({})))
        .collect();
    let classes = [class(
        "small",
        &[r#"device.attributes["gpu.dra.dev"].profile == "1g.10gb""#],
    )];
    let report = check(DRIVER, &classes, &[], &slice_devices(&slice_of(&devices)));
    let table = report.to_table();
    assert_eq!(
        lines_starting(&table, "BLOCKING error"),
        ["BLOCKING error: class small: selector #0 on 6 of 8 devices (gpu.dra.dev/node-a/gpu-0, gpu.dra.dev/node-a/gpu-1, gpu.dra.dev/node-a/gpu-2, ...): CEL runtime error: no such key: profile. consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has() for optional fields"],
        "{table}"
    );
    // Published by two devices: no hint.
    assert!(!table.contains("hint:"), "{table}");

    let json: Value = serde_json::from_str(&report.to_json()).expect("JSON");
    let error = &json["subjects"][0]["errors"][0];
    assert_eq!(
        json["subjects"][0]["errors"].as_array().map(Vec::len),
        Some(1)
    );
    assert_eq!(error["device"], "gpu.dra.dev/node-a/gpu-0");
    assert_eq!(error["devices"].as_array().map(Vec::len), Some(6));
    assert_eq!(error["devices"][5], "gpu.dra.dev/node-a/gpu-5");
    assert_eq!(error["evaluated"], 8);
    assert_eq!(error["blocking"], true);
}

#[test]
fn the_devices_an_error_is_counted_against_are_those_the_selector_ran_on() {
    assert_eq!(
        super::on_devices(&["d/p/gpu-0".to_string()], 1),
        "on device d/p/gpu-0"
    );
    assert_eq!(
        super::on_devices(&["d/p/gpu-0".to_string()], 3),
        "on 1 of 3 devices (d/p/gpu-0)"
    );
    let three: Vec<String> = (0..3).map(|i| format!("gpu-{i}")).collect();
    assert_eq!(super::on_devices(&three, 3), "on all 3 devices");
    assert_eq!(
        super::on_devices(&three, 5),
        "on 3 of 5 devices (gpu-0, gpu-1, gpu-2)"
    );
}

/// The table of checking `expression` as a request of claim ml/train (class `gpu`, which takes the two
/// GPUs of `slices()`).
fn request_table(expression: &str) -> String {
    let classes = [class("gpu", &[IS_GPU])];
    let claims = [claim(json!([
        {"name": "r", "exactly": {"deviceClassName": "gpu", "selectors": [{"cel": {"expression": expression}}]}},
    ]))];
    check(DRIVER, &classes, &claims, &slice_devices(&slices())).to_table()
}

#[test]
fn a_name_no_device_publishes_gets_the_nearest_published_one() {
    let cases = [
        (
            r#"device.attributes["gpu.dra.dev"].typ == "gpu""#,
            "hint: no device has attribute gpu.dra.dev/typ: did you mean type?",
        ),
        (
            r#"device.capacity["gpu.dra.dev"].memroy.compareTo(quantity("1Gi")) > 0"#,
            "hint: no device has capacity gpu.dra.dev/memroy: did you mean memory?",
        ),
        (
            r#"device.capacity["gpu.dra.de"].memory.compareTo(quantity("1Gi")) > 0"#,
            "hint: no device has capacities in domain gpu.dra.de: did you mean gpu.dra.dev?",
        ),
        // The other map.
        (
            r#"device.attributes["gpu.dra.dev"].memory == 1"#,
            r#"hint: no device has attribute gpu.dra.dev/memory: did you mean device.capacity["gpu.dra.dev"].memory?"#,
        ),
        // Nothing near: the fact alone.
        (
            r#"device.attributes["gpu.dra.dev"].cudaCores >= 1"#,
            "hint: no device has attribute gpu.dra.dev/cudaCores",
        ),
    ];
    for (expression, want) in cases {
        let table = request_table(expression);
        let errors = lines_starting(&table, "BLOCKING error");
        assert_eq!(errors.len(), 1, "{table}");
        assert!(
            errors[0].starts_with("BLOCKING error: request r: selector #0 on all 2 devices: CEL runtime error: no such key: "),
            "{table}"
        );
        assert_eq!(lines_starting(&table, "hint:"), [want], "{table}");
    }
}

#[test]
fn a_guarded_lookup_of_a_name_no_device_publishes_gets_the_hint_under_no_match() {
    let expression = r#"has(device.attributes["gpu.dra.dev"].tpye)"#;
    let table = request_table(expression);
    let lines: Vec<&str> = table.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with(&format!("  no match (request r selector #0: {expression})")))
        .expect(&table);
    assert_eq!(
        lines[at + 1],
        "    hint: no device has attribute gpu.dra.dev/tpye: did you mean type?",
        "{table}"
    );
    assert!(!table.contains("BLOCKING"), "{table}");
}

#[test]
fn a_name_published_in_another_domain_is_suggested_there() {
    let devices = [(
        "gpu-0",
        json!({"type": {"string": "gpu"}, "resource.kubernetes.io/pciBusID": {"string": "0000:01:00.0"}}),
        json!({}),
    )];
    let classes = [class(
        "gpu",
        &[r#"device.attributes["gpu.dra.dev"].pciBusID != """#],
    )];
    let table = check(DRIVER, &classes, &[], &slice_devices(&slice_of(&devices))).to_table();
    assert_eq!(
        lines_starting(&table, "BLOCKING error"),
        ["BLOCKING error: class gpu: selector #0 on device gpu.dra.dev/node-a/gpu-0: CEL runtime error: no such key: pciBusID. consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has() for optional fields"],
        "{table}"
    );
    assert_eq!(
        lines_starting(&table, "hint:"),
        [
            r#"hint: no device has attribute gpu.dra.dev/pciBusID: did you mean device.attributes["resource.kubernetes.io"].pciBusID?"#
        ],
        "{table}"
    );
    let json: Value = serde_json::from_str(
        &check(DRIVER, &classes, &[], &slice_devices(&slice_of(&devices))).to_json(),
    )
    .expect("JSON");
    assert_eq!(
        json["subjects"][0]["errors"][0]["selector"]["hints"][0],
        r#"no device has attribute gpu.dra.dev/pciBusID: did you mean device.attributes["resource.kubernetes.io"].pciBusID?"#
    );
}

#[test]
fn edit_distance_counts_swaps_as_one() {
    use super::hints::edit_distance;
    let cases = [
        ("productName", "productName", 0),
        ("productNam", "productName", 1),
        ("memroy", "memory", 1),
        ("gpu.dra.de", "gpu.dra.dev", 1),
        ("type", "uuid", 4),
        ("", "abc", 3),
        ("kitten", "sitting", 3),
    ];
    for (a, b, want) in cases {
        assert_eq!(edit_distance(a, b), want, "{a} {b}");
        assert_eq!(edit_distance(b, a), want, "{b} {a}");
    }
}
