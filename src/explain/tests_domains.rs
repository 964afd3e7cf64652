//! `explain` for pods of ComputeDomains on a cluster of fake GB200 trays: NVLink clique 0 of four nodes
//! (gb-a0..gb-a3), clique 1 of two (gb-b0, gb-b1), each with its IMEX channel device. One test per thing the
//! domain can say: not placed (no clique has room, or its spec is refused), its clique full, not Ready;
//! and a domain of NVIDIA's group.

use serde_json::{json, Value};

use super::report::{ReasonKind, Report};
use super::*;
use crate::api::NVIDIA_DRIVER_NAME;
use crate::domains::api::{
    ComputeDomainPlacement, DomainObject, CHANNEL_DEVICE_CLASS, PLACEMENT_ANNOTATION,
};
use crate::domains::controller::template::channel_template;
use crate::domains::placement::Placed;
use crate::gpu::{gb200_tray, GB200_CLUSTER_UUID};
use crate::support::cluster::{self as fixture, DRIVER};

const NS: &str = "team";
const OURS: &str = "gpu.dra.dev/v1alpha1";
const NVIDIAS: &str = "resource.nvidia.com/v1beta1";

fn clique(n: u32) -> String {
    format!("{GB200_CLUSTER_UUID}.{n}")
}

/// The trays, published under `driver`, with their Nodes and the DeviceClasses `deploy/` ships.
fn cluster(driver: &str) -> Cluster {
    let mut objects = fixture::device_classes();
    for (node, clique) in [
        ("gb-a0", 0),
        ("gb-a1", 0),
        ("gb-a2", 0),
        ("gb-a3", 0),
        ("gb-b0", 1),
        ("gb-b1", 1),
    ] {
        let profile = gb200_tray(GB200_CLUSTER_UUID, clique);
        let slices = fixture::fabric_node_slices(driver, node, &profile, 1);
        objects.extend(slices.iter().map(|s| serde_json::to_value(s).unwrap()));
        objects.push(fixture::node(node, &[], &[], false));
    }
    let mut cluster = Cluster::default();
    for object in objects {
        cluster.add(object).unwrap();
    }
    cluster.sort_slices();
    cluster
}

/// `domain` placed on `clique`, as the controller records it (its ComputeDomainPlacement, read from
/// a dump), with the channel template it then writes.
fn place(cluster: &mut Cluster, domain: Value, clique: &str) {
    cluster.add(domain).unwrap();
    let object: DomainObject = cluster.domains.last().unwrap().clone();
    let placement = ComputeDomainPlacement::of(&object, clique);
    let mut placement = serde_json::to_value(placement).unwrap();
    placement["apiVersion"] = json!("gpu.dra.dev/v1alpha1");
    placement["kind"] = json!("ComputeDomainPlacement");
    cluster.add(placement).unwrap();
    let object = &object;
    let placed = Placed {
        clique: clique.into(),
    };
    let name = format!("{}-channel", object.name);
    let template = channel_template(DRIVER, CHANNEL_DEVICE_CLASS, object, &name, &placed).unwrap();
    cluster
        .add(serde_json::to_value(template).unwrap())
        .unwrap();
}

/// A pod `worker` whose one claim `channel` comes from domain `domain`'s channel template.
fn explain_worker(mut cluster: Cluster, domain: &str) -> Result<Report, ExplainError> {
    let claims =
        json!([{"name": "channel", "resourceClaimTemplateName": format!("{domain}-channel")}]);
    cluster
        .add(fixture::pod(NS, "worker", claims, json!({})))
        .unwrap();
    explain(
        &cluster,
        &Target::Pod {
            namespace: NS.into(),
            name: "worker".into(),
        },
    )
}

