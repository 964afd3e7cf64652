//! `gpu-dra explain` on 1,000-node, 8,000-GPU cluster dumps, on one core. The cluster
//! (`common/fleet.rs`): 700 nodes of 8 whole H100s and 300 with static MIG (4 GPUs each cut into
//! 3g.40gb + 2g.20gb + 2× 1g.10gb); then the same with 50 of the static MIG nodes on dynamic MIG instead
//! (every profile at every placement: 26 devices per GPU, so nearly twice the devices). About half the
//! whole GPUs and some MIG devices are held by claims; some GPUs have XID 79 taints, some nodes a taint,
//! some are cordoned. The dump is the List that `kubectl get
//! pods,resourceclaims,resourceclaimtemplates,deviceclasses,resourceslices,nodes -A -o yaml` prints.
//!
//! For four pods it reports reading the dump and deciding every node, in wall-clock and CPU time, and
//! runs the release binary end to end (`gpu-dra explain pod NS/NAME --from dump.yaml`). The process is
//! pinned to one CPU first, so the binary it starts is too. Target: within 2 s per explain, end to end.
//!
//! Run: `cargo bench --bench explain` (BENCHMARKS.md quotes its output).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use gpu_dra::explain::{explain, Cluster, Target};
use gpu_dra::support::cluster as fixture;

#[path = "common/mod.rs"]
mod common;

use common::fleet::{fleet, Fleet, Shape};
use common::measure::{children_cpu, measure, ms, pin_to_one_cpu, summary};

const WHOLE: usize = 700;
/// (nodes with static MIG, nodes with dynamic MIG) of each cluster.
const MIG_NODES: [(usize, usize); 2] = [(300, 0), (250, 50)];
const ROUNDS: usize = 5;
const TARGET: Duration = Duration::from_secs(2);
const NS: &str = "bench";

fn main() {
    let cpu = pin_to_one_cpu();
    for (static_mig, dynamic_mig) in MIG_NODES {
        run(cpu, static_mig, dynamic_mig);
    }
}

fn run(cpu: usize, static_mig: usize, dynamic_mig: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let started = Instant::now();
    let (items, gpus, devices) = cluster(static_mig, dynamic_mig);
    let dump = dir.path().join("cluster.yaml");
    let text = serde_yaml::to_string(&fixture::list(items)).expect("dump YAML");
    std::fs::write(&dump, &text).expect("dump written");
    // To look at it, or to profile `gpu-dra explain` on it: EXPLAIN_BENCH_DUMP=cluster.yaml keeps a copy
    // (of the last cluster).
    if let Ok(keep) = std::env::var("EXPLAIN_BENCH_DUMP") {
        std::fs::copy(&dump, keep).expect("copying the dump");
    }
    println!(
        "== gpu-dra explain, {} nodes ({WHOLE} whole GPUs, {static_mig} static MIG, {dynamic_mig} dynamic MIG), {gpus} GPUs, {devices} devices; dump {:.1} MiB of YAML (made in {:.1} s); pinned to CPU {cpu}",
        WHOLE + static_mig + dynamic_mig,
        text.len() as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    let (cluster, read) =
        measure(|| Cluster::from_dump_files(std::slice::from_ref(&dump)).expect("dump reads"));
    println!(
        "reading the dump: {:.0} ms ({:.0} ms CPU)",
        ms(read.0),
        ms(read.1)
    );
    println!("pod | fits on | explain, dump already read: best, median (CPU of the best) | end to end, release binary: best, median (CPU of the best) | target 2 s");
    for pod in ["two-linked", "eight", "mig-3g", "eight-big"] {
        let target = Target::Pod {
            namespace: NS.into(),
            name: pod.into(),
        };
        let mut runs = Vec::new();
        let mut fits = 0;
        for _ in 0..ROUNDS {
            let (report, took) = measure(|| explain(&cluster, &target).expect("explain"));
            fits = report.fitting_nodes;
            runs.push(took);
        }
        let binary = end_to_end(&dump, pod);
        let (in_process, whole) = (summary(runs), summary(binary));
        let verdict = if whole.0 <= TARGET { "met" } else { "MISSED" };
        println!(
            "{pod} | {fits} nodes | {:.0} ms, {:.0} ms ({:.0} ms) | {:.2} s, {:.2} s ({:.2} s) | {verdict}",
            ms(in_process.0),
            ms(in_process.1),
            ms(in_process.2),
            whole.0.as_secs_f64(),
            whole.1.as_secs_f64(),
            whole.2.as_secs_f64(),
        );
    }
    println!();
}

/// The cluster's objects with the four pending pods, the number of GPUs and of devices published.
fn cluster(static_mig: usize, dynamic_mig: usize) -> (Vec<Value>, usize, usize) {
    let Fleet {
        mut items,
        gpus,
        devices,
        ..
    } = fleet(Shape {
        whole: WHOLE,
        static_mig,
        dynamic_mig,
    });
    let linked = json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev", "count": 2}}],
        "constraints": [{"matchAttribute": "gpu.dra.dev/nvlinkDomain"}]});
    let eight = json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev", "count": 8}}]});
    let big = json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev", "count": 8,
        "selectors": [{"cel": {"expression": "device.capacity[\"gpu.dra.dev\"].memory.compareTo(quantity(\"100Gi\")) >= 0"}}]}}]});
    let mig = json!({"requests": [{"name": "mig", "exactly": {"deviceClassName": "mig.gpu.dra.dev",
        "selectors": [{"cel": {"expression": "device.attributes[\"gpu.dra.dev\"].profile == \"3g.40gb\""}}]}}]});
    for (pod, devices) in [
        ("two-linked", linked),
        ("eight", eight),
        ("eight-big", big),
        ("mig-3g", mig),
    ] {
        items.push(fixture::claim(NS, pod, devices, true));
        items.push(fixture::pod(
            NS,
            pod,
            json!([{"name": "gpu", "resourceClaimTemplateName": pod}]),
            json!({}),
        ));
    }
    (items, gpus, devices)
}

/// Runs the release binary as a user would, three times: wall-clock and CPU time of each run.
fn end_to_end(dump: &Path, pod: &str) -> Vec<(Duration, Duration)> {
    (0..3)
        .map(|_| {
            let before = children_cpu();
            let started = Instant::now();
            let status = Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
                .args(["explain", "pod", &format!("{NS}/{pod}"), "--from"])
                .arg(dump)
                .stdout(Stdio::null())
                .status()
                .expect("gpu-dra runs");
            let took = started.elapsed();
            assert!(
                matches!(status.code(), Some(0 | 1)),
                "gpu-dra explain failed: {status}"
            );
            (took, children_cpu().saturating_sub(before))
        })
        .collect()
}
