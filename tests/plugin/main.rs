//! The plugin end to end against the doubles: registration, publishing, prepare/unprepare over gRPC,
//! CDI specs, sockets, metrics, and API-server faults. Here the whole path once, and the helpers that
//! read a prepare answer; `serving` covers the sockets, services and endpoints, `publishing` the
//! ResourceSlices, `claims` prepare and unprepare, `startup` the order of the start as the kubelet's
//! probes and sockets see it.

mod claims;
mod publishing;
mod serving;
mod startup;

use std::os::unix::fs::MetadataExt;

use gpu_dra::support::cdi_runtime;
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::{ClaimRef, DraService};

fn ok_devices(
    answer: &std::collections::HashMap<
        String,
        Result<Vec<gpu_dra::support::kubelet::PreparedDevice>, String>,
    >,
    claim: &ClaimRef,
) -> Vec<gpu_dra::support::kubelet::PreparedDevice> {
    match answer.get(&claim.uid) {
        Some(Ok(devices)) => devices.clone(),
        other => panic!("claim {} not prepared: {other:?}", claim.name),
    }
}

fn claim_error(
    answer: &std::collections::HashMap<
        String,
        Result<Vec<gpu_dra::support::kubelet::PreparedDevice>, String>,
    >,
    claim: &ClaimRef,
) -> String {
    match answer.get(&claim.uid) {
        Some(Err(error)) => error.clone(),
        other => panic!("claim {} should have failed: {other:?}", claim.name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_then_prepares_and_unprepares_a_claim() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    assert_eq!(kubelet.service(), DraService::V1);
    let info = kubelet.plugin_info();
    assert_eq!(
        info.supported_versions,
        vec![
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    assert_eq!(
        std::path::Path::new(&info.endpoint),
        node.config.dra_socket()
    );

    let slices = node.wait_for_slices().await;
    assert_eq!(slices.len(), 1);
    let slice = &slices[0];
    assert_eq!(slice.spec.node_name.as_deref(), Some(NODE));
    assert_eq!(slice.spec.pool.name, NODE);
    assert_eq!(slice.spec.pool.resource_slice_count, 1);
    let owner = &slice.metadata.owner_references.as_ref().unwrap()[0];
    let stored_node = node.api.get("nodes", None, NODE).unwrap();
    assert_eq!(owner.kind, "Node");
    assert_eq!(owner.uid, stored_node["metadata"]["uid"].as_str().unwrap());
    assert_eq!(slice.spec.devices.as_ref().unwrap().len(), 8);

    let claim = node.allocated_claim("two-gpus", 2).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let devices = ok_devices(&answer, &claim);
    assert_eq!(devices.len(), 2);
    for device in &devices {
        assert_eq!(device.request_names, vec!["gpus"]);
        assert_eq!(device.pool_name, NODE);
        assert_eq!(
            device.cdi_device_ids,
            vec![format!(
                "k8s.{DRIVER}/gpu={}-{}",
                claim.uid, device.device_name
            )]
        );
    }

    // The spec is where the runtime looks, valid for the reference CDI implementation, and tells the
    // container which GPUs it got.
    let spec_path = node
        .cdi_dir()
        .join(format!("k8s.{DRIVER}-gpu_{}.json", claim.uid));
    let spec = container_device_interface::spec::read_spec(&spec_path, 0)
        .expect("spec accepted by the CDI crate");
    drop(spec);
    let text = std::fs::read_to_string(&spec_path).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let first = &json["devices"][0]["containerEdits"];
    let env: Vec<&str> = first["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        env.iter()
            .any(|e| e.starts_with("GPU_DRA_DEVICE_GPU_") && e.contains("=GPU-")),
        "{text}"
    );
    let nodes = first["deviceNodes"].as_array().unwrap();
    assert!(
        nodes.iter().any(|n| n["path"]
            .as_str()
            .is_some_and(|p| p.starts_with("/dev/nvidia"))),
        "{text}"
    );
    // Fake GPUs' device files exist on no host, as a MIG device's on a real node: the spec names no
    // host file, and the runtime makes each node from the numbers the spec gives (/dev/null's).
    assert!(nodes.iter().all(|n| n.get("hostPath").is_none()), "{text}");
    let ids: Vec<String> = devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect();
    let container = cdi_runtime::inject(&[&node.cdi_dir()], &ids).unwrap_or_else(|e| panic!("{e}"));
    let null = std::fs::metadata("/dev/null").unwrap().rdev();
    for device in &devices {
        let minor = device.device_name.trim_start_matches("gpu-");
        for path in [
            format!("/dev/nvidia{minor}"),
            "/dev/nvidiactl".into(),
            "/dev/nvidia-uvm".into(),
            "/dev/nvidia-uvm-tools".into(),
            // The fake node has the nvidia-modeset module, as NVIDIA's specs show it on such a node.
            "/dev/nvidia-modeset".into(),
        ] {
            let made = container
                .device(&path)
                .unwrap_or_else(|| panic!("{path} not in the container: {container:?}"));
            assert_eq!(made.device_type, "c");
            assert_eq!(
                (made.major, made.minor),
                (
                    nix::sys::stat::major(null) as i64,
                    nix::sys::stat::minor(null) as i64
                ),
                "{path}"
            );
        }
    }

    // Idempotent: the same answer again.
    let again = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(ok_devices(&again, &claim), devices);

    let unprepared = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(unprepared.get(&claim.uid), Some(&Ok(())));
    assert!(!spec_path.exists());
    // Unknown or already unprepared claims succeed.
    let unknown = ClaimRef::new(
        "default",
        "never-seen",
        "0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5b",
    );
    // A spec left behind for a claim the plugin no longer knows is removed by its unprepare.
    let leftover = node
        .cdi_dir()
        .join(format!("k8s.{DRIVER}-gpu_{}.json", unknown.uid));
    std::fs::write(&leftover, "{}").unwrap();
    let answer = kubelet
        .unprepare(&[claim.clone(), unknown.clone()])
        .await
        .unwrap();
    assert_eq!(answer.get(&claim.uid), Some(&Ok(())));
    assert_eq!(answer.get(&unknown.uid), Some(&Ok(())));
    assert!(!leftover.exists());
    plugin.shutdown().await;
}
