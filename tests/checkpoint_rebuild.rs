//! A checkpoint this build cannot use (garbage, a bad checksum, unreadable, a newer major version)
//! is set aside as `checkpoint.json.corrupt-<time>` and rebuilt from the CDI specs on disk and the
//! claims in the API server: never a reason to delete CDI specs or MIG devices, never a crash loop.
//! A checkpoint of the next minor (added fields, unknown claim states) is read, not refused.

use std::time::{Duration, Instant};

use gpu_dra::claims::checkpoint::{CheckpointFile, ClaimState};
use gpu_dra::devices::MigMode;
use gpu_dra::support::apiserver::ServerVersion;
use gpu_dra::support::harness::{Harness, DRIVER, MIG_CLASS};
use gpu_dra::support::kubelet::ClaimRef;
use serde_json::json;
use sha2::Digest;

const WAIT: Duration = Duration::from_secs(10);

fn mig_request(profile: &str) -> serde_json::Value {
    json!({"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS,
        "selectors": [{"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].profile == \"{profile}\"")}}]
    }}]})
}

fn checkpoint_path(node: &Harness) -> std::path::PathBuf {
    node.config.plugin_dir().join("checkpoint.json")
}

/// Files in the plugin directory whose name starts with `prefix`.
fn files_starting(node: &Harness, prefix: &str) -> Vec<String> {
    std::fs::read_dir(node.config.plugin_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|name| name.starts_with(prefix))
        .collect()
}

fn spec_file(uid: &str) -> String {
    format!("k8s.{DRIVER}-gpu_{uid}.json")
}

/// The SHA-256 the checkpoint carries over its `data` object (canonical JSON, keys sorted).
fn checksum(data: &serde_json::Value) -> String {
    hex::encode(sha2::Sha256::digest(data.to_string().as_bytes()))
}

