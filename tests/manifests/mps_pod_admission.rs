//! The admission policy on the Pods the plugin makes (`gpu-dra-mps-daemon-pods`): the plugin may create
//! and delete the Pods of MPS control daemons bound to its own node, as `src/claims/mps/pod.rs` makes them,
//! and no other Pod: not on another node, not another program, not without the daemon's labels.

use std::path::Path;

use gpu_dra::claims::mps::{
    DaemonPodTemplate, DaemonProgram, MpsDaemonSpec, MpsDevice, MpsPrograms,
};
use serde_json::{json, Value as Json};

use super::admission::{check_cases, Request};
use super::{kustomize_dir, manifests};

/// A daemon Pod exactly as the plugin on `node` makes it.
fn daemon_pod(node: &str) -> Json {
    let template = DaemonPodTemplate {
        namespace: "gpu-dra".into(),
        node: node.into(),
        driver: "gpu.dra.dev".into(),
        image: "gpu-dra:dev".into(),
        host_driver_root: "/".into(),
        program: DaemonProgram::Chroot(MpsPrograms {
            control: "/usr/bin/nvidia-cuda-mps-control".into(),
        }),
    };
    let spec = MpsDaemonSpec {
        claim_uid: "8d1f0c3a-0000-4a8e-9f00-1d2c3b4a5e6f".into(),
        devices: vec![MpsDevice {
            device: "gpu-0".into(),
            uuid: "GPU-a".into(),
            pinned_memory_limit_bytes: None,
        }],
        active_thread_percentage: Some(50),
        multi_user: false,
        shm_size_bytes: None,
    };
    let dir =
        Path::new("/var/lib/kubelet/plugins/gpu.dra.dev/mps/8d1f0c3a-0000-4a8e-9f00-1d2c3b4a5e6f");
    serde_json::to_value(template.pod(&spec, dir).unwrap()).unwrap()
}

/// An IMEX daemon Pod exactly as the plugin on `node` makes it for a ComputeDomain.
fn imex_pod(node: &str) -> Json {
    use gpu_dra::domains::imex::{
        ImexDaemonSpec, ImexPodTemplate, ImexProgram, ImexPrograms, Peer,
    };
    let template = ImexPodTemplate {
        pod: gpu_dra::claims::daemon_pod::PodTemplate {
            namespace: "gpu-dra".into(),
            node: node.into(),
            driver: "gpu.dra.dev".into(),
            image: "gpu-dra:dev".into(),
            host_driver_root: "/".into(),
            program: ImexProgram::Chroot(ImexPrograms {
                daemon: "/usr/bin/nvidia-imex".into(),
                ctl: "/usr/bin/nvidia-imex-ctl".into(),
            }),
        },
        node_ip: Some("10.0.0.1".into()),
    };
    let spec = ImexDaemonSpec {
        domain_uid: "5b1d0c3a-0000-4a8e-9f00-1d2c3b4a5e6f".into(),
        domain: "team/job".into(),
        peers: vec![
            Peer {
                index: 0,
                address: "10.0.0.1".into(),
            },
            Peer {
                index: 1,
                address: "10.0.0.2".into(),
            },
        ],
    };
    let dir =
        Path::new("/var/lib/kubelet/plugins/gpu.dra.dev/imex/5b1d0c3a-0000-4a8e-9f00-1d2c3b4a5e6f");
    serde_json::to_value(template.pod(&spec, dir).unwrap()).unwrap()
}

fn with(mut value: Json, pointer: &str, new: Json) -> Json {
    *value
        .pointer_mut(pointer)
        .unwrap_or_else(|| panic!("no {pointer}")) = new;
    value
}

fn cases(plugin: &str) -> Vec<(&'static str, Request, bool)> {
    let create = |pod: Json| Request {
        operation: "CREATE",
        resource: "pods",
        username: plugin.to_string(),
        node: Some("node-1"),
        object: pod,
        old_object: Json::Null,
    };
    let delete = |pod: Json| Request {
        operation: "DELETE",
        resource: "pods",
        username: plugin.to_string(),
        node: Some("node-1"),
        object: Json::Null,
        old_object: pod,
    };
    let own = daemon_pod("node-1");
    let imex = imex_pod("node-1");
    vec![
        (
            "create an IMEX daemon Pod on its node",
            create(imex.clone()),
            true,
        ),
        (
            "delete an IMEX daemon Pod on its node",
            delete(imex.clone()),
            true,
        ),
        (
            "create an IMEX daemon Pod on another node",
            create(imex_pod("node-2")),
            false,
        ),
        (
            "create a Pod labelled an IMEX daemon that runs the MPS program",
            create(with(
                imex.clone(),
                "/spec/containers/0/args/0",
                json!("mps-daemon"),
            )),
            false,
        ),
        (
            "create a Pod labelled an MPS daemon that runs the IMEX program",
            create(with(
                own.clone(),
                "/spec/containers/0/args/0",
                json!("imex-daemon"),
            )),
            false,
        ),
        ("create a daemon Pod on its node", create(own.clone()), true),
        ("delete a daemon Pod on its node", delete(own.clone()), true),
        (
            "create a daemon Pod on another node",
            create(daemon_pod("node-2")),
            false,
        ),
        (
            "delete a daemon Pod on another node",
            delete(daemon_pod("node-2")),
            false,
        ),
        (
            "create an unbound Pod (the scheduler would place it anywhere)",
            create(with(own.clone(), "/spec/nodeName", json!(""))),
            false,
        ),
        (
            "create a Pod that runs a shell",
            create(with(
                own.clone(),
                "/spec/containers/0/command",
                json!(["sh", "-c", "id"]),
            )),
            false,
        ),
        (
            "create a Pod without the daemon's labels",
            create(with(own.clone(), "/metadata/labels", json!({"app": "x"}))),
            false,
        ),
        (
            "delete another Pod of its node",
            delete(with(own.clone(), "/metadata/labels", json!({"app": "x"}))),
            false,
        ),
        (
            "create a daemon Pod with a token bound to no pod",
            Request {
                node: None,
                ..create(own.clone())
            },
            false,
        ),
        (
            "another account creates any Pod (not this policy's business)",
            Request {
                username: "system:serviceaccount:default:ci".into(),
                node: None,
                ..create(with(
                    own.clone(),
                    "/spec/containers/0/command",
                    json!(["sh"]),
                ))
            },
            true,
        ),
    ]
}

#[test]
fn the_plugin_may_make_only_its_nodes_mps_daemon_pods() {
    let (objects, _) = manifests();
    check_cases(&objects, "deploy/base", cases);
}

#[test]
fn the_pod_policy_still_applies_after_renaming_the_namespace_and_the_account() {
    let overlay = "resources: [../../deploy/overlays/nvml]\nnamePrefix: team-\nnamespace: gpus\n";
    let Some(docs) = kustomize_dir(overlay) else {
        return;
    };
    check_cases(&docs, "renamed", cases);
}
