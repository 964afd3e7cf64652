//! Pods written for the device plugin (`nvidia.com/gpu: N`) against the doubles: the scheduler double
//! creates and allocates the pod's special claim as 1.34's scheduler does, the kubelet double prepares the
//! pod as 1.34's kubelet does (the pod's own claims and the special claim in one call, devices to
//! containers through `requestMappings` and the request names the plugin returns), and the plugin prepares
//! the special claim like any other. The same checks ran once against a real 1.34.2 scheduler, kubelet and
//! containerd: `e2e/real-node-extended-resources.sh`.

use std::collections::BTreeSet;

use gpu_dra::support::apiserver::{FeatureGate, FeatureGates, ServerVersion};
use gpu_dra::support::harness::{Harness, NODE};
use gpu_dra::support::kubelet_pods::{prepare_pod, PreparedPod};
use gpu_dra::support::scheduler::{self, AllocationError};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

async fn create_pod(node: &Harness, pod: serde_json::Value) -> Pod {
    let pod: Pod = serde_json::from_value(pod).expect("pod JSON");
    Api::<Pod>::namespaced(node.api.client(), "default")
        .create(&PostParams::default(), &pod)
        .await
        .expect("pod created")
}

fn container(name: &str, resources: serde_json::Value) -> serde_json::Value {
    json!({"name": name, "image": "busybox", "resources": resources})
}

fn pod(name: &str, containers: Vec<serde_json::Value>) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": containers}})
}

/// The scheduler's part for the pod on this node; the claim it made and allocated.
async fn schedule(node: &Harness, pod: &str) -> ResourceClaim {
    scheduler::allocate_extended_resources(&node.api.client(), "default", pod, NODE)
        .await
        .expect("the scheduler allocates the pod's extended resources")
        .expect("the pod has extended resources served by DRA")
}

fn results(claim: &ResourceClaim) -> Vec<(String, String)> {
    claim
        .status
        .iter()
        .flat_map(|s| s.allocation.iter())
        .flat_map(|a| a.devices.iter().flat_map(|d| d.results.iter().flatten()))
        .map(|r| (r.request.clone(), r.device.clone()))
        .collect()
}

