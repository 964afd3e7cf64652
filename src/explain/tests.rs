//! `explain` on a small cluster of fake GPU nodes (whole GPUs, dynamic MIG, L40S without NVLink, a node
//! without GPUs, a tainted and a cordoned node), one test per kind of reason a user can meet.

use serde_json::{json, Value};

use super::report::{NodeVerdict, ReasonKind, Report};
use super::*;
use crate::devices::MigMode;
use crate::gpu::builtin_profile;
use crate::support::cluster::{self as fixture, DRIVER};

const NS: &str = "default";

/// node-a: 8 H100, 6 held by other claims, 2 with XID 79; node-b: 8 free H100; node-c: 4 L40S (no
/// NVLink); node-d: no GPUs; node-e: 8 H100 with dynamic MIG, a MIG device of gpu-0 held; node-f: a
/// node taint; node-g: cordoned.
fn cluster() -> Cluster {
    let h100 = builtin_profile("dgx-h100").unwrap();
    let mut objects = fixture::device_classes();
    let mut a = fixture::node_slices("node-a", &h100, MigMode::None);
    fixture::taint(
        &mut a,
        &["gpu-6", "gpu-7"],
        "gpu.dra.dev/xid",
        "79",
        "NoExecute",
    );
    let mut slices = a;
    slices.extend(fixture::renamed(&slices.clone(), "node-a", "node-b"));
    for s in &mut slices {
        if s.spec.node_name.as_deref() == Some("node-b") {
            s.spec
                .devices
                .iter_mut()
                .flatten()
                .for_each(|d| d.taints = None);
        }
    }
    slices.extend(fixture::node_slices(
        "node-c",
        &builtin_profile("l40s-4").unwrap(),
        MigMode::None,
    ));
    let e = fixture::node_slices("node-e", &h100, MigMode::Dynamic);
    let mig = e
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name.starts_with("gpu-0-mig-1g"))
        .map(|d| d.name.clone())
        .unwrap();
    slices.extend(e);
    slices.extend(fixture::node_slices("node-f", &h100, MigMode::None));
    slices.extend(fixture::node_slices("node-g", &h100, MigMode::None));
    objects.extend(slices.iter().map(|s| serde_json::to_value(s).unwrap()));
    let busy = ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5"];
    objects.push(fixture::allocated_claim("team", "busy", "node-a", &busy));
    objects.push(fixture::allocated_claim("team", "mig", "node-e", &[&mig]));
    for (name, zone) in [("node-a", "a"), ("node-b", "b"), ("node-e", "e")] {
        objects.push(fixture::node(
            name,
            &[("gpu", "h100"), ("zone", zone)],
            &[],
            false,
        ));
    }
    objects.push(fixture::node("node-c", &[("gpu", "l40s")], &[], false));
    objects.push(fixture::node("node-d", &[], &[], false));
    objects.push(fixture::node(
        "node-f",
        &[("gpu", "h100")],
        &["dedicated=ml:NoSchedule"],
        false,
    ));
    objects.push(fixture::node("node-g", &[("gpu", "h100")], &[], true));
    let mut cluster = Cluster::default();
    for object in objects {
        cluster.add(object).unwrap();
    }
    cluster
}

fn gpus(count: usize, selectors: &[&str], constraint: Option<&str>) -> Value {
    let selectors: Vec<Value> = selectors
        .iter()
        .map(|e| json!({"cel": {"expression": e}}))
        .collect();
    let mut devices = json!({"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": DRIVER, "count": count, "selectors": selectors}}]});
    if let Some(attribute) = constraint {
        devices["constraints"] = json!([{"matchAttribute": attribute}]);
    }
    devices
}

/// Adds a pod whose claims come from templates (one per `devices`, not created yet) and explains it.
fn explain_pod(
    mut cluster: Cluster,
    devices: &[Value],
    spec: Value,
) -> Result<Report, ExplainError> {
    let mut claims = Vec::new();
    for (i, devices) in devices.iter().enumerate() {
        let template = format!("tmpl-{i}");
        cluster
            .add(fixture::claim(NS, &template, devices.clone(), true))
            .unwrap();
        claims.push(json!({"name": format!("c{i}"), "resourceClaimTemplateName": template}));
    }
    cluster
        .add(fixture::pod(NS, "job", json!(claims), spec))
        .unwrap();
    explain(
        &cluster,
        &Target::Pod {
            namespace: NS.into(),
            name: "job".into(),
        },
    )
}

pub(super) fn verdict<'a>(report: &'a Report, node: &str) -> &'a NodeVerdict {
    report.nodes.iter().find(|n| n.node == node).unwrap()
}

