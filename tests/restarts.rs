//! Restarts keep what the node really has: the GpuNodePolicy's MIG mode holds from recovery and the
//! first publish on (and a hung or failing API server only delays it); device faults and their
//! taints outlive a plugin restart until the GPU recovers. Checkpoints: `checkpoint_rebuild.rs`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{FakeFault, FakeFaultKind, FakeProfile};
use gpu_dra::plugin::PolicyAtStart;
use gpu_dra::support::apiserver::{FaultSpec, Verb};
use gpu_dra::support::harness::{admin_split_h100_profile, Harness};
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Api;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

/// Files in the plugin directory whose name starts with `prefix`.
fn files_starting(node: &Harness, prefix: &str) -> Vec<String> {
    std::fs::read_dir(node.config.plugin_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|name| name.starts_with(prefix))
        .collect()
}

/// Every ResourceSlice version the API server shows from now on (the existing ones first).
fn record_slices(node: &Harness) -> Arc<Mutex<Vec<ResourceSlice>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let api: Api<ResourceSlice> = Api::all(node.api.client());
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(watcher(api, watcher::Config::default()).applied_objects());
        while let Some(Ok(slice)) = stream.next().await {
            sink.lock().unwrap().push(slice);
        }
    });
    seen
}

async fn wait_until(what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !check() {
        assert!(Instant::now() < deadline, "{what} did not happen in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A two-GPU H100 node whose second GPU an admin split into three MIG devices (static MIG).
fn static_mig_profile(node: &mut Harness) {
    node.use_profile("static", &admin_split_h100_profile());
}

fn policy(name: &str, mig_mode: &str) -> serde_json::Value {
    json!({
        "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuNodePolicy",
        "metadata": {"name": name, "generation": 1},
        "spec": {"migMode": mig_mode}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_mig_mode_holds_for_recovery_and_the_first_publish() {
    // The flag says dynamic; the admin's policy says static and the admin made MIG devices.
    let mut node = Harness::new("dgx-h100").await;
    static_mig_profile(&mut node);
    node.config.mig_mode = MigMode::Dynamic;
    node.api
        .insert("gpunodepolicies", policy("static-mig", "static"));
    let before = node.mig_devices();
    assert_eq!(before.len(), 3);
    let recorded = record_slices(&node);

    let plugin = node.start_plugin().await;
    assert_eq!(
        plugin.policy_at_start,
        PolicyAtStart::Policy("static-mig".into())
    );
    // Recovery ran in static mode: the admin's MIG devices are no claim's, and stay.
    assert!(plugin.recovery.mig_devices_destroyed.is_empty());
    assert_eq!(node.mig_devices(), before);

    node.wait_for_slices().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = recorded.lock().unwrap().clone();
    assert!(!seen.is_empty());
    for slice in &seen {
        // Never a dynamic layout: no counters, no MIG placement the admin did not make.
        assert!(slice.spec.shared_counters.is_none(), "{slice:?}");
        let names: Vec<&str> = slice
            .spec
            .devices
            .iter()
            .flatten()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(
            names,
            vec![
                "gpu-0",
                "gpu-1-mig-3g40gb-0",
                "gpu-1-mig-2g20gb-4",
                "gpu-1-mig-1g10gb-6"
            ]
        );
    }
    plugin.shutdown().await;
}

/// Collects the log lines written while it is the thread's default subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).to_string()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_starts_on_the_flag_when_the_policy_read_hangs_or_fails() {
    for hang in [true, false] {
        let mut node = Harness::new("dgx-h100").await;
        node.config.startup_api_timeout = Duration::from_millis(300);
        node.api
            .insert("gpunodepolicies", policy("dynamic-mig", "dynamic"));
        if hang {
            node.api.set_latency(Duration::from_secs(3));
        } else {
            node.api.fail_next(FaultSpec {
                verb: Some(Verb::List),
                resource: Some("gpunodepolicies".into()),
                code: 403,
                count: 1,
            });
        }
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let started = Instant::now();
        let plugin = {
            // The start's own steps run on this thread, so its log lines land here.
            let _guard = tracing::subscriber::set_default(subscriber);
            node.start_plugin().await
        };
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "hang={hang}: start took {took:?}"
        );
        let logs = logs.text();
        if hang {
            assert_eq!(plugin.policy_at_start, PolicyAtStart::TimedOut);
            assert!(
                logs.contains("reading the GpuNodePolicy at start timed out")
                    && logs.contains("mig_mode=Static"),
                "{logs}"
            );
        } else {
            assert!(
                matches!(&plugin.policy_at_start, PolicyAtStart::Failed(e) if e.contains("403")),
                "{:?}",
                plugin.policy_at_start
            );
            assert!(
                logs.contains("reading the GpuNodePolicy at start failed")
                    && logs.contains("mig_mode=Static"),
                "{logs}"
            );
        }
        // The watcher reads the policy later and the node follows it: dynamic MIG shows counters.
        node.api.clear_faults();
        node.wait_for_slices_where(|slices| {
            slices.iter().any(|s| s.spec.shared_counters.is_some())
        })
        .await;
        plugin.shutdown().await;
    }
}

struct FaultyNode {
    harness: Harness,
    path: std::path::PathBuf,
    profile: FakeProfile,
}

impl FaultyNode {
    async fn new() -> FaultyNode {
        let mut harness = Harness::new("dgx-h100").await;
        let mut profile = gpu_dra::gpu::builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(2);
        let path = harness.dir.path().join("faults.yaml");
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        harness.config.backend = gpu_dra::plugin::BackendChoice::Fake {
            profile: path.display().to_string(),
            state_file: Some(harness.dir.path().join("state.json")),
        };
        FaultyNode {
            harness,
            path,
            profile,
        }
    }

    fn set_faults(&mut self, gpu: usize, faults: Vec<FakeFault>) {
        self.profile.gpus[gpu].faults = faults;
        std::fs::write(&self.path, serde_yaml::to_string(&self.profile).unwrap()).unwrap();
    }

    fn set_unreadable(&mut self, gpu: usize, reason: Option<&str>) {
        self.profile.gpus[gpu].unreadable = reason.map(str::to_string);
        std::fs::write(&self.path, serde_yaml::to_string(&self.profile).unwrap()).unwrap();
    }
}

fn xid(number: u64) -> FakeFault {
    FakeFault {
        kind: FakeFaultKind::Xid,
        xid: Some(number),
        mig_start: None,
    }
}

fn device_taints(slice: &ResourceSlice, name: &str) -> Option<usize> {
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .find(|d: &&Device| d.name == name)
        .map(|d| d.taints.as_ref().map_or(0, Vec::len))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_and_their_taints_outlive_a_plugin_restart_until_the_gpu_recovers() {
    let mut node = FaultyNode::new().await;
    let plugin = node.harness.start_plugin().await;
    node.harness.wait_for_slices().await;
    node.set_faults(0, vec![xid(79)]);
    node.harness
        .wait_for_slices_where(|s| s.iter().any(|s| device_taints(s, "gpu-0") == Some(1)))
        .await;
    plugin.shutdown().await;
    assert!(node
        .harness
        .config
        .plugin_dir()
        .join("faults.json")
        .exists());

    // NVML reports an XID once; the restarted plugin does not hear it again. The profile without
    // the fault models that: the fake backend reports nothing at start.
    node.set_faults(0, Vec::new());
    let recorded = record_slices(&node.harness);
    wait_until("the recorder sees the slice", || {
        !recorded.lock().unwrap().is_empty()
    })
    .await;
    let plugin = node.harness.start_plugin().await;
    // Several rescans and syncs: whatever the plugin writes keeps the taint.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let seen = recorded.lock().unwrap().clone();
    for slice in &seen {
        assert_eq!(
            device_taints(slice, "gpu-0"),
            Some(1),
            "published without the taint after the restart (resourceVersion {:?})",
            slice.metadata.resource_version
        );
        assert_eq!(device_taints(slice, "gpu-1"), Some(0));
    }
    node.harness
        .wait_for_slices_where(|s| s.iter().any(|s| device_taints(s, "gpu-0") == Some(1)))
        .await;

    // The GPU recovers: the backend reports the fault (again) and then that it cleared.
    node.set_faults(0, vec![xid(79)]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.set_faults(0, Vec::new());
    node.harness
        .wait_for_slices_where(|s| s.iter().any(|s| device_taints(s, "gpu-0") == Some(0)))
        .await;
    plugin.shutdown().await;

    // Recovered is recovered: the next restart publishes the GPU untainted.
    let plugin = node.harness.start_plugin().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let slices = node.harness.wait_for_slices().await;
    assert!(slices.iter().all(|s| device_taints(s, "gpu-0") == Some(0)));
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_faulty_gpu_unreadable_at_the_restart_keeps_its_fault_until_it_reads_again() {
    let mut node = FaultyNode::new().await;
    let plugin = node.harness.start_plugin().await;
    node.harness.wait_for_slices().await;
    node.set_faults(0, vec![xid(79)]);
    node.harness
        .wait_for_slices_where(|s| s.iter().any(|s| device_taints(s, "gpu-0") == Some(1)))
        .await;
    plugin.shutdown().await;

    // The GPU cannot be read when the plugin comes back (NVML reported the XID once, before).
    node.set_faults(0, Vec::new());
    node.set_unreadable(0, Some("GPU is lost"));
    let plugin = node.harness.start_plugin().await;
    node.harness
        .wait_for_slices_where(|s| s.iter().all(|s| device_taints(s, "gpu-0").is_none()))
        .await;

    // It reads again: it comes back with the fault it had, not as a healthy GPU.
    let recorded = record_slices(&node.harness);
    node.set_unreadable(0, None);
    node.harness
        .wait_for_slices_where(|s| s.iter().any(|s| device_taints(s, "gpu-0").is_some()))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for slice in recorded.lock().unwrap().iter() {
        assert_ne!(
            device_taints(slice, "gpu-0"),
            Some(0),
            "gpu-0 published untainted after it read again (resourceVersion {:?})",
            slice.metadata.resource_version
        );
    }
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_fault_file_is_set_aside_and_the_plugin_starts_without_it() {
    let node = FaultyNode::new().await;
    std::fs::create_dir_all(node.harness.config.plugin_dir()).unwrap();
    std::fs::write(
        node.harness.config.plugin_dir().join("faults.json"),
        "{\"version\":1,\"boo",
    )
    .unwrap();
    let plugin = node.harness.start_plugin().await;
    assert_eq!(
        files_starting(&node.harness, "faults.json.corrupt-").len(),
        1
    );
    let slices = node.harness.wait_for_slices().await;
    assert!(slices.iter().all(|s| device_taints(s, "gpu-0") == Some(0)));
    let metrics = plugin.metrics.encode();
    assert!(
        metrics
            .contains("gpu_dra_state_files_set_aside_total{file=\"faults\",reason=\"corrupt\"} 1"),
        "{metrics}"
    );
    // A fresh, valid file replaces it.
    let text =
        std::fs::read_to_string(node.harness.config.plugin_dir().join("faults.json")).unwrap();
    assert!(text.contains("\"faults\":[]"), "{text}");
    plugin.shutdown().await;
}
