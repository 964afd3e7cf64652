//! Constraints across a claim's devices: matchAttribute (with backtracking to a domain that has
//! enough free GPUs, and either spelling of a driver-domain attribute) and distinctAttribute.

use serde_json::json;

use super::{devices_of, exactly, gpu, gpus, one_slice, picks, run, used};
use crate::cel::allocator::{AllocationError, InUse};

#[test]
fn match_attribute_backtracks_to_a_domain_with_enough_free_gpus() {
    let slices = one_slice(gpus(&["A", "A", "B", "B"]));
    let constraint = json!([{"matchAttribute": "gpu.dra.dev/nvlinkDomain"}]);
    let results = run(
        &slices,
        &used(&["gpu-0"]),
        json!({"requests": [exactly("gpus", "gpu", json!({"count": 2}))], "constraints": constraint}),
    )
    .expect("allocated");
    assert_eq!(devices_of(&results), ["gpu-2", "gpu-3"]);

    // Across requests named by the constraint, with the first request's pick revisited.
    let results = run(
        &slices,
        &used(&["gpu-0"]),
        json!({
            "requests": [exactly("a", "gpu", json!({})), exactly("b", "gpu", json!({})), exactly("c", "gpu", json!({}))],
            "constraints": [{"matchAttribute": "gpu.dra.dev/nvlinkDomain", "requests": ["a", "b"]}],
        }),
    )
    .expect("allocated");
    assert_eq!(
        picks(&results),
        [
            ("a".into(), "gpu-2".into()),
            ("b".into(), "gpu-3".into()),
            ("c".into(), "gpu-1".into())
        ]
    );

    // A device without the attribute cannot be used for the constrained request.
    let mut devices = gpus(&["A", "A"]);
    devices[0]["attributes"]
        .as_object_mut()
        .expect("attributes")
        .remove("nvlinkDomain");
    let results = run(
        &one_slice(devices),
        &InUse::default(),
        json!({"requests": [exactly("gpu", "gpu", json!({}))], "constraints": constraint}),
    )
    .expect("allocated");
    assert_eq!(devices_of(&results), ["gpu-1"]);

    let error = run(
        &slices,
        &used(&["gpu-0", "gpu-2"]),
        json!({"requests": [exactly("gpus", "gpu", json!({"count": 2}))], "constraints": constraint}),
    )
    .expect_err("no domain with two free");
    assert!(
        error
            .to_string()
            .contains("matchAttribute gpu.dra.dev/nvlinkDomain"),
        "{error}"
    );
}

#[test]
fn distinct_attribute_spreads_devices() {
    let slices = one_slice(gpus(&["A", "A", "B", "B"]));
    let constraint = json!([{"distinctAttribute": "gpu.dra.dev/nvlinkDomain"}]);
    let results = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("gpus", "gpu", json!({"count": 2}))], "constraints": constraint}),
    )
    .expect("allocated");
    assert_eq!(devices_of(&results), ["gpu-0", "gpu-2"]);
    let error = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("gpus", "gpu", json!({"count": 3}))], "constraints": constraint}),
    )
    .expect_err("only two domains");
    assert!(
        matches!(error, AllocationError::Unsatisfiable { .. }),
        "{error}"
    );
}

#[test]
fn match_attribute_finds_qualified_and_driver_domain_names() {
    // One device publishes the attribute with its driver's domain spelled out, the other without.
    let mut qualified = gpu(0, "A");
    qualified["attributes"] =
        json!({"type": {"string": "gpu"}, "gpu.dra.dev/nvlinkDomain": {"string": "A"}});
    let slices = one_slice(vec![qualified, gpu(1, "A"), gpu(2, "B")]);
    let results = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("gpus", "gpu", json!({"count": 2}))],
               "constraints": [{"matchAttribute": "gpu.dra.dev/nvlinkDomain"}]}),
    )
    .expect("both A devices");
    assert_eq!(devices_of(&results), ["gpu-0", "gpu-1"]);
}
