use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    DeviceRequestAllocationResult, ResourceClaimSpec, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{json, Value};

use super::{
    allocate, allocate_with_step_limit, in_use, AllocationError, Candidate, InUse, Node, Pools,
    SelectorOrigin,
};
use crate::cel::CelError;
use crate::quantity::Quantity;

const DRIVER: &str = "gpu.dra.dev";
const NODE: &str = "node-a";

fn slice(name: &str, pool: &str, generation: i64, count: i64, spec: Value) -> ResourceSlice {
    let mut spec = spec;
    spec["driver"] = json!(DRIVER);
    spec["pool"] = json!({"name": pool, "generation": generation, "resourceSliceCount": count});
    if spec.get("nodeName").is_none() {
        spec["nodeName"] = json!(NODE);
    }
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        spec: serde_json::from_value(spec).expect("valid ResourceSliceSpec"),
    }
}

/// A whole GPU with an index and an NVLink domain.
fn gpu(index: i64, domain: &str) -> Value {
    json!({
        "name": format!("gpu-{index}"),
        "attributes": {
            "type": {"string": "gpu"},
            "index": {"int": index},
            "nvlinkDomain": {"string": domain},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    })
}

fn gpus(domains: &[&str]) -> Vec<Value> {
    domains
        .iter()
        .enumerate()
        .map(|(i, domain)| gpu(i as i64, domain))
        .collect()
}

fn classes() -> BTreeMap<String, Vec<String>> {
    BTreeMap::from([
        (
            "gpu.dra.dev".to_string(),
            vec![format!(r#"device.driver == "{DRIVER}""#)],
        ),
        (
            "gpu".to_string(),
            vec![
                format!(r#"device.driver == "{DRIVER}""#),
                r#"device.attributes["gpu.dra.dev"].type == "gpu""#.to_string(),
            ],
        ),
        (
            "mig".to_string(),
            vec![
                format!(r#"device.driver == "{DRIVER}""#),
                r#"device.attributes["gpu.dra.dev"].type == "mig""#.to_string(),
            ],
        ),
    ])
}

fn claim(devices: Value) -> ResourceClaimSpec {
    serde_json::from_value(json!({ "devices": devices })).expect("valid ResourceClaimSpec")
}

/// A claim with one `exactly` request.
fn exactly(name: &str, class: &str, more: Value) -> Value {
    let mut exactly = json!({ "deviceClassName": class });
    if let (Some(target), Value::Object(fields)) = (exactly.as_object_mut(), more) {
        target.extend(fields);
    }
    json!({ "name": name, "exactly": exactly })
}

fn used(names: &[&str]) -> InUse {
    let devices: BTreeSet<Candidate> = names
        .iter()
        .map(|name| Candidate {
            driver: DRIVER.into(),
            pool: NODE.into(),
            device: name.to_string(),
        })
        .collect();
    InUse::from(devices)
}

/// (request, device) of each result.
fn picks(results: &[DeviceRequestAllocationResult]) -> Vec<(String, String)> {
    results
        .iter()
        .map(|r| (r.request.clone(), r.device.clone()))
        .collect()
}

fn devices_of(results: &[DeviceRequestAllocationResult]) -> Vec<String> {
    results.iter().map(|r| r.device.clone()).collect()
}

fn run(
    slices: &[ResourceSlice],
    in_use: &InUse,
    devices: Value,
) -> Result<Vec<DeviceRequestAllocationResult>, AllocationError> {
    let pools = Pools::from_slices(slices, Some(&Node::named(NODE)));
    allocate(&pools, &classes(), in_use, &claim(devices))
}

fn one_slice(devices: Vec<Value>) -> Vec<ResourceSlice> {
    vec![slice(
        "node-a-gpu",
        NODE,
        1,
        1,
        json!({ "devices": devices }),
    )]
}

#[test]
fn first_fit_follows_slice_names_then_device_order() {
    // Listed out of order: the scheduler sorts slices of a pool by name.
    let slices = vec![
        slice(
            "node-a-2",
            NODE,
            1,
            2,
            json!({"devices": [gpu(2, "A"), gpu(3, "A")]}),
        ),
        slice(
            "node-a-1",
            NODE,
            1,
            2,
            json!({"devices": [gpu(1, "A"), gpu(0, "A")]}),
        ),
    ];
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    let order: Vec<&str> = pools.devices().map(|(c, _)| c.device.as_str()).collect();
    assert_eq!(order, ["gpu-1", "gpu-0", "gpu-2", "gpu-3"]);

    let results = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("gpus", "gpu", json!({"count": 3}))]}),
    )
    .expect("allocated");
    assert_eq!(devices_of(&results), ["gpu-1", "gpu-0", "gpu-2"]);
    assert!(results
        .iter()
        .all(|r| r.request == "gpus" && r.driver == DRIVER && r.pool == NODE));
    assert!(results
        .iter()
        .all(|r| r.admin_access.is_none() && r.tolerations.is_none()));
}

#[test]
fn devices_in_use_are_skipped() {
    let slices = one_slice(gpus(&["A", "A", "A"]));
    let results = run(
        &slices,
        &used(&["gpu-0"]),
        json!({"requests": [exactly("gpu", "gpu", json!({}))]}),
    )
    .expect("allocated");
    assert_eq!(devices_of(&results), ["gpu-1"]);

    let error = run(
        &slices,
        &used(&["gpu-0", "gpu-2"]),
        json!({"requests": [exactly("gpus", "gpu", json!({"count": 2}))]}),
    )
    .expect_err("only one free");
    match error {
        AllocationError::NotEnoughDevices {
            ref request,
            matched,
            free,
            wanted,
            ref notes,
        } => {
            assert_eq!((request.as_str(), matched, free, wanted), ("gpus", 3, 1, 2));
            assert!(notes.contains("gpu-0 is in use"), "{notes}");
        }
        other => panic!("unexpected {other}"),
    }
    assert!(error
        .to_string()
        .contains("3 match the selectors, 1 of them usable, 2 wanted"));
}

#[test]
fn a_device_is_allocated_once_per_claim() {
    let slices = one_slice(gpus(&["A", "A"]));
    let results = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("a", "gpu", json!({})), exactly("b", "gpu", json!({}))]}),
    )
    .expect("allocated");
    assert_eq!(
        picks(&results),
        [("a".into(), "gpu-0".into()), ("b".into(), "gpu-1".into())]
    );

    let error = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("a", "gpu", json!({"count": 2})), exactly("b", "gpu", json!({}))]}),
    )
    .expect_err("three devices from two");
    assert!(
        matches!(error, AllocationError::Unsatisfiable { .. }),
        "{error}"
    );
}