/// The node's line as the table shows it (reasons, or devices).
pub(super) fn why(report: &Report, node: &str) -> String {
    let table = report.to_table();
    let line = table
        .lines()
        .find(|l| l.starts_with(&format!("{node} ")))
        .unwrap_or_else(|| panic!("no line for {node} in\n{table}"));
    // After the NODE and FITS columns.
    let after_node = line[node.len()..].trim_start();
    after_node
        .split_once(' ')
        .map_or("", |(_, text)| text)
        .trim()
        .to_string()
}

fn kinds(report: &Report, node: &str) -> Vec<ReasonKind> {
    verdict(report, node)
        .reasons
        .iter()
        .map(|r| r.kind)
        .collect()
}

#[test]
fn one_gpu_fits_where_a_gpu_is_free_and_each_other_node_says_why_not() {
    let report = explain_pod(cluster(), &[gpus(1, &[], None)], json!({})).unwrap();
    assert_eq!(report.exit_code(), 0);
    assert_eq!(
        report.summary,
        "would fit on 3 of 7 nodes; the scheduler picks among them"
    );
    assert_eq!(why(&report, "node-b"), "gpu-0");
    assert_eq!(why(&report, "node-c"), "gpu-0");
    assert_eq!(
        why(&report, "node-e"),
        "gpu-1",
        "gpu-0 has a MIG device in use"
    );
    assert_eq!(
        why(&report, "node-a"),
        "request gpu (1 wanted): 8 GPUs: 6 allocated to other claims, 2 tainted gpu.dra.dev/xid=79:NoExecute"
    );
    assert_eq!(kinds(&report, "node-a"), [ReasonKind::TooFewFree]);
    let counts = verdict(&report, "node-a").reasons[0]
        .devices
        .clone()
        .unwrap();
    assert_eq!(
        (
            counts.matching,
            counts.free,
            counts.allocated_to_other_claims
        ),
        (8, 0, 6)
    );
    assert_eq!(why(&report, "node-d"), "no devices published for this node");
    assert_eq!(kinds(&report, "node-d"), [ReasonKind::NoDevices]);
    assert_eq!(
        why(&report, "node-f"),
        "node taint dedicated=ml:NoSchedule not tolerated by the pod"
    );
    assert_eq!(kinds(&report, "node-f"), [ReasonKind::NodeTaint]);
    assert_eq!(why(&report, "node-g"), "node is unschedulable (cordoned)");
    assert_eq!(kinds(&report, "node-g"), [ReasonKind::Unschedulable]);
    assert!(report.scheduler.is_none(), "it fits somewhere");
}

#[test]
fn a_selector_that_matches_nothing_is_named_with_its_counts() {
    let memory = r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("100Gi")) >= 0"#;
    let report = explain_pod(cluster(), &[gpus(1, &[memory], None)], json!({})).unwrap();
    assert_eq!(report.exit_code(), 1);
    assert_eq!(report.summary, "fits on no node (7 nodes: 1 unschedulable, 1 untolerated node taint, 1 no devices, 4 no matching devices)");
    assert_eq!(
        why(&report, "node-b"),
        format!("request gpu: selector `{memory}` matches 0 of 8 GPUs of class gpu.dra.dev")
    );
    assert_eq!(kinds(&report, "node-b"), [ReasonKind::NoMatch]);
    assert_eq!(
        report.scheduler.as_deref(),
        Some("0/7 nodes are available: 1 node(s) had untolerated taint(s), 1 node(s) were unschedulable, 5 cannot allocate all claims.")
    );

    // The same selector in a DeviceClass: the class is named, and it saw every device of the node.
    let mut cluster = cluster();
    cluster
        .add(
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "big-gpu"},
            "spec": {"selectors": [{"cel": {"expression": memory}}]}}),
        )
        .unwrap();
    let devices = json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "big-gpu"}}]});
    let report = explain_pod(cluster, &[devices], json!({})).unwrap();
    assert_eq!(
        why(&report, "node-b"),
        format!("request gpu: class big-gpu: selector `{memory}` matches 0 of 8 GPUs")
    );
    assert_eq!(
        why(&report, "node-e"),
        format!("request gpu: class big-gpu: selector `{memory}` matches 0 of 208 devices")
    );
}

