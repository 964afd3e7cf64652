//! Shared counters (`DRAPartitionableDevices`): the counter sets of a pool, what each device consumes
//! of them, and whether a device still fits in what is left.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::Device;

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

pub(super) fn consumption(
    device: &Device,
    pool: &str,
    sets: &BTreeSet<&str>,
    counters: &BTreeMap<(&str, &str), usize>,
) -> Result<Vec<Consumption>, String> {
    let mut result = Vec::new();
    for consumes in device.consumes_counters.iter().flatten() {
        let set = consumes.counter_set.as_str();
        if !sets.contains(set) {
            return Err(format!(
                "consumes counter set {set}, which pool {pool} does not publish"
            ));
        }
        for (name, counter) in &consumes.counters {
            let index = *counters.get(&(set, name.as_str())).ok_or_else(|| {
                format!("consumes counter {name}, which counter set {set} does not have")
            })?;
            let amount = Quantity::parse(&counter.value.0)
                .map_err(|e| format!("consumes counter {set}/{name}: {e}"))?;
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
