//! The admission policy on the plugin's ComputeDomain status writes (`gpu-dra-computedomain-status`):
//! a plugin writes, changes and removes the entry of its own node in `status.nodes` of domains of both
//! groups, and nothing else: not another node's entry (the addresses other daemons connect to), not a
//! second entry of its own, not the controller's `status.status` or conditions. Run through the same CEL
//! evaluation as the other policies; e2e/least-privilege.sh tries the same with a pod-bound token
//! against a real API server.

use serde_json::{json, Value as Json};

use super::admission::{check_cases, check_refusal_messages, Request};
use super::{kustomize_dir, manifests};

fn entry(node: &str, ip: &str, index: u32, status: &str) -> Json {
    json!({"name": node, "ipAddress": ip, "cliqueID": "c.0", "index": index, "status": status})
}

/// A domain that node-2 joined, Ready as the controller says.
fn domain(api_version: &str, nodes: Vec<Json>) -> Json {
    json!({
        "apiVersion": api_version, "kind": "ComputeDomain",
        "metadata": {"name": "job", "namespace": "team", "uid": "u1"},
        "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": "job-channel"}}},
        "status": {"status": "NotReady", "nodes": nodes,
                   "conditions": [{"type": "Placed", "status": "True", "reason": "Placed", "message": "c.0"}]},
    })
}

fn cases(plugin: &str) -> Vec<(&'static str, Request, bool)> {
    let ours = "gpu.dra.dev/v1alpha1";
    let before = domain(ours, vec![entry("node-2", "10.0.0.2", 0, "Ready")]);
    let update = |resource: &'static str, old: Json, new: Json| Request {
        operation: "UPDATE",
        resource,
        username: plugin.to_string(),
        node: Some("node-1"),
        object: new,
        old_object: old,
    };
    let status = |old: &Json, nodes: Vec<Json>| {
        let mut new = old.clone();
        new["status"]["nodes"] = json!(nodes);
        new
    };
    let mine = entry("node-1", "10.0.0.1", 1, "NotReady");
    let theirs = entry("node-2", "10.0.0.2", 0, "Ready");
    let joined = status(&before, vec![theirs.clone(), mine.clone()]);
    let mut ready = mine.clone();
    ready["status"] = json!("Ready");
    vec![
        (
            "join: add its own entry",
            update("computedomains/status", before.clone(), joined.clone()),
            true,
        ),
        (
            "turn its entry Ready",
            update(
                "computedomains/status",
                joined.clone(),
                status(&joined, vec![theirs.clone(), ready.clone()]),
            ),
            true,
        ),
        (
            "leave: remove its own entry",
            update("computedomains/status", joined.clone(), before.clone()),
            true,
        ),
        (
            "join a domain of NVIDIA's group",
            update(
                "computedomains.resource.nvidia.com/status",
                domain("resource.nvidia.com/v1beta1", vec![theirs.clone()]),
                domain(
                    "resource.nvidia.com/v1beta1",
                    vec![theirs.clone(), mine.clone()],
                ),
            ),
            true,
        ),
        (
            "point another node's entry at another address",
            update(
                "computedomains/status",
                joined.clone(),
                status(
                    &joined,
                    vec![entry("node-2", "192.0.2.66", 0, "Ready"), mine.clone()],
                ),
            ),
            false,
        ),
        (
            "remove another node's entry",
            update(
                "computedomains/status",
                joined.clone(),
                status(&joined, vec![mine.clone()]),
            ),
            false,
        ),
        (
            "add an entry for another node",
            update(
                "computedomains/status",
                joined.clone(),
                status(
                    &joined,
                    vec![
                        theirs.clone(),
                        mine.clone(),
                        entry("node-3", "192.0.2.66", 2, "Ready"),
                    ],
                ),
            ),
            false,
        ),
        (
            "add a second entry of its own",
            update(
                "computedomains/status",
                joined.clone(),
                status(
                    &joined,
                    vec![
                        theirs.clone(),
                        mine.clone(),
                        entry("node-1", "192.0.2.66", 2, "Ready"),
                    ],
                ),
            ),
            false,
        ),
        (
            "mark the domain Ready",
            update("computedomains/status", joined.clone(), {
                let mut new = joined.clone();
                new["status"]["status"] = json!("Ready");
                new
            }),
            false,
        ),
        (
            "rewrite another node's entry in NVIDIA's group",
            update(
                "computedomains.resource.nvidia.com/status",
                domain("resource.nvidia.com/v1beta1", vec![theirs.clone()]),
                domain(
                    "resource.nvidia.com/v1beta1",
                    vec![entry("node-2", "192.0.2.66", 0, "Ready")],
                ),
            ),
            false,
        ),
        (
            "join with a token bound to no pod",
            Request {
                node: None,
                ..update("computedomains/status", before.clone(), joined.clone())
            },
            false,
        ),
        (
            "the controller marks the domain Ready (not the plugin: not this policy's business)",
            Request {
                username: "system:serviceaccount:gpu-dra:gpu-dra-controller".to_string(),
                node: None,
                ..update("computedomains/status", joined.clone(), {
                    let mut new = joined.clone();
                    new["status"]["status"] = json!("Ready");
                    new
                })
            },
            true,
        ),
    ]
}

#[test]
fn the_plugin_may_write_only_its_own_nodes_entry_of_a_domains_status() {
    let (objects, _) = manifests();
    check_cases(&objects, "deploy/base", cases);
}

#[test]
fn the_domain_status_policy_still_applies_after_renaming_the_namespace_and_the_account() {
    let overlay = "resources: [../../deploy/overlays/nvml]\nnamePrefix: team-\nnamespace: gpus\n";
    let Some(docs) = kustomize_dir(overlay) else {
        return;
    };
    check_cases(&docs, "renamed", cases);
}

#[test]
fn the_domain_status_refusals_say_what_was_refused() {
    let (objects, _) = manifests();
    check_refusal_messages(
        &objects,
        cases,
        &[
            (
                "point another node's entry at another address",
                "on node node-1 may only write the entry of that node",
            ),
            (
                "add a second entry of its own",
                "may write one entry of that node",
            ),
            (
                "mark the domain Ready",
                "status.status or status.conditions",
            ),
            ("join with a token bound to no pod", "names no node"),
        ],
    );
}