/// GPU 0 partitionable into MIG devices: the whole GPU takes all 8 memory slices, each 1g device one,
/// the 2g device slices 0 and 1. `split` puts the counter set into a slice of its own (1.35+);
/// otherwise it sits beside the devices (1.34).
fn partitioned(split: bool) -> Vec<ResourceSlice> {
    let all_slices: BTreeMap<String, Value> = (0..8)
        .map(|i| (format!("memory-slice-{i}"), json!({"value": "1"})))
        .collect();
    let mig = |name: &str, profile: &str, memory: &[u32]| {
        let counters: BTreeMap<String, Value> = memory
            .iter()
            .map(|i| (format!("memory-slice-{i}"), json!({"value": "1"})))
            .collect();
        json!({
            "name": name,
            "attributes": {"type": {"string": "mig"}, "profile": {"string": profile}},
            "consumesCounters": [{"counterSet": "gpu-0-counters", "counters": counters}],
        })
    };
    let mut whole = gpu(0, "A");
    whole["consumesCounters"] =
        json!([{"counterSet": "gpu-0-counters", "counters": all_slices.clone()}]);
    let devices = json!([
        whole,
        mig("gpu-0-mig-1g-0", "1g.10gb", &[0]),
        mig("gpu-0-mig-1g-1", "1g.10gb", &[1]),
        mig("gpu-0-mig-2g-0", "2g.20gb", &[0, 1]),
    ]);
    let counters = json!([{"name": "gpu-0-counters", "counters": all_slices}]);
    if split {
        vec![
            slice(
                "node-a-counters",
                NODE,
                1,
                2,
                json!({"sharedCounters": counters}),
            ),
            slice("node-a-devices", NODE, 1, 2, json!({"devices": devices})),
        ]
    } else {
        vec![slice(
            "node-a-gpu",
            NODE,
            1,
            1,
            json!({"devices": devices, "sharedCounters": counters}),
        )]
    }
}