/// How a test spoils the checkpoint, and the reason it expects.
enum Damage {
    Garbage,
    BadChecksum,
    Unreadable,
    NewerMajor,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_checkpoint_is_set_aside_and_rebuilt_without_deleting_anything() {
    for (round, (damage, kind)) in [
        (Damage::Garbage, "corrupt"),
        (Damage::BadChecksum, "corrupt"),
        (Damage::Unreadable, "unreadable"),
        (Damage::NewerMajor, "too_new"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
        node.config.mig_mode = MigMode::Dynamic;
        let plugin = node.start_plugin().await;
        let kubelet = node.kubelet().await;
        node.wait_for_slices_where(|s| s.len() == 5).await;
        let claim = node
            .allocated_claim_with("mig", mig_request("1g.10gb"))
            .await
            .unwrap();
        let prepared = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
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
        let made = node.mig_devices();
        assert_eq!(made.len(), 1);
        // A spec whose claim the API server does not know (deleted meanwhile, or another install's).
        let unknown = "bbbbbbbb-0000-4000-8000-00000000000b";
        std::fs::write(node.cdi_dir().join(spec_file(unknown)), "{}").unwrap();
        let specs_before = node.cdi_files();

        let path = checkpoint_path(&node);
        let text = std::fs::read_to_string(&path).unwrap();
        match damage {
            Damage::Garbage => std::fs::write(&path, b"\x00\xffnot a checkpoint").unwrap(),
            Damage::BadChecksum => {
                std::fs::write(&path, text.replace("mig-1g10gb", "mig-2g20gb")).unwrap()
            }
            // Unreadable even for root: a directory where the file should be.
            Damage::Unreadable => {
                std::fs::remove_file(&path).unwrap();
                std::fs::create_dir(&path).unwrap();
            }
            Damage::NewerMajor => {
                let mut envelope: serde_json::Value = serde_json::from_str(&text).unwrap();
                envelope["version"] = json!(2);
                std::fs::write(&path, envelope.to_string()).unwrap();
            }
        }

        let plugin = node.start_plugin().await;
        let aside = plugin
            .recovery
            .checkpoint_set_aside
            .clone()
            .expect("set aside");
        assert_eq!(aside.kind, kind, "round {round}: {aside:?}");
        let moved = aside.moved_to.clone().expect("moved");
        assert!(moved.exists(), "round {round}");
        assert_eq!(
            files_starting(&node, "checkpoint.json.corrupt-").len(),
            1,
            "round {round}"
        );
        let mut kept = plugin.recovery.kept.clone();
        kept.sort();
        let mut expected = vec![claim.uid.clone(), gpu_claim.uid.clone()];
        expected.sort();
        assert_eq!(kept, expected, "round {round}");
        assert_eq!(plugin.recovery.left_in_place, vec![unknown.to_string()]);
        assert!(plugin.recovery.orphan_specs_removed.is_empty());
        assert!(plugin.recovery.mig_devices_destroyed.is_empty());
        assert_eq!(node.cdi_files(), specs_before, "round {round}: specs kept");
        assert_eq!(node.mig_devices(), made, "round {round}: MIG device kept");
        let events = node
            .api
            .wait_for(
                "events",
                |events| {
                    events
                        .iter()
                        .any(|e| e["reason"] == "CheckpointSetAside" && e["type"] == "Warning")
                },
                WAIT,
            )
            .await
            .expect("a CheckpointSetAside Event on the Node");
        let event = events
            .iter()
            .find(|e| e["reason"] == "CheckpointSetAside")
            .unwrap();
        let note = event["note"].as_str().unwrap_or_default();
        assert!(note.contains(unknown) && note.contains(kind), "{note}");
        let metrics = plugin.metrics.encode();
        assert!(
            metrics.contains(&format!(
                "gpu_dra_state_files_set_aside_total{{file=\"checkpoint\",reason=\"{kind}\"}} 1"
            )),
            "{metrics}"
        );

        // The rebuilt claims are the kubelet's as before: a repeated prepare answers the same, and
        // unprepare destroys the MIG device the claim had.
        let kubelet = node.kubelet().await;
        let again = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
            .clone()
            .unwrap();
        assert_eq!(again, prepared, "round {round}");
        kubelet
            .unprepare(std::slice::from_ref(&claim))
            .await
            .unwrap()[&claim.uid]
            .clone()
            .unwrap();
        assert!(node.mig_devices().is_empty(), "round {round}");
        plugin.shutdown().await;

        if round == 0 {
            // A later, normal restart does not sweep what the rebuild left in place...
            let plugin = node.start_plugin().await;
            assert!(plugin.recovery.checkpoint_set_aside.is_none());
            assert!(node.cdi_files().contains(&spec_file(unknown)));
            assert_eq!(plugin.recovery.left_in_place, vec![unknown.to_string()]);
            // ...until the kubelet unprepares that claim.
            let kubelet = node.kubelet().await;
            let ghost = ClaimRef::new("default", "ghost", unknown.to_string());
            kubelet
                .unprepare(std::slice::from_ref(&ghost))
                .await
                .unwrap()[unknown]
                .clone()
                .unwrap();
            assert!(!node.cdi_files().contains(&spec_file(unknown)));
            let stored = CheckpointFile::new(checkpoint_path(&node))
                .load()
                .unwrap()
                .unwrap();
            assert!(stored.left_in_place.is_empty());
            plugin.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_the_next_minor_is_read_not_refused() {
    let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
    node.config.mig_mode = MigMode::Dynamic;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices_where(|s| s.len() == 5).await;
    let claim = node
        .allocated_claim_with("mig", mig_request("1g.10gb"))
        .await
        .unwrap();
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
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
    let made = node.mig_devices();
    let specs = node.cdi_files();

    // What the next minor might write: added fields everywhere, a claim state this build lacks.
    let path = checkpoint_path(&node);
    let mut envelope: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let data = &mut envelope["data"];
    data["nodeLabels"] = json!({"zone": "a"});
    data["claims"][&claim.uid]["state"] = json!("statusReported");
    data["claims"][&claim.uid]["devices"][0]["numaNode"] = json!(1);
    data["claims"][&gpu_claim.uid]["preparedAt"] = json!("2026-12-03T17:00:00Z");
    envelope["checksum"] = json!(checksum(&envelope["data"]));
    envelope["minorVersion"] = json!(4);
    std::fs::write(&path, envelope.to_string()).unwrap();

    let plugin = node.start_plugin().await;
    assert!(plugin.recovery.checkpoint_set_aside.is_none());
    assert!(files_starting(&node, "checkpoint.json.corrupt-").is_empty());
    let mut kept = plugin.recovery.kept.clone();
    kept.sort();
    let mut expected = vec![claim.uid.clone(), gpu_claim.uid.clone()];
    expected.sort();
    assert_eq!(kept, expected);
    assert_eq!(node.cdi_files(), specs);
    assert_eq!(node.mig_devices(), made);
    // The claim in the unknown state was checked against the API server and is completed now.
    let stored = CheckpointFile::new(&path).load().unwrap().unwrap();
    assert_eq!(stored.claims[&claim.uid].state, ClaimState::Completed);
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_with_the_api_server_hanging_leaves_everything_in_place() {
    let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
    node.config.mig_mode = MigMode::Dynamic;
    node.config.startup_api_timeout = Duration::from_millis(300);
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices_where(|s| s.len() == 5).await;
    let claim = node
        .allocated_claim_with("mig", mig_request("1g.10gb"))
        .await
        .unwrap();
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .clone()
        .unwrap();
    plugin.shutdown().await;
    let made = node.mig_devices();
    let specs = node.cdi_files();
    std::fs::write(checkpoint_path(&node), b"{\"version\":1,\"chec").unwrap();

    node.api.set_latency(Duration::from_secs(3));
    let started = Instant::now();
    let plugin = node.start_plugin().await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(plugin.recovery.kept.is_empty());
    assert_eq!(plugin.recovery.left_in_place, vec![claim.uid.clone()]);
    assert_eq!(node.cdi_files(), specs);
    assert_eq!(node.mig_devices(), made);
    assert_eq!(files_starting(&node, "checkpoint.json.corrupt-").len(), 1);
    node.api.clear_faults();
    let events = node
        .api
        .wait_for(
            "events",
            |events| events.iter().any(|e| e["reason"] == "CheckpointSetAside"),
            WAIT,
        )
        .await
        .expect("a CheckpointSetAside Event once the server answers");
    let note = events
        .iter()
        .find(|e| e["reason"] == "CheckpointSetAside")
        .and_then(|e| e["note"].as_str())
        .unwrap_or_default()
        .to_string();
    assert!(
        note.contains(&claim.uid) && note.contains("not deleted"),
        "{note}"
    );
    plugin.shutdown().await;
}
