//! Prepare and unprepare as the kubelet calls them: per-claim errors for bad, hostile or conflicting
//! claims, API faults retried or reported, calls for one claim serialised while different claims run
//! in parallel, subrequest names and share IDs, and claim specs on a node without `nvidia-uvm`.

use std::time::Duration;

use gpu_dra::support::apiserver::{FaultSpec, Verb};
use gpu_dra::support::cdi_runtime;
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::ClaimRef;

use super::{claim_error, ok_devices};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_claim_gets_its_own_error_and_good_ones_still_prepare() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;

    let good = node.allocated_claim("good", 1).await;
    let missing = ClaimRef::new("default", "missing", "11111111-2222-4333-8444-555555555555");
    let unallocated_uid = node.create_claim("unallocated", 1).await;
    let unallocated = ClaimRef::new("default", "unallocated", unallocated_uid);
    let replaced = ClaimRef::new("default", "good", "99999999-2222-4333-8444-555555555555");
    let evil = ClaimRef::new("default", "evil", "../../../../etc/cron.d/x");
    let bad_namespace = ClaimRef::new("../etc", "x", "11111111-2222-4333-8444-000000000000");

    // A claim allocated a device this node does not publish, and one allocated in another node's pool.
    let ghost = node.allocated_claim("ghost", 1).await;
    patch_result(&node, "ghost", |r| r["device"] = "gpu-99".into());
    let elsewhere = node.allocated_claim("elsewhere", 1).await;
    patch_result(&node, "elsewhere", |r| r["pool"] = "node-b".into());

    let all = vec![
        good.clone(),
        missing.clone(),
        unallocated.clone(),
        replaced.clone(),
        evil.clone(),
        bad_namespace.clone(),
        ghost.clone(),
        elsewhere.clone(),
    ];
    let answer = kubelet.prepare(&all).await.unwrap();
    assert_eq!(answer.len(), all.len(), "every claim gets an entry");
    assert_eq!(ok_devices(&answer, &good).len(), 1);
    let expect = [
        (&missing, "default/missing", "not found"),
        (&unallocated, "default/unallocated", "not allocated"),
        (&replaced, "default/good", "was replaced"),
        (&evil, "evil", "not a lowercase UUID"),
        (&bad_namespace, "../etc", "not a valid DNS label"),
        (
            &ghost,
            "default/ghost",
            "device gpu-99 is not published by this node",
        ),
        (
            &elsewhere,
            "default/elsewhere",
            "no devices of driver gpu.dra.dev in pool node-a",
        ),
    ];
    for (claim, names, cause) in expect {
        let error = claim_error(&answer, claim);
        assert!(
            error.contains(names) && error.contains(cause),
            "{}: {error}",
            claim.name
        );
    }
    // Only the good claim left a spec, and nothing was written outside the CDI root.
    assert_eq!(
        node.cdi_files(),
        vec![format!("k8s.{DRIVER}-gpu_{}.json", good.uid)]
    );
    assert!(!node.dir.path().join("etc").exists());
    plugin.shutdown().await;
}

