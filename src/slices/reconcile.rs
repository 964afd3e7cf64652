//! Reconciliation of stored ResourceSlices with desired ones (pure): which stored slice each desired one
//! replaces, which are stale, whether anything must be written at all, and the pool generation. Slices
//! are compared by what they say, with quantities in canonical form and server-set fields ignored.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::{CounterSet, Device, ResourceSlice};

use crate::quantity::parse_nanos;

pub(super) struct Reconciliation<'a> {
    pub is_noop: bool,
    pub generation: i64,
    pub stale: Vec<&'a ResourceSlice>,
    /// Every desired slice, with the stored slice it replaces (if any).
    pub writes: Vec<(ResourceSlice, Option<&'a ResourceSlice>)>,
}

/// Matches stored slices to desired ones by what they hold (device and counter-set names; a single
/// slice always matches a single slice) and decides what must be written.
pub(super) fn reconcile<'a>(
    stored: &'a [ResourceSlice],
    desired: &[ResourceSlice],
    pool: &str,
) -> Reconciliation<'a> {
    let (in_pool, other_pools): (Vec<&ResourceSlice>, Vec<&ResourceSlice>) =
        stored.iter().partition(|s| s.spec.pool.name == pool);
    let mut unmatched: Vec<Option<&ResourceSlice>> = in_pool.iter().copied().map(Some).collect();
    let mut writes = Vec::with_capacity(desired.len());
    for want in desired {
        let names = content_names(want);
        let position = unmatched
            .iter()
            .position(|s| s.is_some_and(|s| content_names(s) == names))
            .or_else(|| (desired.len() == 1 && in_pool.len() == 1).then_some(0));
        let existing = position.and_then(|i| unmatched[i].take());
        writes.push((want.clone(), existing));
    }
    let mut stale: Vec<&ResourceSlice> = other_pools;
    stale.extend(unmatched.into_iter().flatten());

    let generations: BTreeSet<i64> = in_pool.iter().map(|s| s.spec.pool.generation).collect();
    let newest = generations.last().copied().unwrap_or(0);
    let changed: Vec<usize> = (0..writes.len())
        .filter(|&i| {
            let (want, existing) = &writes[i];
            !existing.is_some_and(|have| same_content(want, have))
        })
        .collect();
    let consistent = stale.is_empty() && generations.len() == 1;
    if consistent && changed.is_empty() {
        return Reconciliation {
            is_noop: true,
            generation: newest,
            stale,
            writes,
        };
    }
    // One slice updated in place keeps the pool's generation, as the upstream controller does: a
    // taint on one GPU is one write, not a rewrite of the pool. Anything more bumps the generation
    // and writes every slice, so consumers never mix slices of two generations.
    if consistent && changed.len() == 1 && writes[changed[0]].1.is_some() {
        let only = writes.swap_remove(changed[0]);
        return Reconciliation {
            is_noop: false,
            generation: newest,
            stale,
            writes: vec![only],
        };
    }
    Reconciliation {
        is_noop: false,
        generation: newest + 1,
        stale,
        writes,
    }
}

/// What identifies a slice across syncs: its device names and its counter-set names.
fn content_names(slice: &ResourceSlice) -> BTreeSet<String> {
    let devices = slice.spec.devices.iter().flatten().map(|d| d.name.clone());
    let sets = slice
        .spec
        .shared_counters
        .iter()
        .flatten()
        .map(|set| format!("counter set {}", set.name));
    devices.chain(sets).collect()
}

/// Whether a stored slice already says what we want (ignoring the generation and server-set fields).
fn same_content(want: &ResourceSlice, have: &ResourceSlice) -> bool {
    want.spec.driver == have.spec.driver
        && want.spec.node_name == have.spec.node_name
        && want.spec.pool.resource_slice_count == have.spec.pool.resource_slice_count
        && want.metadata.owner_references == have.metadata.owner_references
        && same_counter_sets(
            want.spec.shared_counters.as_deref().unwrap_or_default(),
            have.spec.shared_counters.as_deref().unwrap_or_default(),
        )
        && same_devices(
            want.spec.devices.as_deref().unwrap_or_default(),
            have.spec.devices.as_deref().unwrap_or_default(),
        )
}

fn same_devices(want: &[Device], have: &[Device]) -> bool {
    want.len() == have.len()
        && want
            .iter()
            .zip(have)
            .all(|(a, b)| comparable(a) == comparable(b))
}

fn same_counter_sets(want: &[CounterSet], have: &[CounterSet]) -> bool {
    let canonical = |sets: &[CounterSet]| -> Vec<CounterSet> {
        sets.iter()
            .map(|set| {
                let mut set = set.clone();
                for counter in set.counters.values_mut() {
                    canonicalize(&mut counter.value.0);
                }
                set
            })
            .collect()
    };
    canonical(want) == canonical(have)
}

