//! Scale: what a big node costs to plan and publish, what one device change and one prepare ask of
//! the API server, and `gpu-dra selectors allocate` on a 1,000-node pool dump. The request counts are
//! the inputs of BENCHMARKS.md's cost model (what 5,000 nodes cost the API server).
//!
//! 1. Slice planning (inventory to ResourceSlices) for 8 GPUs with every MIG profile at every
//!    placement, and for 16 whole GPUs: p50, p99 and CPU per plan.
//! 2. Publishing, in-process plugin against the API server double: from a cold start until every
//!    slice is stored, with the requests and bytes it sent; then a fault, its recovery, a GPU going
//!    away and coming back, each counted until the plugin is quiet again.
//! 3. Prepare and unprepare of a whole GPU and of a dynamic MIG device: the requests each sends.
//! 4. `gpu-dra selectors allocate` (the release binary, pinned to one CPU) on a 1,000-node, 8,000-GPU
//!    pool dump.
//!
//! Run: `cargo bench --bench scale` (BENCHMARKS.md quotes its output).

#[path = "../common/mod.rs"]
mod common;

mod allocate;
mod publish;
mod requests;

use common::measure::{micros, pin_to_one_cpu};
use common::planning::time_planning;
use publish::Stored;

const PLANNING_ROUNDS: usize = 1000;
const COLD_STARTS: usize = 10;
const PREPARE_ROUNDS: usize = 3;
/// The API server double's version (its default): the slice layout the plugin publishes for it.
const MINOR: u32 = 35;

fn main() {
    let shapes = publish::shapes();
    println!("== slice planning, inventory to ResourceSlices (Kubernetes 1.{MINOR}), {PLANNING_ROUNDS} rounds each");
    let mut expected = Vec::new();
    for shape in &shapes {
        let plan = time_planning(&shape.inventory(), shape.mig_mode, MINOR, PLANNING_ROUNDS);
        println!(
            "{}: {} devices, {} slices; p50 {:.0} µs, p99 {:.0} µs, {:.0} µs CPU per plan",
            shape.title,
            plan.devices,
            plan.slices,
            micros(plan.p50),
            micros(plan.p99),
            micros(plan.cpu_per_plan),
        );
        expected.push(Stored {
            slices: plan.slices,
            devices: plan.devices,
            tainted: 0,
        });
    }
    println!();

    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    runtime.block_on(async {
        for (shape, expected) in shapes.iter().zip(&expected) {
            println!("== publishing, {}", shape.title);
            publish::cold_start(shape, *expected, COLD_STARTS).await;
            publish::device_changes(shape, *expected).await;
            println!();
        }
        println!("== prepare and unprepare, {}", shapes[0].title);
        publish::prepares(&shapes[0], expected[0], PREPARE_ROUNDS).await;
        println!();
    });
    drop(runtime);

    // Last, when no other thread of this process is left to share the CPU with.
    allocate::run(pin_to_one_cpu());
}
