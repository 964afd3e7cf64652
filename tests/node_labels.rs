//! GPU feature discovery's classic labels on the plugin's own Node (GpuNodePolicy `classicNodeLabels`),
//! end to end against the doubles: off by default; on, the five labels as GFD writes them, kept right
//! when someone else changes them or a GPU is lost; off again (or the policy gone, also across a
//! restart), the labels the plugin wrote are removed and nothing else; another Node is never touched;
//! a refused write is reported and retried while the plugin keeps preparing claims.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use gpu_dra::gpu::FakeProfile;
use gpu_dra::plugin::BackendChoice;
use gpu_dra::support::apiserver::{ApiServer, FaultSpec, Verb};
use gpu_dra::support::harness::{Harness, NODE};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);
const POLICY: &str = "classic-labels";

type Labels = BTreeMap<String, String>;

/// What GFD writes on a node with four L40S.
fn l40s_labels() -> Labels {
    labels(&[
        ("nvidia.com/gpu.present", "true"),
        ("nvidia.com/gpu.product", "NVIDIA-L40S"),
        ("nvidia.com/gpu.count", "4"),
        ("nvidia.com/gpu.memory", "46068"),
        ("nvidia.com/mig.capable", "false"),
    ])
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn policy(spec: Value) -> Value {
    json!({
        "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuNodePolicy",
        "metadata": {"name": POLICY, "generation": 1},
        "spec": spec,
    })
}

/// Stores the GpuNodePolicy with `classicNodeLabels` on or off, as an admin's `kubectl apply`.
fn set_classic_labels(api: &ApiServer, on: bool) {
    api.insert("gpunodepolicies", policy(json!({"classicNodeLabels": on})));
}

/// The plugin keeps no record of labels it owns (it is removed right after the patch's answer).
async fn assert_no_record(node: &Harness) {
    let record = node
        .config
        .plugin_dir()
        .join(gpu_dra::plugin::node_labels::RECORD_FILE);
    let deadline = tokio::time::Instant::now() + WAIT;
    while record.exists() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!record.exists(), "{}", record.display());
}

fn labels_of(node: &Value) -> Labels {
    serde_json::from_value(node["metadata"]["labels"].clone()).unwrap_or_default()
}

/// The `nvidia.com/` labels of Node `name`.
fn nvidia_labels(api: &ApiServer, name: &str) -> Labels {
    let node = api.get("nodes", None, name).expect("the Node exists");
    labels_of(&node)
        .into_iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/"))
        .collect()
}

/// Waits until the `nvidia.com/` labels of this plugin's Node are `expected`.
async fn wait_for_labels(api: &ApiServer, expected: &Labels) {
    let done = api
        .wait_for(
            "nodes",
            |nodes| {
                nodes.iter().any(|n| {
                    n["metadata"]["name"] == NODE
                        && labels_of(n)
                            .into_iter()
                            .filter(|(k, _)| k.starts_with("nvidia.com/"))
                            .collect::<Labels>()
                            == *expected
                })
            },
            WAIT,
        )
        .await;
    assert!(
        done.is_some(),
        "expected {expected:?}, the Node has {:?}",
        nvidia_labels(api, NODE)
    );
}

/// Label writes (update or patch) on Node `name` so far.
fn node_writes(api: &ApiServer, name: &str) -> usize {
    api.requests()
        .iter()
        .filter(|r| {
            r.resource == "nodes"
                && r.name.as_deref() == Some(name)
                && matches!(r.verb, Verb::Patch | Verb::Update)
                && r.code < 300
        })
        .count()
}

/// Someone else (an admin, GFD) merge-patches this Node's labels.
async fn patch_labels(api: &ApiServer, patch: Value) {
    let nodes: Api<Node> = Api::all(api.client());
    nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": patch}})),
        )
        .await
        .expect("the admin's label patch");
}

