//! The plugin against API servers that drop ResourceSlice fields of disabled feature gates (a default
//! 1.34 cluster): no write loop, nothing overlapping published without counters, faulty devices withdrawn
//! without taints, one Warning Event naming the gate, and counters back once the server keeps them.

use std::time::{Duration, Instant};

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{FakeFault, FakeFaultKind, FakeProfile, GpuBackend};
use gpu_dra::support::apiserver::{FeatureGate, FeatureGates, ServerVersion};
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::{ClaimRef, HealthStatus};
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use kube::Api;
use serde_json::{json, Value};

/// The window in which a settled plugin must not keep writing; today's code wrote every second.
const WINDOW: Duration = Duration::from_secs(5);
const WAIT: Duration = Duration::from_secs(10);

fn default_1_34() -> FeatureGates {
    FeatureGates::defaults_of(ServerVersion::V1_34)
}

async fn node(gates: FeatureGates, version: ServerVersion, mig_mode: MigMode) -> Harness {
    let mut node = Harness::with_gates("dgx-h100", version, gates).await;
    node.config.mig_mode = mig_mode;
    node
}

fn stored_slices(node: &Harness) -> Vec<ResourceSlice> {
    node.api
        .list("resourceslices")
        .into_iter()
        .map(|v| serde_json::from_value(v).expect("a stored ResourceSlice"))
        .collect()
}

fn devices(slices: &[ResourceSlice]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect()
}

fn names(devices: &[Device]) -> Vec<String> {
    let mut names: Vec<String> = devices.iter().map(|d| d.name.clone()).collect();
    names.sort();
    names
}

fn whole_gpus(count: u32) -> Vec<String> {
    let mut names: Vec<String> = (0..count).map(|i| format!("gpu-{i}")).collect();
    names.sort();
    names
}

fn has_counters(slices: &[ResourceSlice]) -> bool {
    slices.iter().any(|s| {
        s.spec
            .shared_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
            || s.spec
                .devices
                .iter()
                .flatten()
                .any(|d| d.consumes_counters.is_some())
    })
}

/// Slice writes the API server stored during [`WINDOW`].
async fn writes_in_window(node: &Harness) -> usize {
    let before = node.api.writes("resourceslices");
    tokio::time::sleep(WINDOW).await;
    node.api.writes("resourceslices") - before
}

