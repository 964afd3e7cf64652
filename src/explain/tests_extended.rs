//! `explain` for pods that ask for `nvidia.com/gpu` as an extended resource (KEP-5004, 1.34): DRA
//! nodes (a DeviceClass maps the resource), device-plugin nodes (the node's allocatable lists it),
//! and nodes where neither holds.

use serde_json::{json, Value};

use super::report::{ReasonKind, Report, ResourceSource};
use super::tests::{verdict, why};
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

/// A Pending pod with `limits` in container `main` and a claim from template `one` (1 GPU).
fn mixed_pod(name: &str, limits: Value) -> Vec<Value> {
    let devices =
        json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}}]});
    let mut pod = fixture::limits_pod(NS, name, limits, None);
    pod["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": "one"}]);
    vec![fixture::claim(NS, "one", devices, true), pod]
}

#[test]
fn a_pod_mixing_the_extended_resource_with_a_claim_gets_distinct_devices() {
    let mut objects = mapped();
    let mut pod = mixed_pod("mix", json!({GPU: "1"}));
    let pod_object = pod.pop().unwrap();
    objects.extend(pod);
    let report = explain_pod(objects.clone(), pod_object);
    // dra-a has two GPUs free: one for each claim, never the same; the pod's own claims come first,
    // as in the scheduler's claim store.
    let a = verdict(&report, "dra-a");
    assert!(a.fits, "{}", report.to_table());
    let mut got: Vec<(&str, &str)> = a
        .devices
        .iter()
        .map(|d| (d.claim.as_str(), d.device.as_str()))
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("ml/mix-extended-resources-*", "gpu-7"),
            ("ml/one", "gpu-6")
        ]
    );
    // With claims of its own, 1.34 makes the DRA claim on device-plugin nodes too.
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.contains("also allocates it through DRA")),
        "{:?}",
        report.notes
    );
    assert_eq!(why(&report, "dp-d"), "no devices published for this node");

    // Two GPUs for the container and one for the claim: three wanted, two free on dra-a.
    let mut pod = mixed_pod("mix", json!({GPU: "2"}));
    let pod_object = pod.pop().unwrap();
    let mut objects = mapped();
    objects.extend(pod);
    let report = explain_pod(objects, pod_object);
    assert_eq!(
        why(&report, "dra-a"),
        "requests ml/one:gpu 1, ml/mix-extended-resources-*:container-0-request-0 2 want 3 devices \
         together; 2 GPUs are free"
    );
    assert_eq!(
        verdict(&report, "dra-a").reasons[0].kind,
        ReasonKind::Together
    );
}

#[test]
fn a_resource_no_class_maps_and_no_node_advertises_fits_nowhere() {
    let report = explain_pod(
        mapped(),
        fixture::limits_pod(NS, "fpga", json!({GPU: "1", "example.com/fpga": "1"}), None),
    );
    assert_eq!(report.exit_code(), 1);
    for node in ["dra-a", "dp-c", "cpu-e"] {
        assert_eq!(
            why(&report, node),
            "Insufficient example.com/fpga: no DeviceClass maps it and the node does not advertise it"
        );
        assert_eq!(
            verdict(&report, node).reasons[0].kind,
            ReasonKind::UnservedResource
        );
    }
    assert_eq!(
        report.summary,
        "fits on no node (5 nodes: 5 Insufficient example.com/fpga (not advertised, no DeviceClass maps it))"
    );
    assert_eq!(
        report.scheduler.as_deref(),
        Some("0/5 nodes are available: 5 Insufficient example.com/fpga.")
    );
}