#[test]
fn a_match_attribute_constraint_the_free_devices_cannot_meet() {
    let report = explain_pod(
        cluster(),
        &[gpus(2, &[], Some("gpu.dra.dev/nvlinkDomain"))],
        json!({}),
    )
    .unwrap();
    assert_eq!(
        why(&report, "node-c"),
        "no two free GPUs share nvlinkDomain (none has nvlinkDomain)"
    );
    assert_eq!(kinds(&report, "node-c"), [ReasonKind::Constraint]);
    assert_eq!(why(&report, "node-b"), "gpu-0, gpu-1");
}

#[test]
fn node_selector_affinity_and_tolerations_filter_nodes_first() {
    let spec = json!({
        "nodeSelector": {"gpu": "h100"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["b"]}]}]}}},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]
    });
    let report = explain_pod(cluster(), &[gpus(1, &[], None)], spec).unwrap();
    assert_eq!(
        why(&report, "node-b"),
        "node affinity excludes it (required node affinity)"
    );
    assert_eq!(
        why(&report, "node-c"),
        "node affinity excludes it (nodeSelector gpu=h100)"
    );
    assert_eq!(kinds(&report, "node-c"), [ReasonKind::NodeAffinity]);
    assert_eq!(why(&report, "node-f"), "gpu-0", "the taint is tolerated");
    assert_eq!(
        report.summary,
        "would fit on 2 of 7 nodes; the scheduler picks among them"
    );
}

#[test]
fn a_pod_bound_to_a_node_and_an_allocated_claim_pin_it() {
    let mut cluster = cluster();
    cluster
        .add(fixture::allocated_claim(NS, "pinned", "node-b", &["gpu-3"]))
        .unwrap();
    cluster
        .add(fixture::pod(
            NS,
            "job",
            json!([{"name": "gpu", "resourceClaimName": "pinned"}]),
            json!({}),
        ))
        .unwrap();
    let target = Target::Pod {
        namespace: NS.into(),
        name: "job".into(),
    };
    let report = explain(&cluster, &target).unwrap();
    assert_eq!(report.summary, "would fit on 1 of 7 nodes: node-b");
    assert_eq!(why(&report, "node-b"), "gpu-3 (allocated)");
    assert_eq!(
        why(&report, "node-c"),
        "claim default/pinned is allocated on node-b"
    );
    assert_eq!(kinds(&report, "node-c"), [ReasonKind::ClaimElsewhere]);
    assert_eq!(
        verdict(&report, "node-c").scheduler_reason.as_deref(),
        Some("resourceclaim not available on the node")
    );

    let mut bound = cluster.clone();
    bound.pods[0].spec.as_mut().unwrap().node_name = Some("node-c".into());
    let report = explain(&bound, &target).unwrap();
    assert_eq!(kinds(&report, "node-b"), [ReasonKind::NodeName]);
    assert_eq!(why(&report, "node-b"), "the pod is bound to node node-c");
}

#[test]
fn claims_of_one_pod_are_allocated_together() {
    // 4 + 4 GPUs fit on an empty 8-GPU node, 5 + 5 do not, though each 5 would.
    let report = explain_pod(
        cluster(),
        &[gpus(4, &[], None), gpus(4, &[], None)],
        json!({}),
    )
    .unwrap();
    assert_eq!(
        why(&report, "node-b"),
        "default/tmpl-0: gpu-0, gpu-1, gpu-2, gpu-3; default/tmpl-1: gpu-4, gpu-5, gpu-6, gpu-7"
    );
    let report = explain_pod(
        cluster(),
        &[gpus(5, &[], None), gpus(5, &[], None)],
        json!({}),
    )
    .unwrap();
    assert_eq!(
        why(&report, "node-b"),
        "requests default/tmpl-0:gpu 5, default/tmpl-1:gpu 5 want 10 devices together; 8 GPUs are free"
    );
    assert_eq!(kinds(&report, "node-b"), [ReasonKind::Together]);
    assert_eq!(
        why(&report, "node-c"),
        "claim default/tmpl-0: request gpu (5 wanted): 4 GPUs: 4 free; claim default/tmpl-1: request gpu (5 wanted): 4 GPUs: 4 free"
    );
}

#[test]
fn one_claim_after_another_where_all_mode_is_asked() {
    // "All" GPUs, then one more: the second claim sees the first claim's picks as taken.
    let all = json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER, "allocationMode": "All"}}]});
    let report = explain_pod(cluster(), &[all, gpus(1, &[], None)], json!({})).unwrap();
    assert_eq!(
        why(&report, "node-b"),
        "claim default/tmpl-1: request gpu (1 wanted): 8 GPUs: 8 held by this pod's claim default/tmpl-0"
    );
}

