//! `explain` for pods that ask for `nvidia.com/gpu` as an extended resource (KEP-5004, 1.34): DRA
//! nodes (a DeviceClass maps the resource), device-plugin nodes (the node's allocatable lists it),
//! and nodes where neither holds.

use serde_json::{json, Value};

use super::report::{NodeVerdict, ReasonKind, Report, ResourceSource};
use super::*;
use crate::devices::MigMode;
use crate::gpu::builtin_profile;
use crate::support::cluster::{self as fixture};

const NS: &str = "ml";
const GPU: &str = "nvidia.com/gpu";

/// dra-a: 8 H100 published by gpu.dra.dev, 6 held by another pod's extended-resources claim; dra-b:
/// 8 free H100; dp-c: a device plugin advertising 8, pods bound there use 7 (a Succeeded pod's 8 do
/// not count); dp-d: a device plugin advertising 8, 2 used; cpu-e: nothing.
fn objects(classes: Vec<Value>) -> Vec<Value> {
    let h100 = builtin_profile("dgx-h100").unwrap();
    let mut objects = classes;
    for node in ["dra-a", "dra-b"] {
        let slices = fixture::node_slices(node, &h100, MigMode::None);
        objects.extend(slices.iter().map(|s| serde_json::to_value(s).unwrap()));
        objects.push(fixture::node(node, &[], &[], false));
    }
    let held: Vec<(&str, &str)> = ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5"]
        .iter()
        .map(|d| ("container-0-request-0", *d))
        .collect();
    objects.push(fixture::limits_pod(
        "team",
        "other",
        json!({GPU: "6"}),
        Some("dra-a"),
    ));
    objects.push(fixture::extended_resource_claim(
        "team", "other", "dra-a", &held,
    ));
    for node in ["dp-c", "dp-d"] {
        let node = fixture::node(node, &[], &[], false);
        objects.push(fixture::with_allocatable(
            node,
            &[("cpu", "64"), (GPU, "8")],
        ));
    }
    for (name, count, node) in [
        ("p1", "4", "dp-c"),
        ("p2", "3", "dp-c"),
        ("p3", "2", "dp-d"),
    ] {
        objects.push(fixture::limits_pod(
            "team",
            name,
            json!({GPU: count}),
            Some(node),
        ));
    }
    let mut done = fixture::limits_pod("team", "done", json!({GPU: "8"}), Some("dp-c"));
    done["status"]["phase"] = json!("Succeeded");
    objects.push(done);
    objects.push(fixture::node("cpu-e", &[], &[], false));
    objects
}

fn cluster(objects: Vec<Value>) -> Cluster {
    let mut cluster = Cluster::default();
    for object in objects {
        cluster.add(object).unwrap();
    }
    cluster
}

fn mapped() -> Vec<Value> {
    objects(fixture::device_classes_serving(GPU))
}

fn explain_pod(mut objects: Vec<Value>, pod: Value) -> Report {
    let name = pod["metadata"]["name"].as_str().unwrap().to_string();
    objects.push(pod);
    explain(
        &cluster(objects),
        &Target::Pod {
            namespace: NS.into(),
            name,
        },
    )
    .unwrap()
}

fn verdict<'a>(report: &'a Report, node: &str) -> &'a NodeVerdict {
    report.nodes.iter().find(|n| n.node == node).unwrap()
}

/// The node's line as the table shows it.
fn why(report: &Report, node: &str) -> String {
    let table = report.to_table();
    let line = table
        .lines()
        .find(|l| l.starts_with(&format!("{node} ")))
        .unwrap_or_else(|| panic!("no line for {node} in\n{table}"));
    let after_node = line[node.len()..].trim_start();
    after_node
        .split_once(' ')
        .map_or("", |(_, text)| text)
        .trim()
        .to_string()
}

