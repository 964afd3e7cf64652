//! MIG benchmarks: planning the slices of 8 GPUs with every MIG placement, the packing simulation
//! (published order against name order), and prepare + unprepare of a dynamic MIG device on the fake
//! backend next to a whole GPU in the same run.
//!
//! Run: `cargo bench --bench mig` (BENCHMARKS.md quotes its output).

use std::time::{Duration, Instant};

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{FakeBackend, GpuBackend};
use gpu_dra::support::harness::{Harness, DRIVER, MIG_CLASS};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};
use gpu_dra::support::packing::{compare, Mix};

#[path = "common/mod.rs"]
mod common;

use common::measure::{micros, ms, percentile};
use common::planning::time_planning;

const PLANNING_ROUNDS: usize = 2000;
const PACKING_SEEDS: u64 = 200;
const PREPARE_ROUNDS: usize = 200;

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    planning();
    packing();
    prepare().await;
}

fn planning() {
    let inventory = FakeBackend::new("node-a", "dgx-h100")
        .expect("profile")
        .inventory()
        .expect("inventory");
    println!("== slice planning, 8x H100 80GB, dynamic MIG (every profile at every placement)");
    for minor in [34, 35] {
        let plan = time_planning(&inventory, MigMode::Dynamic, minor, PLANNING_ROUNDS);
        println!(
            "Kubernetes 1.{minor}: {} devices in {} slices; inventory to slices p50 {:.0} µs, p99 {:.0} µs",
            plan.devices,
            plan.slices,
            micros(plan.p50),
            micros(plan.p99),
        );
    }
    println!();
}

fn packing() {
    println!(
        "== MIG packing, 8x H100 80GB, {PACKING_SEEDS} seeded streams per row (45% 1g.10gb, 15% 1g.20gb, 20% 2g.20gb, 20% 3g.40gb; 30% of events release a held device)"
    );
    println!("events | 4g.40gb still fitting: published order | name order | ratio | refused: published | name");
    for events in [20, 40, 60, 80] {
        let mix = Mix {
            events,
            ..Mix::h100()
        };
        let (packing, by_name) = compare("dgx-h100", &mix, 0..PACKING_SEEDS);
        let ratio = packing.large_still_fit as f64 / by_name.large_still_fit.max(1) as f64;
        println!(
            "{events:>6} | {:>38} | {:>10} | {ratio:>5.2} | {:>18} | {:>4}",
            packing.large_still_fit, by_name.large_still_fit, packing.refused, by_name.refused
        );
    }
    println!();
}

async fn prepare() {
    let mut node = Harness::new("dgx-h100").await;
    node.config.mig_mode = MigMode::Dynamic;
    let plugin = node.start_plugin().await;
    let kubelet =
        KubeletDouble::register(&node.config.registry_dir, DRIVER, Duration::from_secs(30))
            .await
            .expect("plugin registers");
    node.wait_for_slices_where(|slices| slices.len() == 9).await;
    let mig = node
        .allocated_claim_with(
            "mig",
            serde_json::json!({"requests": [{"name": "mig", "exactly": {
                "deviceClassName": MIG_CLASS,
                "selectors": [{"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].profile == \"1g.10gb\"")}}]
            }}]}),
        )
        .await
        .expect("MIG claim allocated");
    let whole = node.allocated_claim("whole", 1).await;
    let mig_times = round_trips(&kubelet, &mig).await;
    let whole_times = round_trips(&kubelet, &whole).await;
    println!("== prepare+unprepare round trip, in-process plugin, fake backend, everything on disk ({PREPARE_ROUNDS} rounds each)");
    for (what, times) in [
        ("dynamic MIG 1g.10gb (created and destroyed)", &mig_times),
        ("whole GPU", &whole_times),
    ] {
        println!(
            "{what}: p50 {:.2} ms, p99 {:.2} ms",
            ms(percentile(times, 0.50)),
            ms(percentile(times, 0.99))
        );
    }
    println!(
        "MIG / whole GPU at p50: {:.2}",
        ms(percentile(&mig_times, 0.50)) / ms(percentile(&whole_times, 0.50))
    );
    plugin.shutdown().await;
}

async fn round_trips(kubelet: &KubeletDouble, claim: &ClaimRef) -> Vec<Duration> {
    let mut times = Vec::with_capacity(PREPARE_ROUNDS);
    for _ in 0..PREPARE_ROUNDS {
        let started = Instant::now();
        let prepared = kubelet
            .prepare(std::slice::from_ref(claim))
            .await
            .expect("prepare call");
        assert!(prepared[&claim.uid].is_ok(), "{:?}", prepared[&claim.uid]);
        let unprepared = kubelet
            .unprepare(std::slice::from_ref(claim))
            .await
            .expect("unprepare call");
        assert!(unprepared[&claim.uid].is_ok());
        times.push(started.elapsed());
    }
    times.sort();
    times
}