#[test]
fn mig_devices_in_use_take_their_gpus_counters() {
    let report = explain_pod(cluster(), &[gpus(8, &[], None)], json!({})).unwrap();
    assert_eq!(
        why(&report, "node-e"),
        "request gpu (8 wanted): 8 GPUs: 7 free, 1 overlaps allocated devices (shared counters used up)"
    );
    assert_eq!(
        why(&report, "node-b"),
        "gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, gpu-7"
    );
}

#[test]
fn where_nothing_finer_explains_it_the_allocator_says_why() {
    // 7 whole GPUs and a 7g.80gb MIG device: each alone fits on node-e (gpu-0's MIG device is held,
    // the other seven GPUs are free), together they do not (the 7g.80gb device takes a whole GPU).
    let devices = json!({"requests": [
        {"name": "whole", "exactly": {"deviceClassName": DRIVER, "count": 7}},
        {"name": "mig", "exactly": {"deviceClassName": "mig.gpu.dra.dev", "selectors": [
            {"cel": {"expression": "device.attributes[\"gpu.dra.dev\"].profile == \"7g.80gb\""}}]}}
    ]});
    let report = explain_pod(cluster(), &[devices], json!({})).unwrap();
    assert_eq!(kinds(&report, "node-e"), [ReasonKind::Other]);
    assert_eq!(
        why(&report, "node-e"),
        "no combination of devices satisfies all requests together: the requests need the same devices or more shared counters than are left"
    );
    assert_eq!(
        verdict(&report, "node-e").allocator.as_deref(),
        Some(why(&report, "node-e").as_str())
    );
}

#[test]
fn incomplete_and_invalid_pools_are_named() {
    let h100 = builtin_profile("dgx-h100").unwrap();
    let mut cluster = Cluster::default();
    for class in fixture::device_classes() {
        cluster.add(class).unwrap();
    }
    let mut incomplete = fixture::node_slices("node-h", &h100, MigMode::None);
    incomplete[0].spec.pool.resource_slice_count = 2;
    let mut invalid = fixture::node_slices("node-i", &h100, MigMode::None);
    let copy = invalid[0].spec.devices.as_ref().unwrap()[0].clone();
    invalid[0].spec.devices.as_mut().unwrap().push(copy);
    cluster.slices.extend(incomplete);
    cluster.slices.extend(invalid);
    let report = explain_pod(cluster, &[gpus(1, &[], None)], json!({})).unwrap();
    assert!(
        report.notes.iter().any(|n| n.contains("no Node objects")),
        "{:?}",
        report.notes
    );
    assert_eq!(
        why(&report, "node-h"),
        "pool gpu.dra.dev/node-h incomplete: 1 of 2 slices at generation 0"
    );
    assert_eq!(kinds(&report, "node-h"), [ReasonKind::PoolIncomplete]);
    assert_eq!(
        kinds(&report, "node-i"),
        [ReasonKind::PoolInvalid],
        "{}",
        report.to_table()
    );
    assert!(why(&report, "node-i").contains("duplicate device name gpu-0"));
}

#[test]
fn errors_stop_with_exit_code_2() {
    let unknown = json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "nosuch"}}]});
    let error = explain_pod(cluster(), &[unknown], json!({})).unwrap_err();
    assert_eq!(
        error.to_string(),
        "claim default/tmpl-0: request gpu: device class nosuch does not exist"
    );
    let error =
        explain_pod(cluster(), &[gpus(1, &["device.nosuch"], None)], json!({})).unwrap_err();
    assert!(error.to_string().contains("CEL compile error"), "{error}");
    // A runtime error aborts scheduling: the node shows it, and the exit code is 2.
    let missing = r#"device.attributes["gpu.dra.dev"].nosuch == "x""#;
    let report = explain_pod(cluster(), &[gpus(1, &[missing], None)], json!({})).unwrap();
    assert_eq!(report.exit_code(), 2);
    assert!(
        verdict(&report, "node-b")
            .error
            .as_deref()
            .unwrap()
            .contains("no such key"),
        "{:?}",
        verdict(&report, "node-b")
    );
    let target = Target::Pod {
        namespace: NS.into(),
        name: "absent".into(),
    };
    let error = explain(&cluster(), &target).unwrap_err();
    assert_eq!(error.to_string(), "Pod default/absent not found");
}