fn mig_request(name: &str, profile: &str) -> Value {
    exactly(
        name,
        "mig",
        json!({"selectors": [{"cel": {"expression": format!(r#"device.attributes["gpu.dra.dev"].profile == "{profile}""#)}}]}),
    )
}

#[test]
fn counters_keep_a_whole_gpu_and_its_partitions_apart() {
    for split in [false, true] {
        let slices = partitioned(split);
        let layout = if split { "1.35 split" } else { "1.34 combined" };

        // Whole GPU and a partition in one claim: each fits alone, not both.
        let error = run(
            &slices,
            &InUse::default(),
            json!({"requests": [exactly("gpu", "gpu", json!({})), mig_request("mig", "1g.10gb")]}),
        )
        .expect_err(layout);
        assert!(
            matches!(error, AllocationError::Unsatisfiable { .. }),
            "{layout}: {error}"
        );

        // The whole GPU in use: no partition is left.
        let error = run(
            &slices,
            &used(&["gpu-0"]),
            json!({"requests": [mig_request("mig", "1g.10gb")]}),
        )
        .expect_err(layout);
        match &error {
            AllocationError::NotEnoughDevices {
                matched,
                free,
                notes,
                ..
            } => {
                assert_eq!((*matched, *free), (2, 0), "{layout}");
                assert!(
                    notes.contains("gpu-0-mig-1g-0 needs 1 of counter gpu-0-counters/memory-slice-0, which has 0 left"),
                    "{layout}: {notes}"
                );
            }
            other => panic!("{layout}: unexpected {other}"),
        }

        // A partition in use: the whole GPU and overlapping partitions are out, disjoint ones are not.
        let in_use = used(&["gpu-0-mig-1g-0"]);
        let error = run(
            &slices,
            &in_use,
            json!({"requests": [exactly("gpu", "gpu", json!({}))]}),
        )
        .expect_err(layout);
        assert!(
            matches!(error, AllocationError::NotEnoughDevices { free: 0, .. }),
            "{layout}: {error}"
        );
        let error = run(
            &slices,
            &in_use,
            json!({"requests": [mig_request("mig", "2g.20gb")]}),
        )
        .expect_err(layout);
        assert!(
            matches!(error, AllocationError::NotEnoughDevices { free: 0, .. }),
            "{layout}: {error}"
        );
        let results = run(
            &slices,
            &in_use,
            json!({"requests": [mig_request("mig", "1g.10gb")]}),
        )
        .expect(layout);
        assert_eq!(devices_of(&results), ["gpu-0-mig-1g-1"], "{layout}");

        // Overlapping partitions within one claim: two 1g fit, the 2g never joins them.
        let results = run(
            &slices,
            &InUse::default(),
            json!({"requests": [exactly("migs", "mig", json!({"count": 2}))]}),
        )
        .expect(layout);
        assert_eq!(
            devices_of(&results),
            ["gpu-0-mig-1g-0", "gpu-0-mig-1g-1"],
            "{layout}"
        );
        let error = run(
            &slices,
            &InUse::default(),
            json!({"requests": [exactly("migs", "mig", json!({"count": 3}))]}),
        )
        .expect_err(layout);
        assert!(
            matches!(error, AllocationError::Unsatisfiable { .. }),
            "{layout}: {error}"
        );
        let error = run(
            &slices,
            &InUse::default(),
            json!({"requests": [mig_request("small", "1g.10gb"), mig_request("big", "2g.20gb")]}),
        )
        .expect_err(layout);
        assert!(
            matches!(error, AllocationError::Unsatisfiable { .. }),
            "{layout}: {error}"
        );
    }
}

#[test]
fn remaining_counters_subtract_devices_in_use() {
    let pools = Pools::from_slices(&partitioned(true), Some(&Node::named(NODE)));
    let remaining = pools.remaining_counters(&used(&["gpu-0-mig-2g-0"]));
    let left = |counter: &str| {
        remaining[&(
            DRIVER.to_string(),
            NODE.to_string(),
            "gpu-0-counters".to_string(),
            counter.to_string(),
        )]
            .clone()
    };
    assert_eq!(left("memory-slice-0"), Quantity::zero());
    assert_eq!(left("memory-slice-1"), Quantity::zero());
    assert_eq!(
        left("memory-slice-2"),
        Quantity::parse("1").expect("quantity")
    );
}

#[test]
fn consuming_an_unknown_counter_set_makes_the_pool_invalid() {
    let devices = vec![json!({
        "name": "gpu-0-mig-1g-0",
        "attributes": {"type": {"string": "mig"}},
        "consumesCounters": [{"counterSet": "gpu-9-counters", "counters": {"memory-slice-0": {"value": "1"}}}],
    })];
    let error = run(
        &one_slice(devices),
        &InUse::default(),
        json!({"requests": [exactly("mig", "mig", json!({}))]}),
    )
    .expect_err("no counter set");
    assert_eq!(
        error.to_string(),
        "invalid resource pools were encountered: pool gpu.dra.dev/node-a: device gpu-0-mig-1g-0: \
         counter set gpu-9-counters not found"
    );
}

#[test]
fn all_mode_takes_every_matching_device() {
    let slices = one_slice(gpus(&["A", "A", "B"]));
    let results = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("all", "gpu", json!({"allocationMode": "All"}))]}),
    )
    .expect("allocated");
    assert_eq!(devices_of(&results), ["gpu-0", "gpu-1", "gpu-2"]);

    // As in the scheduler, "all" means all matching devices: one in use fails the request.
    let error = run(
        &slices,
        &used(&["gpu-1"]),
        json!({"requests": [exactly("all", "gpu", json!({"allocationMode": "All"}))]}),
    )
    .expect_err("one in use");
    assert!(
        matches!(
            error,
            AllocationError::NotEnoughDevices {
                matched: 3,
                free: 2,
                wanted: 3,
                ..
            }
        ),
        "{error}"
    );

    // At least one device.
    let error = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("all", "mig", json!({"allocationMode": "All"}))]}),
    )
    .expect_err("no MIG devices");
    assert!(
        matches!(error, AllocationError::NotEnoughDevices { matched: 0, .. }),
        "{error}"
    );

    // An incomplete pool makes "all" unknowable.
    let mut slices = slices;
    slices.push(slice(
        "node-a-other",
        "node-a-other",
        1,
        2,
        json!({"devices": [gpu(7, "C")]}),
    ));
    let error = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("all", "gpu", json!({"allocationMode": "All"}))]}),
    )
    .expect_err("incomplete pool");
    assert!(
        matches!(error, AllocationError::PoolNotReady { .. }),
        "{error}"
    );
}

