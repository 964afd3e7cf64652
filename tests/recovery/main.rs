//! Crash safety: whatever point the plugin dies at, a restart converges. Started claims are rolled
//! back, completed ones kept, and no CDI spec is left that no claim owns.
//! Here a crash of the plugin alone; `reboot` covers a restart after a reboot or power cut.

mod reboot;

use std::process::{Child, Stdio};
use std::time::Duration;

use gpu_dra::claims::checkpoint::{
    CheckpointData, CheckpointFile, ClaimRecord, ClaimState, PreparedDevice,
};
use gpu_dra::claims::Phase;
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};

fn checkpoint(node: &Harness) -> CheckpointFile {
    CheckpointFile::new(node.config.plugin_dir().join("checkpoint.json"))
}

fn record(name: &str, state: ClaimState, device: &str, uid: &str) -> ClaimRecord {
    ClaimRecord {
        namespace: "default".into(),
        name: name.into(),
        state,
        phase: match state {
            ClaimState::Completed => Phase::Completed,
            _ => Phase::Reserved,
        },
        devices: vec![PreparedDevice {
            request_names: vec!["gpus".into()],
            pool: NODE.into(),
            device: device.into(),
            cdi_device_ids: vec![format!("k8s.{DRIVER}/gpu={uid}-{device}")],
            share_id: None,
            admin_access: false,
            mig: None,
            sharing: Default::default(),
            imex_channels: None,
        }],
        mps: None,
        domain: None,
        vfio: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_rolls_back_started_claims_keeps_completed_ones_and_removes_orphans() {
    let node = Harness::new("l40s-4").await;
    let started = "aaaaaaaa-0000-4000-8000-000000000001";
    let completed = "aaaaaaaa-0000-4000-8000-000000000002";
    let orphan = "aaaaaaaa-0000-4000-8000-000000000003";
    // The plugin crashed in this boot: its records need no word from the API server.
    let mut data = CheckpointData {
        boot_id: gpu_dra::claims::checkpoint::current_boot_id(),
        ..Default::default()
    };
    data.claims.insert(
        started.into(),
        record("half-done", ClaimState::Started, "gpu-0", started),
    );
    data.claims.insert(
        completed.into(),
        record("done", ClaimState::Completed, "gpu-1", completed),
    );
    std::fs::create_dir_all(node.config.plugin_dir()).unwrap();
    checkpoint(&node).store(&data).unwrap();
    std::fs::create_dir_all(node.cdi_dir()).unwrap();
    for uid in [started, orphan] {
        std::fs::write(
            node.cdi_dir().join(format!("k8s.{DRIVER}-gpu_{uid}.json")),
            "{}",
        )
        .unwrap();
    }
    // A file of another vendor is not ours to clean up.
    std::fs::write(node.cdi_dir().join("nvidia.com-gpu.json"), "{}").unwrap();
    // A spec of a kept claim left empty (by an earlier release's crash, or by hand).
    let truncated = "aaaaaaaa-0000-4000-8000-000000000004";
    let record_cut = record("cut-short", ClaimState::Completed, "gpu-2", truncated);
    data.claims.insert(truncated.into(), record_cut);
    checkpoint(&node).store(&data).unwrap();
    let truncated_spec = node
        .cdi_dir()
        .join(format!("k8s.{DRIVER}-gpu_{truncated}.json"));
    std::fs::write(&truncated_spec, "").unwrap();

    let plugin = node.start_plugin().await;
    assert_eq!(plugin.recovery.rolled_back, vec![started.to_string()]);
    assert_eq!(
        plugin.recovery.kept,
        vec![completed.to_string(), truncated.to_string()]
    );
    assert_eq!(
        plugin.recovery.orphan_specs_removed,
        vec![orphan.to_string()]
    );
    assert!(!plugin.recovery.rebooted);
    assert!(plugin.recovery.dropped_after_reboot.is_empty());
    // The completed claim's spec is missing and is written again.
    assert_eq!(
        node.cdi_files(),
        vec![
            format!("k8s.{DRIVER}-gpu_{completed}.json"),
            format!("k8s.{DRIVER}-gpu_{truncated}.json"),
            "nvidia.com-gpu.json".to_string()
        ]
    );
    let rewritten = std::fs::read_to_string(&truncated_spec).unwrap();
    assert!(
        rewritten.contains(&format!("{truncated}-gpu-2")),
        "{rewritten}"
    );
    let stored = checkpoint(&node).load().unwrap().unwrap();
    assert_eq!(
        stored.claims.keys().collect::<Vec<_>>(),
        vec![completed, truncated]
    );

    // gpu-0 is free again; gpu-1 is still held by the completed claim.
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let claim = node.allocated_claim("next", 1).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert!(answer[&claim.uid].is_ok(), "{answer:?}");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_is_kept_aside_and_the_plugin_starts_clean() {
    let node = Harness::new("l40s-4").await;
    std::fs::create_dir_all(node.config.plugin_dir()).unwrap();
    std::fs::write(
        node.config.plugin_dir().join("checkpoint.json"),
        "{\"version\":1,\"checks",
    )
    .unwrap();
    let plugin = node.start_plugin().await;
    let aside = plugin
        .recovery
        .checkpoint_set_aside
        .clone()
        .expect("set aside");
    let moved = aside.moved_to.expect("moved");
    assert!(moved
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("checkpoint.json.corrupt-"));
    assert!(moved.exists());
    assert!(checkpoint(&node).load().unwrap().unwrap().claims.is_empty());
    plugin.shutdown().await;
}

fn spawn_plugin(node: &Harness, profile: &std::path::Path, kubeconfig: &std::path::Path) -> Child {
    node.plugin_command(
        std::path::Path::new(env!("CARGO_BIN_EXE_gpu-dra")),
        profile,
        kubeconfig,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::inherit())
    .spawn()
    .expect("plugin binary starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_a_burst_of_prepares_then_restart_converges() {
    const CLAIMS: usize = 24;
    let node = Harness::new("dgx-h100").await;
    let profile = node.write_h100_profile(CLAIMS);
    let kubeconfig = node.dir.path().join("kubeconfig");
    node.api.write_kubeconfig(&kubeconfig).unwrap();

    // Each round kills the plugin once this many claims have completed, while the rest are in flight.
    for (round, kill_after) in [1usize, 8, 16].into_iter().enumerate() {
        let mut child = spawn_plugin(&node, &profile, &kubeconfig);
        let kubelet =
            KubeletDouble::register(&node.config.registry_dir, DRIVER, Duration::from_secs(20))
                .await
                .unwrap();
        node.wait_for_slices_where(|s| {
            s.iter()
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                .sum::<usize>()
                == CLAIMS
        })
        .await;
        let mut claims = Vec::new();
        for i in 0..CLAIMS {
            claims.push(node.allocated_claim(&format!("r{round}-c{i}"), 1).await);
        }

        // 8 callers, 3 claims each, while the plugin gets killed.
        let burst: Vec<_> = claims
            .chunks(3)
            .map(|chunk| {
                let kubelet = kubelet.clone();
                let chunk = chunk.to_vec();
                tokio::spawn(async move {
                    for claim in chunk {
                        let _ = kubelet.prepare(&[claim]).await;
                    }
                })
            })
            .collect();
        wait_for_completed(&node, kill_after).await;
        child.kill().expect("SIGKILL");
        child.wait().unwrap();
        for call in burst {
            let _ = call.await;
        }

        // Restart: the state on disk must converge.
        let mut child = spawn_plugin(&node, &profile, &kubeconfig);
        let kubelet =
            KubeletDouble::register(&node.config.registry_dir, DRIVER, Duration::from_secs(20))
                .await
                .unwrap();
        let stored = wait_for_recovery(&node).await;
        eprintln!(
            "round {round}: killed after {kill_after} completions; {} of {CLAIMS} claims had completed",
            stored.claims.len()
        );
        assert!(
            stored
                .claims
                .values()
                .all(|r| r.state == ClaimState::Completed),
            "round {round}: {stored:?}"
        );
        let expected_files: Vec<String> = stored
            .claims
            .keys()
            .map(|uid| format!("k8s.{DRIVER}-gpu_{uid}.json"))
            .collect();
        assert_eq!(
            node.cdi_files(),
            expected_files,
            "round {round}: every spec belongs to a completed claim"
        );

        // The kubelet retries everything: all claims prepare, then all unprepare, leaving nothing behind.
        let answer = kubelet.prepare(&claims).await.unwrap();
        assert!(
            answer.values().all(Result::is_ok),
            "round {round}: {answer:?}"
        );
        assert_eq!(node.cdi_files().len(), CLAIMS);
        let answer = kubelet.unprepare(&claims).await.unwrap();
        assert!(
            answer.values().all(Result::is_ok),
            "round {round}: {answer:?}"
        );
        assert!(node.cdi_files().is_empty());
        release_allocations(&node, &claims);

        // SIGTERM this time: a clean stop removes the sockets.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        assert!(child.wait().unwrap().success());
        assert!(!node.config.registration_socket().exists());
        assert!(!node.config.dra_socket().exists());
    }
}

/// Returns once the checkpoint records at least `count` completed claims.
async fn wait_for_completed(node: &Harness, count: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(data)) = checkpoint(node).load() {
            if data
                .claims
                .values()
                .filter(|r| r.state == ClaimState::Completed)
                .count()
                >= count
            {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{count} claims never completed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The checkpoint once the restarted plugin has rewritten it (its boot id is this boot's).
async fn wait_for_recovery(node: &Harness) -> CheckpointData {
    let boot_id = gpu_dra::claims::checkpoint::current_boot_id();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        // The plugin answers the kubelet only after recovery, so registration already implies it;
        // the loop covers a checkpoint that was never written before the kill.
        if let Ok(Some(data)) = checkpoint(node).load() {
            if data.boot_id == boot_id {
                return data;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no recovered checkpoint"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Deletes the claims so that the next round can allocate the same GPUs.
fn release_allocations(node: &Harness, claims: &[ClaimRef]) {
    for claim in claims {
        node.api
            .remove("resourceclaims", Some("default"), &claim.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_cannot_be_written_fails_the_claim_and_leaves_no_spec() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let claim = node.allocated_claim("unlucky", 1).await;

    // A directory where the checkpoint file should be makes every write fail (even for root).
    let path = node.config.plugin_dir().join("checkpoint.json");
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let error = answer[&claim.uid].clone().unwrap_err();
    assert!(
        error.contains("default/unlucky") && error.contains("checkpoint"),
        "{error}"
    );
    assert!(
        node.cdi_files().is_empty(),
        "a failed prepare leaves no spec behind"
    );
    assert!(plugin.preparer.prepared_claims().is_empty());

    // Once the disk is writable again, the kubelet's retry succeeds and is recorded.
    std::fs::remove_dir(&path).unwrap();
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert!(answer[&claim.uid].is_ok(), "{answer:?}");
    let stored = checkpoint(&node).load().unwrap().unwrap();
    assert_eq!(stored.claims[&claim.uid].state, ClaimState::Completed);
    plugin.shutdown().await;
}
