//! Dynamic MIG destroys only the MIG devices the plugin made: each is recorded in the checkpoint
//! before it is created, so the start-up sweep destroys a device the plugin made for a claim that is
//! gone (a crash right after a create: `claim_lifecycle.rs`) and leaves an admin's alone (made in
//! static MIG mode, before a switch to dynamic). A prepare the kubelet gave up on finishes on its own,
//! and its device is the claim's until it is unprepared. A missing checkpoint with CDI specs of this
//! driver on disk is rebuilt from them and the API server, as a corrupt one is, instead of wiping
//! running pods' specs and MIG devices.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use gpu_dra::claims::checkpoint::{CheckpointData, CheckpointFile};
use gpu_dra::devices::MigMode;
use gpu_dra::support::apiserver::ServerVersion;
use gpu_dra::support::harness::{
    admin_split_h100_profile, h100_profile, Harness, DRIVER, MIG_CLASS,
};
use gpu_dra::support::kubelet::KubeletDouble;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

/// A MIG device of `profile` on the GPU with minor number `minor`.
fn mig_request(profile: &str, minor: u32) -> serde_json::Value {
    json!({"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS,
        "selectors": [{"cel": {"expression": format!(
            "device.attributes[\"{DRIVER}\"].profile == \"{profile}\" && device.attributes[\"{DRIVER}\"].minor == {minor}"
        )}}]
    }}]})
}

fn checkpoint(node: &Harness) -> CheckpointFile {
    CheckpointFile::new(node.config.plugin_dir().join("checkpoint.json"))
}

/// Two H100s; on the second an admin made three MIG devices (static MIG) before the node was
/// switched to dynamic MIG. MIG operations take `delay_ms`.
fn admin_split_profile(node: &mut Harness, delay_ms: u64) {
    let mut profile = admin_split_h100_profile();
    profile.mig_operation_delay_ms = Some(delay_ms);
    node.use_profile("admin-split", &profile);
    node.config.mig_mode = MigMode::Dynamic;
}

fn uuids(devices: &[(u32, u32, String)]) -> Vec<String> {
    let mut uuids: Vec<String> = devices.iter().map(|d| d.2.clone()).collect();
    uuids.sort();
    uuids
}