/// Writes a quantity the way it compares: the API server may store `40Gi` for `42949672960`.
fn canonicalize(quantity: &mut String) {
    if let Some(parsed) = parse_nanos(quantity) {
        *quantity = parsed.to_string();
    }
}

/// A device with its quantities (capacities, their request policies, counters) in canonical form and
/// server-set taint times dropped.
fn comparable(device: &Device) -> Device {
    let mut device = device.clone();
    if let Some(capacity) = device.capacity.as_mut() {
        for value in capacity.values_mut() {
            canonicalize(&mut value.value.0);
            if let Some(policy) = value.request_policy.as_mut() {
                let range = policy.valid_range.as_mut();
                for quantity in policy
                    .default
                    .iter_mut()
                    .chain(policy.valid_values.iter_mut().flatten())
                    .chain(range.into_iter().flat_map(|r| {
                        std::iter::once(&mut r.min)
                            .chain(r.max.iter_mut())
                            .chain(r.step.iter_mut())
                    }))
                {
                    canonicalize(&mut quantity.0);
                }
            }
        }
    }
    for consumption in device.consumes_counters.iter_mut().flatten() {
        for counter in consumption.counters.values_mut() {
            canonicalize(&mut counter.value.0);
        }
    }
    if let Some(taints) = device.taints.as_mut() {
        for taint in taints.iter_mut() {
            taint.time_added = None;
        }
    }
    device
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{self, MigMode, NodeDevices};
    use crate::gpu::{FakeBackend, GpuBackend};
    use crate::slices::publisher::desired_slices;
    use crate::slices::ServerVersion;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    const V1_35: ServerVersion = ServerVersion { minor: 35 };

    fn node(profile: &str, mig_mode: MigMode) -> NodeDevices {
        devices::node_devices(
            &FakeBackend::new("node-a", profile)
                .unwrap()
                .inventory()
                .unwrap(),
            mig_mode,
        )
    }

    fn h100_devices() -> NodeDevices {
        node("dgx-h100", MigMode::Static)
    }

    fn stored(mut slice: ResourceSlice, name: &str, generation: i64) -> ResourceSlice {
        slice.metadata.name = Some(name.to_string());
        slice.metadata.generate_name = None;
        slice.spec.pool.generation = generation;
        slice
    }

    #[test]
    fn identical_slices_need_no_writes_even_with_canonicalized_quantities() {
        let desired = desired_slices("gpu.dra.dev", "node-a", "uid-1", &h100_devices(), V1_35);
        let mut have = stored(desired[0].clone(), "s1", 3);
        for device in have.spec.devices.as_mut().unwrap() {
            device
                .capacity
                .as_mut()
                .unwrap()
                .get_mut("memory")
                .unwrap()
                .value
                .0 = "81559Mi".into();
        }
        let plan = reconcile(std::slice::from_ref(&have), &desired, "node-a");
        assert!(plan.is_noop);
    }

    #[test]
    fn request_policies_compare_by_value_and_a_new_one_is_a_change() {
        let mut node = h100_devices();
        let shares = crate::devices::MemoryShares {
            minimum_bytes: 1 << 30,
            step_bytes: 1 << 30,
        };
        let unshared = desired_slices("gpu.dra.dev", "node-a", "uid-1", &node, V1_35);
        crate::devices::share_for_mps(&mut node, shares);
        let desired = desired_slices("gpu.dra.dev", "node-a", "uid-1", &node, V1_35);
        let mut have = stored(desired[0].clone(), "s1", 3);
        for device in have.spec.devices.as_mut().unwrap() {
            let memory = device.capacity.as_mut().unwrap().get_mut("memory").unwrap();
            let policy = memory.request_policy.as_mut().unwrap();
            policy.default = Some(Quantity("1073741824".into()));
            policy.valid_range.as_mut().unwrap().step = Some(Quantity("1024Mi".into()));
        }
        assert!(reconcile(std::slice::from_ref(&have), &desired, "node-a").is_noop);
        let before = stored(unshared[0].clone(), "s1", 3);
        assert!(!reconcile(std::slice::from_ref(&before), &desired, "node-a").is_noop);
    }

    #[test]
    fn one_changed_slice_is_updated_alone_and_keeps_the_generation() {
        let node = node("dgx-h100", MigMode::Dynamic);
        let desired = desired_slices("gpu.dra.dev", "node-a", "uid-1", &node, V1_35);
        let stored_slices: Vec<ResourceSlice> = desired
            .iter()
            .enumerate()
            .map(|(i, s)| stored(s.clone(), &format!("s{i}"), 5))
            .collect();
        let mut tainted = node.clone();
        tainted.gpus[3].devices[0].taints =
            Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
                key: "gpu.dra.dev/xid".into(),
                value: Some("79".into()),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]);
        let want = desired_slices("gpu.dra.dev", "node-a", "uid-1", &tainted, V1_35);
        let plan = reconcile(&stored_slices, &want, "node-a");
        assert!(!plan.is_noop);
        assert_eq!(plan.generation, 5);
        assert_eq!(plan.writes.len(), 1);
        // gpu-3's devices share the second device slice with gpu-2's (s0 holds the counter sets).
        assert_eq!(
            plan.writes[0].1.and_then(|s| s.metadata.name.as_deref()),
            Some("s2")
        );

        // Two GPUs changing at once bump the generation and rewrite the pool.
        tainted.gpus[5].devices[0].taints = tainted.gpus[3].devices[0].taints.clone();
        let want = desired_slices("gpu.dra.dev", "node-a", "uid-1", &tainted, V1_35);
        let plan = reconcile(&stored_slices, &want, "node-a");
        assert_eq!(plan.generation, 6);
        assert_eq!(plan.writes.len(), want.len());
    }

    #[test]
    fn changed_devices_update_in_place() {
        let devices = h100_devices();
        let mut fewer = devices.clone();
        fewer.gpus.truncate(7);
        let old = desired_slices("gpu.dra.dev", "node-a", "uid-1", &fewer, V1_35);
        let have = stored(old[0].clone(), "s1", 3);
        let desired = desired_slices("gpu.dra.dev", "node-a", "uid-1", &devices, V1_35);
        let plan = reconcile(std::slice::from_ref(&have), &desired, "node-a");
        assert!(!plan.is_noop);
        assert_eq!(
            plan.generation, 3,
            "a single in-place update keeps the generation"
        );
        assert!(plan.stale.is_empty());
        assert_eq!(
            plan.writes[0].1.and_then(|s| s.metadata.name.as_deref()),
            Some("s1")
        );
    }

    #[test]
    fn slices_of_other_pools_and_duplicates_are_stale() {
        let desired = desired_slices("gpu.dra.dev", "node-a", "uid-1", &h100_devices(), V1_35);
        let mut renamed_pool = stored(desired[0].clone(), "old-pool", 1);
        renamed_pool.spec.pool.name = "old".into();
        let duplicate = stored(desired[0].clone(), "dup", 1);
        let keep = stored(desired[0].clone(), "keep", 1);
        let all = vec![renamed_pool, keep, duplicate];
        let plan = reconcile(&all, &desired, "node-a");
        assert!(!plan.is_noop);
        let stale: Vec<_> = plan
            .stale
            .iter()
            .map(|s| s.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(stale, vec!["old-pool", "dup"]);
    }

    #[test]
    fn stored_dynamic_mig_slices_with_canonical_counters_need_no_writes() {
        let mut node = node("dgx-h100", MigMode::Dynamic);
        // A memory counter in bytes, as a GPU whose memory can run out before its slices has.
        let bytes = k8s_openapi::api::resource::v1::Counter {
            value: k8s_openapi::apimachinery::pkg::api::resource::Quantity("85520809984".into()),
        };
        let gpu = &mut node.gpus[0];
        let set = gpu.counter_set.as_mut().unwrap();
        set.counters.insert("memory".into(), bytes.clone());
        for device in &mut gpu.devices {
            device.consumes_counters.as_mut().unwrap()[0]
                .counters
                .insert("memory".into(), bytes.clone());
        }
        let desired = desired_slices("gpu.dra.dev", "node-a", "uid-1", &node, V1_35);
        assert!(desired[0].spec.devices.is_none());
        assert_eq!(desired[0].spec.shared_counters.as_ref().unwrap().len(), 8);
        let mut stored_slices: Vec<ResourceSlice> = desired
            .iter()
            .enumerate()
            .map(|(i, s)| stored(s.clone(), &format!("s{i}"), 2))
            .collect();
        // The server writes memory counters in its canonical form.
        let set = &mut stored_slices[0].spec.shared_counters.as_mut().unwrap()[0];
        let memory = set.counters.get_mut("memory").unwrap();
        memory.value.0 = format!("{}Mi", 81559);
        stored_slices.reverse();
        assert!(reconcile(&stored_slices, &desired, "node-a").is_noop);

        // A counter that really changed is written.
        let set = &mut stored_slices
            .last_mut()
            .unwrap()
            .spec
            .shared_counters
            .as_mut()
            .unwrap()[0];
        set.counters.get_mut("ofa-engines").unwrap().value.0 = "2".into();
        assert!(!reconcile(&stored_slices, &desired, "node-a").is_noop);
    }
}
