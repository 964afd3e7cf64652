//! A node swapped from NVIDIA's DRA plugin to ours: the plugin started as `gpu.nvidia.com` finds
//! NVIDIA's `checkpoint.json` in its directory. It must leave that file exactly as it is (NVIDIA's
//! plugin needs it when swapped back) and say which claims NVIDIA's plugin left prepared.

use std::time::Duration;

use gpu_dra::api::NVIDIA_DRIVER_NAME;
use gpu_dra::support::harness::Harness;
use gpu_dra::support::kubelet::KubeletDouble;

const WAIT: Duration = Duration::from_secs(10);

// A v2 checkpoint in the shape NVIDIA's plugin writes (its Go types: checkpointv.go, prepared.go),
// with the v1 copy it keeps for downgrades.
const NVIDIA_CHECKPOINT: &str = r#"{"checksum":3158233281,"v1":{"preparedClaims":{"7c1f":{"status":{},"preparedDevices":[{"devices":[{"gpu":{"info":{"uuid":"GPU-a"},"device":{"Requests":["gpu"],"PoolName":"node-a","DeviceName":"gpu-0","CDIDeviceIDs":["k8s.gpu.nvidia.com/claim=7c1f-gpu-0"]}},"mig":null}],"configState":{"containerEdits":null}}]}}},"v2":{"checksum":1804289383,"preparedClaims":{"7c1f":{"checkpointState":"PrepareCompleted","status":{},"preparedDevices":[{"devices":[{"gpu":{"info":{"uuid":"GPU-a"},"device":{"Requests":["gpu"],"PoolName":"node-a","DeviceName":"gpu-0","CDIDeviceIDs":["k8s.gpu.nvidia.com/claim=7c1f-gpu-0"]}},"mig":null}],"configState":{"containerEdits":null}}],"name":"pod0-gpu-x7k2p","namespace":"gpu-test1"}},"nodeBootID":"b00t"}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidias_checkpoint_is_left_alone_and_its_claims_are_reported() {
    let mut node = Harness::new("dgx-h100").await;
    node.config.driver_name = NVIDIA_DRIVER_NAME.to_string();
    let plugin_dir = node.config.plugin_dir();
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let theirs = plugin_dir.join("checkpoint.json");
    std::fs::write(&theirs, NVIDIA_CHECKPOINT).unwrap();

    for _ in 0..2 {
        let plugin = node.start_plugin().await;
        // Registered under NVIDIA's name, with our own checkpoint beside theirs.
        let _kubelet = KubeletDouble::register(&node.config.registry_dir, NVIDIA_DRIVER_NAME, WAIT)
            .await
            .expect("the kubelet registers gpu.nvidia.com");
        assert!(
            plugin.recovery.checkpoint_set_aside.is_none(),
            "NVIDIA's checkpoint was taken for ours"
        );
        plugin.shutdown().await;
        assert_eq!(
            std::fs::read_to_string(&theirs).unwrap(),
            NVIDIA_CHECKPOINT,
            "NVIDIA's checkpoint changed"
        );
        let mut names: Vec<String> = std::fs::read_dir(&plugin_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.contains("checkpoint"))
            .collect();
        names.sort();
        // Nothing set aside as corrupt; ours (if written yet) under its own name.
        assert!(
            names
                .iter()
                .all(|n| n == "checkpoint.json" || n == "gpu-dra-checkpoint.json"),
            "{names:?}"
        );
    }

    let events = node
        .api
        .wait_for(
            "events",
            |events| events.iter().any(|e| e["reason"] == "NvidiaPreparedClaims"),
            WAIT,
        )
        .await
        .expect("a NvidiaPreparedClaims Event on the Node");
    let event = events
        .into_iter()
        .find(|e| e["reason"] == "NvidiaPreparedClaims")
        .unwrap();
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["kind"], "Node");
    let note = event["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("gpu-test1/pod0-gpu-x7k2p (7c1f) on gpu-0"),
        "{note}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_own_driver_name_keeps_checkpoint_json() {
    let node = Harness::new("dgx-h100").await;
    assert_eq!(
        gpu_dra::claims::checkpoint_path(&node.config.plugin_dir(), &node.config.driver_name),
        node.config.plugin_dir().join("checkpoint.json"),
        "an upgrade must find the checkpoint where earlier releases wrote it"
    );
}
