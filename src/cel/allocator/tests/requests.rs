//! Requests as the search serves them: first fit in slice and device order, devices in use, one device
//! per claim, allocation mode All, firstAvailable, admin access, malformed claims and the step bound.

use k8s_openapi::api::resource::v1::DeviceRequestAllocationResult;
use serde_json::json;

use super::{
    claim, classes, devices_of, exactly, gpu, gpus, one_slice, partitioned, picks, run, slice,
    used, DRIVER, NODE,
};
use crate::cel::allocator::{
    allocate, allocate_with_step_limit, in_use, AllocationError, InUse, Node, Pools,
};

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
