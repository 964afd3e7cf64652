//! The resource-health service as the kubelet double sees it over real Unix sockets: the complete list at once,
//! updates on change, periodic resends that beat the health timeout, truncated messages, the end of the stream
//! at plugin shutdown, both API versions, and no task left behind by a client that goes away.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpu_dra::kubelet::{DeviceHealthReport, HealthService};
use gpu_dra::proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use gpu_dra::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use gpu_dra::proto::{
    health_v1, health_v1alpha1, DRA_PLUGIN_TYPE, DRA_V1_SERVICE, HEALTH_V1ALPHA1_SERVICE,
    HEALTH_V1_SERVICE,
};
use gpu_dra::support::kubelet::{
    DeviceHealth, HealthApi, HealthStatus, HealthWatch, KubeletDouble, KubeletError,
};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

const DRIVER: &str = "gpu.example.com";
/// Long enough for any resend or update on a loaded 2-core machine; the checks that matter use shorter bounds.
const WAIT: Duration = Duration::from_secs(5);

struct StaticRegistration {
    info: PluginInfo,
}

#[tonic::async_trait]
impl Registration for StaticRegistration {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        _: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// A plugin that serves registration and both health APIs; the test drives its reports through `reports`.
struct Plugin {
    _dir: tempfile::TempDir,
    reports: Option<watch::Sender<Arc<Vec<DeviceHealthReport>>>>,
    servers: Vec<JoinHandle<()>>,
    kubelet: KubeletDouble,
}

impl Drop for Plugin {
    fn drop(&mut self) {
        for server in &self.servers {
            server.abort();
        }
    }
}

impl Plugin {
    async fn start(
        advertised: &[&str],
        timeout: Duration,
        devices: Vec<DeviceHealthReport>,
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let registry = dir.path().join("plugins_registry");
        std::fs::create_dir(&registry).expect("registry dir");
        let dra_socket = dir.path().join("dra.sock");

        let (reports, rx) = watch::channel(Arc::new(devices));
        let health = HealthService::new(rx, timeout);
        let dra = UnixListenerStream::new(UnixListener::bind(&dra_socket).expect("bind dra.sock"));
        let dra_server = tokio::spawn(async move {
            let served = Server::builder()
                .add_service(
                    health_v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(
                        health.clone(),
                    ),
                )
                .add_service(
                    health_v1::dra_resource_health_server::DraResourceHealthServer::new(health),
                )
                .serve_with_incoming(dra)
                .await;
            if let Err(error) = served {
                eprintln!("DRA server failed: {error}");
            }
        });

        let info = PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_string(),
            name: DRIVER.to_string(),
            endpoint: dra_socket.display().to_string(),
            supported_versions: advertised.iter().map(|s| s.to_string()).collect(),
        };
        let reg =
            UnixListener::bind(registry.join(format!("{DRIVER}-reg.sock"))).expect("bind reg");
        let reg_server = tokio::spawn(async move {
            let served = Server::builder()
                .add_service(RegistrationServer::new(StaticRegistration { info }))
                .serve_with_incoming(gpu_dra::kubelet::lenient_incoming(reg))
                .await;
            if let Err(error) = served {
                eprintln!("registration server failed: {error}");
            }
        });

        let kubelet = KubeletDouble::register(&registry, DRIVER, WAIT)
            .await
            .expect("registration");
        Plugin {
            _dir: dir,
            reports: Some(reports),
            servers: vec![dra_server, reg_server],
            kubelet,
        }
    }

    fn report(&self, devices: Vec<DeviceHealthReport>) {
        self.reports
            .as_ref()
            .expect("reports still open")
            .send_replace(Arc::new(devices));
    }
}

fn report(device: &str, healthy: bool, message: &str) -> DeviceHealthReport {
    DeviceHealthReport {
        pool: "node-a".to_string(),
        device: device.to_string(),
        healthy,
        message: message.to_string(),
    }
}

fn two_healthy_gpus() -> Vec<DeviceHealthReport> {
    vec![report("gpu-0", true, ""), report("gpu-1", true, "")]
}

async fn next(watch: &mut HealthWatch) -> Vec<DeviceHealth> {
    tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("a response in time")
        .expect("a valid response")
        .expect("the stream is still open")
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
}