#[test]
fn a_class_implicit_name_is_never_served_by_dra_in_1_34() {
    // mig.gpu.dra.dev has no extendedResourceName, so its implicit name is in the mapping; but the
    // name lies under kubernetes.io/: NodeResourcesFit leaves it to DRA, and DRA skips it.
    let implicit = "deviceclass.resource.kubernetes.io/mig.gpu.dra.dev";
    let report = explain_pod(
        mapped(),
        fixture::limits_pod(NS, "implicit", json!({implicit: "1"}), None),
    );
    assert_eq!(report.fitting_nodes, 5, "{}", report.to_table());
    assert_eq!(
        why(&report, "dra-b"),
        format!("{implicit} ignored (no device for it)")
    );
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.contains("it is ignored: the pod fits as if it did not ask")),
        "{:?}",
        report.notes
    );
    assert_eq!(
        verdict(&report, "dra-b").extended_resources[0].source,
        ResourceSource::Ignored
    );

    // gpu.dra.dev has extendedResourceName, so it does not answer to its implicit name; next to a real
    // extended resource, NodeResourcesFit then counts the implicit name against the allocatable.
    let named = "deviceclass.resource.kubernetes.io/gpu.dra.dev";
    let report = explain_pod(
        mapped(),
        fixture::limits_pod(NS, "named", json!({named: "1", GPU: "1"}), None),
    );
    assert_eq!(report.exit_code(), 1);
    assert_eq!(
        why(&report, "dra-b"),
        format!("Insufficient {named}: no DeviceClass maps it and the node does not advertise it")
    );
    assert!(
        report.notes.iter().any(|n| n.contains(
            "DeviceClass gpu.dra.dev answers only to its extendedResourceName nvidia.com/gpu"
        )),
        "{:?}",
        report.notes
    );
}

#[test]
fn a_bound_pod_shows_its_extended_resources_claim_and_a_stale_one_blocks_every_node() {
    let mut objects = mapped();
    objects.push(fixture::extended_resource_claim(
        NS,
        "train",
        "dra-b",
        &[
            ("container-0-request-0", "gpu-0"),
            ("container-0-request-0", "gpu-1"),
        ],
    ));
    let report = explain_pod(
        objects.clone(),
        fixture::limits_pod(NS, "train", json!({GPU: "2"}), Some("dra-b")),
    );
    assert_eq!(report.claims.len(), 1, "no second, synthetic claim");
    let table = report.to_table();
    assert!(
        table.contains(
            "claim ml/train-extended-resources-x7k2p (for extended resources nvidia.com/gpu, allocated): \
             container-0-request-0: 2 of class gpu.dra.dev (nvidia.com/gpu of container main)"
        ),
        "{table}"
    );
    assert_eq!(
        why(&report, "dra-b"),
        "gpu-0 (allocated), gpu-1 (allocated)"
    );
    assert_eq!(why(&report, "dra-a"), "the pod is bound to node dra-b");
    assert_eq!(report.fitting_nodes, 1);

    // The same claim for a pod not bound: left from an attempt that failed to bind.
    let report = explain_pod(
        objects,
        fixture::limits_pod(NS, "train", json!({GPU: "2"}), None),
    );
    assert_eq!(report.exit_code(), 1);
    assert_eq!(
        why(&report, "dra-a"),
        "claim ml/train-extended-resources-x7k2p for the extended resources is left from an earlier \
         attempt: the scheduler deletes it and tries again"
    );
    assert_eq!(
        verdict(&report, "dp-d").scheduler_reason.as_deref(),
        Some("cannot schedule extended resource claim")
    );
    // NodeResourcesFit runs first.
    assert_eq!(
        verdict(&report, "dp-c").reasons[0].kind,
        ReasonKind::InsufficientResource
    );
}

#[test]
fn with_the_gate_off_only_the_nodes_allocatable_counts() {
    // The API server drops extendedResourceName when DRAExtendedResource is off.
    let report = explain_pod(
        objects(fixture::device_classes()),
        fixture::limits_pod(NS, "train", json!({GPU: "2"}), None),
    );
    assert_eq!(report.summary, "would fit on 1 of 5 nodes: dp-d");
    assert_eq!(
        why(&report, "dra-b"),
        "Insufficient nvidia.com/gpu: no DeviceClass maps it and the node does not advertise it"
    );
    assert_eq!(
        verdict(&report, "dra-b").scheduler_reason.as_deref(),
        Some("Insufficient nvidia.com/gpu")
    );
    assert!(report.claims.is_empty());
    let notes = report.notes.join("\n");
    assert!(
        notes.contains("no DeviceClass has spec.extendedResourceName"),
        "{notes}"
    );
    assert!(
        notes.contains("hint: no DeviceClass maps nvidia.com/gpu; DeviceClass gpu.dra.dev selects gpu.dra.dev devices"),
        "{notes}"
    );
}
