//! Timing the slice planner: a node's inventory becomes devices, counter sets and ResourceSlices, as
//! the plugin does on every inventory change. Shared by the MIG and scale benchmarks.

use std::time::{Duration, Instant};

use gpu_dra::devices::{node_devices, MigMode};
use gpu_dra::gpu::Inventory;
use gpu_dra::slices::{desired_slices, ServerVersion};

use super::measure::{own_cpu, percentile};

/// What `rounds` plannings of one inventory took.
pub struct Planning {
    pub devices: usize,
    pub slices: usize,
    pub p50: Duration,
    pub p99: Duration,
    /// CPU time of all rounds divided by their number.
    pub cpu_per_plan: Duration,
}

/// Plans the slices of `inventory` `rounds` times for a server of Kubernetes 1.`minor`.
pub fn time_planning(inventory: &Inventory, mode: MigMode, minor: u32, rounds: usize) -> Planning {
    let version = ServerVersion { minor };
    let mut times = Vec::with_capacity(rounds);
    let mut shape = (0, 0);
    let cpu = own_cpu();
    for _ in 0..rounds {
        let started = Instant::now();
        let node = node_devices(inventory, mode);
        let slices = desired_slices("gpu.dra.dev", "node-a", "uid", &node, version);
        times.push(started.elapsed());
        shape = (node.device_count(), slices.len());
    }
    let cpu = own_cpu().saturating_sub(cpu);
    times.sort();
    Planning {
        devices: shape.0,
        slices: shape.1,
        p50: percentile(&times, 0.50),
        p99: percentile(&times, 0.99),
        cpu_per_plan: cpu / rounds as u32,
    }
}
