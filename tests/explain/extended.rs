//! `gpu-dra explain pod` for pods that ask for `nvidia.com/gpu: N` (extended resources backed by DRA,
//! Kubernetes 1.34): from a dump the test writes and from the API server double, on a cluster with DRA
//! nodes (gpu.dra.dev publishes their GPUs, DeviceClass gpu.dra.dev maps `nvidia.com/gpu`) and
//! device-plugin nodes (their allocatable lists `nvidia.com/gpu`).

use serde_json::{json, Value};

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::builtin_profile;
use gpu_dra::support::apiserver::{ApiServer, Verb};
use gpu_dra::support::cluster as fixture;

use super::{offline_run, Run};

const GPU: &str = "nvidia.com/gpu";

/// (resource, object): dra-a with 6 of 8 H100 held by another pod's extended-resources claim, dra-b
/// with 8 free, dp-c and dp-d advertising 8 through a device plugin (7 and 2 used by bound pods).
fn objects(classes: Vec<Value>) -> Vec<(&'static str, Value)> {
    let h100 = builtin_profile("dgx-h100").unwrap();
    let mut objects: Vec<(&str, Value)> =
        classes.into_iter().map(|c| ("deviceclasses", c)).collect();
    for node in ["dra-a", "dra-b"] {
        for slice in fixture::node_slices(node, &h100, MigMode::None) {
            objects.push(("resourceslices", serde_json::to_value(slice).unwrap()));
        }
        objects.push(("nodes", fixture::node(node, &[("gpu", "h100")], &[], false)));
    }
    let held: Vec<(&str, &str)> = ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5"]
        .iter()
        .map(|d| ("container-0-request-0", *d))
        .collect();
    objects.push((
        "pods",
        fixture::limits_pod("team", "other", json!({GPU: "6"}), Some("dra-a")),
    ));
    objects.push((
        "resourceclaims",
        fixture::extended_resource_claim("team", "other", "dra-a", &held),
    ));
    for node in ["dp-c", "dp-d"] {
        let node = fixture::node(node, &[("gpu", "plugin")], &[], false);
        objects.push(("nodes", fixture::with_allocatable(node, &[(GPU, "8")])));
    }
    for (name, count, node) in [
        ("p1", "4", "dp-c"),
        ("p2", "3", "dp-c"),
        ("p3", "2", "dp-d"),
    ] {
        objects.push((
            "pods",
            fixture::limits_pod("team", name, json!({GPU: count}), Some(node)),
        ));
    }
    objects
}

fn dump(dir: &tempfile::TempDir, objects: &[(&str, Value)]) -> std::path::PathBuf {
    let items = objects.iter().map(|(_, o)| o.clone()).collect();
    let path = dir.path().join("cluster.yaml");
    std::fs::write(&path, serde_yaml::to_string(&fixture::list(items)).unwrap()).unwrap();
    path
}

async fn explain(objects: &[(&str, Value)], args: &[&str]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let path = dump(&dir, objects);
    offline_run(&path, args).await
}

fn node<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == name)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_extended_resource_pod_fits_through_dra_or_the_device_plugin() {
    let mut objects = objects(fixture::device_classes_serving(GPU));
    objects.push((
        "pods",
        fixture::limits_pod("ml", "train", json!({GPU: "2"}), None),
    ));
    let out = explain(&objects, &["explain", "pod", "ml/train"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines[0],
        "Pod ml/train: would fit on 3 of 4 nodes; the scheduler picks among them"
    );
    assert_eq!(
        lines[1],
        "claim ml/train-extended-resources-* (for extended resources nvidia.com/gpu, made by the \
         scheduler per node): container-0-request-0: 2 of class gpu.dra.dev (nvidia.com/gpu of container main)"
    );
    assert_eq!(out.line("dra-a"), "gpu-6, gpu-7");
    assert_eq!(out.line("dra-b"), "gpu-0, gpu-1");
    assert_eq!(
        out.line("dp-c"),
        "device plugin: Insufficient nvidia.com/gpu (requested 2, used 7 of 8)"
    );
    assert_eq!(
        out.line("dp-d"),
        "device plugin: nvidia.com/gpu fits (requested 2, 6 of 8 free)"
    );

    let out = explain(&objects, &["explain", "pod", "ml/train", "-o", "json"]).await;
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["fittingNodes"], 3);
    assert_eq!(
        report["claims"][0]["source"],
        json!({"kind": "extendedResources",
        "resources": [GPU], "created": false})
    );
    let a = node(&report, "dra-a");
    assert_eq!(a["devices"][0]["request"], "container-0-request-0");
    assert_eq!(a["extendedResources"][0]["source"], "dra");
    let c = node(&report, "dp-c");
    assert_eq!(c["reasons"][0]["kind"], "insufficientResource");
    assert_eq!(c["reasons"][0]["resource"], GPU);
    assert_eq!(c["schedulerReason"], "Insufficient nvidia.com/gpu");
    assert_eq!(c["extendedResources"][0]["used"], 7);
    assert_eq!(c["extendedResources"][0]["allocatable"], 8);
}

