//! A plugin started as `gpu.nvidia.com` (NVIDIA compatibility mode), driven the way the kubelet and the
//! scheduler drive it: claims written for NVIDIA's driver (its classes, its `resource.nvidia.com/v1beta1`
//! configs) are allocated from its slices and prepared with NVIDIA's precedence, under NVIDIA's name end
//! to end (registration, sockets, CDI).

use std::collections::BTreeMap;

use gpu_dra::api::NVIDIA_DRIVER_NAME;
use gpu_dra::gpu::{GpuSharingMode, TimeSliceInterval};
use gpu_dra::support::harness::Harness;
use serde_json::json;

fn time_slicing(interval: &str) -> serde_json::Value {
    json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidias_claims_are_prepared_under_its_name_with_its_precedence() {
    let node = Harness::nvidia_compat("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let slices = node.wait_for_slices().await;
    assert!(slices.iter().all(|s| s.spec.driver == NVIDIA_DRIVER_NAME));

    // A config for request `a`, then one for all requests. NVIDIA takes the last config that fits, so
    // both GPUs get Short; gpu-dra's own rule would give `a` its named config, Long.
    let claim = node
        .allocated_claim_with(
            "nvidia-precedence",
            json!({
                "requests": [
                    {"name": "a", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
                    {"name": "b", "exactly": {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {
                        "expression": "device.attributes['gpu.nvidia.com'].index >= 0"}}]}}
                ],
                "config": [
                    {"requests": ["a"], "opaque": {"driver": NVIDIA_DRIVER_NAME, "parameters": time_slicing("Long")}},
                    {"opaque": {"driver": NVIDIA_DRIVER_NAME, "parameters": time_slicing("Short")}}
                ]
            }),
        )
        .await
        .expect("allocated through NVIDIA's classes, with a selector on index");

    let answers = kubelet
        .prepare(std::slice::from_ref(&claim))
        .await
        .expect("kubelet call");
    let devices = answers[&claim.uid].clone().expect("prepared");
    assert_eq!(devices.len(), 2);
    for device in &devices {
        assert!(
            device
                .cdi_device_ids
                .iter()
                .all(|id| id.starts_with("k8s.gpu.nvidia.com/gpu=")),
            "{:?}",
            device.cdi_device_ids
        );
    }
    let spec_file = format!("k8s.gpu.nvidia.com-gpu_{}.json", claim.uid);
    assert!(node.cdi_files().contains(&spec_file));
    // As in NVIDIA's CDI specs: the NVIDIA container runtime's legacy mode, where it is the node's
    // default, must not add GPUs of its own because a CUDA image says NVIDIA_VISIBLE_DEVICES=all.
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(node.cdi_dir().join(&spec_file)).expect("the claim's CDI spec"),
    )
    .unwrap();
    let env = spec["containerEdits"]["env"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        env.contains(&json!("NVIDIA_VISIBLE_DEVICES=void")),
        "{env:?}"
    );

    let want: BTreeMap<String, GpuSharingMode> = devices
        .iter()
        .map(|d| {
            (
                node.gpu_uuid(&d.device_name),
                GpuSharingMode::TimeSlice(TimeSliceInterval::Short),
            )
        })
        .collect();
    assert_eq!(node.fake_backend().sharing_modes(), want);

    let answers = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .expect("kubelet call");
    assert_eq!(answers[&claim.uid], Ok(()));
    assert!(node.cdi_files().is_empty());
    plugin.shutdown().await;
}
