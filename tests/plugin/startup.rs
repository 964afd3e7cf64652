//! The start as the kubelet sees it: `/healthz` answers from the first part on and through a slow
//! recovery, `/readyz` only once the claims are recovered, the sockets serve and the slices are
//! published; the kubelet finds no socket while recovery runs; the MPS daemons of many claims are
//! restored side by side; and a part past its bound fails `/healthz`, naming it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use gpu_dra::plugin::{PartBounds, RunningPlugin, DEFAULT_PART_BOUNDS};
use gpu_dra::support::harness::{Harness, DRIVER};
use gpu_dra::support::kubelet::ClaimRef;
use serde_json::json;

use super::serving::http_get;

/// How long each new daemon Pod waits in ContainerCreating: long beside everything else a restart
/// does, so that restoring the daemons one after another would show.
const POD_START: Duration = Duration::from_secs(2);

/// A port nothing listens on now, for a plugin whose `/healthz` is read while it starts.
fn free_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address")
}

/// A node with `count` claims of one MPS-shared GPU each, prepared by a plugin that is then stopped
/// (their daemons keep running).
async fn node_with_mps_claims(count: usize) -> (Harness, Vec<ClaimRef>) {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let mps = json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": {}}});
    let mut claims = Vec::new();
    for i in 0..count {
        let devices = json!({
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": mps}}]
        });
        let claim = node
            .allocated_claim_with(&format!("mps-{i}"), devices)
            .await
            .expect("allocated");
        let answers = kubelet
            .prepare(std::slice::from_ref(&claim))
            .await
            .expect("kubelet call");
        assert!(
            matches!(answers.get(&claim.uid), Some(Ok(_))),
            "{answers:?}"
        );
        claims.push(claim);
    }
    drop(kubelet);
    plugin.shutdown().await;
    (node, claims)
}

