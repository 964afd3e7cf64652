//! After a reboot. The checkpoint and the CDI specs are written without fsync, so a power cut (a reboot)
//! may leave them stale, torn, empty or missing. The kubelet prepares every claim again after a reboot;
//! these tests play that part and check that the node converges and that no record of the earlier boot
//! holds a device the API server does not confirm.

use std::time::Duration;

use gpu_dra::claims::checkpoint::{CheckpointData, ClaimState};
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};

use super::{checkpoint, record};

const EARLIER_BOOT: &str = "an-earlier-boot";

/// A claim as the scheduler left it in the API server: `uid`, allocated `device` on this node, and
/// reserved for a pod when `reserved`.
fn insert_allocated(node: &Harness, name: &str, uid: &str, device: &str, reserved: bool) {
    let reserved_for = if reserved {
        serde_json::json!([{"resource": "pods", "name": format!("pod-{name}"), "uid": format!("pod-uid-{name}")}])
    } else {
        serde_json::json!([])
    };
    node.api.insert(
        "resourceclaims",
        serde_json::json!({
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}},
            "status": {
                "allocation": {"devices": {"results": [
                    {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": device}
                ]}},
                "reservedFor": reserved_for
            }
        }),
    );
}

fn spec_path(node: &Harness, uid: &str) -> std::path::PathBuf {
    node.cdi_dir().join(format!("k8s.{DRIVER}-gpu_{uid}.json"))
}

/// What a power cut may leave of a spec file: half of one.
fn write_torn_spec(node: &Harness, uid: &str) {
    std::fs::create_dir_all(node.cdi_dir()).unwrap();
    std::fs::write(
        spec_path(node, uid),
        "{\"cdiVersion\":\"0.5.0\",\"kind\":\"k8s.",
    )
    .unwrap();
}

