//! What rules a device in or out for a request: taints and the tolerations that let a request past
//! them, and selectors of the request and its class, whose errors name the expression, the device and
//! where the selector came from.

use serde_json::{json, Value};

use super::{claim, classes, devices_of, exactly, gpus, one_slice, picks, run, used, NODE};
use crate::cel::allocator::{allocate, AllocationError, InUse, Node, Pools, SelectorOrigin};
use crate::cel::CelError;

#[test]
fn taints_block_unless_tolerated() {
    let mut devices = gpus(&["A", "A"]);
    devices[0]["taints"] =
        json!([{"key": "gpu.dra.dev/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]);
    devices[1]["taints"] = json!([{"key": "gpu.dra.dev/draining", "effect": "None"}]);
    let slices = one_slice(devices);
    let first = |tolerations: Value| {
        run(
            &slices,
            &InUse::default(),
            json!({"requests": [exactly("gpu", "gpu", json!({"tolerations": tolerations}))]}),
        )
        .map(|results| devices_of(&results))
    };
    // Effect None does not block; NoSchedule does.
    assert_eq!(first(json!([])).expect("allocated"), ["gpu-1"]);
    for tolerated in [
        json!([{"key": "gpu.dra.dev/unhealthy", "operator": "Exists"}]),
        json!([{"key": "gpu.dra.dev/unhealthy", "operator": "Equal", "value": "xid-79", "effect": "NoSchedule"}]),
        json!([{"key": "gpu.dra.dev/unhealthy", "value": "xid-79"}]),
        json!([{"operator": "Exists"}]),
    ] {
        assert_eq!(
            first(tolerated.clone()).expect("allocated"),
            ["gpu-0"],
            "{tolerated}"
        );
    }
    for not_tolerated in [
        json!([{"key": "gpu.dra.dev/unhealthy", "operator": "Exists", "effect": "NoExecute"}]),
        json!([{"key": "gpu.dra.dev/unhealthy", "operator": "Equal", "value": "xid-48"}]),
        json!([{"key": "other", "operator": "Exists"}]),
    ] {
        assert_eq!(
            first(not_tolerated.clone()).expect("allocated"),
            ["gpu-1"],
            "{not_tolerated}"
        );
    }

    // The result carries the request's tolerations; an untolerated taint is reported.
    let results = run(
        &slices,
        &used(&["gpu-1"]),
        json!({"requests": [exactly("gpu", "gpu", json!({"tolerations": [{"operator": "Exists"}]}))]}),
    )
    .expect("tolerated");
    assert_eq!(results[0].tolerations.as_ref().map(Vec::len), Some(1));
    let error = run(
        &slices,
        &used(&["gpu-1"]),
        json!({"requests": [exactly("gpu", "gpu", json!({}))]}),
    )
    .expect_err("tainted");
    assert!(
        error
            .to_string()
            .contains("gpu-0 has taint gpu.dra.dev/unhealthy=xid-79:NoSchedule"),
        "{error}"
    );
}

#[test]
fn selectors_filter_and_errors_name_expression_and_device() {
    let slices = one_slice(gpus(&["A", "B"]));
    let selected = |expression: &str| {
        run(
            &slices,
            &InUse::default(),
            json!({"requests": [exactly("gpu", "gpu.dra.dev", json!({"selectors": [{"cel": {"expression": expression}}]}))]}),
        )
    };
    let results =
        selected(r#"device.attributes["gpu.dra.dev"].nvlinkDomain == "B""#).expect("allocated");
    assert_eq!(devices_of(&results), ["gpu-1"]);
    let results = selected(r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40Gi")) >= 0 && device.attributes["gpu.dra.dev"].index != 0"#)
        .expect("allocated");
    assert_eq!(devices_of(&results), ["gpu-1"]);
    let error =
        selected(r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("81Gi")) >= 0"#)
            .expect_err("too small");
    assert!(
        matches!(error, AllocationError::NotEnoughDevices { matched: 0, .. }),
        "{error}"
    );

    let unknown = r#"device.attributes["gpu.dra.dev"].cudaCores >= 1"#;
    let error = selected(unknown).expect_err("unknown attribute");
    match &error {
        AllocationError::Selector {
            origin,
            index,
            expression,
            device,
            error: CelError::Runtime(reason),
        } => {
            assert_eq!(*origin, SelectorOrigin::Request("gpu".into()));
            assert_eq!(*index, 0);
            assert_eq!(expression, unknown);
            assert_eq!(device.as_ref().map(|d| d.device.as_str()), Some("gpu-0"));
            assert!(reason.contains("no such key: cudaCores"), "{reason}");
        }
        other => panic!("unexpected {other}"),
    }
    assert!(
        error.to_string().starts_with(
            "request gpu: selector #0 on device gpu.dra.dev/node-a/gpu-0: CEL runtime error: "
        ),
        "{error}"
    );

    // A compile error is an error too (raised when the selector is first needed), never "no match".
    let unsupported = r#"device.attributes["gpu.dra.dev"].index in noSuchList"#;
    match selected(unsupported).expect_err("does not compile") {
        AllocationError::Selector {
            expression,
            device: None,
            error: CelError::Compile(_),
            ..
        } => assert_eq!(expression, unsupported),
        other => panic!("unexpected {other}"),
    }

    // A class selector that rules a device out first keeps the request's erroring selector away.
    let results = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("mig", "mig", json!({"selectors": [{"cel": {"expression": unknown}}]}))]}),
    )
    .expect_err("no MIG devices");
    assert!(
        matches!(
            results,
            AllocationError::NotEnoughDevices { matched: 0, .. }
        ),
        "{results}"
    );
}

#[test]
fn class_selectors_run_first_and_their_errors_name_the_class() {
    let slices = one_slice(gpus(&["A"]));
    let mut classes = classes();
    classes.insert(
        "typo".into(),
        vec![r#"device.attributes["gpu.dra.dev"].cudaCores >= 1"#.into()],
    );
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    // No count: ExactCount of one device.
    let spec = claim(json!({"requests": [exactly("gpu", "typo", json!({
        "selectors": [{"cel": {"expression": "device.driver == \"other\""}}]}))]}));
    let error = allocate(&pools, &classes, &InUse::default(), &spec).expect_err("class error");
    assert!(
        error.to_string().starts_with(
            "class typo: selector #0 on device gpu.dra.dev/node-a/gpu-0: CEL runtime error:"
        ),
        "{error}"
    );
    let spec = claim(json!({"requests": [exactly("gpu", "gpu", json!({}))]}));
    let results = allocate(&pools, &classes, &InUse::default(), &spec).expect("one GPU");
    assert_eq!(picks(&results), [("gpu".to_string(), "gpu-0".to_string())]);
}
