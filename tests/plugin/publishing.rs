//! Publishing ResourceSlices: nothing written when nothing changed, stale slices removed and other
//! drivers' left alone, wiped slices restored, API errors survived, each sync counted and the last
//! confirmation timed, profile edits republished, a large node split into slices, a re-created Node
//! followed, and an idle plugin that only watches.

use std::time::Duration;

use gpu_dra::support::apiserver::{FaultSpec, Verb};
use gpu_dra::support::harness::{Harness, DRIVER, NODE};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_nothing_changed_writes_nothing() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let first = node.wait_for_slices().await;
    plugin.shutdown().await;

    node.api.clear_requests();
    let plugin = node.start_plugin().await;
    settle_after_first_slice_list(&node).await;
    assert_eq!(
        node.api.writes("resourceslices"),
        0,
        "requests: {:?}",
        node.api.requests()
    );
    let second = node.wait_for_slices().await;
    assert_eq!(first[0].metadata.name, second[0].metadata.name);
    assert_eq!(
        first[0].metadata.resource_version,
        second[0].metadata.resource_version
    );
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_slices_are_removed_and_other_drivers_left_alone() {
    let node = Harness::new("l40s-4").await;
    let slice = |name: &str, driver: &str, pool: &str| {
        serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": NODE, "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-9"}]}
        })
    };
    node.api
        .insert("resourceslices", slice("old-pool", DRIVER, "renamed-node"));
    node.api
        .insert("resourceslices", slice("old-device", DRIVER, NODE));
    node.api.insert(
        "resourceslices",
        slice("someone-else", "other.example.com", NODE),
    );
    let plugin = node.start_plugin().await;
    let ours = node
        .wait_for_slices_where(|slices| {
            slices.len() == 1
                && slices[0]
                    .spec
                    .devices
                    .as_ref()
                    .is_some_and(|d| d.len() == 4)
        })
        .await;
    assert_eq!(ours[0].spec.pool.name, NODE);
    assert!(node.api.get("resourceslices", None, "old-pool").is_none());
    assert!(node
        .api
        .get("resourceslices", None, "someone-else")
        .is_some());
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_wiped_by_the_kubelet_come_back() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let before = node.wait_for_slices().await;
    let name = before[0].metadata.name.clone().unwrap();
    node.api
        .remove("resourceslices", None, &name)
        .expect("slice existed");
    let after = node
        .wait_for_slices_where(|slices| {
            slices.len() == 1 && slices[0].metadata.name.as_deref() != Some(&name)
        })
        .await;
    assert_eq!(after[0].spec.devices.as_ref().unwrap().len(), 4);
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_survives_api_errors_and_slowness() {
    let node = Harness::new("l40s-4").await;
    node.api.set_latency(Duration::from_millis(100));
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::Create),
        resource: Some("resourceslices".to_string()),
        code: 500,
        count: 2,
    });
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::List),
        resource: Some("resourceslices".to_string()),
        code: 503,
        count: 1,
    });
    let plugin = node.start_plugin().await;
    let slices = node.wait_for_slices().await;
    assert_eq!(slices.len(), 1);
    let metrics = plugin.metrics.encode();
    // A slice create is either the dry run that asks what the server keeps or a real create.
    let errors = |operation: &str| -> u64 {
        let prefix = format!("gpu_dra_api_errors_total{{operation=\"{operation}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
            .unwrap_or(0)
    };
    assert_eq!(errors("creating") + errors("dry_run_slice"), 2, "{metrics}");
    plugin.shutdown().await;
}

