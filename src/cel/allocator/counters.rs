//! Shared counters (`DRAPartitionableDevices`): the counter sets of a pool, what each device consumes
//! of them, and whether a device still fits in what is left.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use super::pools::Pools;
use crate::quantity::Quantity;

#[derive(Debug, Clone)]
pub(super) struct CounterInfo {
    pub(super) driver: String,
    pub(super) pool: String,
    pub(super) set: String,
    pub(super) name: String,
    pub(super) capacity: Quantity,
}

#[derive(Debug, Clone)]
pub(super) struct Consumption {
    pub(super) counter: usize,
    pub(super) amount: Quantity,
}

/// The counter sets of one pool at its current generation: (set, counter) → index into
/// [`Pools`]' counters, and the counters themselves.
pub(super) struct PoolCounters<'a> {
    index: BTreeMap<(&'a str, &'a str), usize>,
    sets: BTreeSet<&'a str>,
    pub(super) infos: Vec<CounterInfo>,
}

/// The counter sets the pool's slices publish, numbered from `first`. Counter sets may sit beside
/// devices (1.34) or in slices of their own (1.35+); a name twice in the pool makes it invalid, as in
/// upstream's `getAndValidateCounterSets`.
pub(super) fn pool_counters<'a>(
    driver: &str,
    pool: &str,
    slices: &[&'a ResourceSlice],
    first: usize,
) -> Result<PoolCounters<'a>, String> {
    let mut counters = PoolCounters {
        index: BTreeMap::new(),
        sets: BTreeSet::new(),
        infos: Vec::new(),
    };
    for set in slices
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
    {
        if !counters.sets.insert(set.name.as_str()) {
            return Err(format!("duplicate counter set name {}", set.name));
        }
        for (name, counter) in &set.counters {
            let capacity = Quantity::parse(&counter.value.0)
                .map_err(|e| format!("counter set {}: counter {name}: {e}", set.name))?;
            counters
                .index
                .insert((&set.name, name), first + counters.infos.len());
            counters.infos.push(CounterInfo {
                driver: driver.to_string(),
                pool: pool.to_string(),
                set: set.name.clone(),
                name: name.clone(),
                capacity,
            });
        }
    }
    Ok(counters)
}

/// What `device` consumes of the pool's counters. A counter set or counter the pool does not publish
/// (also one another pool publishes) makes the pool invalid, as upstream's
/// `validateDeviceCounterConsumption` has it; the texts are upstream's.
pub(super) fn consumption(
    device: &Device,
    counters: &PoolCounters<'_>,
) -> Result<Vec<Consumption>, String> {
    let mut result = Vec::new();
    for consumes in device.consumes_counters.iter().flatten() {
        let set = consumes.counter_set.as_str();
        if !counters.sets.contains(set) {
            return Err(format!("counter set {set} not found"));
        }
        for (name, counter) in &consumes.counters {
            let index = *counters
                .index
                .get(&(set, name.as_str()))
                .ok_or_else(|| format!("counter {name} not found in counter set {set}"))?;
            let amount = Quantity::parse(&counter.value.0)
                .map_err(|e| format!("counter set {set}: counter {name}: {e}"))?;
            result.push(Consumption {
                counter: index,
                amount,
            });
        }
    }
    Ok(result)
}

pub(super) fn counters_fit(
    counters: &[CounterInfo],
    consumed: &[Quantity],
    consumes: &[Consumption],
) -> bool {
    // A device may name a counter twice (in two consumption entries); sum per counter first.
    let mut wanted: BTreeMap<usize, Quantity> = BTreeMap::new();
    for c in consumes {
        let total = wanted.entry(c.counter).or_insert_with(Quantity::zero);
        *total = total.add(&c.amount);
    }
    wanted
        .iter()
        .all(|(counter, amount)| consumed[*counter].add(amount) <= counters[*counter].capacity)
}

pub(super) fn counter_shortage(
    pools: &Pools,
    consumed: &[Quantity],
    consumes: &[Consumption],
) -> Option<String> {
    consumes.iter().find_map(|c| {
        let info = &pools.counters[c.counter];
        let left = info.capacity.sub(&consumed[c.counter]);
        (c.amount > left).then(|| {
            format!(
                "{} of counter {}/{}, which has {} left",
                c.amount, info.set, info.name, left
            )
        })
    })
}