#[test]
fn first_available_falls_back_in_order() {
    let slices = one_slice(gpus(&["A", "A", "A"]));
    let request = json!({"requests": [{
        "name": "gpus",
        "firstAvailable": [
            {"name": "four", "deviceClassName": "gpu", "count": 4},
            {"name": "two", "deviceClassName": "gpu", "count": 2},
            {"name": "one", "deviceClassName": "gpu"},
        ],
    }]});
    let results = run(&slices, &InUse::default(), request.clone()).expect("allocated");
    assert_eq!(
        picks(&results),
        [
            ("gpus/two".into(), "gpu-0".into()),
            ("gpus/two".into(), "gpu-1".into())
        ]
    );
    let results = run(&slices, &used(&["gpu-0", "gpu-2"]), request.clone()).expect("allocated");
    assert_eq!(picks(&results), [("gpus/one".into(), "gpu-1".into())]);

    let error = run(&slices, &used(&["gpu-0", "gpu-1", "gpu-2"]), request).expect_err("none free");
    match error {
        AllocationError::NotEnoughDevices {
            ref request,
            ref notes,
            ..
        } => {
            assert_eq!(request, "gpus/one");
            assert!(
                notes.contains("alternative gpus/four also short"),
                "{notes}"
            );
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn admin_access_ignores_use_and_counters_but_not_the_claim() {
    let slices = partitioned(false);
    let admin = |name: &str| {
        exactly(
            name,
            "gpu",
            json!({"adminAccess": true, "selectors": [{"cel": {"expression": r#"device.attributes["gpu.dra.dev"].index == 0"#}}]}),
        )
    };
    // gpu-0 itself and a partition of it are in use.
    let results = run(
        &slices,
        &used(&["gpu-0", "gpu-0-mig-1g-0"]),
        json!({"requests": [admin("monitor")]}),
    )
    .expect("admin access");
    assert_eq!(devices_of(&results), ["gpu-0"]);
    assert_eq!(results[0].admin_access, Some(true));

    // Still only once per claim.
    let error = run(
        &slices,
        &InUse::default(),
        json!({"requests": [admin("a"), admin("b")]}),
    )
    .expect_err("twice in one claim");
    assert!(
        matches!(error, AllocationError::Unsatisfiable { .. }),
        "{error}"
    );

    // Admin-access results do not count as in use.
    let admin_result = DeviceRequestAllocationResult {
        request: "monitor".into(),
        driver: DRIVER.into(),
        pool: NODE.into(),
        device: "gpu-0".into(),
        admin_access: Some(true),
        ..Default::default()
    };
    assert_eq!(in_use([&admin_result]), InUse::default());
}

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
fn malformed_claims_are_refused() {
    let slices = one_slice(gpus(&["A"]));
    let error = run(&slices, &InUse::default(), json!({"requests": []})).expect_err("no requests");
    assert!(matches!(error, AllocationError::NoRequests));
    let error = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("gpu", "no-such-class", json!({}))]}),
    )
    .expect_err("unknown class");
    assert!(
        matches!(error, AllocationError::UnknownDeviceClass { ref class, .. } if class == "no-such-class"),
        "{error}"
    );
    let error = run(
        &slices,
        &InUse::default(),
        json!({"requests": [exactly("gpu", "gpu", json!({"count": 33}))]}),
    )
    .expect_err("too many");
    assert!(
        matches!(error, AllocationError::TooManyDevices { wanted: 33 }),
        "{error}"
    );
}

#[test]
fn incomplete_pools_and_old_generations_are_ignored() {
    let slices = vec![
        // Pool node-a is at generation 2, where one of its two slices is missing.
        slice("node-a-1", NODE, 2, 2, json!({"devices": [gpu(0, "A")]})),
        slice("node-a-old", NODE, 1, 1, json!({"devices": [gpu(9, "A")]})),
        // Pool node-a-extra: generation 3 replaced generation 2.
        slice(
            "node-a-extra-old",
            "node-a-extra",
            2,
            1,
            json!({"devices": [gpu(5, "B")]}),
        ),
        slice(
            "node-a-extra-new",
            "node-a-extra",
            3,
            1,
            json!({"devices": [gpu(6, "B")]}),
        ),
    ];
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    let devices: Vec<String> = pools.devices().map(|(c, _)| c.to_string()).collect();
    assert_eq!(devices, ["gpu.dra.dev/node-a-extra/gpu-6"]);
    assert_eq!(pools.skipped().len(), 1);
    assert_eq!(pools.skipped()[0].pool, NODE);
    assert!(pools.skipped()[0]
        .reason
        .contains("1 of 2 slices at generation 2"));

    let error = allocate(
        &pools,
        &classes(),
        &InUse::default(),
        &claim(json!({"requests": [exactly("gpus", "gpu", json!({"count": 2}))]})),
    )
    .expect_err("only one device");
    assert!(
        error
            .to_string()
            .contains("pool gpu.dra.dev/node-a skipped: incomplete"),
        "{error}"
    );
}

#[test]
fn node_filter_keeps_the_nodes_slices() {
    let slices = vec![
        slice("node-a", NODE, 1, 1, json!({"devices": [gpu(0, "A")]})),
        slice(
            "node-b",
            "node-b",
            1,
            1,
            json!({"nodeName": "node-b", "devices": [gpu(0, "A")]}),
        ),
    ];
    let pools_a: Vec<String> = Pools::from_slices(&slices, Some(&Node::named(NODE)))
        .devices()
        .map(|(c, _)| c.to_string())
        .collect();
    assert_eq!(pools_a, ["gpu.dra.dev/node-a/gpu-0"]);
    assert_eq!(Pools::from_slices(&slices, None).devices().count(), 2);
}

#[test]
fn duplicate_device_names_invalidate_the_pool() {
    let slices = vec![
        slice("node-a-1", NODE, 1, 2, json!({"devices": [gpu(0, "A")]})),
        slice("node-a-2", NODE, 1, 2, json!({"devices": [gpu(0, "A")]})),
    ];
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    assert_eq!(pools.devices().count(), 0);
    assert!(pools.skipped()[0]
        .reason
        .contains("duplicate device name gpu-0"));
}

#[test]
fn the_search_is_bounded() {
    // Two domains, three GPUs with pairwise different domains wanted: every pair is tried first.
    let domains: Vec<&str> = (0..30)
        .map(|i| if i % 2 == 0 { "A" } else { "B" })
        .collect();
    let slices = one_slice(gpus(&domains));
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    let spec = claim(json!({
        "requests": [exactly("gpus", "gpu", json!({"count": 3}))],
        "constraints": [{"distinctAttribute": "gpu.dra.dev/nvlinkDomain"}],
    }));
    let error = allocate_with_step_limit(&pools, &classes(), &InUse::default(), &spec, 100)
        .expect_err("step limit");
    assert!(
        matches!(error, AllocationError::StepLimit { limit: 100 }),
        "{error}"
    );
    let error = allocate(&pools, &classes(), &InUse::default(), &spec).expect_err("impossible");
    assert!(
        matches!(error, AllocationError::Unsatisfiable { .. }),
        "{error}"
    );
}

#[test]
fn node_selectors_and_per_device_selection_pick_the_nodes_devices() {
    let zone = |z: &str| json!({"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": [z]}]}]});
    let mut by_selector = json!({"nodeSelector": zone("z1"), "devices": [gpu(0, "A")]});
    by_selector["nodeName"] = Value::Null;
    let mut per_device = json!({"perDeviceNodeSelection": true, "devices": [
        {"name": "mine", "nodeName": NODE}, {"name": "theirs", "nodeName": "node-b"},
        {"name": "everyone", "allNodes": true}, {"name": "zoned", "nodeSelector": zone("z2")}]});
    per_device["nodeName"] = Value::Null;
    let slices = vec![
        slice("a-selected", "zoned-pool", 1, 1, by_selector),
        slice("b-per-device", "shared-pool", 1, 1, per_device),
    ];
    let devices = |labels: &[(&str, &str)]| -> Vec<String> {
        let node = Node {
            name: NODE.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        Pools::from_slices(&slices, Some(&node))
            .devices()
            .map(|(c, _)| format!("{}/{}", c.pool, c.device))
            .collect()
    };
    assert_eq!(devices(&[]), ["shared-pool/mine", "shared-pool/everyone"]);
    assert_eq!(
        devices(&[("zone", "z1")]),
        [
            "shared-pool/mine",
            "shared-pool/everyone",
            "zoned-pool/gpu-0"
        ]
    );
    assert_eq!(
        devices(&[("zone", "z2")]),
        [
            "shared-pool/mine",
            "shared-pool/everyone",
            "shared-pool/zoned"
        ]
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