/// A sample of the plugin's metrics, by its full name with labels (0 when absent).
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_slice_sync_is_counted_and_a_matching_one_confirms_the_slices() {
    let confirmed = "gpu_dra_slices_confirmed_timestamp_seconds";
    let syncs = |outcome: &str| format!("gpu_dra_slice_syncs_total{{outcome=\"{outcome}\"}}");
    let node = Harness::new("l40s-4").await;
    let before = unix_now();
    let plugin = node.start_plugin().await;
    let published = node.wait_for_slices().await;
    until_quiet(&node, Duration::from_millis(1500)).await;
    let metrics = plugin.metrics.encode();
    assert_eq!(sample(&metrics, &syncs("written")), 1.0, "{metrics}");
    let first = sample(&metrics, confirmed);
    assert!(first >= before && first <= unix_now(), "{metrics}");

    // The kubelet wipes the slice; the first create fails, the retry restores it.
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::Create),
        resource: Some("resourceslices".to_string()),
        code: 500,
        count: 1,
    });
    let name = published[0].metadata.name.clone().unwrap();
    node.api.remove("resourceslices", None, &name).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let metrics = plugin.metrics.encode();
        if sample(&metrics, &syncs("written")) == 2.0 {
            break metrics;
        }
        assert!(tokio::time::Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(sample(&metrics, &syncs("error")), 1.0, "{metrics}");
    assert!(sample(&metrics, confirmed) > first, "{metrics}");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_fake_profile_is_republished() {
    let node = Harness::new("l40s-4").await;
    let path = node.dir.path().join("profile.yaml");
    let mut profile = gpu_dra::gpu::builtin_profile("l40s-4").unwrap();
    profile.gpus.truncate(2);
    std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
    let mut config = node.config.clone();
    config.backend = gpu_dra::plugin::BackendChoice::Fake {
        profile: path.display().to_string(),
        state_file: None,
    };
    let plugin = gpu_dra::plugin::start(config, node.api.client())
        .await
        .unwrap();
    node.wait_for_slices_where(|s| {
        s.len() == 1 && s[0].spec.devices.as_ref().is_some_and(|d| d.len() == 2)
    })
    .await;
    let extra = profile.gpus[0].clone();
    profile.gpus.push(gpu_dra::gpu::FakeGpuSpec {
        pci_bus_id: "0000:c1:00.0".into(),
        ..extra
    });
    std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
    let slices = node
        .wait_for_slices_where(|s| {
            s.len() == 1 && s[0].spec.devices.as_ref().is_some_and(|d| d.len() == 3)
        })
        .await;
    assert_eq!(
        slices[0].spec.pool.generation, 1,
        "one slice updated in place keeps the pool generation, as upstream does"
    );
    // A broken edit keeps what was published.
    std::fs::write(&path, "gpus: [").unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let slices = node.wait_for_slices().await;
    assert_eq!(slices[0].spec.devices.as_ref().unwrap().len(), 3);
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_node_is_split_into_slices_the_api_server_accepts() {
    let node = Harness::new("l40s-4").await;
    let mut config = node.config.clone();
    config.backend = gpu_dra::plugin::BackendChoice::Fake {
        profile: node.write_h100_profile(200).display().to_string(),
        state_file: None,
    };
    let plugin = gpu_dra::plugin::start(config.clone(), node.api.client())
        .await
        .unwrap();
    let slices = node.wait_for_slices_where(|s| s.len() == 2).await;
    let mut sizes: Vec<usize> = slices
        .iter()
        .map(|s| s.spec.devices.as_ref().unwrap().len())
        .collect();
    sizes.sort();
    assert_eq!(sizes, vec![72, 128], "at most 128 devices per slice");
    assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 2));
    assert!(slices
        .iter()
        .all(|s| s.spec.pool.generation == slices[0].spec.pool.generation));
    plugin.shutdown().await;

    // Restarting a multi-slice pool with nothing changed writes nothing either.
    node.api.clear_requests();
    let plugin = gpu_dra::plugin::start(config, node.api.client())
        .await
        .unwrap();
    settle_after_first_slice_list(&node).await;
    assert_eq!(node.api.writes("resourceslices"), 0);
    plugin.shutdown().await;
}

/// Waits until a (re)started publisher has listed the slices once, and a little longer, so that
/// whatever it decided to write has been written.
async fn settle_after_first_slice_list(node: &Harness) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !node
        .api
        .requests()
        .iter()
        .any(|r| r.verb == Verb::List && r.resource == "resourceslices")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the publisher never listed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_follow_a_node_that_was_re_created() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let before = node.wait_for_slices().await;
    let old_uid = before[0].metadata.owner_references.as_ref().unwrap()[0]
        .uid
        .clone();

    // The Node is deleted and registers again (new UID); the garbage collector removes its slices.
    node.api.remove("nodes", None, NODE).unwrap();
    node.api.insert(
        "nodes",
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}),
    );
    let new_uid = node.api.get("nodes", None, NODE).unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(old_uid, new_uid);
    node.api.remove_where("resourceslices", |_| true);
    let after = node
        .wait_for_slices_where(|s| {
            s.len() == 1 && s[0].metadata.owner_references.as_ref().unwrap()[0].uid == new_uid
        })
        .await;
    assert_eq!(after[0].spec.devices.as_ref().unwrap().len(), 4);
    plugin.shutdown().await;
}

/// Waits until the server has seen no request for `quiet`, so that what follows starts from rest.
async fn until_quiet(node: &Harness, quiet: Duration) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let before = node.api.requests().len();
        tokio::time::sleep(quiet).await;
        if node.api.requests().len() == before {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the plugin never came to rest: {:?}",
            node.api.requests()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_plugin_sends_nothing_but_its_watches_even_as_the_node_heartbeats() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    node.wait_for_slices().await;
    // Longer than the publisher's coalescing window: its follow-up sync comes 1 s after a write, and a
    // shorter quiet period could end just before it (seen on a loaded machine).
    until_quiet(&node, Duration::from_millis(1500)).await;
    node.api.clear_requests();
    // The kubelet updates its Node's status (conditions, heartbeats); the UID stays.
    for beat in 0..3 {
        let mut stored = node.api.get("nodes", None, NODE).unwrap();
        stored["status"]["conditions"] = serde_json::json!([{"type": "Ready", "status": "True",
            "reason": "KubeletReady", "message": format!("heartbeat {beat}")}]);
        node.api.insert("nodes", stored);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let requests = node.api.requests();
    assert!(
        requests.iter().all(|r| r.verb == Verb::Watch),
        "an idle plugin sent {:?}",
        requests
            .iter()
            .filter(|r| r.verb != Verb::Watch)
            .collect::<Vec<_>>()
    );
    plugin.shutdown().await;
}