#[test]
fn gpus_as_an_extended_resource_come_from_dra_or_the_device_plugin_per_node() {
    let report = explain_pod(
        mapped(),
        fixture::limits_pod(NS, "train", json!({"cpu": "1", GPU: "2"}), None),
    );
    assert_eq!(report.exit_code(), 0);
    assert_eq!(
        report.summary,
        "would fit on 3 of 5 nodes; the scheduler picks among them"
    );
    // The claim the scheduler would make: cpu, nvidia.com/gpu sorted, so the GPUs are request 1.
    let table = report.to_table();
    assert!(table.contains(
        "claim ml/train-extended-resources-* (for extended resources nvidia.com/gpu, made by the scheduler per node): \
         container-0-request-1: 2 of class gpu.dra.dev (nvidia.com/gpu of container main)"
    ), "{table}");
    // Other pods' extended-resources claims hold their devices like any claim.
    assert_eq!(why(&report, "dra-a"), "gpu-6, gpu-7");
    assert_eq!(why(&report, "dra-b"), "gpu-0, gpu-1");
    let a = verdict(&report, "dra-a");
    assert_eq!(a.devices[0].claim, "ml/train-extended-resources-*");
    assert_eq!(a.devices[0].request, "container-0-request-1");
    assert_eq!(a.extended_resources[0].source, ResourceSource::Dra);
    assert_eq!(
        why(&report, "dp-c"),
        "device plugin: Insufficient nvidia.com/gpu (requested 2, used 7 of 8)"
    );
    let c = verdict(&report, "dp-c");
    assert_eq!(c.reasons[0].kind, ReasonKind::InsufficientResource);
    assert_eq!(c.reasons[0].resource.as_deref(), Some(GPU));
    assert_eq!(
        c.scheduler_reason.as_deref(),
        Some("Insufficient nvidia.com/gpu")
    );
    assert_eq!(
        why(&report, "dp-d"),
        "device plugin: nvidia.com/gpu fits (requested 2, 6 of 8 free)"
    );
    let d = verdict(&report, "dp-d");
    assert!(d.devices.is_empty(), "no DRA claim on a device-plugin node");
    let json: Value = serde_json::from_str(&report.render(Output::Json)).unwrap();
    let dp_d = json["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "dp-d")
        .unwrap();
    assert_eq!(
        dp_d["extendedResources"][0],
        json!({"resource": GPU, "source": "devicePlugin", "requested": 2, "used": 2,
               "allocatable": 8, "fits": true})
    );
    assert_eq!(json["claims"][0]["source"]["kind"], "extendedResources");
    // cpu-e publishes no devices: the DRA step finds nothing.
    assert_eq!(why(&report, "cpu-e"), "no devices published for this node");
}

#[test]
fn too_few_gpus_anywhere_names_the_device_plugin_and_the_allocator() {
    let report = explain_pod(
        mapped(),
        fixture::limits_pod(NS, "big", json!({GPU: "9"}), None),
    );
    assert_eq!(report.exit_code(), 1);
    // The scheduler's words for the device-plugin nodes, next to what explain found.
    assert_eq!(
        report.summary,
        "fits on no node (5 nodes: 2 Insufficient nvidia.com/gpu (device plugin), 1 no devices, \
         2 too few free devices)"
    );
    assert_eq!(
        report.scheduler.as_deref(),
        Some(
            "0/5 nodes are available: 2 Insufficient nvidia.com/gpu, 3 cannot allocate all claims."
        )
    );
    assert_eq!(
        why(&report, "dra-a"),
        "request container-0-request-0 (9 wanted): 8 GPUs: 2 free, 6 allocated to other claims"
    );
    assert_eq!(
        why(&report, "dra-b"),
        "request container-0-request-0 (9 wanted): 8 GPUs: 8 free"
    );
    assert_eq!(
        why(&report, "dp-c"),
        "device plugin: Insufficient nvidia.com/gpu (requested 9, used 7 of 8)"
    );
    assert_eq!(
        why(&report, "dp-d"),
        "device plugin: Insufficient nvidia.com/gpu (requested 9, used 2 of 8)"
    );
}
