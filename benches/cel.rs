//! CEL selector evaluation rate: the DeviceClass selectors `deploy/` ships and a memory-quantity selector,
//! each evaluated over 10,000 devices on one thread, with the devices converted once up front as the
//! scheduler does.
//!
//! Run: `cargo bench --bench cel` (BENCHMARKS.md quotes its output).

use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::{Device, DeviceClass};
use serde::Deserialize;

use gpu_dra::cel::{DeviceView, Selector};
use gpu_dra::devices::{node_devices, MigMode};
use gpu_dra::gpu::{FakeBackend, GpuBackend};

const DRIVER: &str = "gpu.dra.dev";
const DEVICES: usize = 10_000;
/// Passes over all devices per selector; the rate is taken from the fastest pass, the least disturbed
/// by other work on a shared machine, and the median is printed beside it.
const PASSES: usize = 7;
/// Evaluations per second on one core that each selector must reach.
const TARGET_PER_SECOND: f64 = 500_000.0;
const MEMORY_SELECTOR: &str =
    r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40Gi")) >= 0"#;

fn main() {
    let devices = devices();
    let started = Instant::now();
    let views: Vec<DeviceView> = devices.iter().map(|d| DeviceView::new(DRIVER, d)).collect();
    let conversion = started.elapsed();
    println!(
        "== CEL selector evaluation, one thread, {} devices (H100 80GB whole GPUs and every MIG placement)",
        views.len()
    );
    println!(
        "converting the devices for CEL: {:.2} µs per device",
        conversion.as_secs_f64() * 1e6 / views.len() as f64
    );
    let mut selectors: Vec<(String, String)> = deploy_class_selectors();
    selectors.push(("memory >= 40Gi".to_string(), MEMORY_SELECTOR.to_string()));
    println!("selector | matching devices | evaluations/s: best pass, median pass | best against the 500,000/s target");
    for (label, expression) in selectors {
        let selector = match Selector::compile(&expression) {
            Ok(selector) => selector,
            Err(error) => panic!("{label}: {expression}: {error}"),
        };
        let mut passes = Vec::with_capacity(PASSES);
        let mut matching = 0;
        for _ in 0..PASSES {
            let started = Instant::now();
            matching = 0;
            for view in &views {
                if selector.matches(view).expect("selector evaluates") {
                    matching += 1;
                }
            }
            passes.push(started.elapsed());
        }
        passes.sort();
        let rate = |pass: Duration| views.len() as f64 / pass.as_secs_f64();
        let best = rate(passes[0]);
        println!(
            "{label} | {matching} | {:.0}, {:.0} | {:.1}x",
            best,
            rate(passes[PASSES / 2]),
            best / TARGET_PER_SECOND
        );
    }
}

/// 10,000 devices: the dynamic-MIG devices of a DGX H100 repeated under distinct names, like the pools
/// of many nodes.
fn devices() -> Vec<Device> {
    let inventory = FakeBackend::new("node-a", "dgx-h100")
        .expect("built-in profile")
        .inventory()
        .expect("fake inventory");
    let node = node_devices(&inventory, MigMode::Dynamic);
    let one_node: Vec<Device> = node.devices().cloned().collect();
    (0..DEVICES)
        .map(|i| {
            let mut device = one_node[i % one_node.len()].clone();
            device.name = format!("{}-n{}", device.name, i / one_node.len());
            device
        })
        .collect()
}

/// (class name, expression) for every selector of the DeviceClasses in `deploy/base`.
fn deploy_class_selectors() -> Vec<(String, String)> {
    let text = include_str!("../deploy/base/deviceclasses.yaml");
    serde_yaml::Deserializer::from_str(text)
        .map(|document| DeviceClass::deserialize(document).expect("deploy/ DeviceClass"))
        .flat_map(|class| {
            let name = class.metadata.name.clone().unwrap_or_default();
            class
                .spec
                .into_iter()
                .flat_map(|spec| spec.selectors.into_iter().flatten())
                .filter_map(move |s| s.cel.map(|c| (format!("class {name}"), c.expression)))
        })
        .collect()
}
