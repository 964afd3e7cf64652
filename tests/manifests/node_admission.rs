//! The admission policy on the plugin's Node writes (`gpu-dra-node-labels`): with a GpuNodePolicy's
//! `classicNodeLabels` the plugin may set, change and remove GPU feature discovery's five labels on its own
//! Node, and nothing else: not another Node, another label, a taint, an annotation, an owner or a
//! finalizer. Run through the same CEL evaluation as the other policies (`admission::admit`);
//! e2e/least-privilege.sh tries the same cases against a real API server.

use serde_json::{json, Value as Json};

use super::admission::{check_cases, check_refusal_messages, Request};
use super::{kustomize_dir, manifests};

/// A Node as the kubelet registers it, with GFD's labels from an earlier run.
fn node(name: &str) -> Json {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-L40S",
                "nvidia.com/gpu.count": "4",
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": "10.244.1.0/24"},
    })
}

/// `node` with its labels changed by `changes` (a JSON merge patch of `metadata.labels`).
fn relabelled(mut node: Json, changes: Json) -> Json {
    let labels = node["metadata"]["labels"].as_object_mut().unwrap();
    for (key, value) in changes.as_object().unwrap() {
        if value.is_null() {
            labels.remove(key);
        } else {
            labels.insert(key.clone(), value.clone());
        }
    }
    node
}

fn with(mut value: Json, pointer: &str, new: Json) -> Json {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    value
        .pointer_mut(parent)
        .unwrap_or_else(|| panic!("no {parent}"))
        .as_object_mut()
        .unwrap()
        .insert(key.to_string(), new);
    value
}

/// Each case: what, the request, whether the server must allow it.
fn cases(plugin: &str) -> Vec<(&'static str, Request, bool)> {
    let as_plugin = |old: Json, new: Json| Request {
        operation: "UPDATE",
        resource: "nodes",
        username: plugin.to_string(),
        node: Some("node-1"),
        object: new,
        old_object: old,
    };
    let own = node("node-1");
    let other = node("node-2");
    let label = |changes: Json| as_plugin(own.clone(), relabelled(own.clone(), changes));
    vec![
        (
            "set the five labels on its Node",
            label(
                json!({"nvidia.com/gpu.memory": "46068", "nvidia.com/mig.capable": "false",
                         "nvidia.com/gpu.count": "3"}),
            ),
            true,
        ),
        (
            "change the product",
            label(json!({"nvidia.com/gpu.product": "NVIDIA-H100"})),
            true,
        ),
        (
            "remove the labels it wrote",
            label(
                json!({"nvidia.com/gpu.present": null, "nvidia.com/gpu.product": null,
                         "nvidia.com/gpu.count": null}),
            ),
            true,
        ),
        ("write nothing new", label(json!({})), true),
        (
            "label another Node",
            as_plugin(
                other.clone(),
                relabelled(other.clone(), json!({"nvidia.com/gpu.count": "8"})),
            ),
            false,
        ),
        ("add another label", label(json!({"team": "ml"})), false),
        (
            "add another nvidia.com label",
            label(json!({"nvidia.com/gpu.family": "ada"})),
            false,
        ),
        (
            "change another label",
            label(json!({"kubernetes.io/hostname": "elsewhere"})),
            false,
        ),
        (
            "remove another label",
            label(json!({"kubernetes.io/hostname": null})),
            false,
        ),
        (
            "add a taint",
            as_plugin(
                own.clone(),
                with(
                    own.clone(),
                    "/spec/taints",
                    json!([{"key": "gpu", "effect": "NoSchedule"}]),
                ),
            ),
            false,
        ),
        (
            "cordon its Node",
            as_plugin(
                own.clone(),
                with(own.clone(), "/spec/unschedulable", json!(true)),
            ),
            false,
        ),
        (
            "change an annotation",
            as_plugin(
                own.clone(),
                with(
                    own.clone(),
                    "/metadata/annotations/node.alpha.kubernetes.io~1ttl",
                    json!("30"),
                ),
            ),
            false,
        ),
        (
            "add an annotation",
            as_plugin(
                own.clone(),
                with(own.clone(), "/metadata/annotations/x", json!("y")),
            ),
            false,
        ),
        (
            "add a finalizer",
            as_plugin(
                own.clone(),
                with(
                    own.clone(),
                    "/metadata/finalizers",
                    json!(["gpu.dra.dev/keep"]),
                ),
            ),
            false,
        ),
        (
            "add an owner",
            as_plugin(
                own.clone(),
                with(
                    own.clone(),
                    "/metadata/ownerReferences",
                    json!([{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u"}]),
                ),
            ),
            false,
        ),
        (
            "label its Node with a token bound to no pod",
            Request {
                node: None,
                ..label(json!({"nvidia.com/gpu.count": "3"}))
            },
            false,
        ),
        (
            "another account taints another Node (not the plugin: not this policy's business)",
            Request {
                username: "system:node:node-2".to_string(),
                node: None,
                ..as_plugin(
                    other.clone(),
                    with(
                        other.clone(),
                        "/spec/taints",
                        json!([{"key": "gpu", "effect": "NoSchedule"}]),
                    ),
                )
            },
            true,
        ),
    ]
}

#[test]
fn the_plugin_may_write_only_gfds_labels_on_its_own_node() {
    let (objects, _) = manifests();
    check_cases(&objects, "deploy/base", cases);
}

#[test]
fn the_node_policy_still_applies_after_renaming_the_namespace_and_the_account() {
    let overlay = "resources: [../../deploy/overlays/nvml]\nnamePrefix: team-\nnamespace: gpus\n";
    let Some(docs) = kustomize_dir(overlay) else {
        return;
    };
    check_cases(&docs, "renamed", cases);
}

#[test]
fn the_refusals_say_what_was_refused() {
    let (objects, _) = manifests();
    check_refusal_messages(
        &objects,
        cases,
        &[
            (
                "label another Node",
                "on node node-1 may only label that Node, not node-2",
            ),
            (
                "add another label",
                "may only set, change or remove the labels nvidia.com/gpu.present",
            ),
            ("add a taint", "may not change its Node's spec"),
            (
                "change an annotation",
                "may not change its Node's annotations",
            ),
            ("add a finalizer", "owner references or finalizers"),
            (
                "label its Node with a token bound to no pod",
                "names no node",
            ),
        ],
    );
}
