//! Fault to taint and back: an in-process plugin on the fake backend (8x H100, static MIG) against the
//! API server double and the kubelet double's health stream. Each round injects an XID 79 on one GPU by
//! editing the fake profile, times until the taint is stored in the API server and until the health
//! stream says UNHEALTHY, then removes the fault and times until the taint is gone.
//!
//! Run: `cargo bench --bench health` (BENCHMARKS.md quotes its output).

use std::time::{Duration, Instant};

use gpu_dra::gpu::{FakeFault, FakeFaultKind};
use gpu_dra::support::harness::Harness;
use gpu_dra::support::kubelet::HealthStatus;
use k8s_openapi::api::resource::v1::ResourceSlice;

const ROUNDS: usize = 40;
const GPUS: usize = 8;
/// The publisher writes at most twice a second; rounds are spaced past that window so each fault and
/// each recovery is the first change of its window, as an isolated fault on a node is.
const SPACING: Duration = Duration::from_millis(1100);

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let mut node = Harness::new("dgx-h100").await;
    let mut profile = gpu_dra::gpu::builtin_profile("dgx-h100").expect("profile");
    profile.gpus.truncate(GPUS);
    let path = node.dir.path().join("faults.yaml");
    let write = |profile: &gpu_dra::gpu::FakeProfile| {
        std::fs::write(&path, serde_yaml::to_string(profile).expect("YAML")).expect("profile")
    };
    write(&profile);
    node.config.backend = gpu_dra::plugin::BackendChoice::Fake {
        profile: path.display().to_string(),
        state_file: None,
    };
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let mut health = kubelet.watch_health().await.expect("health stream");
    node.wait_for_slices().await;
    tokio::time::sleep(SPACING).await;

    let mut to_taint = Vec::new();
    let mut to_unhealthy = Vec::new();
    let mut to_cleared = Vec::new();
    for round in 0..ROUNDS {
        let gpu = round % GPUS;
        let device = format!("gpu-{gpu}");
        profile.gpus[gpu].faults = vec![FakeFault {
            kind: FakeFaultKind::Xid,
            xid: Some(79),
            mig_start: None,
        }];
        let started = Instant::now();
        write(&profile);
        let (tainted, unhealthy) = tokio::join!(
            async {
                wait_until(|| has_taint(&node, &device)).await;
                started.elapsed()
            },
            async {
                loop {
                    let list = health.next().await.expect("stream").expect("open");
                    if list
                        .iter()
                        .any(|d| d.device == device && d.health == HealthStatus::Unhealthy)
                    {
                        return started.elapsed();
                    }
                }
            }
        );
        to_taint.push(tainted);
        to_unhealthy.push(unhealthy);
        tokio::time::sleep(SPACING).await;

        profile.gpus[gpu].faults.clear();
        let started = Instant::now();
        write(&profile);
        wait_until(|| !has_taint(&node, &device)).await;
        to_cleared.push(started.elapsed());
        tokio::time::sleep(SPACING).await;
    }
    println!(
        "== fault to taint and back, in-process plugin, fake backend, 8x H100, {ROUNDS} rounds"
    );
    for (what, times) in [
        ("XID 79 to taint stored in the API server", &mut to_taint),
        (
            "XID 79 to UNHEALTHY on the kubelet's health stream",
            &mut to_unhealthy,
        ),
        (
            "fault removed to taint gone from the API server",
            &mut to_cleared,
        ),
    ] {
        times.sort();
        println!(
            "{what}: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            ms(percentile(times, 0.50)),
            ms(percentile(times, 0.99)),
            ms(*times.last().expect("rounds"))
        );
    }
    plugin.shutdown().await;
}

fn has_taint(node: &Harness, device: &str) -> bool {
    node.api.list("resourceslices").into_iter().any(|value| {
        let slice: ResourceSlice = serde_json::from_value(value).expect("slice");
        slice
            .spec
            .devices
            .unwrap_or_default()
            .iter()
            .any(|d| d.name == device && d.taints.as_ref().is_some_and(|t| !t.is_empty()))
    })
}

async fn wait_until(mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "timed out");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