/// Rewrites the first allocation result of a claim, as a buggy or malicious scheduler might.
fn patch_result(node: &Harness, name: &str, change: impl Fn(&mut serde_json::Value)) {
    let mut claim = node
        .api
        .get("resourceclaims", Some("default"), name)
        .unwrap();
    change(&mut claim["status"]["allocation"]["devices"]["results"][0]);
    node.api.insert("resourceclaims", claim);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_prepared_for_one_claim_is_refused_to_another() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let first = node.allocated_claim("first", 1).await;
    let second = node.allocated_claim("second", 1).await;
    // A double allocation, which the scheduler should never make: the plugin is the last line of defence.
    patch_result(&node, "second", |r| r["device"] = "gpu-0".into());
    let answer = kubelet.prepare(std::slice::from_ref(&first)).await.unwrap();
    assert_eq!(ok_devices(&answer, &first)[0].device_name, "gpu-0");
    let answer = kubelet
        .prepare(std::slice::from_ref(&second))
        .await
        .unwrap();
    let error = claim_error(&answer, &second);
    assert!(
        error.contains("gpu-0 is already prepared for claim default/first"),
        "{error}"
    );
    // Once the first claim lets go, the second one can have it.
    kubelet.unprepare(&[first]).await.unwrap();
    let answer = kubelet
        .prepare(std::slice::from_ref(&second))
        .await
        .unwrap();
    assert_eq!(ok_devices(&answer, &second)[0].device_name, "gpu-0");

    // Admin access (say, a monitoring pod) shares the device with the claim that holds it.
    let monitor = node.allocated_claim("monitor", 1).await;
    patch_result(&node, "monitor", |r| {
        r["device"] = "gpu-0".into();
        r["adminAccess"] = true.into();
    });
    let answer = kubelet
        .prepare(std::slice::from_ref(&monitor))
        .await
        .unwrap();
    assert_eq!(ok_devices(&answer, &monitor)[0].device_name, "gpu-0");
    // ...and does not stop a normal claim from taking the device once its holder lets go.
    kubelet
        .unprepare(std::slice::from_ref(&second))
        .await
        .unwrap();
    let third = node.allocated_claim("third", 1).await;
    patch_result(&node, "third", |r| r["device"] = "gpu-0".into());
    let answer = kubelet.prepare(std::slice::from_ref(&third)).await.unwrap();
    assert_eq!(ok_devices(&answer, &third)[0].device_name, "gpu-0");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_faults_during_prepare_are_retried_or_reported_per_claim() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let claim = node.allocated_claim("flaky", 1).await;

    // One transient error is absorbed by the plugin's own retry.
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::Get),
        resource: Some("resourceclaims".to_string()),
        code: 500,
        count: 1,
    });
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    ok_devices(&answer, &claim);
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();

    // A longer outage becomes a per-claim error that names the claim; the kubelet retries later.
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::Get),
        resource: Some("resourceclaims".to_string()),
        code: 500,
        count: 10,
    });
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let error = claim_error(&answer, &claim);
    assert!(
        error.contains("default/flaky") && error.contains("reading it from the API server"),
        "{error}"
    );
    assert!(node.cdi_files().is_empty());
    node.api.clear_faults();

    // A slow API server only makes it slower.
    node.api.set_latency(Duration::from_millis(300));
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    ok_devices(&answer, &claim);
    let metrics = plugin.metrics.encode();
    assert!(
        metrics.contains("gpu_dra_claims_prepared_total{outcome=\"error\"} 1"),
        "{metrics}"
    );
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_for_one_claim_are_serialised_and_agree() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let claim = node.allocated_claim("shared", 2).await;
    let mut others = Vec::new();
    for i in 0..4 {
        others.push(node.allocated_claim_named(i).await);
    }

    let mut calls = Vec::new();
    for _ in 0..4 {
        let kubelet = kubelet.clone();
        let claim = claim.clone();
        calls.push(tokio::spawn(async move { kubelet.prepare(&[claim]).await }));
    }
    for other in &others {
        let kubelet = kubelet.clone();
        let other = other.clone();
        calls.push(tokio::spawn(async move { kubelet.prepare(&[other]).await }));
    }
    let mut seen_for_claim = Vec::new();
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        if let Some(Ok(devices)) = answer.get(&claim.uid) {
            seen_for_claim.push(devices.clone());
        }
        assert!(answer.values().all(Result::is_ok), "{answer:?}");
    }
    assert_eq!(seen_for_claim.len(), 4);
    assert!(seen_for_claim.windows(2).all(|w| w[0] == w[1]));
    let prepared = plugin.preparer.prepared_claims();
    assert_eq!(prepared.len(), 5);
    let mut devices: Vec<_> = prepared
        .values()
        .flat_map(|r| r.devices.iter().map(|d| d.device.clone()))
        .collect();
    devices.sort();
    devices.dedup();
    assert_eq!(devices.len(), 6, "no device prepared twice");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_claim_references_get_errors_and_the_plugin_keeps_serving() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let uid = "0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5b";
    let hostile = [
        ("", "", ""),
        ("default", "x", "0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5b\0"),
        ("default", "x", "/0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5"),
        ("default", "../../../x", uid),
        ("default", "x/../../y", uid),
        ("default\n", "x", uid),
        ("défault", "x", uid),
        ("default", &"a".repeat(10_000), uid),
        (&"n".repeat(100_000), "x", uid),
    ];
    let claims: Vec<ClaimRef> = hostile
        .iter()
        .enumerate()
        .map(|(i, (namespace, name, uid))| {
            // Distinct UIDs where the UID itself is not the hostile part, so each gets its own entry.
            let uid = if *uid == "0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5b" {
                format!("0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a{i:02}")
            } else {
                uid.to_string()
            };
            ClaimRef::new(*namespace, *name, uid)
        })
        .collect();
    let answer = kubelet.prepare(&claims).await.unwrap();
    assert_eq!(answer.len(), claims.len());
    for claim in &claims {
        let error = claim_error(&answer, claim);
        assert!(
            error.len() < 1_000,
            "errors stay short: {} bytes",
            error.len()
        );
    }
    let answer = kubelet.unprepare(&claims).await.unwrap();
    assert!(answer.values().all(|r| r.is_err()), "{answer:?}");
    assert!(node.cdi_files().is_empty());
    // Still alive and serving.
    let claim = node.allocated_claim("after", 1).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    ok_devices(&answer, &claim);
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subrequests_answer_with_the_request_name_and_share_ids_pass_through() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let claim = node.allocated_claim("first-available", 1).await;
    let share_id = "7f3e2a10-1b2c-4d5e-8f90-a1b2c3d4e5f6";
    patch_result(&node, "first-available", |r| {
        r["request"] = "gpus/large".into();
        r["shareID"] = share_id.into();
    });
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let device = &ok_devices(&answer, &claim)[0];
    // Containers name the request, never the subrequest, so that is what the kubelet must get.
    assert_eq!(device.request_names, vec!["gpus"]);
    assert_eq!(device.share_id.as_deref(), Some(share_id));
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_claims_run_in_parallel_and_one_claims_calls_one_at_a_time() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let mut claims = Vec::new();
    for i in 0..4 {
        claims.push(node.allocated_claim_named(i).await);
    }
    let shared = node.allocated_claim("shared", 1).await;

    // Every API request now takes 500 ms. Four claims one after the other would need 2 s.
    node.api.set_latency(Duration::from_millis(500));
    node.api.clear_requests();
    let started = tokio::time::Instant::now();
    let answer = kubelet.prepare(&claims).await.unwrap();
    assert!(answer.values().all(Result::is_ok), "{answer:?}");
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_millis(1500),
        "claims were prepared one by one: {elapsed:?}"
    );

    // Three calls for one claim at once: the first reads the claim, the others wait for it and get
    // its answer from the checkpoint, so the API server sees exactly one read.
    let calls: Vec<_> = (0..3)
        .map(|_| {
            let kubelet = kubelet.clone();
            let shared = shared.clone();
            tokio::spawn(async move { kubelet.prepare(&[shared]).await })
        })
        .collect();
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        assert!(answer.values().all(Result::is_ok), "{answer:?}");
    }
    let reads = node
        .api
        .requests()
        .iter()
        .filter(|r| r.verb == Verb::Get && r.name.as_deref() == Some("shared"))
        .count();
    assert_eq!(reads, 1);
    plugin.shutdown().await;
}

