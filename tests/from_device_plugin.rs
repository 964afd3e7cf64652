//! docs/from-device-plugin.md: each row's example in `examples/from-device-plugin/` goes
//! through the doubles the way a cluster would take it: the resourceclaim controller and the scheduler
//! (`support::pods::schedule_pod`), the kubelet (`support::kubelet_pods::prepare_pod`) and the plugin.

use std::collections::BTreeSet;

use gpu_dra::cdi::CdiRegistry;
use gpu_dra::devices::MigMode;
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::KubeletDouble;
use gpu_dra::support::kubelet_pods::{prepare_pod, PreparedPod};
use gpu_dra::support::pods::schedule_pod;
use gpu_dra::support::scheduler::AllocationError;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, PostParams};
use serde::Deserialize;

fn example(file: &str) -> Vec<serde_json::Value> {
    let path = format!(
        "{}/examples/from-device-plugin/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde_json::Value::deserialize(doc).expect("YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn parse<T: serde::de::DeserializeOwned>(file: &str, doc: serde_json::Value) -> T {
    serde_json::from_value(doc).unwrap_or_else(|e| panic!("{file}: not a valid object: {e}"))
}

/// `kubectl apply -f` of one example file.
async fn apply(node: &Harness, file: &str) {
    let client = node.api.client();
    let params = PostParams::default();
    for doc in example(file) {
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        match kind.as_str() {
            "Pod" => {
                let pod: Pod = parse(file, doc);
                Api::<Pod>::namespaced(client.clone(), "default")
                    .create(&params, &pod)
                    .await
                    .map(drop)
            }
            "ResourceClaim" => {
                let claim: ResourceClaim = parse(file, doc);
                Api::<ResourceClaim>::namespaced(client.clone(), "default")
                    .create(&params, &claim)
                    .await
                    .map(drop)
            }
            "ResourceClaimTemplate" => {
                let template: ResourceClaimTemplate = parse(file, doc);
                Api::<ResourceClaimTemplate>::namespaced(client.clone(), "default")
                    .create(&params, &template)
                    .await
                    .map(drop)
            }
            other => panic!("{file}: no way to apply a {other}"),
        }
        .unwrap_or_else(|e| panic!("{file}: the API server refused a {kind}: {e}"));
    }
}

/// The node with the plugin running and `deploy/components/extended-resource` applied.
async fn node_with(
    profile: &str,
    mig: MigMode,
) -> (Harness, gpu_dra::plugin::RunningPlugin, KubeletDouble) {
    let mut node = Harness::new(profile).await;
    node.config.mig_mode = mig;
    node.apply_extended_resource_component().await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    // The whole pool: the scheduler skips a pool with slices missing.
    node.wait_for_slices_where(|slices| {
        slices
            .first()
            .is_some_and(|s| s.spec.pool.resource_slice_count == slices.len() as i64)
    })
    .await;
    (node, plugin, kubelet)
}

async fn start(node: &Harness, kubelet: &KubeletDouble, pod: &str) -> PreparedPod {
    schedule_pod(&node.api.client(), "default", pod, NODE)
        .await
        .unwrap_or_else(|e| panic!("{pod} not scheduled: {e}"));
    prepare_pod(kubelet, &node.api.client(), "default", pod, true)
        .await
        .unwrap_or_else(|e| panic!("{pod} not prepared: {e}"))
}

fn container_env(node: &Harness, claim_uid: &str) -> Vec<String> {
    let spec = CdiRegistry::new(&node.config.cdi_root, DRIVER)
        .read_claim_spec(claim_uid)
        .expect("spec readable")
        .expect("claim has a CDI spec");
    let devices = spec
        .devices
        .iter()
        .flat_map(|d| d.container_edits.env.iter());
    spec.container_edits
        .env
        .iter()
        .chain(devices)
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_1_nvidia_gpu_and_a_claim_template_both_give_two_whole_gpus() {
    let (node, _plugin, kubelet) = node_with("dgx-h100", MigMode::Static).await;
    apply(&node, "nvidia-gpu.yaml").await;
    let plugin_style = start(&node, &kubelet, "train").await;
    apply(&node, "gpu-claim-template.yaml").await;
    let dra_style = start(&node, &kubelet, "train-dra").await;

    let devices = |prepared: &PreparedPod| -> BTreeSet<String> {
        prepared
            .devices
            .values()
            .flatten()
            .map(|d| d.device_name.clone())
            .collect()
    };
    let (a, b) = (devices(&plugin_style), devices(&dra_style));
    assert_eq!((a.len(), b.len()), (2, 2), "{a:?} {b:?}");
    assert!(
        a.iter().chain(&b).all(|d| !d.contains("-mig-")),
        "whole GPUs"
    );
    assert!(a.is_disjoint(&b));
    assert_eq!(plugin_style.cdi_devices["main"].len(), 2);
    assert_eq!(dra_style.cdi_devices["main"].len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_2_the_product_selector_takes_h100_nodes_only() {
    let (h100, _plugin, kubelet) = node_with("dgx-h100", MigMode::Static).await;
    apply(&h100, "product-selector.yaml").await;
    let prepared = start(&h100, &kubelet, "on-h100").await;
    assert_eq!(prepared.cdi_devices["main"].len(), 1);

    // The nodeSelector of the docs' row matches the label `classicNodeLabels` writes on this node.
    use gpu_dra::gpu::GpuBackend;
    let labels = gpu_dra::devices::node_labels::classic_labels(
        &h100.fake_backend().inventory().expect("inventory"),
    );
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/from-device-plugin.md"
    ))
    .unwrap();
    let product = &labels[gpu_dra::devices::node_labels::PRODUCT];
    assert!(
        page.contains(&format!(
            "nodeSelector: {{nvidia.com/gpu.product: {product}}}"
        )),
        "docs/from-device-plugin.md's row 2 must show the label value the plugin writes: {product}"
    );

    let (a100, _plugin, _kubelet) = node_with("dgx-a100", MigMode::Static).await;
    apply(&a100, "product-selector.yaml").await;
    let refused = schedule_pod(&a100.api.client(), "default", "on-h100", NODE).await;
    assert!(
        matches!(refused, Err(AllocationError::Unallocatable { .. })),
        "an A100 node must not take the pod: {refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_3_two_pods_time_slice_one_gpu() {
    let (node, _plugin, kubelet) = node_with("dgx-h100", MigMode::Static).await;
    apply(&node, "time-slicing.yaml").await;
    let a = start(&node, &kubelet, "notebook-a").await;
    let b = start(&node, &kubelet, "notebook-b").await;
    assert_eq!(a.cdi_devices["main"].len(), 1);
    assert_eq!(a.cdi_devices["main"], b.cdi_devices["main"], "the same GPU");
    let env = container_env(&node, &a.claims[0].uid);
    assert!(
        env.contains(&"GPU_DRA_SHARING=TimeSlicing/Default".to_string()),
        "{env:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_4_the_mig_class_gives_a_1g10gb_device() {
    let (node, _plugin, kubelet) = node_with("dgx-h100", MigMode::Dynamic).await;
    apply(&node, "mig.yaml").await;
    let prepared = start(&node, &kubelet, "small").await;
    let devices: Vec<&str> = prepared
        .devices
        .values()
        .flatten()
        .map(|d| d.device_name.as_str())
        .collect();
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert!(devices[0].contains("-mig-1g10gb-"), "{}", devices[0]);
    assert_eq!(prepared.cdi_devices["main"].len(), 1);
    assert!(
        node.mig_devices().len() == 1,
        "the plugin created the MIG device: {:?}",
        node.mig_devices()
    );
}

/// Row 5: where the scheduler says `Insufficient nvidia.com/gpu` or `cannot allocate all claims` for the
/// row-1 pod, `gpu-dra explain pod` says per node which of the two serves it and what is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_5_explain_answers_for_the_nvidia_gpu_pod() {
    use gpu_dra::explain::{explain, Cluster, Target};
    let (node, _plugin, _kubelet) = node_with("dgx-h100", MigMode::Static).await;
    node.allocated_claim("busy", 7).await;
    apply(&node, "nvidia-gpu.yaml").await;
    let target = Target::Pod {
        namespace: "default".into(),
        name: "train".into(),
    };
    let answer = |cluster: &Cluster| {
        let report = explain(cluster, &target).expect("explained");
        (report.exit_code(), report.to_table())
    };

    let cluster = Cluster::fetch(&node.api.client(), &target).await.unwrap();
    let (code, table) = answer(&cluster);
    assert_eq!(code, 1, "{table}");
    assert!(table.contains("cannot allocate all claims"), "{table}");
    assert!(
        table.contains("container-0-request-0 (2 wanted)"),
        "{table}"
    );
    assert!(table.contains("1 free"), "{table}");

    // The same node once a device plugin advertised nvidia.com/gpu there (and left it at 0).
    node.api.insert(
        "nodes",
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "status": {"capacity": {"nvidia.com/gpu": "0"}, "allocatable": {"nvidia.com/gpu": "0"}}}),
    );
    let cluster = Cluster::fetch(&node.api.client(), &target).await.unwrap();
    let (code, table) = answer(&cluster);
    assert_eq!(code, 1, "{table}");
    assert!(table.contains("Insufficient nvidia.com/gpu"), "{table}");
    assert!(table.contains("device plugin"), "{table}");
}
