//! The plugin with the NVML backend against NVIDIA's mock NVML, driven by the API server and kubelet
//! doubles: start-up (driver files under the driver root), publishing, and NodePrepareResources for a
//! whole GPU and for a dynamic MIG device. It needs a driver root laid out with the mock library, which
//! `e2e/mock-nvml/run.sh` makes (`PREPARE=1`) and names in `GPU_DRA_MOCK_NVML_ROOT`. So the tests
//! are ignored unless asked for (`--ignored`, as the script does): CI has neither Go nor the mock,
//! and shows them as not run rather than passed. Each check also prints a PASS / KNOWN line for the
//! script's report.

use std::path::PathBuf;

use gpu_dra::devices::MigMode;
use gpu_dra::plugin::BackendChoice;
use gpu_dra::support::harness::{Harness, MIG_CLASS};
use serde_json::json;

/// The mock's driver root, which the script names.
fn mock_root() -> PathBuf {
    std::env::var_os("GPU_DRA_MOCK_NVML_ROOT")
        .map(PathBuf::from)
        .expect(
            "GPU_DRA_MOCK_NVML_ROOT names the mock's driver root (e2e/mock-nvml/run.sh sets it)",
        )
}

async fn mock_node(root: &std::path::Path, mig_mode: MigMode) -> Harness {
    let mut node = Harness::new("dgx-h100").await;
    node.config.backend = BackendChoice::Nvml {
        driver_root: root.to_path_buf(),
        host_driver_root: root.to_path_buf(),
    };
    node.config.mig_mode = mig_mode;
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs NVIDIA's mock NVML: PREPARE=1 e2e/mock-nvml/run.sh"]
async fn a_whole_gpu_is_published_and_prepared_through_the_mock() {
    let root = mock_root();
    let node = mock_node(&root, MigMode::Static).await;
    let plugin = match gpu_dra::plugin::start(node.config.clone(), node.api.client()).await {
        Ok(plugin) => plugin,
        Err(error) => panic!("FAIL the plugin did not start on the mock: {error}"),
    };
    println!("PASS plugin started with --backend nvml on the mock");
    let slices = node.wait_for_whole_pool().await;
    let devices: usize = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    println!("PASS {devices} devices published");
    let kubelet = node.kubelet().await;
    let claim = node.allocated_claim("one-gpu", 1).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let prepared = answer[&claim.uid]
        .clone()
        .unwrap_or_else(|e| panic!("FAIL preparing a whole GPU: {e}"));
    println!("PASS prepared {}", prepared[0].device_name);
    let spec = std::fs::read_to_string(
        node.cdi_dir()
            .join(format!("k8s.gpu.dra.dev-gpu_{}.json", claim.uid)),
    )
    .unwrap();
    let minor = prepared[0].device_name.trim_start_matches("gpu-");
    assert!(
        spec.contains(&format!("\"/dev/nvidia{minor}\"")),
        "FAIL the CDI spec lacks the GPU's device node: {spec}"
    );
    assert!(
        spec.contains("libnvidia-ml.so."),
        "FAIL the CDI spec does not mount libnvidia-ml: {spec}"
    );
    println!("PASS the CDI spec names /dev/nvidia{minor} and mounts libnvidia-ml");
    if !spec.contains("libcuda.so.") {
        println!("KNOWN the CDI spec mounts no libcuda: the mock driver root has none");
    }
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap()[&claim.uid]
        .clone()
        .unwrap_or_else(|e| panic!("FAIL unpreparing: {e}"));
    assert!(node.cdi_files().is_empty(), "FAIL the CDI spec is left");
    println!("PASS unprepared; the CDI spec is gone");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs NVIDIA's mock NVML: PREPARE=1 e2e/mock-nvml/run.sh"]
async fn a_dynamic_mig_device_fails_at_prepare_naming_the_call_and_the_gpu() {
    let root = mock_root();
    let node = mock_node(&root, MigMode::Dynamic).await;
    let plugin = gpu_dra::plugin::start(node.config.clone(), node.api.client())
        .await
        .unwrap_or_else(|e| panic!("FAIL the plugin did not start on the mock: {e}"));
    let slices = node.wait_for_whole_pool().await;
    let gpu_uuids: Vec<String> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| !d.name.contains("-mig-"))
        .filter_map(|d| d.attributes.as_ref()?.get("uuid")?.string.clone())
        .collect();
    let kubelet = node.kubelet().await;
    let request = json!({"requests": [{"name": "mig", "exactly": {"deviceClassName": MIG_CLASS}}]});
    let claim = node
        .allocated_claim_with("one-mig", request)
        .await
        .expect("a MIG device is allocated");
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    match &answer[&claim.uid] {
        Ok(devices) => println!("PASS prepared MIG device {}", devices[0].device_name),
        Err(error) => {
            println!("KNOWN dynamic MIG fails on the mock: {error}");
            assert!(
                error.contains("nvmlDeviceSetMigMode"),
                "FAIL the error does not name the NVML call: {error}"
            );
            assert!(
                gpu_uuids.iter().any(|uuid| error.contains(uuid.as_str())),
                "FAIL the error does not name the GPU by UUID: {error}"
            );
            println!("PASS the prepare error names nvmlDeviceSetMigMode and the GPU");
        }
    }
    plugin.shutdown().await;
}

/// Time-slicing and MPS change the GPU's compute mode or time-slice interval: the mock answers
/// `nvmlDeviceSetComputeMode` with NOT_SUPPORTED and the driver root has no `nvidia-smi`, so each is a
/// per-claim error that names the GPU and what failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs NVIDIA's mock NVML: PREPARE=1 e2e/mock-nvml/run.sh"]
async fn sharing_fails_at_prepare_naming_the_gpu_and_the_step() {
    let root = mock_root();
    let node = mock_node(&root, MigMode::Static).await;
    let plugin = gpu_dra::plugin::start(node.config.clone(), node.api.client())
        .await
        .unwrap_or_else(|e| panic!("FAIL the plugin did not start on the mock: {e}"));
    node.wait_for_whole_pool().await;
    let kubelet = node.kubelet().await;
    let strategies = [
        (
            "time-sliced",
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
        ),
        ("mps", json!({"strategy": "MPS"})),
    ];
    for (name, sharing) in strategies {
        let parameters =
            json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing});
        let devices = json!({
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.dra.dev", "parameters": parameters}}]
        });
        let claim = node.allocated_claim_with(name, devices).await.unwrap();
        let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
        match &answer[&claim.uid] {
            Ok(_) => println!("PASS {name}: prepared"),
            Err(error) => {
                assert!(
                    error.contains("GPU GPU-"),
                    "FAIL {name}: the error does not name the GPU: {error}"
                );
                println!("KNOWN {name} fails on the mock: {error}");
            }
        }
    }
    plugin.shutdown().await;
}
