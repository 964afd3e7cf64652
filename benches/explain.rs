//! `gpu-dra explain` on 1,000-node, 8,000-GPU cluster dumps, on one core. The cluster: 700 nodes of 8
//! whole H100s and 300 with static MIG (4 GPUs each cut into 3g.40gb + 2g.20gb + 2× 1g.10gb); then the
//! same with 50 of the static MIG nodes on dynamic MIG instead (every profile at every placement: 26
//! devices per GPU, so nearly twice the devices). About half the whole GPUs and some MIG devices are
//! held by claims; some GPUs have XID 79 taints, some nodes a taint, some are cordoned. The dump is the
//! List that `kubectl get pods,resourceclaims,resourceclaimtemplates,deviceclasses,resourceslices,nodes
//! -A -o yaml` prints.
//!
//! For four pods it reports reading the dump and deciding every node, in wall-clock and CPU time, and
//! runs the release binary end to end (`gpu-dra explain pod NS/NAME --from dump.yaml`). The process is
//! pinned to one CPU first, so the binary it starts is too. Target: within 2 s per explain, end to end.
//!
//! Run: `cargo bench --bench explain` (BENCHMARKS.md quotes its output).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};

use gpu_dra::devices::MigMode;
use gpu_dra::explain::{explain, Cluster, Target};
use gpu_dra::gpu::builtin_profile;
use gpu_dra::support::cluster as fixture;

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

/// The cluster's objects, the number of GPUs and of devices published.
fn cluster(static_mig: usize, dynamic_mig: usize) -> (Vec<Value>, usize, usize) {
    let h100 = builtin_profile("dgx-h100").expect("built-in profile");
    let cut = [
        ("3g.40gb", 4),
        ("2g.20gb", 0),
        ("1g.10gb", 2),
        ("1g.10gb", 3),
    ];
    let kinds: [(&str, Vec<ResourceSlice>, usize); 3] = [
        (
            "whole",
            fixture::node_slices("t", &h100, MigMode::None),
            WHOLE,
        ),
        (
            "static-mig",
            fixture::node_slices(
                "t",
                &fixture::static_mig("dgx-h100", &[0, 1, 2, 3], &cut),
                MigMode::Static,
            ),
            static_mig,
        ),
        (
            "dynamic-mig",
            fixture::node_slices("t", &h100, MigMode::Dynamic),
            dynamic_mig,
        ),
    ];
    let mut items = fixture::device_classes();
    let (mut gpus, mut devices) = (0, 0);
    let mut index = 0;
    for (kind, template, count) in &kinds {
        let names: Vec<String> = template
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .map(|d| d.name.clone())
            .collect();
        for _ in 0..*count {
            let node = format!("{kind}-{index:04}");
            let mut slices = fixture::renamed(template, "t", &node);
            if index % 50 == 7 {
                fixture::taint(
                    &mut slices,
                    &["gpu-7"],
                    "gpu.dra.dev/xid",
                    "79",
                    "NoExecute",
                );
            }
            devices += names.len();
            gpus += 8;
            items.extend(
                slices
                    .iter()
                    .map(|s| serde_json::to_value(s).expect("slice")),
            );
            let held: Vec<&str> = match *kind {
                // 0 to 8 whole GPUs held: about half of them.
                "whole" => names.iter().take(index % 9).map(String::as_str).collect(),
                // The 3g.40gb devices of the cut GPUs, on every other node.
                "static-mig" if index % 2 == 0 => names
                    .iter()
                    .filter(|n| n.contains("-mig-3g40gb"))
                    .map(String::as_str)
                    .collect(),
                "dynamic-mig" => names
                    .iter()
                    .filter(|n| n.ends_with("-mig-1g10gb-0"))
                    .take(index % 4)
                    .map(String::as_str)
                    .collect(),
                _ => Vec::new(),
            };
            if !held.is_empty() {
                items.push(fixture::allocated_claim(
                    "team",
                    &format!("job-{index}"),
                    &node,
                    &held,
                ));
            }
            let taints: &[&str] = if index % 100 == 3 {
                &["dedicated=inference:NoSchedule"]
            } else {
                &[]
            };
            let zone = format!("zone-{}", index % 4);
            items.push(fixture::node(
                &node,
                &[("gpu", "h100"), ("zone", &zone), ("mig", kind)],
                taints,
                index % 200 == 5,
            ));
            index += 1;
        }
    }
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

fn measure<T>(f: impl FnOnce() -> T) -> (T, (Duration, Duration)) {
    let cpu = own_cpu();
    let started = Instant::now();
    let value = f();
    (value, (started.elapsed(), own_cpu().saturating_sub(cpu)))
}

/// (best, median, CPU of the best) of (wall, CPU) runs.
fn summary(mut runs: Vec<(Duration, Duration)>) -> (Duration, Duration, Duration) {
    runs.sort();
    (runs[0].0, runs[runs.len() / 2].0, runs[0].1)
}

fn own_cpu() -> Duration {
    rusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
}

fn children_cpu() -> Duration {
    rusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
}

fn rusage(who: nix::sys::resource::UsageWho) -> Duration {
    let usage = nix::sys::resource::getrusage(who).expect("getrusage");
    let time = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    time(usage.user_time()) + time(usage.system_time())
}

/// Pins this process (and what it starts) to the first CPU it may run on; returns that CPU.
fn pin_to_one_cpu() -> usize {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let allowed = sched_getaffinity(Pid::from_raw(0)).expect("affinity");
    let cpu = (0..CpuSet::count())
        .find(|c| allowed.is_set(*c).unwrap_or(false))
        .expect("a CPU");
    let mut one = CpuSet::new();
    one.set(cpu).expect("CPU index");
    sched_setaffinity(Pid::from_raw(0), &one).expect("pinning to one CPU");
    cpu
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