/// The Events on the Node with `reason` whose note names `gate`, once at least one is there.
async fn events_naming(node: &Harness, reason: &str, gate: &str) -> Vec<Value> {
    let deadline = Instant::now() + WAIT;
    loop {
        let events: Vec<Value> = node
            .api
            .list("events")
            .into_iter()
            .filter(|e| {
                e["reason"] == reason && e["note"].as_str().is_some_and(|n| n.contains(gate))
            })
            .collect();
        if !events.is_empty() || Instant::now() > deadline {
            return events;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn metrics_where(plugin: &gpu_dra::plugin::RunningPlugin, want: &str) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let text = plugin.metrics.encode();
        if text.contains(want) || Instant::now() > deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_partitionable_devices_dynamic_mig_publishes_whole_gpus_once_and_prepares_no_mig() {
    let node = node(default_1_34(), ServerVersion::V1_34, MigMode::Dynamic).await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let settled = writes_in_window(&node).await;
    assert!(
        settled == 0,
        "{settled} slice writes in {WINDOW:?} after the slices were first published"
    );
    let total = node.api.writes("resourceslices");
    assert!(total <= 2, "{total} slice writes in all");
    let stored = stored_slices(&node);
    assert_eq!(names(&devices(&stored)), whole_gpus(8));
    assert!(!has_counters(&stored));

    let warnings = events_naming(&node, "FeatureGateDisabled", "DRAPartitionableDevices").await;
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert_eq!(warnings[0]["type"], "Warning");
    assert_eq!(warnings[0]["regarding"]["name"], NODE);
    let note = warnings[0]["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("whole GPUs only") && note.contains("--mig-mode static"),
        "{note}"
    );
    let text = metrics_where(
        &plugin,
        "gpu_dra_feature_gate_disabled{feature_gate=\"DRAPartitionableDevices\"} 1",
    )
    .await;
    assert!(
        text.contains("gpu_dra_feature_gate_disabled{feature_gate=\"DRAPartitionableDevices\"} 1"),
        "{text}"
    );

    // A MIG device is no longer published, so the prepare path must not make one either.
    let forged = forge_claim(&node, "forged", "gpu-0-mig-1g10gb-0").await;
    let answer = kubelet
        .prepare(std::slice::from_ref(&forged))
        .await
        .unwrap();
    let error = answer[&forged.uid]
        .clone()
        .expect_err("a MIG device is refused");
    assert!(error.contains("gpu-0-mig-1g10gb-0"), "{error}");
    assert!(error.contains("FeatureGateDisabled"), "{error}");
    let inventory = node.fake_backend().inventory().unwrap();
    assert!(
        inventory
            .gpus
            .iter()
            .all(|g| g.mig.as_ref().is_none_or(|m| m.instances.is_empty())),
        "no MIG device was created"
    );
    plugin.shutdown().await;
}

/// A claim whose allocation names `device` directly (no scheduler would allocate an unpublished one).
async fn forge_claim(node: &Harness, name: &str, device: &str) -> ClaimRef {
    let uid = node.create_claim(name, 1).await;
    let claims: Api<ResourceClaim> = Api::namespaced(node.api.client(), "default");
    let mut claim = claims.get(name).await.unwrap();
    claim.status = Some(
        serde_json::from_value(json!({
            "allocation": {"devices": {"results": [
                {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": device}
            ]}}
        }))
        .unwrap(),
    );
    claims
        .replace_status(name, &Default::default(), &claim)
        .await
        .unwrap();
    ClaimRef::new("default", name, uid)
}

/// A fake profile of `gpus` H100s in a file the test edits to inject faults.
struct Profile {
    path: std::path::PathBuf,
    profile: FakeProfile,
}

impl Profile {
    fn install(node: &mut Harness, gpus: usize) -> Profile {
        let mut profile = gpu_dra::gpu::builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(gpus);
        let path = node.dir.path().join("faults.yaml");
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        node.config.backend = gpu_dra::plugin::BackendChoice::Fake {
            profile: path.display().to_string(),
            state_file: Some(node.dir.path().join("state.json")),
        };
        Profile { path, profile }
    }

    fn set_faults(&mut self, gpu: usize, faults: Vec<FakeFault>) {
        self.profile.gpus[gpu].faults = faults;
        std::fs::write(&self.path, serde_yaml::to_string(&self.profile).unwrap()).unwrap();
    }
}

fn xid_79() -> FakeFault {
    FakeFault {
        kind: FakeFaultKind::Xid,
        xid: Some(79),
        mig_start: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_device_taints_a_faulty_gpu_is_withdrawn_until_it_recovers() {
    let mut node = node(
        FeatureGates::disabling([FeatureGate::DRADeviceTaints]),
        ServerVersion::V1_34,
        MigMode::Static,
    )
    .await;
    let mut profile = Profile::install(&mut node, 2);
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let mut health = kubelet.watch_health().await.unwrap();
    node.wait_for_slices_where(|s| names(&devices(s)) == whole_gpus(2))
        .await;

    profile.set_faults(1, vec![xid_79()]);
    let slices = node
        .wait_for_slices_where(|s| names(&devices(s)) == vec!["gpu-0".to_string()])
        .await;
    assert!(devices(&slices).iter().all(|d| d.taints.is_none()));
    // The kubelet still hears that the withdrawn GPU is unhealthy.
    let deadline = Instant::now() + WAIT;
    loop {
        let list = tokio::time::timeout(WAIT, health.next())
            .await
            .expect("a health update in time")
            .expect("a healthy stream")
            .expect("the stream stays open");
        if list
            .iter()
            .any(|d| d.device == "gpu-1" && d.health == HealthStatus::Unhealthy)
        {
            break;
        }
        assert!(Instant::now() < deadline, "gpu-1 never unhealthy: {list:?}");
    }
    let settled = writes_in_window(&node).await;
    assert!(
        settled == 0,
        "{settled} slice writes in {WINDOW:?} with a faulty GPU"
    );
    assert_eq!(names(&devices(&stored_slices(&node))), vec!["gpu-0"]);
    let warnings = events_naming(&node, "FeatureGateDisabled", "DRADeviceTaints").await;
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert!(
        events_naming(&node, "FeatureGateDisabled", "DRAPartitionableDevices")
            .await
            .is_empty()
    );

    // Recovery brings it back.
    profile.set_faults(1, Vec::new());
    node.wait_for_slices_where(|s| names(&devices(s)) == whole_gpus(2))
        .await;
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_keeps_the_fields_gets_counters_and_taints_as_before() {
    let mut node = node(
        FeatureGates::all_enabled(),
        ServerVersion::V1_34,
        MigMode::Dynamic,
    )
    .await;
    let mut profile = Profile::install(&mut node, 2);
    let plugin = node.start_plugin().await;
    let slices = node.wait_for_slices_where(has_counters).await;
    assert!(devices(&slices).iter().any(|d| d.name.contains("-mig-")));
    assert!(
        node.api.dry_runs("resourceslices") >= 1,
        "the plugin asked the server what it keeps"
    );

    profile.set_faults(1, vec![xid_79()]);
    node.wait_for_slices_where(|s| {
        devices(s)
            .iter()
            .any(|d| d.name == "gpu-1" && d.taints.as_ref().is_some_and(|t| !t.is_empty()))
    })
    .await;
    let text = metrics_where(
        &plugin,
        "gpu_dra_feature_gate_disabled{feature_gate=\"DRADeviceTaints\"} 0",
    )
    .await;
    for gate in ["DRAPartitionableDevices", "DRADeviceTaints"] {
        assert!(
            text.contains(&format!(
                "gpu_dra_feature_gate_disabled{{feature_gate=\"{gate}\"}} 0"
            )),
            "{text}"
        );
    }
    assert!(node
        .api
        .list("events")
        .iter()
        .all(|e| e["reason"] != "FeatureGateDisabled"));
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_come_back_when_the_server_keeps_them_after_a_restart() {
    let node = node(default_1_34(), ServerVersion::V1_34, MigMode::Dynamic).await;
    let plugin = node.start_plugin().await;
    node.wait_for_slices_where(|s| names(&devices(s)) == whole_gpus(8))
        .await;
    plugin.shutdown().await;

    // The admin enables the gates (kube-apiserver restarted with them) and restarts the plugin.
    node.api.set_feature_gates(FeatureGates::all_enabled());
    let plugin = node.start_plugin().await;
    // On 1.34 the partitionable GPUs' counter sets sit in slices with the devices consuming them,
    // three GPUs to a slice.
    let slices = node
        .wait_for_slices_where(|s| {
            s.iter()
                .map(|s| s.spec.shared_counters.as_ref().map_or(0, Vec::len))
                .sum::<usize>()
                == 8
                && s.len() == 3
        })
        .await;
    assert!(devices(&slices).iter().any(|d| d.name.contains("-mig-")));
    let settled = writes_in_window(&node).await;
    assert!(settled == 0, "{settled} slice writes in {WINDOW:?}");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_come_back_when_the_server_is_upgraded_to_a_version_that_keeps_them() {
    let node = node(default_1_34(), ServerVersion::V1_34, MigMode::Dynamic).await;
    let plugin = node.start_plugin().await;
    node.wait_for_slices_where(|s| names(&devices(s)) == whole_gpus(8))
        .await;

    // The control plane is upgraded to 1.36, where both gates are on by default. A real upgrade
    // restarts the server and the plugin's watch re-lists; here a slice wiped behind the plugin's
    // back is the watch event that makes it sync, read the new version and ask again.
    node.api.upgrade(
        ServerVersion::V1_36,
        FeatureGates::defaults_of(ServerVersion::V1_36),
    );
    node.api.remove_where("resourceslices", |_| true);
    // From 1.35 the 8 counter sets share a slice of their own.
    let slices = node
        .wait_for_slices_where(|s| {
            s.iter().any(|s| {
                s.spec
                    .shared_counters
                    .as_ref()
                    .is_some_and(|c| c.len() == 8)
            }) && s.len() == 5
        })
        .await;
    assert!(devices(&slices).iter().any(|d| d.name.contains("-mig-")));
    let enabled = events_naming(&node, "FeatureGateEnabled", "DRAPartitionableDevices").await;
    assert_eq!(enabled.len(), 1, "{enabled:#?}");
    let text = metrics_where(
        &plugin,
        "gpu_dra_feature_gate_disabled{feature_gate=\"DRAPartitionableDevices\"} 0",
    )
    .await;
    assert!(
        text.contains("gpu_dra_feature_gate_disabled{feature_gate=\"DRAPartitionableDevices\"} 0"),
        "{text}"
    );
    let settled = writes_in_window(&node).await;
    assert!(settled == 0, "{settled} slice writes in {WINDOW:?}");
    plugin.shutdown().await;
}
