//! The MIG packing simulation: a seeded stream of mixed MIG claims (and releases) on one node of
//! dynamic-MIG GPUs, allocated by the allocator double as the scheduler would (first fit), once with the
//! device order gpu-dra publishes and once with devices sorted by name (what a driver that does not
//! think about placement publishes). At the end it counts how many large MIG devices still fit.
//! Used by a test (`tests/mig_packing.rs`) and by `cargo bench --bench mig` for BENCHMARKS.md.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{ResourceClaimSpec, ResourceSlice};

use super::allocator::{self, Candidate, InUse, Pools};
use crate::devices::{node_devices, MigMode, NodeDevices};
use crate::gpu::{FakeBackend, GpuBackend};
use crate::slices::{desired_slices, ServerVersion};

const DRIVER: &str = "gpu.dra.dev";
const NODE: &str = "node-a";

/// How the devices of each GPU are ordered in the published slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// As gpu-dra publishes them (`devices::mig::packing_order`).
    Packing,
    /// Sorted by device name.
    ByName,
}

/// One simulated stream and what it left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Small requests of the stream that found no room.
    pub refused: usize,
    /// MIG devices held at the end of the stream.
    pub held: usize,
    /// How many more devices of the large profile fit after the stream, one after another.
    pub large_still_fit: usize,
}

/// The request mix of the stream: (profile, weight).
#[derive(Debug, Clone)]
pub struct Mix {
    pub requests: Vec<(String, u32)>,
    /// The profile whose remaining room is counted at the end.
    pub large: String,
    /// Events in the stream; each is a new claim or, with `release_percent`, the release of a random
    /// held one.
    pub events: usize,
    pub release_percent: u32,
}

impl Mix {
    /// A mix for 8x H100 80GB: mostly small devices, some medium, counting 4g.40gb at the end.
    pub fn h100() -> Mix {
        Mix {
            requests: vec![
                ("1g.10gb".into(), 45),
                ("1g.20gb".into(), 15),
                ("2g.20gb".into(), 20),
                ("3g.40gb".into(), 20),
            ],
            large: "4g.40gb".into(),
            events: 60,
            release_percent: 30,
        }
    }
}

/// The node's slices (1.35 layout) with each GPU's devices in `order`, named so they sort in GPU order.
pub fn slices(profile: &str, order: Order) -> Vec<ResourceSlice> {
    let inventory = FakeBackend::new(NODE, profile)
        .expect("built-in profile")
        .inventory()
        .expect("fake inventory");
    let mut node: NodeDevices = node_devices(&inventory, MigMode::Dynamic);
    if order == Order::ByName {
        for gpu in node.gpus.iter_mut() {
            gpu.devices.sort_by(|a, b| a.name.cmp(&b.name));
        }
    }
    let mut slices = desired_slices(DRIVER, NODE, "uid", &node, ServerVersion { minor: 35 });
    for (index, slice) in slices.iter_mut().enumerate() {
        slice.metadata.name = Some(format!("{NODE}-{DRIVER}-{index:03}"));
        slice.spec.pool.generation = 1;
    }
    slices
}

fn request(profile: &str) -> ResourceClaimSpec {
    serde_json::from_value(serde_json::json!({"devices": {"requests": [{"name": "mig", "exactly": {
        "deviceClassName": "mig",
        "selectors": [{"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].profile == \"{profile}\"")}}]
    }}]}}))
    .expect("claim spec")
}

/// Runs the stream of `seed` on `profile` (a built-in fake profile) with devices in `order`.
pub fn simulate(profile: &str, order: Order, mix: &Mix, seed: u64) -> Outcome {
    let slices = slices(profile, order);
    let pools = Pools::from_slices(&slices, Some(&allocator::Node::named(NODE)));
    let classes = BTreeMap::from([(
        "mig".to_string(),
        vec![format!("device.attributes[\"{DRIVER}\"].type == \"mig\"")],
    )]);
    let specs: BTreeMap<&str, ResourceClaimSpec> = mix
        .requests
        .iter()
        .map(|(p, _)| (p.as_str(), request(p)))
        .chain(std::iter::once((mix.large.as_str(), request(&mix.large))))
        .collect();
    let total_weight: u32 = mix.requests.iter().map(|(_, w)| w).sum();
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut held: Vec<Candidate> = Vec::new();
    let mut outcome = Outcome::default();
    for _ in 0..mix.events {
        if !held.is_empty() && rng.u32(0..100) < mix.release_percent {
            let index = rng.usize(0..held.len());
            held.swap_remove(index);
            continue;
        }
        let mut pick = rng.u32(0..total_weight);
        let profile = mix
            .requests
            .iter()
            .find(|(_, weight)| {
                let hit = pick < *weight;
                pick = pick.saturating_sub(*weight);
                hit
            })
            .map(|(p, _)| p.as_str())
            .unwrap_or(&mix.large);
        let in_use = InUse::from(held.iter().cloned().collect::<BTreeSet<Candidate>>());
        match allocator::allocate(&pools, &classes, &in_use, &specs[profile]) {
            Ok(results) => held.extend(results.iter().map(Candidate::of_result)),
            Err(_) => outcome.refused += 1,
        }
    }
    outcome.held = held.len();
    loop {
        let in_use = InUse::from(held.iter().cloned().collect::<BTreeSet<Candidate>>());
        match allocator::allocate(&pools, &classes, &in_use, &specs[mix.large.as_str()]) {
            Ok(results) => {
                held.extend(results.iter().map(Candidate::of_result));
                outcome.large_still_fit += 1;
            }
            Err(_) => break,
        }
    }
    outcome
}

/// Sums of [`simulate`] over `seeds`, for both orders: (packing, by name).
pub fn compare(profile: &str, mix: &Mix, seeds: std::ops::Range<u64>) -> (Outcome, Outcome) {
    let mut totals = (Outcome::default(), Outcome::default());
    for seed in seeds {
        for (order, total) in [
            (Order::Packing, &mut totals.0),
            (Order::ByName, &mut totals.1),
        ] {
            let one = simulate(profile, order, mix, seed);
            total.refused += one.refused;
            total.held += one.held;
            total.large_still_fit += one.large_still_fit;
        }
    }
    totals
}