/// A node whose `nvidia-uvm` module is not loaded (the fake's `/proc/devices` without its line): the
/// plugin says so once as a Warning Event on the Node, and claim specs still list `/dev/nvidia-uvm`,
/// without numbers, so a container starts only where the host has the file and otherwise fails
/// naming it, rather than starting and failing in CUDA. Loading the module fixes later claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_uvm_module_the_node_is_warned_and_containers_fail_naming_the_file() {
    let node = Harness::new("l40s-4").await;
    let proc = node.dir.path().join("fake-gpu-state.proc");
    std::fs::create_dir_all(&proc).unwrap();
    let loaded =
        "Character devices:\n  1 mem\n195 nvidia-frontend\n237 nvidia-caps\n510 nvidia-uvm\n";
    std::fs::write(proc.join("devices"), loaded.replace("510 nvidia-uvm\n", "")).unwrap();
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;

    let mut warned = Vec::new();
    for _ in 0..100 {
        warned = node
            .api
            .list("events")
            .into_iter()
            .filter(|e| e["regarding"]["name"] == NODE && e["reason"] == "NvidiaUvmNotLoaded")
            .collect();
        if !warned.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0]["type"], "Warning");
    let note = warned[0]["note"].as_str().unwrap();
    assert!(
        note.contains("nvidia-uvm kernel module is not loaded"),
        "{note}"
    );

    let claim = node.allocated_claim("no-uvm", 1).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let ids = ok_devices(&answer, &claim)[0].cdi_device_ids.clone();
    let error = cdi_runtime::inject(&[&node.cdi_dir()], &ids)
        .unwrap_err()
        .to_string();
    assert!(
        error.starts_with("failed to stat CDI host device \"/dev/nvidia-uvm\""),
        "{error}"
    );

    // The module loaded: the next rescan gives later claims its numbers.
    std::fs::write(proc.join("devices"), loaded).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let claim = node.allocated_claim("with-uvm", 1).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let ids = ok_devices(&answer, &claim)[0].cdi_device_ids.clone();
    let container = cdi_runtime::inject(&[&node.cdi_dir()], &ids).unwrap_or_else(|e| panic!("{e}"));
    assert!(container.device("/dev/nvidia-uvm").is_some());
}
