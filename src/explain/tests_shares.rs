//! `explain` for shared devices (consumable shares): a share that does not fit says which capacity
//! is short, how much is left and how much the other claims' shares hold.

use serde_json::{json, Value};

use super::report::ReasonKind;
use super::*;
use crate::devices::{node_devices, share_devices, MemoryShares, MigMode, Shares};
use crate::gpu::{FakeBackend, GpuBackend};
use crate::slices::{desired_slices, ServerVersion};
use crate::support::cluster::{self as fixture, DRIVER};

const NS: &str = "default";
const NODE: &str = "node-a";

/// One H100 (81559Mi) shared as `shares` says, held by `held` shares with these consumed capacities.
fn cluster(shares: &Shares, held: &[Value]) -> Cluster {
    let inventory = FakeBackend::new(NODE, "dgx-h100")
        .unwrap()
        .inventory()
        .unwrap();
    let mut devices = node_devices(&inventory, MigMode::None);
    devices.gpus.truncate(1);
    assert!(share_devices(&mut devices, shares).is_empty());
    let mut objects = fixture::device_classes();
    for (i, mut slice) in desired_slices(DRIVER, NODE, "", &devices, ServerVersion { minor: 35 })
        .into_iter()
        .enumerate()
    {
        slice.metadata.name = Some(format!("{NODE}-{i}"));
        slice.metadata.generate_name = None;
        objects.push(serde_json::to_value(slice).unwrap());
    }
    for (i, consumed) in held.iter().enumerate() {
        let mut claim = fixture::allocated_claim("team", &format!("held-{i}"), NODE, &["gpu-0"]);
        let result = &mut claim["status"]["allocation"]["devices"]["results"][0];
        result["shareID"] = json!(format!("00000000-0000-4000-8000-00000000000{i}"));
        result["consumedCapacity"] = consumed.clone();
        objects.push(claim);
    }
    objects.push(fixture::node(NODE, &[], &[], false));
    let mut cluster = Cluster::default();
    for object in objects {
        cluster.add(object).unwrap();
    }
    cluster
}

fn explain_claim(mut cluster: Cluster, exactly: Value) -> report::Report {
    let devices = json!({"requests": [{"name": "gpu", "exactly": exactly}]});
    cluster
        .add(fixture::claim(NS, "want", devices, false))
        .unwrap();
    explain(
        &cluster,
        &Target::Claim {
            namespace: NS.into(),
            name: "want".into(),
        },
    )
    .unwrap()
}

fn reasons(report: &report::Report) -> Vec<(ReasonKind, String)> {
    let node = report
        .nodes
        .iter()
        .find(|n| n.node == NODE)
        .expect("the node");
    assert!(!node.fits, "{node:#?}");
    node.reasons
        .iter()
        .map(|r| (r.kind, r.message.clone()))
        .collect()
}

#[test]
fn a_memory_share_that_does_not_fit_says_what_is_left_and_what_others_hold() {
    let shares = Shares::mps_memory(MemoryShares {
        minimum_bytes: 1 << 30,
        step_bytes: 1 << 30,
    });
    let held = vec![json!({"memory": "26Gi"}); 3];
    let report = explain_claim(
        cluster(&shares, &held),
        json!({"deviceClassName": DRIVER, "capacity": {"requests": {"memory": "4Gi"}}}),
    );
    let reasons = reasons(&report);
    assert_eq!(
        reasons,
        [(
            ReasonKind::TooFewFree,
            "request gpu (1 wanted): 1 GPU: gpu-0: memory 4Gi requested, 1687Mi left of 81559Mi \
             (3 claims hold 78Gi)"
                .to_string()
        )]
    );
    // A smaller share fits beside them.
    let fits = explain_claim(
        cluster(&shares, &held),
        json!({"deviceClassName": DRIVER, "capacity": {"requests": {"memory": "1Gi"}}}),
    );
    assert!(fits.nodes.iter().any(|n| n.node == NODE && n.fits));
}

#[test]
fn a_share_by_count_says_how_many_are_taken() {
    let shares = Shares::nvidia_flag("4").unwrap().unwrap();
    let held = vec![json!({"memory": "0", "shares": "1"}); 4];
    let report = explain_claim(cluster(&shares, &held), json!({"deviceClassName": DRIVER}));
    assert_eq!(
        reasons(&report),
        [(
            ReasonKind::TooFewFree,
            "request gpu (1 wanted): 1 GPU: gpu-0: shares: 4 of 4 taken".to_string()
        )]
    );
    let three = explain_claim(
        cluster(&shares, &held[..3]),
        json!({"deviceClassName": DRIVER}),
    );
    assert!(three.nodes.iter().any(|n| n.node == NODE && n.fits));
}