#[test]
fn a_pod_of_a_domain_no_clique_has_room_for_waits_for_it_and_says_why() {
    let mut cluster = cluster(DRIVER);
    cluster
        .add(fixture::compute_domain(OURS, NS, "big", 5))
        .unwrap();
    let report = explain_worker(cluster.clone(), "big").unwrap();
    assert_eq!(report.exit_code(), 1, "{}", report.to_table());
    assert_eq!(
        report.summary,
        format!(
            "waits for ComputeDomain team/big: not placed: no NVLink clique has 5 free nodes: {} has 4 \
             (of 4), {} has 2 (of 2); nodes without an NVLink fabric are never used (explain's own \
             placement from the ResourceSlices and claims: the domain has no gpu.dra.dev/placement \
             annotation)",
            clique(0),
            clique(1)
        )
    );
    // The scheduler does not try the pod: no "0/6 nodes" line.
    assert_eq!(report.scheduler, None);
    assert_eq!(report.nodes.len(), 6);
    for node in &report.nodes {
        assert!(!node.fits);
        assert_eq!(node.reasons[0].kind, ReasonKind::DomainNotPlaced);
        assert_eq!(
            node.reasons[0].message,
            "pod claim channel waits for ComputeDomain team/big (ResourceClaimTemplate \
             team/big-channel does not exist yet)"
        );
    }
    let table = report.to_table();
    assert!(
        table.starts_with("Pod team/worker: waits for ComputeDomain team/big: not placed: "),
        "{table}"
    );
    assert!(
        table.contains(
            "note: pod claim channel: ResourceClaimTemplate team/big-channel does not exist yet"
        ),
        "{table}"
    );
    assert!(
        !table.contains("has no resource claims"),
        "the domain's claim is one: {table}"
    );

    // The controller's reason, where it wrote one, is what the report says.
    let mut annotated = cluster.clone();
    annotated.domains[0].annotations.insert(
        PLACEMENT_ANNOTATION.into(),
        "no room (as the controller saw it)".into(),
    );
    let report = explain_worker(annotated, "big").unwrap();
    assert_eq!(
        report.summary,
        "waits for ComputeDomain team/big: not placed: no room (as the controller saw it)"
    );

    // A missing template that is no domain's is still an error.
    let error = explain_worker(cluster, "nobody").unwrap_err();
    assert_eq!(
        error.to_string(),
        "ResourceClaimTemplate team/nobody-channel not found"
    );
}

#[test]
fn a_pod_of_a_refused_domain_says_what_is_wrong_with_the_spec() {
    let mut cluster = cluster(DRIVER);
    let mut all = fixture::compute_domain(OURS, NS, "all", 2);
    all["spec"]["channel"]["allocationMode"] = json!("Some");
    cluster.add(all).unwrap();
    let report = explain_worker(cluster, "all").unwrap();
    assert_eq!(report.exit_code(), 1);
    assert!(
        report.summary.starts_with(
            "waits for ComputeDomain team/all: not placed: spec.channel.allocationMode \"Some\" is not one of"
        ),
        "{}",
        report.summary
    );
}

#[test]
fn a_pod_of_a_domain_whose_clique_is_full_gets_a_note_naming_each_node() {
    let mut cluster = cluster(DRIVER);
    place(
        &mut cluster,
        fixture::compute_domain(OURS, NS, "d", 2),
        &clique(1),
    );
    // The domain's two pods before this one hold channel 0 on both nodes of clique 1.
    for (claim, node) in [("w0-channel", "gb-b0"), ("w1-channel", "gb-b1")] {
        cluster
            .add(fixture::allocated_claim(
                NS,
                claim,
                node,
                &["imex-channel-0"],
            ))
            .unwrap();
    }
    let report = explain_worker(cluster, "d").unwrap();
    assert_eq!(report.exit_code(), 1, "{}", report.to_table());
    let note = format!(
        "ComputeDomain team/d: 0 of the 2 nodes of NVLink clique {} are free for the ComputeDomain's pods: \
         1 (gb-b0): channel taken by claim team/w0-channel; 1 (gb-b1): channel taken by claim \
         team/w1-channel",
        clique(1)
    );
    assert!(report.notes.contains(&note), "{:#?}", report.notes);
    // Beside the per-node verdicts, which stay as they were.
    let b0 = report.nodes.iter().find(|n| n.node == "gb-b0").unwrap();
    assert_eq!(b0.reasons[0].kind, ReasonKind::TooFewFree, "{b0:?}");
    let a0 = report.nodes.iter().find(|n| n.node == "gb-a0").unwrap();
    assert_eq!(a0.reasons[0].kind, ReasonKind::NoMatch, "{a0:?}");
}

