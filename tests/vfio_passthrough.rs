//! VFIO passthrough as an admin and a KubeVirt user see it: a GpuNodePolicy chooses GPUs, the node
//! publishes them only as `gpu-vfio-<n>` (never also as GPUs), prepare binds the GPU's whole IOMMU
//! group to vfio-pci in the fake `/sys` and the claim's CDI spec gives `/dev/vfio/<group>` and
//! `/dev/vfio/vfio`; unprepare gives every function back to its driver. A group holding a device in
//! use is refused with the reason. NVIDIA's `VfioDeviceConfig` decides the API device in
//! compatibility mode.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpu_dra::gpu::builtin_profile;
use gpu_dra::support::harness::{Harness, DRIVER};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(20);

fn policy(gpus: &[&str]) -> Value {
    json!({
        "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuNodePolicy",
        "metadata": {"name": "vms", "generation": 1},
        "spec": {"passthrough": {"gpus": gpus}},
    })
}

/// An l40s-4 node (GPUs at 01, 41, 81, c1, each with an audio function; 81 and c1 share IOMMU
/// group 12) with its fake state (and `/sys`) in the scratch directory.
async fn node(nvidia: bool) -> Harness {
    let mut node = if nvidia {
        Harness::nvidia_compat("l40s-4").await
    } else {
        Harness::new("l40s-4").await
    };
    node.use_profile(
        "l40s",
        &builtin_profile("l40s-4").expect("built-in profile"),
    );
    node
}

fn sys(node: &Harness) -> PathBuf {
    node.dir.path().join("l40s-state.sys")
}

fn driver_of(node: &Harness, address: &str) -> Option<String> {
    std::fs::read_link(
        sys(node)
            .join("bus/pci/devices")
            .join(address)
            .join("driver"),
    )
    .ok()
    .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}

fn names(slices: &[ResourceSlice]) -> Vec<String> {
    let mut names: Vec<String> = slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .map(|d| d.name)
        .collect();
    names.sort();
    names
}

async fn published(node: &Harness, wanted: &[&str]) {
    let slices = node
        .wait_for_slices_where(|s| {
            let now = names(s);
            wanted.iter().all(|w| now.iter().any(|n| n == w))
        })
        .await;
    let now = names(&slices);
    assert_eq!(now, wanted, "the node publishes exactly these devices");
}

/// A claim for the device of `class` at PCI address `address`.
fn vfio_claim(class: &str, address: &str, config: Option<Value>) -> Value {
    let expression =
        format!("device.attributes[\"resource.kubernetes.io\"].pciBusID == \"{address}\"");
    let mut devices = json!({"requests": [{"name": "vm", "exactly": {
        "deviceClassName": class,
        "selectors": [{"cel": {"expression": expression}}]
    }}]});
    if let Some(config) = config {
        devices["config"] = json!([config]);
    }
    devices
}

async fn prepare(kubelet: &KubeletDouble, claim: &ClaimRef) -> Result<(), String> {
    let answers = kubelet
        .prepare(std::slice::from_ref(claim))
        .await
        .expect("kubelet call");
    answers[&claim.uid].clone().map(|_| ())
}

async fn unprepare(kubelet: &KubeletDouble, claim: &ClaimRef) {
    let answers = kubelet
        .unprepare(std::slice::from_ref(claim))
        .await
        .expect("kubelet call");
    if let Some(Err(error)) = answers.get(&claim.uid) {
        panic!("unprepare failed: {error}");
    }
}

