//! GPU sharing from opaque configs, through the plugin as the kubelet drives it: time-slicing set on
//! the GPU and reset by the last claim, one MPS daemon per claim (a real stand-in process) with its
//! limits and its CDI mounts, across plugin restarts, config precedence between class and claim,
//! shares of a GPU published for sharing, and configs that must fail the claim.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use gpu_dra::cdi::CdiRegistry;
use gpu_dra::claims::checkpoint::CheckpointFile;
use gpu_dra::claims::checkpoint_path;
use gpu_dra::gpu::{GpuSharingMode, TimeSliceInterval};
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};
use serde_json::{json, Value};

fn gpu_config(sharing: Value) -> Value {
    json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing})
}

/// `spec.devices` for one whole GPU with `parameters` as a claim config naming the request.
fn one_gpu_with(parameters: Value) -> Value {
    json!({
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}]
    })
}

fn mps(limits: Value) -> Value {
    gpu_config(json!({"strategy": "MPS", "mpsConfig": limits}))
}

async fn prepare(kubelet: &KubeletDouble, claim: &ClaimRef) -> Result<Vec<String>, String> {
    let answers = kubelet
        .prepare(std::slice::from_ref(claim))
        .await
        .expect("kubelet call");
    answers
        .get(&claim.uid)
        .cloned()
        .expect("an answer for the claim")
        .map(|devices| devices.into_iter().map(|d| d.device_name).collect())
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

/// What a container that gets the claim's first device sees in its environment and mounts.
fn container_view(node: &Harness, uid: &str) -> (Vec<String>, Vec<(String, String)>) {
    let spec = CdiRegistry::new(&node.config.cdi_root, DRIVER)
        .read_claim_spec(uid)
        .expect("spec readable")
        .expect("claim has a CDI spec");
    let device = &spec.devices[0].container_edits;
    let env = spec
        .container_edits
        .env
        .iter()
        .chain(&device.env)
        .cloned()
        .collect();
    let mounts = spec
        .container_edits
        .mounts
        .iter()
        .chain(&device.mounts)
        .map(|m| (m.host_path.clone(), m.container_path.clone()))
        .collect();
    (env, mounts)
}

/// Allocates a claim `name` for one GPU with the config `parameters`, prepares it and checks that its
/// container is told, and its GPU set to, time-slicing with the Long interval.
async fn time_sliced_long(
    node: &Harness,
    kubelet: &KubeletDouble,
    name: &str,
    parameters: Value,
) -> ClaimRef {
    let claim = node
        .allocated_claim_with(name, one_gpu_with(parameters))
        .await
        .unwrap();
    let devices = prepare(kubelet, &claim).await.expect("prepared");
    let uuid = node.gpu_uuid(&devices[0]);
    let (env, _) = container_view(node, &claim.uid);
    assert!(
        env.contains(&"GPU_DRA_SHARING=TimeSlicing/Long".to_string()),
        "{env:?}"
    );
    assert_eq!(
        modes(node),
        BTreeMap::from([(uuid, GpuSharingMode::TimeSlice(TimeSliceInterval::Long))])
    );
    claim
}

fn modes(node: &Harness) -> BTreeMap<String, GpuSharingMode> {
    node.fake_backend().sharing_modes()
}

/// Whether the daemon Pod with this UID exists and is Ready (the kubelet runs its daemon).
fn process_runs(node: &Harness, pod_uid: &str) -> bool {
    node.api.list("pods").iter().any(|pod| {
        pod["metadata"]["uid"] == pod_uid
            && pod["metadata"].get("deletionTimestamp").is_none()
            && pod["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
    })
}

async fn wait_gone(node: &Harness, pod_uid: &str) {
    for _ in 0..400 {
        if !node
            .api
            .list("pods")
            .iter()
            .any(|pod| pod["metadata"]["uid"] == pod_uid)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("daemon Pod {pod_uid} still there");
}

/// The UID of the Pod that runs the claim's MPS daemon.
fn daemon_pid(plugin: &gpu_dra::plugin::RunningPlugin, uid: &str) -> String {
    plugin.preparer.prepared_claims()[uid]
        .mps
        .as_ref()
        .expect("the claim records its MPS daemon")
        .pod_uid
        .clone()
}

fn mps_dir(node: &Harness, uid: &str) -> std::path::PathBuf {
    node.config.plugin_dir().join("mps").join(uid)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_slicing_sets_the_interval_until_the_claim_goes() {
    let node = Harness::new("dgx-h100").await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let sliced =
        gpu_config(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}));
    let claim = time_sliced_long(&node, &kubelet, "sliced", sliced).await;

    unprepare(&kubelet, &claim).await;
    assert!(
        modes(&node).is_empty(),
        "the GPU is back to its default: {:?}",
        modes(&node)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidias_gpu_config_time_slicing_long_is_prepared_with_its_interval() {
    // A config written for NVIDIA's driver, under our driver name (tests/nvidia_compat.rs runs the
    // plugin as gpu.nvidia.com, with NVIDIA's precedence).
    let node = Harness::new("dgx-h100").await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let sliced = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}});
    let claim = time_sliced_long(&node, &kubelet, "nvidia-sliced", sliced).await;

    // NVIDIA's MPS config with a percentage of 0, which our own API refuses: the daemon is started
    // without a percentage (it keeps its default), with NVIDIA's whole-MiB limit.
    let mps_config = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0,
            "defaultPinnedDeviceMemoryLimit": "1.5Gi"}}});
    let mps_claim = node
        .allocated_claim_with("nvidia-mps", one_gpu_with(mps_config))
        .await
        .unwrap();
    prepare(&kubelet, &mps_claim).await.expect("prepared");
    let log = read(&mps_dir(&node, &mps_claim.uid).join("log/control.log"));
    assert!(
        !log.contains("set_default_active_thread_percentage"),
        "{log}"
    );
    assert!(
        log.contains("set_default_device_pinned_mem_limit 0 1536M"),
        "{log}"
    );
    unprepare(&kubelet, &mps_claim).await;
    unprepare(&kubelet, &claim).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mps_claim_gets_its_own_daemon_with_its_limits_and_mounts() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let limits = json!({"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi",
                        "shmSize": "32Mi"});
    let claim = node
        .allocated_claim_with("mps", one_gpu_with(mps(limits)))
        .await
        .unwrap();

    let devices = prepare(&kubelet, &claim).await.expect("prepared");
    let pid = daemon_pid(&plugin, &claim.uid);
    assert!(process_runs(&node, &pid), "daemon Pod {pid} runs");
    let dir = mps_dir(&node, &claim.uid);
    assert_eq!(
        gpu_dra::claims::mps::shm::tmpfs_size(&dir.join("shm")),
        Some(32 << 20),
        "the claim's /dev/shm has the size its MPS config asks for"
    );
    let log = read(&dir.join("log/control.log"));
    assert!(
        log.contains("set_default_active_thread_percentage 50"),
        "{log}"
    );
    assert!(
        log.contains("set_default_device_pinned_mem_limit 0 10240M"),
        "{log}"
    );
    assert!(
        log.contains(&node.gpu_uuid(&devices[0])),
        "the daemon serves the claim's GPU: {log}"
    );

    let (env, mounts) = container_view(&node, &claim.uid);
    for wanted in [
        "GPU_DRA_SHARING=MPS",
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
    ] {
        assert!(env.contains(&wanted.to_string()), "{wanted} in {env:?}");
    }
    let pipe = dir.join("pipe").display().to_string();
    assert!(
        mounts.contains(&(pipe, "/tmp/nvidia-mps".to_string())),
        "{mounts:?}"
    );
    assert!(mounts.iter().any(|(_, to)| to == "/dev/shm"), "{mounts:?}");
    let uuid = node.gpu_uuid(&devices[0]);
    assert_eq!(
        modes(&node).get(&uuid),
        Some(&GpuSharingMode::ExclusiveProcess)
    );

    // A second pod of the same claim: prepared once, the same daemon.
    assert_eq!(prepare(&kubelet, &claim).await.unwrap(), devices);
    assert_eq!(daemon_pid(&plugin, &claim.uid), pid);

    unprepare(&kubelet, &claim).await;
    wait_gone(&node, &pid).await;
    assert!(!dir.exists(), "the claim's MPS directory is removed");
    assert!(modes(&node).is_empty(), "{:?}", modes(&node));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_daemons_are_taken_over_restarted_or_cleaned_up_across_restarts() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let claim = node
        .allocated_claim_with("mps", one_gpu_with(mps(json!({}))))
        .await
        .unwrap();
    prepare(&kubelet, &claim).await.expect("prepared");
    let first = daemon_pid(&plugin, &claim.uid);
    drop(kubelet);
    plugin.shutdown().await;
    assert!(
        process_runs(&node, &first),
        "the daemon outlives the plugin"
    );

    // Still running: taken over.
    let plugin = node.start_plugin().await;
    assert_eq!(
        plugin.recovery.mps_daemons_taken_over,
        std::slice::from_ref(&claim.uid)
    );
    assert_eq!(daemon_pid(&plugin, &claim.uid), first);
    plugin.shutdown().await;

    // Its Pod was deleted while no plugin ran (by hand, or evicted): started again in the same
    // directories.
    let pod_name = format!("gpu-dra-mps-{}", claim.uid);
    node.api.remove("pods", Some("gpu-dra"), &pod_name);
    wait_gone(&node, &first).await;
    let plugin = node.start_plugin().await;
    assert_eq!(
        plugin.recovery.mps_daemons_restarted,
        std::slice::from_ref(&claim.uid)
    );
    let second = daemon_pid(&plugin, &claim.uid);
    assert_ne!(second, first);
    assert!(process_runs(&node, &second));
    plugin.shutdown().await;

    // The claim is gone from the checkpoint (its unprepare was the last thing the old plugin did
    // before the daemon could be stopped): the daemon and its directory are cleaned up.
    let file = CheckpointFile::new(checkpoint_path(
        &node.config.plugin_dir(),
        &node.config.driver_name,
    ));
    let mut data = file.load().unwrap().unwrap();
    data.claims.remove(&claim.uid);
    file.store(&data).unwrap();
    let plugin = node.start_plugin().await;
    assert_eq!(
        plugin.recovery.mps_daemons_cleaned_up,
        std::slice::from_ref(&claim.uid)
    );
    wait_gone(&node, &second).await;
    assert!(!mps_dir(&node, &claim.uid).exists());
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configs_that_cannot_apply_fail_the_claim_and_prepare_nothing() {
    let node = Harness::new("dgx-h100").await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let cases = [
        (
            mps(json!({"defaultActiveThreadPercentage": 0})),
            "config[0] (GpuConfig from the claim): sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100",
        ),
        (
            gpu_config(json!({"strategy": "TimeSlicing", "timeSliceConfig": {}})),
            "config[0] (GpuConfig from the claim): sharing.timeSliceConfig: unknown field",
        ),
        (
            json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "MigConfig", "sharing": {"strategy": "MPS"}}),
            "config[0] (MigConfig from the claim): kind: MigConfig does not fit gpu-",
        ),
    ];
    for (i, (parameters, wanted)) in cases.into_iter().enumerate() {
        let name = format!("bad-{i}");
        let claim = node
            .allocated_claim_with(&name, one_gpu_with(parameters))
            .await
            .unwrap();
        let error = prepare(&kubelet, &claim).await.expect_err("refused");
        assert!(
            error.contains(&format!("ResourceClaim default/{name}")),
            "{error}"
        );
        assert!(error.contains(wanted), "{wanted:?} in {error}");
    }
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    assert!(modes(&node).is_empty());
    let mps_root = node.config.plugin_dir().join("mps");
    assert!(std::fs::read_dir(&mps_root).map_or(true, |mut d| d.next().is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_config_applies_unless_the_claim_overrides_it() {
    let node = Harness::new("dgx-h100").await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let short =
        gpu_config(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}));
    node.api.insert(
        "deviceclasses",
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "time-sliced.gpu.dra.dev"},
            "spec": {
                "selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}],
                "config": [{"opaque": {"driver": DRIVER, "parameters": short}}]
            }
        }),
    );
    let request =
        json!([{"name": "gpu", "exactly": {"deviceClassName": "time-sliced.gpu.dra.dev"}}]);
    let from_class = node
        .allocated_claim_with("from-class", json!({"requests": request}))
        .await
        .unwrap();
    // A claim config for all requests overrides the class's.
    let overridden = node
        .allocated_claim_with(
            "overridden",
            json!({"requests": request, "config": [{"opaque": {"driver": DRIVER, "parameters": mps(json!({}))}}]}),
        )
        .await
        .unwrap();
    prepare(&kubelet, &from_class).await.expect("prepared");
    prepare(&kubelet, &overridden).await.expect("prepared");
    let (env, _) = container_view(&node, &from_class.uid);
    assert!(
        env.contains(&"GPU_DRA_SHARING=TimeSlicing/Short".to_string()),
        "{env:?}"
    );
    let (env, _) = container_view(&node, &overridden.uid);
    assert!(env.contains(&"GPU_DRA_SHARING=MPS".to_string()), "{env:?}");
    unprepare(&kubelet, &overridden).await;
}