async fn wait_for_event(node: &Harness, reason: &str) -> serde_json::Value {
    let events = node
        .api
        .wait_for(
            "events",
            |events| events.iter().any(|e| e["reason"] == reason),
            WAIT,
        )
        .await
        .unwrap_or_else(|| panic!("a {reason} Event on the Node"));
    events.into_iter().find(|e| e["reason"] == reason).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admins_mig_devices_survive_a_dynamic_mig_start_and_are_reported() {
    let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
    admin_split_profile(&mut node, 0);
    let admins = node.mig_devices();
    assert_eq!(admins.len(), 3);

    for _ in 0..2 {
        let plugin = node.start_plugin().await;
        assert!(plugin.recovery.mig_devices_destroyed.is_empty());
        let mut left = plugin.recovery.mig_devices_left_alone.clone();
        left.sort();
        assert_eq!(left, uuids(&admins));
        assert_eq!(node.mig_devices(), admins);
        plugin.shutdown().await;
    }
    let event = wait_for_event(&node, "MigDevicesLeftAlone").await;
    assert_eq!(event["type"], "Warning");
    let note = event["note"].as_str().unwrap_or_default();
    assert!(admins.iter().all(|d| note.contains(&d.2)), "{note}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_the_kubelet_gave_up_on_finishes_and_its_mig_device_goes_with_its_unprepare_after_a_restart(
) {
    let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
    admin_split_profile(&mut node, 1500);
    let admins = node.mig_devices();
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_whole_pool().await;
    let claim = node
        .allocated_claim_with("abandoned", mig_request("1g.10gb", 0))
        .await
        .unwrap();
    let impatient = kubelet
        .clone()
        .with_call_timeout(Duration::from_millis(500));
    assert!(impatient
        .prepare(std::slice::from_ref(&claim))
        .await
        .is_err());
    // The prepare goes on without the kubelet: the device is made and the claim completed.
    let deadline = Instant::now() + WAIT;
    while plugin.preparer.phase_of(&claim.uid) != Some(gpu_dra::claims::Phase::Completed) {
        assert!(Instant::now() < deadline, "the prepare never finished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let made: Vec<(u32, u32, String)> = node
        .mig_devices()
        .into_iter()
        .filter(|d| !admins.contains(d))
        .collect();
    assert_eq!(made.len(), 1, "{made:?}");
    plugin.shutdown().await;

    // A restart keeps it (it is the claim's), and sweeps none of the admin's.
    let plugin = node.start_plugin().await;
    assert_eq!(plugin.recovery.kept, vec![claim.uid.clone()]);
    assert!(plugin.recovery.mig_devices_destroyed.is_empty());
    let mut all = admins.clone();
    all.extend(made);
    all.sort();
    let mut now = node.mig_devices();
    now.sort();
    assert_eq!(now, all);
    // The kubelet's unprepare (the pod went) destroys it, and only it.
    let kubelet = node.kubelet().await;
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap()[&claim.uid]
        .clone()
        .unwrap();
    assert_eq!(node.mig_devices(), admins, "the admin's MIG devices stay");
    let stored = checkpoint(&node).load().unwrap().unwrap();
    assert!(stored.mig_devices_made.is_empty(), "{stored:?}");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_checkpoint_with_specs_of_running_claims_is_rebuilt_and_nothing_is_wiped() {
    let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
    node.config.mig_mode = MigMode::Dynamic;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices_where(|s| s.len() == 5).await;
    let mig_claim = node
        .allocated_claim_with("mig", mig_request("1g.10gb", 0))
        .await
        .unwrap();
    let prepared = kubelet
        .prepare(std::slice::from_ref(&mig_claim))
        .await
        .unwrap()[&mig_claim.uid]
        .clone()
        .unwrap();
    let gpu_claim = node.allocated_claim("whole", 1).await;
    kubelet
        .prepare(std::slice::from_ref(&gpu_claim))
        .await
        .unwrap()[&gpu_claim.uid]
        .clone()
        .unwrap();
    plugin.shutdown().await;
    // The specs of another driver name (this plugin's name before a change, say) are never ours.
    let foreign = "k8s.other.example.com-gpu_cccccccc-0000-4000-8000-00000000000c.json";
    std::fs::write(node.cdi_dir().join(foreign), "{}").unwrap();
    let made = node.mig_devices();
    let specs = node.cdi_files();
    assert_eq!(made.len(), 1);
    assert_eq!(specs.len(), 3);
    std::fs::remove_file(checkpoint(&node).path()).unwrap();

    let plugin = node.start_plugin().await;
    assert_eq!(
        plugin.recovery.checkpoint_missing.as_deref(),
        Some(checkpoint(&node).path())
    );
    let mut kept = plugin.recovery.kept.clone();
    kept.sort();
    let mut expected = vec![mig_claim.uid.clone(), gpu_claim.uid.clone()];
    expected.sort();
    assert_eq!(kept, expected);
    assert!(plugin.recovery.orphan_specs_removed.is_empty());
    assert!(plugin.recovery.mig_devices_destroyed.is_empty());
    assert_eq!(node.cdi_files(), specs, "every spec stays");
    assert_eq!(node.mig_devices(), made, "the MIG device stays");
    let stored: CheckpointData = checkpoint(&node)
        .load()
        .unwrap()
        .expect("rebuilt checkpoint");
    assert_eq!(stored.claims.len(), 2);
    assert_eq!(stored.mig_devices_made.len(), 1);
    assert_eq!(
        stored.mig_devices_made[0].uuid.as_deref(),
        Some(made[0].2.as_str())
    );
    let event = wait_for_event(&node, "CheckpointMissing").await;
    assert_eq!(event["type"], "Warning");
    let note = event["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("checkpoint.json") && note.contains("Rebuilt 2"),
        "{note}"
    );

    // The rebuilt claims are the kubelet's as before: the same answer, and unprepare destroys the
    // MIG device the claim had.
    let kubelet = node.kubelet().await;
    let again = kubelet
        .prepare(std::slice::from_ref(&mig_claim))
        .await
        .unwrap()[&mig_claim.uid]
        .clone()
        .unwrap();
    assert_eq!(again, prepared);
    kubelet
        .unprepare(std::slice::from_ref(&mig_claim))
        .await
        .unwrap()[&mig_claim.uid]
        .clone()
        .unwrap();
    assert!(node.mig_devices().is_empty());
    plugin.shutdown().await;
    assert!(node.cdi_files().contains(&foreign.to_string()));
}

/// The plugin binary in dynamic MIG mode on the fake GPUs of `node.config.backend`.
fn spawn_plugin(node: &Harness, kubeconfig: &std::path::Path) -> Child {
    let gpu_dra::plugin::BackendChoice::Fake {
        profile,
        state_file: Some(state),
    } = &node.config.backend
    else {
        panic!("a fake backend with a state file");
    };
    node.plugin_command(
        std::path::Path::new(env!("CARGO_BIN_EXE_gpu-dra")),
        std::path::Path::new(profile),
        kubeconfig,
    )
    .args(["--mig-mode", "dynamic", "--fake-state"])
    .arg(state)
    .stdout(Stdio::null())
    .stderr(Stdio::inherit())
    .spawn()
    .expect("plugin binary starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_recording_and_creating_a_mig_device_leaves_nothing_behind() {
    let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
    let mut profile = h100_profile(1);
    profile.mig_operation_delay_ms = Some(4000);
    let profile_path = node.dir.path().join("slow-mig.yaml");
    std::fs::write(&profile_path, serde_yaml::to_string(&profile).unwrap()).unwrap();
    node.config.backend = gpu_dra::plugin::BackendChoice::Fake {
        profile: profile_path.display().to_string(),
        state_file: Some(node.dir.path().join("slow-mig-state.json")),
    };
    let kubeconfig = node.dir.path().join("kubeconfig");
    node.api.write_kubeconfig(&kubeconfig).unwrap();
    let mut plugin = spawn_plugin(&node, &kubeconfig);
    let kubelet =
        KubeletDouble::register(&node.config.registry_dir, DRIVER, Duration::from_secs(30))
            .await
            .unwrap();
    node.wait_for_whole_pool().await;
    let claim = node
        .allocated_claim_with("cut-short", mig_request("1g.10gb", 0))
        .await
        .unwrap();
    let call = {
        let (kubelet, claim) = (kubelet.clone(), claim.clone());
        tokio::spawn(async move { kubelet.prepare(&[claim]).await })
    };
    // Killed once the device is recorded, while the create is under way.
    let deadline = Instant::now() + WAIT;
    loop {
        let recorded = checkpoint(&node)
            .load()
            .ok()
            .flatten()
            .is_some_and(|data| !data.mig_devices_made.is_empty());
        if recorded {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the MIG device was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    plugin.kill().unwrap();
    plugin.wait().unwrap();
    let _ = call.await;
    assert!(
        node.mig_devices().is_empty(),
        "killed before the create finished"
    );

    let mut plugin = spawn_plugin(&node, &kubeconfig);
    let kubelet =
        KubeletDouble::register(&node.config.registry_dir, DRIVER, Duration::from_secs(30))
            .await
            .unwrap();
    // Registration comes after recovery, which wrote the checkpoint.
    let stored = checkpoint(&node).load().unwrap().unwrap();
    assert!(stored.claims.is_empty(), "{stored:?}");
    assert!(stored.mig_devices_made.is_empty(), "{stored:?}");
    assert!(node.mig_devices().is_empty());
    assert!(node.cdi_files().is_empty());
    // The kubelet's retry prepares the claim from scratch.
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .clone()
        .unwrap();
    assert_eq!(node.mig_devices().len(), 1);
    plugin.kill().unwrap();
    plugin.wait().unwrap();
}