/// The device nodes of the claim's CDI spec, by path, with their type.
fn spec_nodes(node: &Harness, claim: &ClaimRef) -> (Vec<(String, Option<String>)>, Value) {
    let file = node
        .cdi_files()
        .into_iter()
        .find(|f| f.contains(&claim.uid))
        .expect("the claim's CDI spec");
    let spec: Value =
        serde_json::from_slice(&std::fs::read(node.config.cdi_root.join(file)).unwrap()).unwrap();
    let mut nodes = Vec::new();
    let edits = std::iter::once(&spec["containerEdits"]).chain(
        spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| &d["containerEdits"]),
    );
    for edit in edits {
        for n in edit["deviceNodes"].as_array().into_iter().flatten() {
            nodes.push((
                n["path"].as_str().unwrap_or_default().to_string(),
                n["type"].as_str().map(str::to_string),
            ));
        }
    }
    nodes.sort();
    (nodes, spec)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chosen_gpu_is_bound_with_its_group_for_a_vm_and_given_back() {
    let node = node(false).await;
    node.api
        .insert("gpunodepolicies", policy(&["0000:41:00.0"]));
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    published(&node, &["gpu-0", "gpu-2", "gpu-3", "gpu-vfio-1"]).await;

    let claim = node
        .allocated_claim_with("vm", vfio_claim("vfio.gpu.dra.dev", "0000:41:00.0", None))
        .await
        .expect("allocated");
    prepare(&kubelet, &claim).await.expect("prepared");
    // The GPU and its audio function, the whole IOMMU group 11, are vfio-pci's.
    assert_eq!(
        driver_of(&node, "0000:41:00.0").as_deref(),
        Some("vfio-pci")
    );
    assert_eq!(
        driver_of(&node, "0000:41:00.1").as_deref(),
        Some("vfio-pci")
    );
    assert_eq!(driver_of(&node, "0000:01:00.0").as_deref(), Some("nvidia"));
    let (nodes, spec) = spec_nodes(&node, &claim);
    // Under our own name the VM gets the container device too; no GPU device files, no driver.
    assert_eq!(
        nodes,
        [
            ("/dev/vfio/11".to_string(), Some("c".to_string())),
            ("/dev/vfio/vfio".to_string(), Some("c".to_string()))
        ]
    );
    let text = spec.to_string();
    assert!(text.contains("NVIDIA_VISIBLE_DEVICES=void"), "{text}");
    assert!(
        text.contains("0000:41:00.0"),
        "the PCI address reaches the VM: {text}"
    );
    // KEP-5304: the VM's launcher finds the PCI address in the device metadata file; no driver
    // files are mounted.
    let mounts = spec["containerEdits"]["mounts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(
        mounts[0]["containerPath"],
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm/vm/gpu.dra.dev-metadata.json"
    );
    let host_file = PathBuf::from(mounts[0]["hostPath"].as_str().unwrap());
    let metadata: Value = serde_json::from_slice(&std::fs::read(&host_file).unwrap()).unwrap();
    assert_eq!(metadata["apiVersion"], "metadata.resource.k8s.io/v1alpha1");
    assert_eq!(metadata["kind"], "DeviceMetadata");
    let device = &metadata["requests"][0]["devices"][0];
    assert_eq!(device["name"], "gpu-vfio-1");
    assert_eq!(
        device["attributes"]["resource.kubernetes.io/pciBusID"]["string"],
        "0000:41:00.0"
    );

    unprepare(&kubelet, &claim).await;
    assert_eq!(driver_of(&node, "0000:41:00.0").as_deref(), Some("nvidia"));
    assert_eq!(
        driver_of(&node, "0000:41:00.1").as_deref(),
        Some("snd_hda_intel")
    );
    assert!(node.cdi_files().is_empty());
    assert!(!host_file.exists(), "the metadata file goes with the claim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_with_a_device_in_use_is_refused_and_left_as_it_was() {
    let mut node = node(false).await;
    // Group 12 holds the GPUs at 81 and c1; c1 is chosen for passthrough, 81 stays a GPU.
    node.api
        .insert("gpunodepolicies", policy(&["0000:c1:00.0"]));
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    published(&node, &["gpu-0", "gpu-1", "gpu-2", "gpu-vfio-3"]).await;

    // Another claim holds gpu-2, in the same IOMMU group.
    let gpu = node
        .allocated_claim_with("train", json!({"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER,
            "selectors": [{"cel": {"expression": "device.attributes[\"resource.kubernetes.io\"].pciBusID == \"0000:81:00.0\""}}]
        }}]}))
        .await
        .expect("allocated");
    prepare(&kubelet, &gpu).await.expect("GPU prepared");
    let vm = node
        .allocated_claim_with("vm", json!({"requests": [{"name": "vm", "exactly": {"deviceClassName": "vfio.gpu.dra.dev"}}]}))
        .await
        .expect("allocated");
    let error = prepare(&kubelet, &vm).await.expect_err("refused");
    assert!(
        error.contains("gpu-vfio-3") && error.contains("default/train"),
        "{error}"
    );
    assert_eq!(driver_of(&node, "0000:c1:00.0").as_deref(), Some("nvidia"));
    unprepare(&kubelet, &gpu).await;

    // A process holds the GPU open: refused with the reason, nothing moved, nothing recorded.
    let mut profile = builtin_profile("l40s-4").unwrap();
    profile.pci.in_use = vec!["0000:81:00.0".into()];
    node.use_profile("l40s", &profile);
    let error = prepare(&kubelet, &vm).await.expect_err("refused");
    assert!(
        error.contains("0000:81:00.0, which a process has open"),
        "{error}"
    );
    for address in [
        "0000:81:00.0",
        "0000:81:00.1",
        "0000:c1:00.0",
        "0000:c1:00.1",
    ] {
        assert_ne!(
            driver_of(&node, address).as_deref(),
            Some("vfio-pci"),
            "{address}"
        );
    }
    // Released: the retry binds the whole group.
    node.use_profile("l40s", &builtin_profile("l40s-4").unwrap());
    let deadline = Instant::now() + WAIT;
    while let Err(error) = prepare(&kubelet, &vm).await {
        assert!(Instant::now() < deadline, "{error}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for address in [
        "0000:81:00.0",
        "0000:81:00.1",
        "0000:c1:00.0",
        "0000:c1:00.1",
    ] {
        assert_eq!(
            driver_of(&node, address).as_deref(),
            Some("vfio-pci"),
            "{address}"
        );
    }
    unprepare(&kubelet, &vm).await;
    assert_eq!(driver_of(&node, "0000:81:00.0").as_deref(), Some("nvidia"));
    assert_eq!(
        driver_of(&node, "0000:c1:00.1").as_deref(),
        Some("snd_hda_intel")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidias_vfio_config_decides_the_api_device_in_compatibility_mode() {
    let node = node(true).await;
    node.api.insert("gpunodepolicies", policy(&["all"]));
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    published(
        &node,
        &["gpu-vfio-0", "gpu-vfio-1", "gpu-vfio-2", "gpu-vfio-3"],
    )
    .await;

    let plain = node
        .allocated_claim_with(
            "plain",
            vfio_claim("vfio.gpu.nvidia.com", "0000:41:00.0", None),
        )
        .await
        .expect("allocated");
    prepare(&kubelet, &plain).await.expect("prepared");
    let (nodes, _) = spec_nodes(&node, &plain);
    assert_eq!(nodes, [("/dev/vfio/11".to_string(), Some("c".to_string()))]);
    unprepare(&kubelet, &plain).await;

    let config = json!({"requests": ["vm"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig",
        "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": true}}}});
    let full = node
        .allocated_claim_with(
            "full",
            vfio_claim("vfio.gpu.nvidia.com", "0000:01:00.0", Some(config)),
        )
        .await
        .expect("allocated");
    prepare(&kubelet, &full).await.expect("prepared");
    let (nodes, _) = spec_nodes(&node, &full);
    assert_eq!(
        nodes.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(),
        ["/dev/vfio/10", "/dev/vfio/vfio"]
    );
    unprepare(&kubelet, &full).await;

    let wrong = json!({"requests": ["vm"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}});
    let refused = node
        .allocated_claim_with(
            "wrong",
            vfio_claim("vfio.gpu.nvidia.com", "0000:81:00.0", Some(wrong)),
        )
        .await
        .expect("allocated");
    let error = prepare(&kubelet, &refused).await.expect_err("refused");
    assert!(
        error.contains("only VfioDeviceConfig applies to device gpu-vfio-2"),
        "{error}"
    );
    assert_eq!(driver_of(&node, "0000:81:00.0").as_deref(), Some("nvidia"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_switched_either_way_stays_as_a_claim_holds_it_until_the_claim_is_gone() {
    let node = node(false).await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    published(&node, &["gpu-0", "gpu-1", "gpu-2", "gpu-3"]).await;
    let gpu = node
        .allocated_claim_with("train", vfio_claim(DRIVER, "0000:41:00.0", None))
        .await
        .expect("allocated");
    prepare(&kubelet, &gpu).await.expect("GPU prepared");

    // The admin switches gpu-1 to passthrough while a claim still has it as a GPU: it stays a GPU
    // (and gpu-3 turns passthrough) until that claim is gone.
    node.api
        .insert("gpunodepolicies", policy(&["gpu-1", "gpu-3"]));
    published(&node, &["gpu-0", "gpu-1", "gpu-2", "gpu-vfio-3"]).await;
    unprepare(&kubelet, &gpu).await;
    published(&node, &["gpu-0", "gpu-2", "gpu-vfio-1", "gpu-vfio-3"]).await;
    let vm = node
        .allocated_claim_with("vm", vfio_claim("vfio.gpu.dra.dev", "0000:41:00.0", None))
        .await
        .expect("allocated");
    prepare(&kubelet, &vm)
        .await
        .expect("prepared once the GPU is free");
    assert_eq!(
        driver_of(&node, "0000:41:00.0").as_deref(),
        Some("vfio-pci")
    );

    // Back: the policy no longer chooses gpu-1 (and now chooses gpu-0), but the VM holds gpu-1: it
    // stays gpu-vfio-1 until the VM's claim is gone.
    node.api
        .insert("gpunodepolicies", policy(&["0000:01:00.0", "gpu-3"]));
    published(&node, &["gpu-2", "gpu-vfio-0", "gpu-vfio-1", "gpu-vfio-3"]).await;
    unprepare(&kubelet, &vm).await;
    published(&node, &["gpu-1", "gpu-2", "gpu-vfio-0", "gpu-vfio-3"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_passthrough_claim_is_bound_again_at_start_when_its_gpu_went_back() {
    use gpu_dra::gpu::GpuBackend;
    let node = node(false).await;
    node.api
        .insert("gpunodepolicies", policy(&["0000:41:00.0"]));
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    published(&node, &["gpu-0", "gpu-2", "gpu-3", "gpu-vfio-1"]).await;
    let claim = node
        .allocated_claim_with("vm", vfio_claim("vfio.gpu.dra.dev", "0000:41:00.0", None))
        .await
        .expect("allocated");
    prepare(&kubelet, &claim).await.expect("prepared");
    plugin.shutdown().await;

    // What a reboot does to the bindings: every function back with its default driver.
    let pci = node.fake_backend().pci().unwrap().unwrap();
    pci.restore("0000:41:00.0", Some("nvidia")).unwrap();
    pci.restore("0000:41:00.1", Some("snd_hda_intel")).unwrap();
    assert_eq!(driver_of(&node, "0000:41:00.0").as_deref(), Some("nvidia"));

    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    // The kubelet prepares the claim again after the reboot: it is kept, and its group is vfio-pci's.
    prepare(&kubelet, &claim).await.expect("prepared again");
    assert_eq!(
        driver_of(&node, "0000:41:00.0").as_deref(),
        Some("vfio-pci")
    );
    assert_eq!(
        driver_of(&node, "0000:41:00.1").as_deref(),
        Some("vfio-pci")
    );
    unprepare(&kubelet, &claim).await;
    assert_eq!(driver_of(&node, "0000:41:00.0").as_deref(), Some("nvidia"));
}