fn cdi_of<'a>(prepared: &'a PreparedPod, container: &str) -> &'a [String] {
    prepared
        .cdi_devices
        .get(container)
        .unwrap_or_else(|| panic!("no container {container}: {prepared:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_asking_for_two_gpus_gets_them_through_the_schedulers_claim() {
    let node = Harness::new("dgx-h100").await;
    let class = node.apply_extended_resource_component().await;
    assert_eq!(
        class.spec.unwrap().extended_resource_name.as_deref(),
        Some("nvidia.com/gpu")
    );
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;

    // An init container first, then the GPU next to cpu and memory: request index 2 of container 1.
    let mut spec = pod(
        "train",
        vec![container(
            "main",
            json!({"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": "2"}}),
        )],
    );
    spec["spec"]["initContainers"] = json!([container("setup", json!({"requests": {"cpu": "1"}}))]);
    create_pod(&node, spec).await;
    let claim = schedule(&node, "train").await;

    let name = claim.metadata.name.clone().unwrap();
    assert!(
        name.starts_with("train-extended-resources-")
            && name.len() == "train-extended-resources-".len() + 5,
        "{name}"
    );
    let allocated = results(&claim);
    assert_eq!(allocated.len(), 2, "{allocated:?}");
    assert!(allocated
        .iter()
        .all(|(request, _)| request == "container-1-request-2"));

    let pod: Pod = Api::namespaced(node.api.client(), "default")
        .get("train")
        .await
        .unwrap();
    let status = pod.status.unwrap().extended_resource_claim_status.unwrap();
    assert_eq!(status.resource_claim_name, name);
    assert_eq!(status.request_mappings.len(), 1);
    assert_eq!(status.request_mappings[0].container_name, "main");

    let prepared = prepare_pod(&kubelet, &node.api.client(), "default", "train", true)
        .await
        .expect("the kubelet prepares the pod");
    assert_eq!(prepared.claims.len(), 1);
    assert_eq!(prepared.claims[0].name, name);
    let devices = &prepared.devices[&name];
    let names: BTreeSet<&str> = devices.iter().map(|d| d.device_name.as_str()).collect();
    let allocated_names: BTreeSet<&str> = allocated.iter().map(|(_, d)| d.as_str()).collect();
    assert_eq!(
        names, allocated_names,
        "the plugin prepares what was allocated"
    );
    for device in devices {
        assert_eq!(device.request_names, ["container-1-request-2"]);
    }
    assert_eq!(cdi_of(&prepared, "main").len(), 2);
    assert!(cdi_of(&prepared, "setup").is_empty());
    let uid = prepared.claims[0].uid.clone();
    assert!(
        node.cdi_files().iter().any(|f| f.contains(&uid)),
        "CDI spec for {uid}"
    );

    kubelet
        .unprepare(&prepared.claims)
        .await
        .expect("unprepare")
        .remove(&uid)
        .unwrap()
        .expect("claim unprepared");
    assert!(!node.cdi_files().iter().any(|f| f.contains(&uid)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_mixing_a_claim_with_nvidia_gpu_gets_distinct_gpus_in_one_call() {
    let node = Harness::new("dgx-h100").await;
    node.apply_extended_resource_component().await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;

    node.create_claim("own", 1).await;
    let mut spec = pod(
        "mixed",
        vec![
            container("dra-style", json!({"claims": [{"name": "gpu"}]})),
            container("plugin-style", json!({"limits": {"nvidia.com/gpu": "1"}})),
        ],
    );
    spec["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": "own"}]);
    let created = create_pod(&node, spec).await;
    let uid = created.metadata.uid.unwrap();
    // The pod's own claim first, as in one scheduling cycle; the special claim sees its device in use.
    scheduler::allocate(&node.api.client(), "default", "own", NODE, ("mixed", &uid))
        .await
        .expect("own claim allocated");
    let special = schedule(&node, "mixed").await;
    let special_name = special.metadata.name.clone().unwrap();

    let prepared = prepare_pod(&kubelet, &node.api.client(), "default", "mixed", true)
        .await
        .expect("the kubelet prepares the pod");
    let order: Vec<&str> = prepared.claims.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        order,
        ["own", special_name.as_str()],
        "one call, the pod's own claim first"
    );
    let (a, b) = (
        cdi_of(&prepared, "dra-style"),
        cdi_of(&prepared, "plugin-style"),
    );
    assert_eq!((a.len(), b.len()), (1, 1), "{prepared:?}");
    let device = |claim: &str| prepared.devices[claim][0].device_name.clone();
    assert_ne!(device("own"), device(&special_name), "two different GPUs");
    assert_ne!(a, b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_container_gets_the_devices_of_its_own_request() {
    let node = Harness::new("dgx-h100").await;
    node.apply_extended_resource_component().await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;

    create_pod(
        &node,
        pod(
            "pair",
            vec![
                container("one", json!({"limits": {"nvidia.com/gpu": "1"}})),
                container(
                    "three",
                    json!({"limits": {"nvidia.com/gpu": "3", "cpu": "1"}}),
                ),
            ],
        ),
    )
    .await;
    let claim = schedule(&node, "pair").await;
    let requests: BTreeSet<String> = results(&claim).into_iter().map(|(r, _)| r).collect();
    assert_eq!(
        requests,
        BTreeSet::from([
            "container-0-request-0".into(),
            "container-1-request-1".into()
        ])
    );

    let prepared = prepare_pod(&kubelet, &node.api.client(), "default", "pair", true)
        .await
        .expect("the kubelet prepares the pod");
    let (one, three) = (cdi_of(&prepared, "one"), cdi_of(&prepared, "three"));
    assert_eq!((one.len(), three.len()), (1, 3), "{prepared:?}");
    assert!(
        one.iter().all(|id| !three.contains(id)),
        "no device in both"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_gpus_than_the_node_has_are_not_allocated() {
    let node = Harness::new("dgx-h100").await;
    node.apply_extended_resource_component().await;
    let _plugin = node.start_plugin().await;
    node.wait_for_slices().await;
    create_pod(
        &node,
        pod(
            "big",
            vec![container(
                "main",
                json!({"limits": {"nvidia.com/gpu": "9"}}),
            )],
        ),
    )
    .await;
    let err = scheduler::allocate_extended_resources(&node.api.client(), "default", "big", NODE)
        .await
        .expect_err("8 GPUs cannot serve 9");
    assert!(
        matches!(err, AllocationError::Unallocatable { .. }),
        "{err}"
    );
}

/// A node whose allocatable lists `nvidia.com/gpu` (the device plugin runs there, or did and left
/// `nvidia.com/gpu: 0`) is served by the device plugin: no special claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_advertises_nvidia_gpu_is_left_to_the_device_plugin() {
    let node = Harness::new("dgx-h100").await;
    node.apply_extended_resource_component().await;
    node.api.insert(
        "nodes",
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "status": {"capacity": {"nvidia.com/gpu": "0"}, "allocatable": {"nvidia.com/gpu": "0"}}}),
    );
    create_pod(
        &node,
        pod(
            "old",
            vec![container(
                "main",
                json!({"limits": {"nvidia.com/gpu": "1"}}),
            )],
        ),
    )
    .await;
    let claim = scheduler::allocate_extended_resources(&node.api.client(), "default", "old", NODE)
        .await
        .expect("no error");
    assert!(claim.is_none(), "{claim:?}");
    let claims = Api::<ResourceClaim>::namespaced(node.api.client(), "default")
        .list(&Default::default())
        .await
        .unwrap();
    assert!(claims.items.is_empty());
}

/// With `DRAExtendedResource` off the API server drops the class's `extendedResourceName` and the pod's
/// `extendedResourceClaimStatus`, as 1.34's registry strategies do; nothing then maps `nvidia.com/gpu`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gate_the_server_drops_the_fields() {
    let gates = FeatureGates::disabling([FeatureGate::DRAExtendedResource]);
    let node = Harness::with_gates("dgx-h100", ServerVersion::default(), gates).await;
    let class = node.apply_extended_resource_component().await;
    assert_eq!(class.spec.unwrap().extended_resource_name, None);
    create_pod(
        &node,
        pod(
            "p",
            vec![container(
                "main",
                json!({"limits": {"nvidia.com/gpu": "1"}}),
            )],
        ),
    )
    .await;
    let err =
        scheduler::allocate_extended_resources(&node.api.client(), "default", "p", NODE).await;
    assert!(
        matches!(err, Ok(None)),
        "nothing maps nvidia.com/gpu: {err:?}"
    );

    let status = json!({"status": {"extendedResourceClaimStatus": {
        "resourceClaimName": "p-extended-resources-abcde", "requestMappings": []}}});
    let pod: Pod = Api::namespaced(node.api.client(), "default")
        .patch_status("p", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    assert!(pod
        .status
        .unwrap_or_default()
        .extended_resource_claim_status
        .is_none());
}

/// 1.34.2's scheduler, seen on a real one: a pod with a claim of its own on a node whose device plugin
/// advertises `nvidia.com/gpu` still gets its `nvidia.com/gpu` from DRA as well (the special claim covers
/// every mapped resource once the DRA step runs for the pod's claims).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_claim_of_its_own_a_pod_gets_dra_gpus_even_on_a_device_plugin_node() {
    let node = Harness::new("dgx-h100").await;
    node.apply_extended_resource_component().await;
    let _plugin = node.start_plugin().await;
    node.wait_for_slices().await;
    node.api.insert(
        "nodes",
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "status": {"capacity": {"nvidia.com/gpu": "4"}, "allocatable": {"nvidia.com/gpu": "4"}}}),
    );
    node.create_claim("own", 1).await;
    let mut spec = pod(
        "both",
        vec![container(
            "main",
            json!({"limits": {"nvidia.com/gpu": "1"}, "claims": [{"name": "gpu"}]}),
        )],
    );
    spec["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": "own"}]);
    create_pod(&node, spec).await;
    let claim = schedule(&node, "both").await;
    let allocated = results(&claim);
    assert_eq!(allocated.len(), 1, "{allocated:?}");
    assert_eq!(allocated[0].0, "container-0-request-0");
}
