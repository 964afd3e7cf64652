//! `gpu-dra selectors allocate` on a 1,000-node pool dump: the release binary decides one claim on one
//! node of the cluster the explain benchmark builds (`common/fleet.rs`), given every ResourceSlice of
//! the cluster as `kubectl get resourceslices -o yaml` prints them and what the node's other claims
//! hold. Beside it, the same claim given only that node's slices, which shows what reading the dump
//! costs. Run pinned to one CPU, like the explain benchmark.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use gpu_dra::support::cluster as fixture;

use crate::common::fleet::{fleet, Fleet, Shape};
use crate::common::measure::{children_cpu, ms, summary};

/// The explain benchmark's larger cluster: 8,000 GPUs, 21,000 devices.
const SHAPE: Shape = Shape {
    whole: 700,
    static_mig: 250,
    dynamic_mig: 50,
};
const RUNS: usize = 3;

/// A claim and the node it is decided on.
struct Case {
    name: &'static str,
    node: &'static str,
    devices: Value,
}

fn cases() -> Vec<Case> {
    let gpus = |count: u32| json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev", "count": count}}]});
    let mut linked = gpus(2);
    linked["constraints"] = json!([{"matchAttribute": "gpu.dra.dev/nvlinkDomain"}]);
    vec![
        // 4 of its 8 GPUs held.
        Case {
            name: "one-gpu",
            node: "whole-0004",
            devices: gpus(1),
        },
        // 6 held: the last 2 free GPUs, on the node's one NVLink domain.
        Case {
            name: "two-linked",
            node: "whole-0006",
            devices: linked,
        },
        // Does not fit (2 free): the search has to give up.
        Case {
            name: "eight",
            node: "whole-0006",
            devices: gpus(8),
        },
        // 208 devices on the node, 3 of its 1g.10gb devices held.
        Case {
            name: "mig-1g",
            node: "dynamic-mig-0951",
            devices: json!({"requests": [{"name": "mig", "exactly": {"deviceClassName": "mig.gpu.dra.dev",
                "selectors": [{"cel": {"expression": "device.attributes[\"gpu.dra.dev\"].profile == \"1g.10gb\""}}]}}]}),
        },
    ]
}

pub fn run(cpu: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let started = Instant::now();
    let cluster = fleet(SHAPE);
    let dump = write_yaml(dir.path(), "slices.yaml", fixture::list(cluster.slices()));
    println!(
        "== gpu-dra selectors allocate, {} nodes ({} whole GPUs, {} static MIG, {} dynamic MIG), {} GPUs, {} devices; pool dump {:.1} MiB of YAML (made in {:.1} s); pinned to CPU {cpu}",
        SHAPE.nodes(),
        SHAPE.whole,
        SHAPE.static_mig,
        SHAPE.dynamic_mig,
        cluster.gpus,
        cluster.devices,
        file_mib(&dump),
        started.elapsed().as_secs_f64()
    );
    let classes = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/base/deviceclasses.yaml");
    println!("claim | node (its devices, held) | answer | whole dump: best, median (CPU of the best) | node's slices only: best (CPU)");
    for case in cases() {
        let node = cluster.node(case.node);
        let claim = write_yaml(
            dir.path(),
            &format!("{}.yaml", case.name),
            fixture::claim("bench", case.name, case.devices, false),
        );
        let in_use = write_in_use(dir.path(), &cluster, case.node);
        let own = write_yaml(
            dir.path(),
            &format!("{}-slices.yaml", case.node),
            fixture::list(node_slices(&cluster, case.node)),
        );
        let allocate = |slices: &Path| {
            let mut command = Command::new(env!("CARGO_BIN_EXE_gpu-dra"));
            command
                .args(["selectors", "allocate", "--claim"])
                .arg(&claim)
                .arg("--class")
                .arg(&classes)
                .arg("--slices")
                .arg(slices)
                .args(["--node", case.node, "--in-use"])
                .arg(&in_use)
                .args(["-o", "json"]);
            command
        };
        let answer = answer(&mut allocate(&dump));
        let whole = summary(timed(|| allocate(&dump)));
        let alone = summary(timed(|| allocate(&own)));
        println!(
            "{} | {} ({} devices, {} held) | {answer} | {:.2} s, {:.2} s ({:.2} s) | {:.0} ms ({:.0} ms)",
            case.name,
            case.node,
            node.devices,
            node.held.len(),
            whole.0.as_secs_f64(),
            whole.1.as_secs_f64(),
            whole.2.as_secs_f64(),
            ms(alone.0),
            ms(alone.2),
        );
    }
    println!();
}

/// The node's own slices from the cluster.
fn node_slices(cluster: &Fleet, node: &str) -> Vec<Value> {
    cluster
        .slices()
        .into_iter()
        .filter(|s| s["spec"]["nodeName"] == node)
        .collect()
}

/// `--in-use`: what the node's other claims hold, as allocation results.
fn write_in_use(dir: &Path, cluster: &Fleet, node: &str) -> PathBuf {
    let held: Vec<Value> = cluster
        .node(node)
        .held
        .iter()
        .map(|device| json!({"driver": "gpu.dra.dev", "pool": node, "device": device}))
        .collect();
    let path = dir.join(format!("{node}-in-use.json"));
    std::fs::write(&path, Value::Array(held).to_string()).expect("in-use written");
    path
}

fn write_yaml(dir: &Path, name: &str, value: Value) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_yaml::to_string(&value).expect("YAML")).expect("file written");
    path
}

fn file_mib(path: &Path) -> f64 {
    std::fs::metadata(path).expect("file").len() as f64 / (1 << 20) as f64
}

/// "allocated gpu-6, gpu-7" or "refused", from one run's JSON.
fn answer(command: &mut Command) -> String {
    let output = command.output().expect("gpu-dra runs");
    assert!(
        matches!(output.status.code(), Some(0 | 1)),
        "gpu-dra selectors allocate failed: {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let decision: Value = serde_json::from_slice(&output.stdout).expect("JSON answer");
    match decision["results"].as_array() {
        Some(results) if decision["allocated"] == true => {
            let devices: Vec<&str> = results
                .iter()
                .filter_map(|r| r["device"].as_str())
                .collect();
            format!("allocated {}", devices.join(", "))
        }
        _ => "refused".to_string(),
    }
}

/// Wall-clock and CPU time of [`RUNS`] runs of the command `make` builds.
fn timed(make: impl Fn() -> Command) -> Vec<(Duration, Duration)> {
    (0..RUNS)
        .map(|_| {
            let before = children_cpu();
            let started = Instant::now();
            let status = make().stdout(Stdio::null()).status().expect("gpu-dra runs");
            let took = started.elapsed();
            assert!(matches!(status.code(), Some(0 | 1)), "{status}");
            (took, children_cpu().saturating_sub(before))
        })
        .collect()
}