#[tokio::test(flavor = "multi_thread")]
async fn too_few_gpus_and_a_resource_nobody_serves_exit_1_in_the_schedulers_words() {
    let mut objects = objects(fixture::device_classes_serving(GPU));
    objects.push((
        "pods",
        fixture::limits_pod("ml", "nine", json!({GPU: "9"}), None),
    ));
    let fpga = json!({GPU: "1", "example.com/fpga": "1"});
    objects.push(("pods", fixture::limits_pod("ml", "fpga", fpga, None)));
    let out = explain(&objects, &["explain", "pod", "ml/nine"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines[0],
        "Pod ml/nine: fits on no node (4 nodes: 2 Insufficient nvidia.com/gpu (device plugin), 2 too few free devices)"
    );
    assert_eq!(
        lines[1],
        "scheduler: 0/4 nodes are available: 2 Insufficient nvidia.com/gpu, 2 cannot allocate all claims."
    );
    assert_eq!(
        out.line("dra-a"),
        "request container-0-request-0 (9 wanted): 8 GPUs: 2 free, 6 allocated to other claims"
    );
    assert_eq!(
        out.line("dp-d"),
        "device plugin: Insufficient nvidia.com/gpu (requested 9, used 2 of 8)"
    );

    let out = explain(&objects, &["explain", "pod", "ml/fpga"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert_eq!(
        out.line("dra-b"),
        "Insufficient example.com/fpga: no DeviceClass maps it and the node does not advertise it"
    );
    assert!(
        out.stdout
            .contains("scheduler: 0/4 nodes are available: 4 Insufficient example.com/fpga."),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_mixing_the_resource_with_a_template_claim_and_the_implicit_class_name() {
    let mut objects = objects(fixture::device_classes_serving(GPU));
    let devices =
        json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}}]});
    objects.push((
        "resourceclaimtemplates",
        fixture::claim("ml", "one", devices, true),
    ));
    let mut mix = fixture::limits_pod("ml", "mix", json!({GPU: "1"}), None);
    mix["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": "one"}]);
    mix["spec"]["nodeSelector"] = json!({"gpu": "h100"});
    objects.push(("pods", mix));
    let implicit = "deviceclass.resource.kubernetes.io/mig.gpu.dra.dev";
    objects.push((
        "pods",
        fixture::limits_pod("ml", "implicit", json!({implicit: "1"}), None),
    ));

    let out = explain(&objects, &["explain", "pod", "ml/mix"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    // The two claims take different GPUs: dra-a has exactly two free.
    assert_eq!(
        out.line("dra-a"),
        "ml/one: gpu-6; ml/mix-extended-resources-*: gpu-7"
    );
    assert_eq!(
        out.line("dp-c"),
        "node affinity excludes it (nodeSelector gpu=h100)"
    );

    let out = explain(&objects, &["explain", "pod", "ml/implicit"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.line("dra-a"),
        format!("{implicit} ignored (no device for it)")
    );
    assert!(
        out.stdout.contains(&format!(
            "note: {implicit} lies under kubernetes.io/, so to the 1.34 scheduler it is no extended \
             resource name and its DRA step never allocates a device for it; NodeResourcesFit leaves \
             it to DRA, so it is ignored"
        )),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bound_pod_shows_its_claim_and_the_gate_off_leaves_the_device_plugin() {
    let mut objects = objects(fixture::device_classes_serving(GPU));
    let results = [
        ("container-0-request-0", "gpu-3"),
        ("container-0-request-0", "gpu-4"),
    ];
    objects.push((
        "resourceclaims",
        fixture::extended_resource_claim("ml", "train", "dra-b", &results),
    ));
    objects.push((
        "pods",
        fixture::limits_pod("ml", "train", json!({GPU: "2"}), Some("dra-b")),
    ));
    let out = explain(&objects, &["explain", "pod", "ml/train"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.stdout.lines().nth(1),
        Some(
            "claim ml/train-extended-resources-x7k2p (for extended resources nvidia.com/gpu, allocated): \
             container-0-request-0: 2 of class gpu.dra.dev (nvidia.com/gpu of container main)"
        )
    );
    assert_eq!(out.line("dra-b"), "gpu-3 (allocated), gpu-4 (allocated)");
    assert_eq!(out.line("dra-a"), "the pod is bound to node dra-b");

    // The gate off: the API server drops extendedResourceName, so only device plugins serve it.
    let mut objects = self::objects(fixture::device_classes());
    objects.push((
        "pods",
        fixture::limits_pod("ml", "train", json!({GPU: "2"}), None),
    ));
    let out = explain(&objects, &["explain", "pod", "ml/train"]).await;
    assert_eq!(out.code, 0, "{out:?}");
    assert_eq!(
        out.stdout.lines().next(),
        Some("Pod ml/train: would fit on 1 of 4 nodes: dp-d")
    );
    assert_eq!(
        out.line("dra-b"),
        "Insufficient nvidia.com/gpu: no DeviceClass maps it and the node does not advertise it"
    );
    assert!(
        out.stdout
            .contains("note: hint: no DeviceClass maps nvidia.com/gpu"),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn through_the_api_server_explain_lists_pods_and_answers_as_from_the_dump() {
    let api = ApiServer::start().await.expect("API server double");
    let mut objects = objects(fixture::device_classes_serving(GPU));
    objects.push((
        "pods",
        fixture::limits_pod("ml", "train", json!({GPU: "2"}), None),
    ));
    for (resource, object) in &objects {
        api.insert(resource, object.clone());
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let args = [
        "explain",
        "pod",
        "ml/train",
        "--kubeconfig",
        &kubeconfig.display().to_string(),
    ];
    let live = super::run(
        env!("CARGO_BIN_EXE_gpu-dra").into(),
        args.iter().map(|a| a.to_string()).collect(),
        None,
    )
    .await;
    let offline = explain(&objects, &["explain", "pod", "ml/train"]).await;
    assert_eq!(live.code, 0, "{live:?}");
    assert_eq!(live.stdout, offline.stdout);
    let requests = api.requests();
    assert!(
        requests
            .iter()
            .any(|r| r.verb == Verb::List && r.resource == "pods"),
        "{requests:?}"
    );
    assert!(requests
        .iter()
        .all(|r| matches!(r.verb, Verb::Get | Verb::List)));
}