async fn harness() -> Harness {
    let node = Harness::new("l40s-4").await;
    node.api.insert(
        "nodes",
        json!({"metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}}),
    );
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_by_default_the_plugin_writes_no_label_even_beside_gfds() {
    let node = harness().await;
    // GFD labelled this node; a policy without the setting is in force.
    patch_labels(&node.api, json!(l40s_labels())).await;
    node.api
        .insert("gpunodepolicies", policy(json!({"migMode": "static"})));
    let before = node_writes(&node.api, NODE);
    let plugin = node.start_plugin().await;
    node.wait_for_slices().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        node_writes(&node.api, NODE),
        before,
        "{:?}",
        node.api.requests()
    );
    assert_eq!(nvidia_labels(&node.api, NODE), l40s_labels());
    // Not even a record of labels to remove later.
    assert_no_record(&node).await;
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_node_gets_gfds_labels_and_changes_by_others_are_corrected() {
    let node = harness().await;
    // A stale value from a GFD that ran here before, and an admin's label of their own.
    patch_labels(
        &node.api,
        json!({"nvidia.com/gpu.product": "Tesla-T4", "team": "ml"}),
    )
    .await;
    set_classic_labels(&node.api, true);
    let plugin = node.start_plugin().await;
    wait_for_labels(&node.api, &l40s_labels()).await;
    let all = labels_of(&node.api.get("nodes", None, NODE).unwrap());
    assert_eq!(all["team"], "ml");
    assert_eq!(all["kubernetes.io/hostname"], NODE);

    // Settled: no further writes. (The double records a request just after it stores the object,
    // so the count is taken a moment after the labels appear.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    let settled = node_writes(&node.api, NODE);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(node_writes(&node.api, NODE), settled);

    // Someone changes one and removes another: both are written back, nothing else is touched.
    patch_labels(
        &node.api,
        json!({"nvidia.com/gpu.count": "99", "nvidia.com/gpu.present": null}),
    )
    .await;
    wait_for_labels(&node.api, &l40s_labels()).await;
    assert_eq!(
        labels_of(&node.api.get("nodes", None, NODE).unwrap())["team"],
        "ml"
    );
    plugin.shutdown().await;

    // A restart with the labels right writes nothing.
    let before = node_writes(&node.api, NODE);
    let plugin = node.start_plugin().await;
    node.wait_for_slices().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(node_writes(&node.api, NODE), before);
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turned_off_or_removed_the_written_labels_go_and_other_values_stay() {
    let node = harness().await;
    set_classic_labels(&node.api, true);
    let plugin = node.start_plugin().await;
    wait_for_labels(&node.api, &l40s_labels()).await;

    // Turned off in the policy: every label it wrote goes, the others stay.
    set_classic_labels(&node.api, false);
    wait_for_labels(&node.api, &Labels::new()).await;
    assert_eq!(
        labels_of(&node.api.get("nodes", None, NODE).unwrap()),
        labels(&[("kubernetes.io/hostname", NODE)])
    );

    // On again, then the plugin stops; while it is down an admin pins the product and deletes the
    // policy. The restarted plugin removes what it wrote (it remembers), but not the admin's value.
    set_classic_labels(&node.api, true);
    wait_for_labels(&node.api, &l40s_labels()).await;
    plugin.shutdown().await;
    patch_labels(&node.api, json!({"nvidia.com/gpu.product": "pinned"})).await;
    node.api.remove("gpunodepolicies", None, POLICY);
    let plugin = node.start_plugin().await;
    wait_for_labels(&node.api, &labels(&[("nvidia.com/gpu.product", "pinned")])).await;
    assert_no_record(&node).await;
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_node_is_never_touched() {
    let node = harness().await;
    let other =
        json!({"metadata": {"name": "node-b", "labels": {"nvidia.com/gpu.product": "Tesla-T4"}}});
    node.api.insert("nodes", other);
    set_classic_labels(&node.api, true);
    let plugin = node.start_plugin().await;
    wait_for_labels(&node.api, &l40s_labels()).await;
    set_classic_labels(&node.api, false);
    wait_for_labels(&node.api, &Labels::new()).await;
    assert_eq!(node_writes(&node.api, "node-b"), 0);
    assert_eq!(
        nvidia_labels(&node.api, "node-b"),
        labels(&[("nvidia.com/gpu.product", "Tesla-T4")])
    );
    plugin.shutdown().await;
}

/// A node whose fake profile is a file the test edits.
fn with_profile_file(node: &mut Harness) -> (PathBuf, FakeProfile) {
    let profile = gpu_dra::gpu::builtin_profile("l40s-4").expect("built-in profile");
    let path = node.dir.path().join("node.yaml");
    std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
    node.config.backend = BackendChoice::Fake {
        profile: path.display().to_string(),
        state_file: Some(node.dir.path().join("state.json")),
    };
    (path, profile)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_gpu_lowers_the_count_and_its_return_raises_it() {
    let mut node = harness().await;
    let (path, mut profile) = with_profile_file(&mut node);
    set_classic_labels(&node.api, true);
    let plugin = node.start_plugin().await;
    wait_for_labels(&node.api, &l40s_labels()).await;

    profile.gpus[2].unreadable = Some("GPU is lost".into());
    std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
    let mut three = l40s_labels();
    three.insert("nvidia.com/gpu.count".into(), "3".into());
    wait_for_labels(&node.api, &three).await;

    profile.gpus[2].unreadable = None;
    std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
    wait_for_labels(&node.api, &l40s_labels()).await;
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_is_reported_and_retried_and_claims_are_still_prepared() {
    let node = harness().await;
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::Patch),
        resource: Some("nodes".into()),
        code: 403,
        count: 2,
    });
    set_classic_labels(&node.api, true);
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;

    let events = node
        .api
        .wait_for(
            "events",
            |events| {
                events.iter().any(|e| {
                    e["reason"] == "NodeLabelsNotWritten" && e["regarding"]["name"] == NODE
                })
            },
            WAIT,
        )
        .await
        .expect("a Warning Event on the Node");
    let warning = events
        .iter()
        .find(|e| e["reason"] == "NodeLabelsNotWritten")
        .unwrap();
    assert_eq!(warning["type"], "Warning");
    let note = warning["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("classicNodeLabels") && note.contains("403"),
        "{note}"
    );

    // Prepare does not wait for labels.
    node.wait_for_slices().await;
    let claim = node.allocated_claim("one-gpu", 1).await;
    let answer = kubelet
        .prepare(std::slice::from_ref(&claim))
        .await
        .expect("NodePrepareResources answers");
    match answer.get(&claim.uid) {
        Some(Ok(devices)) => assert_eq!(devices.len(), 1),
        other => panic!("claim not prepared: {other:?}"),
    }

    // The retries succeed once the server allows the write.
    wait_for_labels(&node.api, &l40s_labels()).await;
    plugin.shutdown().await;
}