fn by_device<'a>(devices: &'a [DeviceHealth], name: &str) -> &'a DeviceHealth {
    devices
        .iter()
        .find(|d| d.device == name)
        .unwrap_or_else(|| panic!("device {name} missing from {devices:?}"))
}

const BOTH: [&str; 3] = [DRA_V1_SERVICE, HEALTH_V1_SERVICE, HEALTH_V1ALPHA1_SERVICE];

#[tokio::test]
async fn sends_the_complete_list_on_connect() {
    let plugin = Plugin::start(&BOTH, Duration::from_secs(30), two_healthy_gpus()).await;
    let mut watch = plugin.kubelet.watch_health().await.expect("watch");
    assert_eq!(
        watch.api(),
        HealthApi::V1,
        "1.37 prefers v1 when advertised"
    );

    let before = unix_now();
    let devices = next(&mut watch).await;
    assert_eq!(devices.len(), 2);
    for name in ["gpu-0", "gpu-1"] {
        let d = by_device(&devices, name);
        assert_eq!(d.pool, "node-a");
        assert_eq!(d.health, HealthStatus::Healthy);
        assert_eq!(d.message, "");
        assert_eq!(d.timeout_seconds, 30);
        assert!((before - 1..=unix_now()).contains(&d.last_updated));
    }

    // With a 30 s timeout and no change, the next resend is ~10 s away.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), watch.next())
            .await
            .is_err(),
        "nothing changed, so nothing should arrive this early"
    );
}

#[tokio::test]
async fn sends_the_whole_list_again_when_a_device_turns_unhealthy() {
    let plugin = Plugin::start(&BOTH, Duration::from_secs(30), two_healthy_gpus()).await;
    let mut watch = plugin.kubelet.watch_health().await.expect("watch");
    next(&mut watch).await;

    plugin.report(vec![
        report("gpu-0", true, "stale text that must not be sent"),
        report("gpu-1", false, "XID 79: GPU has fallen off the bus"),
    ]);
    let devices = tokio::time::timeout(Duration::from_secs(2), watch.next())
        .await
        .expect("an update well before the 10 s resend")
        .expect("valid")
        .expect("open");
    assert_eq!(devices.len(), 2, "every response is the complete list");
    let gpu0 = by_device(&devices, "gpu-0");
    assert_eq!(gpu0.health, HealthStatus::Healthy);
    assert_eq!(gpu0.message, "", "healthy devices carry no message");
    let gpu1 = by_device(&devices, "gpu-1");
    assert_eq!(gpu1.health, HealthStatus::Unhealthy);
    assert_eq!(gpu1.message, "XID 79: GPU has fallen off the bus");
}

#[tokio::test]
async fn resends_without_changes_at_a_third_of_the_timeout() {
    let plugin = Plugin::start(&BOTH, Duration::from_millis(300), two_healthy_gpus()).await;
    let mut watch = plugin.kubelet.watch_health().await.expect("watch");
    let first = next(&mut watch).await;
    assert_eq!(
        first[0].timeout_seconds, 1,
        "300 ms rounds up to 1 s, not 0 (= kubelet default)"
    );

    // Five resends must come in about 5 × 100 ms; well under the 300 ms timeout each, even on a busy machine.
    let started = tokio::time::Instant::now();
    for _ in 0..5 {
        let gap = tokio::time::Instant::now();
        let devices = tokio::time::timeout(Duration::from_millis(300), watch.next())
            .await
            .expect("a resend before the device times out")
            .expect("valid")
            .expect("open");
        assert_eq!(devices.len(), 2);
        assert!(gap.elapsed() < Duration::from_millis(300));
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(400),
        "resends are paced, not a busy loop: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_millis(1000),
        "resends too slow: {elapsed:?}"
    );
}

#[tokio::test]
async fn long_messages_are_cut_to_the_kubelet_limit() {
    let long = "NVML: ".to_string() + &"€rror ".repeat(1000);
    let plugin = Plugin::start(
        &BOTH,
        Duration::from_secs(30),
        vec![report("gpu-0", false, &long)],
    )
    .await;
    // The double itself rejects messages over 1024 characters, so receiving it at all is part of the check.
    let mut watch = plugin.kubelet.watch_health().await.expect("watch");
    let devices = next(&mut watch).await;
    let message = &devices[0].message;
    assert!(message.chars().count() <= 1024);
    assert!(message.len() <= 1024, "also within 1024 bytes");
    assert!(message.starts_with("NVML: €rror €rror"));
    assert!(message.ends_with("..."));
    assert!(long.starts_with(message.trim_end_matches("...")));
}

