//! Which slices make the node's pools: complete pools at their newest generation, the node's own
//! slices, node selectors and per-device node selection; duplicate device names invalidate a pool.

use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};

use super::{claim, classes, exactly, gpu, slice, NODE};
use crate::cel::allocator::{allocate, InUse, Node, Pools};

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
fn a_pool_moved_to_another_node_keeps_the_nodes_complete_older_generation() {
    // Generation 1 of pool "shared" is node-a's, complete; generation 2 went to node-b. The scheduler
    // gathers node-a's own slices first and, finding them complete, allocates from them.
    let on_b = |name: &str, generation: i64, index: i64| {
        slice(
            name,
            "shared",
            generation,
            2,
            json!({"nodeName": "node-b", "devices": [gpu(index, "A")]}),
        )
    };
    let mut slices = vec![
        slice("a-1", "shared", 1, 2, json!({"devices": [gpu(0, "A")]})),
        slice("a-2", "shared", 1, 2, json!({"devices": [gpu(1, "A")]})),
        on_b("b-1", 2, 0),
        on_b("b-2", 2, 1),
    ];
    let names = |slices: &[ResourceSlice], node: &str| -> Vec<String> {
        Pools::from_slices(slices, Some(&Node::named(node)))
            .devices()
            .map(|(c, _)| c.to_string())
            .collect()
    };
    assert_eq!(
        names(&slices, NODE),
        ["gpu.dra.dev/shared/gpu-0", "gpu.dra.dev/shared/gpu-1"]
    );
    assert_eq!(
        names(&slices, "node-b"),
        ["gpu.dra.dev/shared/gpu-0", "gpu.dra.dev/shared/gpu-1"]
    );

    // Half of node-a's generation 1 gone: its slices alone are not complete, so all of the pool's
    // decide, and generation 2 elsewhere makes them obsolete. The pool is not node-a's at all: no
    // device, and not "being updated", so an All request of another pool is not held up by it.
    slices.remove(1);
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    assert_eq!(pools.devices().count(), 0);
    assert!(pools.skipped().is_empty(), "{:?}", pools.skipped());
    slices.push(slice(
        "node-a",
        NODE,
        1,
        1,
        json!({"devices": [gpu(7, "B")]}),
    ));
    let pools = Pools::from_slices(&slices, Some(&Node::named(NODE)));
    let result = allocate(
        &pools,
        &classes(),
        &InUse::default(),
        &claim(json!({"requests": [{"name": "all", "exactly": {
            "deviceClassName": "gpu", "allocationMode": "All"}}]})),
    )
    .expect("all of node-a's own pool");
    assert_eq!(result.len(), 1, "{result:?}");

    // A generation spread over both nodes, complete only over both: node-a's part of it counts.
    let spread = vec![
        slice("a-1", "shared", 3, 2, json!({"devices": [gpu(0, "A")]})),
        on_b("b-1", 3, 1),
    ];
    assert_eq!(names(&spread, NODE), ["gpu.dra.dev/shared/gpu-0"]);
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
