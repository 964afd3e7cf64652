//! What the cluster holds, indexed once for all nodes: slices by pool, and a pool by the node it is
//! local to (every slice names that node); pools spanning nodes (`nodeSelector`, `allNodes`,
//! per-device node selection) go to every node, and `Pools::from_slices` decides which nodes they
//! serve. Devices held by claims are indexed by pool too, so each node costs only its own pools.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceSlice};

use crate::cel::allocator::{self, Candidate, InUse};

use super::cluster::Cluster;
use super::subject::Subject;

pub(super) type PoolKey = (String, String);

/// Slices by the node whose pools they belong to, and the pools that may serve any node.
pub(super) struct SliceIndex<'a> {
    slices: &'a [ResourceSlice],
    /// Indexes of each node's slices, in order.
    pub(super) local: HashMap<String, Vec<usize>>,
    local_pools: HashMap<String, Vec<PoolKey>>,
    spanning: Vec<usize>,
    spanning_pools: Vec<PoolKey>,
}

impl<'a> SliceIndex<'a> {
    pub(super) fn new(slices: &'a [ResourceSlice]) -> SliceIndex<'a> {
        let mut by_pool: BTreeMap<(&str, &str), Vec<usize>> = BTreeMap::new();
        for (i, slice) in slices.iter().enumerate() {
            let key = (slice.spec.driver.as_str(), slice.spec.pool.name.as_str());
            by_pool.entry(key).or_default().push(i);
        }
        let mut index = SliceIndex {
            slices,
            local: HashMap::new(),
            local_pools: HashMap::new(),
            spanning: Vec::new(),
            spanning_pools: Vec::new(),
        };
        fn node_of(s: &ResourceSlice) -> Option<&str> {
            s.spec
                .node_name
                .as_deref()
                .filter(|n| !n.is_empty() && s.spec.per_device_node_selection != Some(true))
        }
        for ((driver, pool), members) in by_pool {
            let key = (driver.to_string(), pool.to_string());
            let first = members.first().and_then(|i| node_of(&slices[*i]));
            match first.filter(|node| members.iter().all(|i| node_of(&slices[*i]) == Some(*node))) {
                Some(node) => {
                    index
                        .local
                        .entry(node.to_string())
                        .or_default()
                        .extend(members);
                    index
                        .local_pools
                        .entry(node.to_string())
                        .or_default()
                        .push(key);
                }
                None => {
                    index.spanning.extend(members);
                    index.spanning_pools.push(key);
                }
            }
        }
        for members in index.local.values_mut() {
            members.sort_unstable();
        }
        index
    }

    /// The slices of every pool that may serve `node`: borrowed when they lie side by side (as
    /// `Cluster::sort_slices` puts them) and no pool spans nodes, else copied.
    pub(super) fn slices_for(&self, node: &str) -> Cow<'a, [ResourceSlice]> {
        let local = self.local.get(node).map(Vec::as_slice).unwrap_or_default();
        let side_by_side = match (local.first(), local.last()) {
            (Some(first), Some(last)) => last - first + 1 == local.len(),
            _ => true,
        };
        if self.spanning.is_empty() && side_by_side {
            return Cow::Borrowed(match local.first() {
                Some(first) => &self.slices[*first..first + local.len()],
                None => &[],
            });
        }
        Cow::Owned(
            local
                .iter()
                .chain(&self.spanning)
                .map(|i| self.slices[*i].clone())
                .collect(),
        )
    }

    pub(super) fn pools_for<'b>(&'b self, node: &str) -> impl Iterator<Item = &'b PoolKey> {
        self.local_pools
            .get(node)
            .into_iter()
            .flatten()
            .chain(&self.spanning_pools)
    }
}

/// What claims hold, by pool, as `in_use` gathers it from their allocation results.
pub(super) struct Held {
    by_pool: HashMap<PoolKey, InUse>,
    /// Devices held by the subject's own allocated claims, with the claim's name.
    pub(super) by_subject: HashMap<Candidate, String>,
}

impl Held {
    pub(super) fn new(cluster: &Cluster, subject: &Subject) -> Held {
        let mut results: HashMap<PoolKey, Vec<&DeviceRequestAllocationResult>> = HashMap::new();
        let replaced: BTreeSet<&str> = subject.replaces.iter().map(String::as_str).collect();
        for claim in &cluster.claims {
            let name = format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or("default"),
                claim.metadata.name.as_deref().unwrap_or_default()
            );
            if replaced.contains(name.as_str()) {
                continue;
            }
            for result in crate::claims::allocation_results(claim) {
                results
                    .entry((result.driver.clone(), result.pool.clone()))
                    .or_default()
                    .push(result);
            }
        }
        let mut by_subject = HashMap::new();
        for claim in &subject.claims {
            let allocated = claim.allocation.iter().flat_map(|a| a.devices.iter());
            for result in allocated.flat_map(|d| d.results.iter().flatten()) {
                by_subject.insert(Candidate::of_result(result), claim.name.clone());
                if replaced.contains(claim.name.as_str()) {
                    // A claim from a file with an allocation holds its devices as the stored one did.
                    results
                        .entry((result.driver.clone(), result.pool.clone()))
                        .or_default()
                        .push(result);
                }
            }
        }
        let by_pool = results
            .into_iter()
            .map(|(key, results)| (key, allocator::in_use(results)))
            .collect();
        Held {
            by_pool,
            by_subject,
        }
    }

    pub(super) fn for_pools<'a>(&self, pools: impl Iterator<Item = &'a PoolKey>) -> InUse {
        let mut held = InUse::default();
        for key in pools {
            if let Some(pool) = self.by_pool.get(key) {
                held.devices.extend(pool.devices.iter().cloned());
                for (device, consumed) in &pool.shares {
                    held.add_share(device.clone(), consumed.clone());
                }
                for (device, holders) in &pool.share_holders {
                    held.share_holders.insert(device.clone(), *holders);
                }
            }
        }
        held
    }
}