/// Deletes the daemon Pods of `claims` (evicted while no plugin ran), so that the next start has to
/// start each again, and waits until the kubelet double has ended them.
async fn delete_daemons(node: &Harness, claims: &[ClaimRef]) {
    for claim in claims {
        node.api.remove(
            "pods",
            Some("gpu-dra"),
            &format!("gpu-dra-mps-{}", claim.uid),
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.api.list("pods").iter().any(|pod| {
        claims
            .iter()
            .any(|c| pod["metadata"]["name"] == format!("gpu-dra-mps-{}", c.uid))
    }) {
        assert!(Instant::now() < deadline, "daemon Pods still there");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn restarted(plugin: &RunningPlugin, claims: &[ClaimRef]) -> bool {
    let mut restarted = plugin.recovery.mps_daemons_restarted.clone();
    restarted.sort();
    let mut wanted: Vec<String> = claims.iter().map(|c| c.uid.clone()).collect();
    wanted.sort();
    restarted == wanted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_recovery_is_alive_not_ready_and_restores_daemons_side_by_side() {
    let claims_count = 4;
    let (mut node, claims) = node_with_mps_claims(claims_count).await;
    node.pods.set_start_delay(POD_START);

    // One daemon to start again: the time of one.
    delete_daemons(&node, &claims[..1]).await;
    let began = Instant::now();
    let plugin = node.start_plugin().await;
    let one = began.elapsed();
    assert!(restarted(&plugin, &claims[..1]), "{:?}", plugin.recovery);
    assert!(one >= POD_START, "{one:?}");
    plugin.shutdown().await;

    // All of them, with `/healthz` and `/readyz` read while the plugin starts.
    delete_daemons(&node, &claims).await;
    let addr = free_port();
    node.config.http_addr = Some(addr);
    let began = Instant::now();
    let starting = tokio::spawn(gpu_dra::plugin::start(
        node.config.clone(),
        node.api.client(),
    ));
    let mut seen_in_recovery = None;
    while !starting.is_finished() {
        if let Ok(health) =
            tokio::time::timeout(Duration::from_secs(1), try_get(addr, "/healthz")).await
        {
            let Some((code, body)) = health else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            if body.contains("starting: recovery") {
                assert_eq!(code, 200, "alive during recovery: {body}");
                let (ready, why) = http_get(addr, "/readyz").await;
                let sockets = (
                    node.config.dra_socket().exists(),
                    node.config.registration_socket().exists(),
                );
                seen_in_recovery.get_or_insert((body, ready, why, sockets));
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let plugin = starting.await.unwrap().expect("plugin starts");
    let all = began.elapsed();
    let (health, ready, why, sockets) =
        seen_in_recovery.expect("/healthz was read while recovery ran");
    assert!(
        health.starts_with("ok (starting: recovery for "),
        "{health}"
    );
    assert_eq!(ready, 503, "{why}");
    assert!(why.contains("prepared claims not recovered yet"), "{why}");
    assert_eq!(
        sockets,
        (false, false),
        "no socket for the kubelet to dial while recovery runs"
    );
    assert!(restarted(&plugin, &claims), "{:?}", plugin.recovery);
    eprintln!("start with {claims_count} daemons to start again: {all:?}; with one: {one:?}");
    // Side by side, not one after another: well under `claims_count` times one.
    assert!(
        all < one * 2,
        "{claims_count} daemons took {all:?}, one took {one:?}"
    );

    // Claims recovered and sockets served, but neither registered nor published yet.
    let (code, body) = http_get(addr, "/healthz").await;
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    let (code, body) = http_get(addr, "/readyz").await;
    if code == 503 {
        assert!(!body.contains("prepared claims"), "{body}");
        assert!(!body.contains("DRA gRPC server"), "{body}");
    }
    let _kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while http_get(addr, "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    plugin.shutdown().await;
    assert!(!node.config.dra_socket().exists());
    assert!(!node.config.registration_socket().exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_past_its_bound_fails_healthz_naming_it() {
    let mut node = Harness::new("l40s-4").await;
    // The GpuNodePolicy read waits for its start-up timeout on a slow API server, past the policy
    // part's bound.
    node.api.set_latency(Duration::from_secs(3));
    node.config.startup_api_timeout = Duration::from_millis(1500);
    node.config.start_bounds = Some(PartBounds {
        policy: Duration::from_millis(300),
        ..DEFAULT_PART_BOUNDS
    });
    let addr = free_port();
    node.config.http_addr = Some(addr);
    let starting = tokio::spawn(gpu_dra::plugin::start(
        node.config.clone(),
        node.api.client(),
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    let (code, body) = loop {
        if let Some((code, body)) = try_get(addr, "/healthz").await {
            if code != 200 {
                break (code, body);
            }
        }
        assert!(Instant::now() < deadline, "/healthz never failed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(code, 503, "{body}");
    assert!(
        body.starts_with("unhealthy: start-up part policy has run for ")
            && body.contains(", past its bound of 0.3s"),
        "{body}"
    );

    // Once the part is done the start goes on, and /healthz says alive again.
    node.api.set_latency(Duration::ZERO);
    let plugin = starting.await.unwrap().expect("plugin starts");
    let (code, body) = http_get(addr, "/healthz").await;
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    plugin.shutdown().await;
}

#[test]
fn the_start_up_bound_is_the_sum_of_the_parts() {
    let bounds = PartBounds::for_timeouts(
        gpu_dra::plugin::startup::DEFAULT_STARTUP_API_TIMEOUT,
        gpu_dra::claims::SHARING_TIMEOUT,
    );
    assert_eq!(bounds, DEFAULT_PART_BOUNDS);
    assert_eq!(bounds.total(), gpu_dra::plugin::STARTUP_BOUND);
    let recovery = gpu_dra::claims::recovery_bound(
        gpu_dra::plugin::startup::DEFAULT_STARTUP_API_TIMEOUT,
        gpu_dra::claims::SHARING_TIMEOUT,
    );
    assert!(bounds.recovery > recovery);
    assert!(
        recovery >= gpu_dra::claims::MPS_RESTORE_BOUND + gpu_dra::claims::SHARING_TIMEOUT * 2,
        "{recovery:?}"
    );
}

/// `GET path`, or `None` while nothing listens yet.
async fn try_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    tokio::net::TcpStream::connect(addr).await.ok()?;
    Some(http_get(addr, path).await)
}