#[tokio::test]
async fn the_stream_ends_when_the_plugin_stops_reporting() {
    let mut plugin = Plugin::start(&BOTH, Duration::from_secs(30), two_healthy_gpus()).await;
    let mut watch = plugin.kubelet.watch_health().await.expect("watch");
    next(&mut watch).await;

    drop(plugin.reports.take());
    let end = tokio::time::timeout(Duration::from_secs(2), watch.next())
        .await
        .expect("the end well before the 10 s resend")
        .expect("a clean end, not an error");
    assert_eq!(end, None);

    // A stream opened after shutdown is refused rather than left silent.
    let mut late = plugin.kubelet.watch_health().await;
    if let Ok(watch) = late.as_mut() {
        // tonic may report the handler's status on the first message instead of on the call.
        let error = watch.next().await.expect_err("refused");
        assert!(
            matches!(error, KubeletError::HealthStream(s) if s.code() == tonic::Code::Unavailable)
        );
    } else {
        assert!(
            matches!(late, Err(KubeletError::HealthStream(s)) if s.code() == tonic::Code::Unavailable)
        );
    }
}

#[tokio::test]
async fn v1alpha1_is_used_when_only_it_is_advertised_and_by_older_kubelets() {
    let plugin = Plugin::start(
        &[DRA_V1_SERVICE, HEALTH_V1ALPHA1_SERVICE],
        Duration::from_secs(30),
        two_healthy_gpus(),
    )
    .await;
    let mut watch = plugin.kubelet.watch_health().await.expect("watch");
    assert_eq!(watch.api(), HealthApi::V1alpha1);
    plugin.report(vec![
        report("gpu-0", false, "ECC"),
        report("gpu-1", true, ""),
    ]);
    // The first response may already hold the update; wait for the one that does.
    let mut devices = next(&mut watch).await;
    if by_device(&devices, "gpu-0").health == HealthStatus::Healthy {
        devices = next(&mut watch).await;
    }
    assert_eq!(by_device(&devices, "gpu-0").health, HealthStatus::Unhealthy);
    assert_eq!(by_device(&devices, "gpu-0").message, "ECC");

    // A 1.34 – 1.36 kubelet opens v1alpha1 even on a plugin that advertises both.
    let both = Plugin::start(&BOTH, Duration::from_secs(30), two_healthy_gpus()).await;
    let mut old = both
        .kubelet
        .watch_health_with(HealthApi::V1alpha1)
        .await
        .expect("v1alpha1 watch");
    assert_eq!(next(&mut old).await.len(), 2);
}

#[tokio::test]
async fn a_1_37_kubelet_opens_no_stream_without_an_advertised_health_service() {
    let plugin = Plugin::start(
        &[DRA_V1_SERVICE],
        Duration::from_secs(30),
        two_healthy_gpus(),
    )
    .await;
    let error = plugin
        .kubelet
        .watch_health()
        .await
        .err()
        .expect("no stream");
    assert!(matches!(error, KubeletError::NoHealthService(_)), "{error}");
}

#[tokio::test]
async fn the_double_rejects_entries_the_kubelet_cannot_use() {
    let plugin = Plugin::start(&BOTH, Duration::from_secs(30), vec![report("", true, "")]).await;
    let mut watch = plugin.kubelet.watch_health().await.expect("watch");
    let error = tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("in time")
        .expect_err("an empty device name is rejected");
    assert!(matches!(error, KubeletError::BadHealth { .. }), "{error}");
}

#[tokio::test]
async fn a_client_that_goes_away_leaves_no_task_behind() {
    // A 30 s timeout: the task must notice the client leaving, not a failed resend 10 s later.
    let plugin = Plugin::start(&BOTH, Duration::from_secs(30), two_healthy_gpus()).await;
    let sender = plugin.reports.as_ref().expect("open");
    let idle = sender.receiver_count();

    let mut watch = plugin.kubelet.watch_health().await.expect("watch");
    next(&mut watch).await;
    assert_eq!(
        sender.receiver_count(),
        idle + 1,
        "the stream's task holds a receiver"
    );

    drop(watch);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while sender.receiver_count() > idle {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stream task outlived its client"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
