//! The plugin end to end against the doubles: registration, publishing, prepare/unprepare over gRPC,
//! CDI specs, sockets, metrics, and API-server faults.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::time::Duration;

use gpu_dra::support::apiserver::{FaultSpec, Verb};
use gpu_dra::support::cdi_runtime;
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::{
    ClaimRef, Dial, DraService, HealthApi, HealthStatus, KubeletDouble,
};

fn ok_devices(
    answer: &std::collections::HashMap<
        String,
        Result<Vec<gpu_dra::support::kubelet::PreparedDevice>, String>,
    >,
    claim: &ClaimRef,
) -> Vec<gpu_dra::support::kubelet::PreparedDevice> {
    match answer.get(&claim.uid) {
        Some(Ok(devices)) => devices.clone(),
        other => panic!("claim {} not prepared: {other:?}", claim.name),
    }
}

fn claim_error(
    answer: &std::collections::HashMap<
        String,
        Result<Vec<gpu_dra::support::kubelet::PreparedDevice>, String>,
    >,
    claim: &ClaimRef,
) -> String {
    match answer.get(&claim.uid) {
        Some(Err(error)) => error.clone(),
        other => panic!("claim {} should have failed: {other:?}", claim.name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_then_prepares_and_unprepares_a_claim() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    assert_eq!(kubelet.service(), DraService::V1);
    let info = kubelet.plugin_info();
    assert_eq!(
        info.supported_versions,
        vec![
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    assert_eq!(
        std::path::Path::new(&info.endpoint),
        node.config.dra_socket()
    );

    let slices = node.wait_for_slices().await;
    assert_eq!(slices.len(), 1);
    let slice = &slices[0];
    assert_eq!(slice.spec.node_name.as_deref(), Some(NODE));
    assert_eq!(slice.spec.pool.name, NODE);
    assert_eq!(slice.spec.pool.resource_slice_count, 1);
    let owner = &slice.metadata.owner_references.as_ref().unwrap()[0];
    let stored_node = node.api.get("nodes", None, NODE).unwrap();
    assert_eq!(owner.kind, "Node");
    assert_eq!(owner.uid, stored_node["metadata"]["uid"].as_str().unwrap());
    assert_eq!(slice.spec.devices.as_ref().unwrap().len(), 8);

    let claim = node.allocated_claim("two-gpus", 2).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let devices = ok_devices(&answer, &claim);
    assert_eq!(devices.len(), 2);
    for device in &devices {
        assert_eq!(device.request_names, vec!["gpus"]);
        assert_eq!(device.pool_name, NODE);
        assert_eq!(
            device.cdi_device_ids,
            vec![format!(
                "k8s.{DRIVER}/gpu={}-{}",
                claim.uid, device.device_name
            )]
        );
    }

    // The spec is where the runtime looks, valid for the reference CDI implementation, and tells the
    // container which GPUs it got.
    let spec_path = node
        .cdi_dir()
        .join(format!("k8s.{DRIVER}-gpu_{}.json", claim.uid));
    let spec = container_device_interface::spec::read_spec(&spec_path, 0)
        .expect("spec accepted by the CDI crate");
    drop(spec);
    let text = std::fs::read_to_string(&spec_path).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let first = &json["devices"][0]["containerEdits"];
    let env: Vec<&str> = first["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        env.iter()
            .any(|e| e.starts_with("GPU_DRA_DEVICE_GPU_") && e.contains("=GPU-")),
        "{text}"
    );
    let nodes = first["deviceNodes"].as_array().unwrap();
    assert!(
        nodes.iter().any(|n| n["path"]
            .as_str()
            .is_some_and(|p| p.starts_with("/dev/nvidia"))),
        "{text}"
    );
    // Fake GPUs' device files exist on no host, as a MIG device's on a real node: the spec names no
    // host file, and the runtime makes each node from the numbers the spec gives (/dev/null's).
    assert!(nodes.iter().all(|n| n.get("hostPath").is_none()), "{text}");
    let ids: Vec<String> = devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect();
    let container = cdi_runtime::inject(&[&node.cdi_dir()], &ids).unwrap_or_else(|e| panic!("{e}"));
    let null = std::fs::metadata("/dev/null").unwrap().rdev();
    for device in &devices {
        let minor = device.device_name.trim_start_matches("gpu-");
        for path in [
            format!("/dev/nvidia{minor}"),
            "/dev/nvidiactl".into(),
            "/dev/nvidia-uvm".into(),
            "/dev/nvidia-uvm-tools".into(),
        ] {
            let made = container
                .device(&path)
                .unwrap_or_else(|| panic!("{path} not in the container: {container:?}"));
            assert_eq!(made.device_type, "c");
            assert_eq!(
                (made.major, made.minor),
                (
                    nix::sys::stat::major(null) as i64,
                    nix::sys::stat::minor(null) as i64
                ),
                "{path}"
            );
        }
    }

    // Idempotent: the same answer again.
    let again = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(ok_devices(&again, &claim), devices);

    let unprepared = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(unprepared.get(&claim.uid), Some(&Ok(())));
    assert!(!spec_path.exists());
    // Unknown or already unprepared claims succeed.
    let unknown = ClaimRef::new(
        "default",
        "never-seen",
        "0b5e6a1c-2f3d-4e5f-8a9b-0c1d2e3f4a5b",
    );
    // A spec left behind for a claim the plugin no longer knows is removed by its unprepare.
    let leftover = node
        .cdi_dir()
        .join(format!("k8s.{DRIVER}-gpu_{}.json", unknown.uid));
    std::fs::write(&leftover, "{}").unwrap();
    let answer = kubelet
        .unprepare(&[claim.clone(), unknown.clone()])
        .await
        .unwrap();
    assert_eq!(answer.get(&claim.uid), Some(&Ok(())));
    assert_eq!(answer.get(&unknown.uid), Some(&Ok(())));
    assert!(!leftover.exists());
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_kubelet_uses_v1beta1() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let kubelet = KubeletDouble::register_with(
        &node.config.registry_dir,
        DRIVER,
        Duration::from_secs(10),
        &["v1beta1.DRAPlugin"],
    )
    .await
    .unwrap();
    assert_eq!(kubelet.service(), DraService::V1beta1);
    node.wait_for_slices().await;
    let claim = node.allocated_claim("beta", 1).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(ok_devices(&answer, &claim)[0].device_name, "gpu-0");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_are_private_replace_stale_ones_and_go_away_on_shutdown() {
    let node = Harness::new("l40s-4").await;
    // A stale socket from a previous instance that died without cleaning up.
    std::fs::create_dir_all(&node.config.registry_dir).unwrap();
    let stale = std::os::unix::net::UnixListener::bind(node.config.registration_socket()).unwrap();
    drop(stale);
    let plugin = node.start_plugin().await;
    for socket in [node.config.registration_socket(), node.config.dra_socket()] {
        let meta = std::fs::metadata(&socket).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(
            meta.permissions().mode() & 0o007,
            0,
            "{} is world-accessible",
            socket.display()
        );
    }
    node.kubelet().await;
    plugin.shutdown().await;
    assert!(!node.config.registration_socket().exists());
    assert!(!node.config.dra_socket().exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regular_file_in_place_of_the_socket_is_not_deleted() {
    let node = Harness::new("l40s-4").await;
    std::fs::create_dir_all(&node.config.registry_dir).unwrap();
    std::fs::write(node.config.registration_socket(), "not mine").unwrap();
    let error = gpu_dra::plugin::start(node.config.clone(), node.api.client())
        .await
        .err()
        .expect("start refuses");
    assert!(error.to_string().contains("not a socket"), "{error}");
    assert_eq!(
        std::fs::read_to_string(node.config.registration_socket()).unwrap(),
        "not mine"
    );
}

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
async fn health_readiness_and_metrics_are_served() {
    let mut node = Harness::new("dgx-h100").await;
    node.config.http_addr = Some(([127, 0, 0, 1], 0).into());
    let plugin = node.start_plugin().await;
    let addr = plugin.http_addr.unwrap();
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    let (code, body) = http_get(addr, "/readyz").await;
    assert_eq!(code, 503, "not registered yet: {body}");
    assert!(body.contains("not registered with the kubelet"), "{body}");

    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while http_get(addr, "/readyz").await.0 != 200 {
        assert!(tokio::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let claim = node.allocated_claim("metered", 1).await;
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    let (code, metrics) = http_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    for expected in [
        "gpu_dra_claims_prepared_total{outcome=\"ok\"} 1",
        "gpu_dra_claims_unprepared_total{outcome=\"ok\"} 1",
        "gpu_dra_prepare_duration_seconds_count 1",
        "gpu_dra_published_devices 8",
    ] {
        assert!(
            metrics.contains(expected),
            "missing {expected:?} in\n{metrics}"
        );
    }
    plugin.shutdown().await;
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).await.unwrap();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_dialling_by_raw_path_reaches_every_service() {
    // The double dials the registration socket as the kubelet does, by its raw path, so `:authority`
    // is the percent-encoded path; here the DRA socket is dialled the same way (older kubelets did).
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await.redial(Dial::RawPath);
    node.wait_for_slices().await;
    let claim = node.allocated_claim("raw-path", 1).await;
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(ok_devices(&answer, &claim).len(), 1);
    let mut health = kubelet
        .watch_health_with(HealthApi::V1alpha1)
        .await
        .unwrap();
    let devices = tokio::time::timeout(Duration::from_secs(10), health.next())
        .await
        .expect("a health report in time")
        .unwrap()
        .expect("the stream is open");
    assert_eq!(devices.len(), 4);
    let answer = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(answer.get(&claim.uid), Some(&Ok(())));
    assert!(node.cdi_files().is_empty());
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelets_health_loop_follows_a_plugin_restart() {
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let mut monitor = kubelet.monitor_health(HealthApi::V1alpha1, Duration::from_millis(300));
    let wait = Duration::from_secs(10);
    let all_healthy = |cache: &gpu_dra::support::kubelet::HealthCache| {
        cache.devices.len() == 4 && cache.devices.values().all(|h| *h == HealthStatus::Healthy)
    };
    monitor
        .wait_for(wait, all_healthy)
        .await
        .expect("four healthy GPUs");

    // The stream ends with the plugin, and the kubelet forgets what it was told.
    plugin.shutdown().await;
    monitor
        .wait_for(wait, |cache| cache.devices.is_empty())
        .await
        .expect("the cache is cleared when the stream ends");

    // It keeps trying, and the restarted plugin's stream fills the cache again.
    let plugin = node.start_plugin().await;
    let cache = monitor
        .wait_for(wait, |cache| {
            cache.streams_opened >= 2 && all_healthy(cache)
        })
        .await
        .expect("the stream is opened again");
    assert!(cache.streams_opened >= 2);
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
    until_quiet(&node, Duration::from_millis(500)).await;
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