/// The kubelet's prepare after the reboot succeeds for each claim.
async fn prepare_all(kubelet: &KubeletDouble, claims: &[ClaimRef]) {
    let answer = kubelet.prepare(claims).await.unwrap();
    for claim in claims {
        assert!(
            answer[&claim.uid].is_ok(),
            "{}: {:?}",
            claim.name,
            answer[&claim.uid]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_only_records_the_api_server_confirms_hold_devices() {
    let node = Harness::new("dgx-h100").await;
    let uid = |n: u32| format!("bbbbbbbb-0000-4000-8000-00000000000{n}");
    let (confirmed, gone, replaced, moved, unreserved, half_done) =
        (uid(1), uid(2), uid(3), uid(4), uid(5), uid(6));
    let mut data = CheckpointData {
        boot_id: EARLIER_BOOT.into(),
        ..Default::default()
    };
    for (name, state, device, uid) in [
        ("confirmed", ClaimState::Completed, "gpu-0", &confirmed),
        ("gone", ClaimState::Completed, "gpu-1", &gone),
        ("replaced", ClaimState::Completed, "gpu-2", &replaced),
        ("moved", ClaimState::Completed, "gpu-3", &moved),
        ("unreserved", ClaimState::Completed, "gpu-4", &unreserved),
        ("half-done", ClaimState::Started, "gpu-5", &half_done),
    ] {
        data.claims
            .insert(uid.clone(), record(name, state, device, uid));
    }
    std::fs::create_dir_all(node.config.plugin_dir()).unwrap();
    checkpoint(&node).store(&data).unwrap();
    // What the API server holds now. `gone` has no claim; `replaced` was deleted and created again.
    insert_allocated(&node, "confirmed", &confirmed, "gpu-0", true);
    insert_allocated(&node, "replaced", &uid(9), "gpu-2", true);
    insert_allocated(&node, "moved", &moved, "gpu-6", true);
    insert_allocated(&node, "unreserved", &unreserved, "gpu-4", false);
    // A CDI root that is not tmpfs keeps its specs over the reboot: every one torn by the power cut.
    for uid in [
        &confirmed,
        &gone,
        &replaced,
        &moved,
        &unreserved,
        &half_done,
    ] {
        write_torn_spec(&node, uid);
    }

    let plugin = node.start_plugin().await;
    let recovery = &plugin.recovery;
    assert!(recovery.rebooted);
    assert_eq!(recovery.kept, vec![confirmed.clone()]);
    assert_eq!(
        recovery.dropped_after_reboot,
        vec![
            gone.clone(),
            replaced.clone(),
            moved.clone(),
            unreserved.clone()
        ]
    );
    assert_eq!(recovery.rolled_back, vec![half_done.clone()]);
    // Only the confirmed claim's spec is left, written again in full.
    assert_eq!(
        node.cdi_files(),
        vec![format!("k8s.{DRIVER}-gpu_{confirmed}.json")]
    );
    let rewritten = std::fs::read_to_string(spec_path(&node, &confirmed)).unwrap();
    assert!(
        rewritten.contains(&format!("{confirmed}-gpu-0")),
        "{rewritten}"
    );
    let stored = checkpoint(&node).load().unwrap().unwrap();
    assert_eq!(stored.claims.keys().collect::<Vec<_>>(), vec![&confirmed]);
    assert_eq!(
        stored.boot_id,
        gpu_dra::claims::checkpoint::current_boot_id()
    );

    // The kubelet prepares again what its pods still need: the confirmed claim, the replacement and
    // the moved claim; every device a dropped record named is free for them and for new claims.
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let mut again = vec![
        ClaimRef::new("default", "confirmed", confirmed.clone()),
        ClaimRef::new("default", "replaced", uid(9)),
        ClaimRef::new("default", "moved", moved.clone()),
    ];
    for (n, device) in [
        ("1", "gpu-1"),
        ("3", "gpu-3"),
        ("4", "gpu-4"),
        ("5", "gpu-5"),
    ] {
        let new_uid = format!("cccccccc-0000-4000-8000-00000000000{n}");
        insert_allocated(&node, &format!("new-{device}"), &new_uid, device, true);
        again.push(ClaimRef::new("default", format!("new-{device}"), new_uid));
    }
    prepare_all(&kubelet, &again).await;
    // The confirmed record does hold gpu-0.
    insert_allocated(&node, "intruder", &uid(8), "gpu-0", true);
    let intruder = ClaimRef::new("default", "intruder", uid(8));
    let answer = kubelet
        .prepare(std::slice::from_ref(&intruder))
        .await
        .unwrap();
    let error = answer[&intruder.uid].clone().unwrap_err();
    assert!(error.contains("default/confirmed"), "{error}");
    let answer = kubelet.unprepare(&again).await.unwrap();
    assert!(answer.values().all(Result::is_ok), "{answer:?}");
    assert!(node.cdi_files().is_empty());
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_with_the_api_server_not_answering_no_record_holds_a_device() {
    let mut node = Harness::new("l40s-4").await;
    node.config.startup_api_timeout = Duration::from_millis(300);
    let held = "dddddddd-0000-4000-8000-000000000001";
    let mut data = CheckpointData {
        boot_id: EARLIER_BOOT.into(),
        ..Default::default()
    };
    data.claims.insert(
        held.into(),
        record("held", ClaimState::Completed, "gpu-0", held),
    );
    std::fs::create_dir_all(node.config.plugin_dir()).unwrap();
    checkpoint(&node).store(&data).unwrap();
    insert_allocated(&node, "held", held, "gpu-0", true);

    node.api.set_latency(Duration::from_secs(3));
    let started = std::time::Instant::now();
    let plugin = node.start_plugin().await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "start-up waited {:?} for the API server",
        started.elapsed()
    );
    assert!(plugin.recovery.kept.is_empty());
    assert_eq!(plugin.recovery.dropped_after_reboot, vec![held.to_string()]);
    assert!(checkpoint(&node).load().unwrap().unwrap().claims.is_empty());

    // Once the server answers, the kubelet's prepare of the same claim makes it again.
    node.api.clear_faults();
    node.api.set_latency(Duration::ZERO);
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    prepare_all(
        &kubelet,
        &[ClaimRef::new("default", "held", held.to_string())],
    )
    .await;
    assert_eq!(
        node.cdi_files(),
        vec![format!("k8s.{DRIVER}-gpu_{held}.json")]
    );
    plugin.shutdown().await;
}

/// One power cut's leftovers: what the checkpoint file holds when the node is back.
enum CheckpointAfterPowerCut {
    Missing,
    Empty,
    Torn,
    /// Written before the last changes: it still records `stale` and lacks `live`.
    Stale,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_power_cut_a_missing_empty_torn_or_stale_checkpoint_converges() {
    use CheckpointAfterPowerCut::*;
    for case in [Missing, Empty, Torn, Stale] {
        let label = match case {
            Missing => "missing",
            Empty => "empty",
            Torn => "torn",
            Stale => "stale",
        };
        let node = Harness::new("l40s-4").await;
        // `live` was prepared last and its pod still runs; `stale` was unprepared and deleted before
        // the power cut, but the checkpoint written then did not reach the disk.
        let live = "eeeeeeee-0000-4000-8000-000000000001";
        let stale = "eeeeeeee-0000-4000-8000-000000000002";
        insert_allocated(&node, "live", live, "gpu-1", true);
        std::fs::create_dir_all(node.config.plugin_dir()).unwrap();
        let path = node.config.plugin_dir().join("checkpoint.json");
        let mut data = CheckpointData {
            boot_id: EARLIER_BOOT.into(),
            ..Default::default()
        };
        data.claims.insert(
            stale.into(),
            record("stale", ClaimState::Completed, "gpu-0", stale),
        );
        checkpoint(&node).store(&data).unwrap();
        match case {
            Missing => std::fs::remove_file(&path).unwrap(),
            Empty => std::fs::write(&path, "").unwrap(),
            Torn => {
                let bytes = std::fs::read(&path).unwrap();
                std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
            }
            Stale => {}
        }
        // The live claim's spec survived on a CDI root that is not tmpfs, torn.
        write_torn_spec(&node, live);

        let plugin = node.start_plugin().await;
        let recovery = &plugin.recovery;
        match case {
            // No file but specs on disk (a changed plugin directory, a lost file): rebuilt from the
            // specs and the API server as for a corrupt one, never taken as "nothing prepared".
            Missing => {
                assert!(recovery.checkpoint_set_aside.is_none(), "{label}");
                assert!(recovery.checkpoint_missing.is_some(), "{label}");
                assert_eq!(
                    recovery.kept,
                    vec![live.to_string()],
                    "{label}: {recovery:?}"
                );
                assert!(recovery.orphan_specs_removed.is_empty(), "{label}");
            }
            // Set aside and rebuilt from the specs on disk and the API server, which confirms `live`.
            Empty | Torn => {
                assert!(recovery.checkpoint_set_aside.is_some(), "{label}");
                assert_eq!(recovery.kept, vec![live.to_string()], "{label}");
            }
            Stale => {
                assert_eq!(recovery.dropped_after_reboot, vec![stale.to_string()]);
                assert!(recovery.kept.is_empty(), "{label}: {recovery:?}");
                assert_eq!(recovery.orphan_specs_removed, vec![live.to_string()]);
            }
        }

        // The kubelet prepares the live claim again; a new claim gets the device the stale record
        // named; then everything unprepares and nothing is left on the node.
        let kubelet = node.kubelet().await;
        node.wait_for_slices().await;
        let newcomer = "eeeeeeee-0000-4000-8000-000000000003";
        insert_allocated(&node, "newcomer", newcomer, "gpu-0", true);
        let claims = [
            ClaimRef::new("default", "live", live.to_string()),
            ClaimRef::new("default", "newcomer", newcomer.to_string()),
        ];
        prepare_all(&kubelet, &claims).await;
        let spec = std::fs::read_to_string(spec_path(&node, live)).unwrap();
        assert!(spec.contains(&format!("{live}-gpu-1")), "{label}: {spec}");
        let stored = checkpoint(&node).load().unwrap().unwrap();
        assert_eq!(
            stored.claims.keys().collect::<Vec<_>>(),
            vec![live, newcomer],
            "{label}"
        );
        let answer = kubelet.unprepare(&claims).await.unwrap();
        assert!(answer.values().all(Result::is_ok), "{label}: {answer:?}");
        assert!(
            node.cdi_files().is_empty(),
            "{label}: {:?}",
            node.cdi_files()
        );
        plugin.shutdown().await;
    }
}