/// A claim allocated one share of gpu-0 (a device published with allowMultipleAllocations).
fn shared_claim(node: &Harness, name: &str, memory: &str, config: Option<Value>) -> ClaimRef {
    let config: Vec<Value> = config
        .into_iter()
        .map(|parameters| json!({"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}))
        .collect();
    let stored = node.api.insert(
        "resourceclaims",
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
            "status": {"allocation": {"devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
                             "shareID": format!("{name}-share"), "consumedCapacity": {"memory": memory}}],
                "config": config
            }}}
        }),
    );
    ClaimRef::new(
        "default",
        name,
        stored["metadata"]["uid"].as_str().unwrap().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_of_one_gpu_go_to_several_claims_with_one_interval_and_their_memory_limits() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let interval = |name: &str| {
        gpu_config(json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": name}}))
    };
    let long = shared_claim(&node, "long", "20Gi", Some(interval("Long")));
    let short = shared_claim(&node, "short", "20Gi", Some(interval("Short")));
    let by_memory = shared_claim(&node, "by-memory", "30Gi", None);
    let exclusive = shared_claim(
        &node,
        "exclusive",
        "10Gi",
        Some(gpu_config(json!({"strategy": "Exclusive"}))),
    );

    prepare(&kubelet, &long).await.expect("the first share");
    let error = prepare(&kubelet, &short)
        .await
        .expect_err("another interval");
    assert!(
        error.contains("gpu-0 is time-sliced with interval Long for claim default/long"),
        "{error}"
    );
    // No config on a share: MPS, limited to the claim's share of the memory.
    prepare(&kubelet, &by_memory).await.expect("an MPS share");
    let log = read(&mps_dir(&node, &by_memory.uid).join("log/control.log"));
    assert!(
        log.contains("set_default_device_pinned_mem_limit 0 30720M"),
        "{log}"
    );
    let error = prepare(&kubelet, &exclusive)
        .await
        .expect_err("a share is never exclusive");
    assert!(error.contains("shared with other claims"), "{error}");
    // Shares keep the default compute mode, so every claim's daemon can run beside the others.
    let uuid = node.gpu_uuid("gpu-0");
    assert_eq!(
        modes(&node).get(&uuid),
        Some(&GpuSharingMode::TimeSlice(TimeSliceInterval::Long))
    );

    unprepare(&kubelet, &long).await;
    assert!(
        modes(&node).is_empty(),
        "the last time-sliced share reset the GPU"
    );
    let pid = daemon_pid(&plugin, &by_memory.uid);
    unprepare(&kubelet, &by_memory).await;
    wait_gone(&node, &pid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_whose_mode_cannot_be_set_fails_the_claim_and_rolls_back() {
    let mut node = Harness::new("dgx-h100").await;
    let mut profile = gpu_dra::gpu::builtin_profile("dgx-h100").unwrap();
    profile.gpus.truncate(1);
    profile.gpus[0].sharing_fails = Some("compute mode change refused by the driver".into());
    let path = node.dir.path().join("stuck.yaml");
    std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
    node.config.backend = gpu_dra::plugin::BackendChoice::Fake {
        profile: path.display().to_string(),
        state_file: Some(node.dir.path().join("stuck-state.json")),
    };
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let claim = node
        .allocated_claim_with("mps", one_gpu_with(mps(json!({}))))
        .await
        .unwrap();
    let error = prepare(&kubelet, &claim).await.expect_err("mode refused");
    assert!(
        error.contains("compute mode change refused by the driver"),
        "{error}"
    );
    assert!(node.cdi_files().is_empty());
    assert!(plugin.preparer.prepared_claims().is_empty());
    assert!(
        !mps_dir(&node, &claim.uid).exists(),
        "no daemon was started"
    );
}