#[test]
fn a_claim_or_a_file_of_claims_can_be_explained_without_a_pod() {
    let mut cluster = cluster();
    cluster
        .add(fixture::claim(NS, "two", gpus(2, &[], None), false))
        .unwrap();
    let target = Target::Claim {
        namespace: NS.into(),
        name: "two".into(),
    };
    let report = explain(&cluster, &target).unwrap();
    assert_eq!(report.subject.kind, "ResourceClaim");
    // No pod, so no node filters: the tainted and the cordoned node fit too.
    assert_eq!(report.fitting_nodes, 5);
    assert!(report.scheduler.is_none());

    let mut file = Cluster::default();
    file.add(fixture::claim(NS, "two", gpus(3, &[], None), false))
        .unwrap();
    let target = Target::Claims {
        origin: "claims.yaml".into(),
        claims: file,
    };
    let report = explain(&cluster, &target).unwrap();
    assert_eq!(why(&report, "node-c"), "gpu-0, gpu-1, gpu-2");
    assert_eq!(
        why(&report, "node-a"),
        "request gpu (3 wanted): 8 GPUs: 6 allocated to other claims, 2 tainted gpu.dra.dev/xid=79:NoExecute"
    );
}

#[test]
fn dumps_are_lists_documents_or_json() {
    let node = fixture::node("n1", &[], &[], false);
    let mut cluster = Cluster::default();
    let list = serde_yaml::to_string(&fixture::list(vec![node.clone()])).unwrap();
    let documents = format!(
        "{}---\n{}",
        serde_yaml::to_string(&node).unwrap(),
        serde_yaml::to_string(
            &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}})
        )
        .unwrap()
    );
    cluster.add_text("list.yaml", &list).unwrap();
    cluster.add_text("docs.yaml", &documents).unwrap();
    cluster
        .add_text("list.json", &fixture::list(vec![node]).to_string())
        .unwrap();
    // Keys in another order than kubectl's (kind before apiVersion) take the generic route, in a List
    // cut into items and in documents.
    let by_hand = "kind: List\napiVersion: v1\nitems:\n- kind: Node\n  apiVersion: v1\n  metadata: {name: n2}\n";
    assert_eq!(dump::list_items(by_hand).map(|items| items.len()), Some(1));
    cluster.add_text("by-hand.yaml", by_hand).unwrap();
    let documents = format!("{by_hand}---\nmetadata: {{name: n3}}\nkind: Node\napiVersion: v1\n");
    assert_eq!(dump::list_items(&documents), None);
    cluster.add_text("documents.yaml", &documents).unwrap();
    assert_eq!(cluster.nodes.len(), 6);
    assert_eq!(cluster.nodes[3].metadata.name.as_deref(), Some("n2"));
    assert_eq!(cluster.nodes[5].metadata.name.as_deref(), Some("n3"));
    assert_eq!(cluster.ignored.get("ConfigMap"), Some(&1));
    let error = cluster.add_text("bad.json", "{\"items\": [}").unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("bad.json: document 1: not valid JSON"),
        "{error}"
    );
    let error = cluster
        .add_text("no-kind.yaml", "apiVersion: v1\nmetadata: {name: x}\n")
        .unwrap_err();
    assert!(error.to_string().contains("kind missing"), "{error}");
    let old = json!({"apiVersion": "resource.k8s.io/v1beta1", "kind": "DeviceClass", "metadata": {"name": "x"}});
    let error = cluster
        .add_text(
            "old.yaml",
            &serde_yaml::to_string(&fixture::list(vec![old])).unwrap(),
        )
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "old.yaml: the item at line 3: DeviceClass apiVersion \"resource.k8s.io/v1beta1\": only resource.k8s.io/v1 is supported (Kubernetes 1.34 and later serve it) at line 1 column 3"
    );
}

#[test]
fn a_pool_for_all_nodes_serves_every_node() {
    let mut cluster = cluster();
    let mut shared = fixture::node_slices("x", &builtin_profile("l40s-4").unwrap(), MigMode::None);
    for slice in &mut shared {
        slice.spec.node_name = None;
        slice.spec.all_nodes = Some(true);
        slice.spec.pool.name = "shared".into();
    }
    cluster.slices.extend(shared);
    let report = explain_pod(cluster, &[gpus(1, &[], None)], json!({})).unwrap();
    assert_eq!(why(&report, "node-d"), "shared/gpu-0");
    assert_eq!(why(&report, "node-b"), "gpu-0");
}

#[test]
fn the_kubectl_plugin_name_shows_in_usage() {
    use std::ffi::OsStr;
    assert_eq!(
        command_name(Some(OsStr::new("/usr/local/bin/kubectl-gpu_dra"))),
        "kubectl gpu-dra"
    );
    assert_eq!(command_name(Some(OsStr::new("./gpu-dra"))), "gpu-dra");
    assert_eq!(command_name(None), "gpu-dra");
}
