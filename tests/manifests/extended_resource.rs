//! The way in for device-plugin users: `deploy/components/extended-resource` (the whole-GPU class answers
//! to `nvidia.com/gpu`), `deploy/components/node-by-node` (the plugin only on nodes handed over), and
//! what e2e/ deploys on kind with them. The rendered classes go through the scheduler's mapping and
//! allocation (`cel::extended_resources`, `selectors::simulate`) as a pod's `nvidia.com/gpu` would.

use std::collections::BTreeSet;

use gpu_dra::cel::extended_resources::{class_mapping, node_requests, NodeNeed};
use gpu_dra::cel::input::NamedClaim;
use gpu_dra::cel::selectors::simulate::{simulate, Decision, Simulation};
use gpu_dra::devices::MigMode;
use gpu_dra::support::cluster::node_slices;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::DeviceClaim;
use k8s_openapi::api::resource::v1::ResourceClaimSpec;
use serde_json::Value;

use super::{device_classes, kustomize_dir, one, read_docs, render_with, root, Doc};

const COMPONENT: &str = "../../deploy/components/extended-resource";
const NODE_BY_NODE: &str = "../../deploy/components/node-by-node";
const HANDOVER_LABEL: &str = "gpu-dra.dev/kubelet-plugin";

#[test]
fn the_component_maps_nvidia_gpu_to_whole_gpus_and_changes_nothing_else() {
    for overlay in ["fake", "nvml"] {
        let (Some(plain), Some(with)) = (
            render_with(overlay, &[]),
            render_with(overlay, &[COMPONENT]),
        ) else {
            return; // no kubectl
        };
        let mapping = class_mapping(&device_classes(&with));
        assert_eq!(
            mapping.get("nvidia.com/gpu").map(String::as_str),
            Some("gpu.dra.dev"),
            "{overlay}: nvidia.com/gpu must map to the whole-GPU class"
        );
        let answering: Vec<_> = device_classes(&with)
            .into_iter()
            .filter(|c| {
                c.spec
                    .as_ref()
                    .and_then(|s| s.extended_resource_name.as_deref())
                    == Some("nvidia.com/gpu")
            })
            .collect();
        assert_eq!(
            answering.len(),
            1,
            "{overlay}: one class answers to nvidia.com/gpu"
        );

        // Everything else is the overlay as it was; the class differs by extendedResourceName alone.
        assert_eq!(
            plain.len(),
            with.len(),
            "{overlay}: the component adds no object"
        );
        for (a, b) in plain.iter().zip(&with) {
            if a.kind() == "DeviceClass" && a.name() == "gpu.dra.dev" {
                let mut b = b.value.clone();
                b["spec"]
                    .as_object_mut()
                    .unwrap()
                    .remove("extendedResourceName");
                assert_eq!(
                    a.value, b,
                    "{overlay}: the class changed beyond extendedResourceName"
                );
            } else {
                assert_eq!(
                    a.value,
                    b.value,
                    "{overlay}: {} {} changed",
                    a.kind(),
                    a.name()
                );
            }
        }
    }
}

/// The e2e pod, as written for the device plugin, gets one whole GPU of a node with fake H100s from the
/// classes e2e/run.sh deploys, with the request name the kubelet will look for.
#[test]
fn the_e2e_pod_asking_for_nvidia_gpu_gets_one_whole_gpu() {
    let Some(deployed) = kustomize_dir("resources:\n  - ../../e2e/deploy\n") else {
        return;
    };
    let pod: Pod = read_docs(&root().join("e2e/workloads/extended-resource-gpu.yaml"))
        .iter()
        .find(|d| d.kind() == "Pod")
        .expect("the e2e pod")
        .typed();
    let classes = device_classes(&deployed);
    let need = node_requests(&pod, &class_mapping(&classes), &BTreeSet::new())
        .expect("nvidia.com/gpu is mapped");
    let NodeNeed::Devices(requests) = need else {
        panic!("a node without the device plugin serves nvidia.com/gpu from DRA: {need:?}");
    };
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].name, "container-0-request-0");

    let profile = gpu_dra::gpu::builtin_profile("dgx-h100").expect("built-in profile");
    let slices = node_slices("kind-worker", &profile, MigMode::Dynamic);
    let claim = ResourceClaimSpec {
        devices: Some(DeviceClaim {
            requests: Some(requests),
            ..Default::default()
        }),
    };
    let decision = simulate(&Simulation {
        claim: NamedClaim {
            name: "gpu-dra-e2e/extended-resource-gpu-extended-resources-x".into(),
            spec: claim,
        },
        classes,
        slices,
        node: Some("kind-worker".into()),
        node_labels: Default::default(),
        in_use: Default::default(),
    })
    .expect("the claim can be decided");
    let Decision::Allocated { results, .. } = decision else {
        panic!("not allocated: {decision:?}");
    };
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].request, "container-0-request-0");
    assert!(
        results[0].device.starts_with("gpu-") && !results[0].device.contains("-mig-"),
        "a whole GPU, not {}",
        results[0].device
    );

    // And the cluster is made with the gate, and the script deploys what this test rendered.
    let kind = std::fs::read_to_string(root().join("e2e/kind.yaml")).unwrap();
    let kind: Value = serde_yaml::from_str(&kind).unwrap();
    assert_eq!(
        kind["featureGates"]["DRAExtendedResource"],
        Value::Bool(true)
    );
    let run = std::fs::read_to_string(root().join("e2e/run.sh")).unwrap();
    assert!(
        run.contains("kubectl apply -k e2e/deploy"),
        "e2e/run.sh must deploy e2e/deploy"
    );
}

#[test]
fn node_by_node_runs_the_plugin_only_on_nodes_handed_over() {
    let (Some(plain), Some(with)) = (
        render_with("nvml", &[]),
        render_with("nvml", &[NODE_BY_NODE]),
    ) else {
        return;
    };
    let ds = |docs: &[Doc]| -> DaemonSet { one(docs, "DaemonSet", "gpu-dra-plugin").typed() };
    let (before, after) = (ds(&plain), ds(&with));
    let spec = |d: &DaemonSet| d.spec.template.spec.clone().unwrap();
    let selector = spec(&after).node_selector.unwrap_or_default();
    assert_eq!(
        selector.get(HANDOVER_LABEL).map(String::as_str),
        Some("true")
    );
    assert_eq!(
        spec(&before).affinity,
        spec(&after).affinity,
        "the GPU-node affinity of the base must stay"
    );
    // The migration steps name the same label, for the device plugin's side too.
    let readme = std::fs::read_to_string(root().join("deploy/README.md")).unwrap();
    assert!(
        readme.contains(&format!("kubectl label node NODE {HANDOVER_LABEL}=true")),
        "deploy/README.md must show how to hand a node over with {HANDOVER_LABEL}"
    );
    assert!(
        readme.contains(&format!(
            "\"key\":\"{HANDOVER_LABEL}\",\"operator\":\"NotIn\""
        )),
        "deploy/README.md must show how to keep the device plugin off handed-over nodes"
    );
}