#[test]
fn a_pod_of_a_domain_that_is_not_ready_fits_and_says_which_nodes_wait() {
    let mut cluster = cluster(DRIVER);
    let mut domain = fixture::compute_domain(OURS, NS, "d", 3);
    domain["status"] = json!({"status": "NotReady", "nodes": [
        {"name": "gb-a0", "status": "Ready", "cliqueID": clique(0)},
        {"name": "gb-a1", "status": "NotReady", "cliqueID": clique(0),
         "reason": "IMEX daemon not ready: waiting for peers"},
    ]});
    place(&mut cluster, domain, &clique(0));
    let report = explain_worker(cluster.clone(), "d").unwrap();
    assert_eq!(report.exit_code(), 0, "{}", report.to_table());
    assert_eq!(report.fitting_nodes, 4, "{}", report.to_table());
    let note = report
        .notes
        .iter()
        .find(|n| n.starts_with("ComputeDomain team/d is NotReady"))
        .unwrap_or_else(|| panic!("{:#?}", report.notes));
    assert!(
        note.starts_with(
            "ComputeDomain team/d is NotReady: 1 of 3 nodes ready (gb-a1: IMEX daemon not ready: \
             waiting for peers); "
        ),
        "{note}"
    );
    assert!(note.contains("ContainerCreating"), "{note}");

    // Ready: nothing to say.
    cluster.domains[0].status.status = "Ready".into();
    let report = explain_worker(cluster, "d").unwrap();
    assert!(
        !report.notes.iter().any(|n| n.contains("ComputeDomain")),
        "{:#?}",
        report.notes
    );
}

#[test]
fn a_domain_of_nvidias_group_is_placed_on_the_channels_of_nvidias_driver_name() {
    let mut cluster = cluster(NVIDIA_DRIVER_NAME);
    cluster
        .add(fixture::compute_domain(NVIDIAS, NS, "imex", 5))
        .unwrap();
    assert_eq!(
        cluster.domains[0].group,
        crate::domains::api::DomainGroup::Nvidia
    );
    let report = explain_worker(cluster, "imex").unwrap();
    assert_eq!(report.exit_code(), 1);
    assert!(
        report.summary.starts_with(&format!(
            "waits for ComputeDomain team/imex: not placed: no NVLink clique has 5 free nodes: {} has 4 (of 4)",
            clique(0)
        )),
        "{}",
        report.summary
    );
}

#[test]
fn domains_are_read_from_dumps_of_either_group_and_others_are_ignored() {
    let mut other = fixture::compute_domain("example.com/v1", NS, "x", 1);
    other["kind"] = json!("ComputeDomain");
    let dump = fixture::list(vec![
        fixture::compute_domain(OURS, NS, "ours", 1),
        fixture::compute_domain(NVIDIAS, NS, "theirs", 2),
        other,
    ]);
    let mut cluster = Cluster::default();
    cluster
        .add_text("dump.yaml", &serde_yaml::to_string(&dump).unwrap())
        .unwrap();
    let keys: Vec<String> = cluster.domains.iter().map(DomainObject::key).collect();
    assert_eq!(keys, ["team/ours", "team/theirs"]);
    assert_eq!(cluster.domains[1].spec.num_nodes, 2);
    assert_eq!(
        cluster.ignored.keys().collect::<Vec<_>>(),
        ["ComputeDomain (example.com/v1)"]
    );
}
