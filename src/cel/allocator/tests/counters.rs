//! Shared counters: a whole GPU and its MIG partitions consume the same memory slices, devices in use
//! take theirs away, and a device that names a counter set the pool lacks makes the pool invalid.

use serde_json::json;

use super::{devices_of, exactly, mig_request, one_slice, partitioned, run, used, DRIVER, NODE};
use crate::cel::allocator::{AllocationError, InUse, Node, Pools};
use crate::quantity::Quantity;

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
