//! What an idle plugin costs the API server: the release plugin runs against the API server double (a
//! fake dgx-h100, as on a node), publishes its slices, comes to rest, and then every request it sends
//! in a window is counted, by verb and resource. Watches are counted apart: they are the plugin's open
//! watches, renewed each time the server (or the client's timeout) ends one.
//!
//! Two runs: the GpuNodePolicy CRD installed, and not installed (every policy request answered 404).
//! The window is `IDLE_BENCH_SECONDS` long (default 120).
//!
//! Run: `cargo bench --bench idle`

use std::collections::BTreeMap;
use std::time::Duration;

use gpu_dra::support::apiserver::{RequestRecord, Verb};
use gpu_dra::support::harness::Harness;

fn window() -> Duration {
    let seconds = std::env::var("IDLE_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    Duration::from_secs(seconds)
}

/// Waits until the server has seen no request for two seconds (or 60 s have passed).
async fn until_quiet(node: &Harness) {
    for _ in 0..30 {
        let before = node.api.requests().len();
        tokio::time::sleep(Duration::from_secs(2)).await;
        if node.api.requests().len() == before {
            return;
        }
    }
    println!("  (the plugin did not come to rest within 60 s; counting anyway)");
}

fn verb(v: Verb) -> &'static str {
    match v {
        Verb::Get => "GET",
        Verb::List => "LIST",
        Verb::Watch => "WATCH",
        Verb::Create => "CREATE",
        Verb::Update => "UPDATE",
        Verb::Patch => "PATCH",
        Verb::Delete => "DELETE",
    }
}

fn report(requests: &[RequestRecord], window: Duration) {
    let minutes = window.as_secs_f64() / 60.0;
    let mut by_kind: BTreeMap<(bool, String), usize> = BTreeMap::new();
    for r in requests {
        let key = (
            r.verb == Verb::Watch,
            format!("{} {} ({})", verb(r.verb), r.resource, r.code),
        );
        *by_kind.entry(key).or_default() += 1;
    }
    let (watches, others): (Vec<_>, Vec<_>) = by_kind.iter().partition(|((watch, _), _)| *watch);
    let total = |rows: &[(&(bool, String), &usize)]| rows.iter().map(|(_, n)| **n).sum::<usize>();
    println!(
        "  requests other than watches: {} in {:.0} s = {:.2} per minute",
        total(&others),
        window.as_secs_f64(),
        total(&others) as f64 / minutes
    );
    for ((_, what), n) in &others {
        println!("    {what}: {n}");
    }
    println!(
        "  watch requests (opening or renewing a watch): {} = {:.2} per minute",
        total(&watches),
        total(&watches) as f64 / minutes
    );
    for ((_, what), n) in &watches {
        println!("    {what}: {n}");
    }
}

async fn run(title: &str, crd_installed: bool) {
    println!("== {title}");
    let node = Harness::new("dgx-h100").await;
    if !crd_installed {
        node.api.stop_serving("gpunodepolicies");
    }
    let (mut plugin, _kubelet) = node
        .spawn_plugin_process(std::path::Path::new(env!("CARGO_BIN_EXE_gpu-dra")), 8)
        .await;
    until_quiet(&node).await;
    node.api.clear_requests();
    let window = window();
    tokio::time::sleep(window).await;
    report(&node.api.requests(), window);
    let _ = plugin.kill();
    let _ = plugin.wait();
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    run("idle plugin, GpuNodePolicy CRD installed", true).await;
    run(
        "idle plugin, GpuNodePolicy CRD not installed (every policy request answered 404)",
        false,
    )
    .await;
}
