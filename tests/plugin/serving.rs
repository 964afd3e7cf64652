//! What the plugin serves and how the kubelet reaches it: private sockets that replace stale ones and
//! go away on shutdown, v1beta1 for an older kubelet, dialling by raw path, the health stream across a
//! restart, and the HTTP health, readiness and metrics endpoints.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Duration;

use gpu_dra::support::harness::{Harness, DRIVER};
use gpu_dra::support::kubelet::{Dial, DraService, HealthApi, HealthStatus, KubeletDouble};

use super::ok_devices;

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

pub(super) async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
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
