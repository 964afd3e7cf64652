//! Which NVLink clique a ComputeDomain gets, and why one cannot get any (pure: the controller hands in
//! what it listed). A clique is chosen only when enough of its nodes could take one of the domain's pods
//! now: a published, untainted, unallocated channel device and a free GPU. The choice holds nothing:
//! each node's one channel device is taken by a worker's claim when the scheduler allocates it, so a
//! node serves one domain at a time and a domain without workers keeps no node from anyone.
//!
//! ```ignore
//! let fabric = Fabric::from_cluster("gpu.dra.dev", &slices, &claims);
//! let decisions = place_all(&domains, &placements, &fabric);
//! ```

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};

use super::api::{DomainObject, ALL, READY, SINGLE};
use super::channels::{CHANNEL_ATTRIBUTE, CHANNEL_TYPE, CLIQUE_ATTRIBUTE};

/// The device types whose free devices make a node able to run a domain's pod.
const GPU_TYPES: [&str; 2] = ["gpu", "mig"];
/// Taint effects that keep a claim off a channel device.
const BLOCKING_EFFECTS: [&str; 2] = ["NoSchedule", "NoExecute"];

/// One channel device as published: whether a taint keeps claims off it, and which claim holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChannelDevice {
    /// `key=value:effect` of the first NoSchedule or NoExecute taint.
    pub taint: Option<String>,
    /// `namespace/name` of the claim it is allocated to.
    pub allocated_to: Option<String>,
}

/// A node of a clique: its channel device (channel 0) and how many of its GPUs (or MIG devices) no
/// claim holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FabricNode {
    pub channel: Option<ChannelDevice>,
    pub free_gpus: usize,
}

impl FabricNode {
    /// Whether a domain's pod could go here now, or what stops it.
    pub fn problem(&self) -> Option<NodeProblem> {
        let Some(device) = &self.channel else {
            return Some(NodeProblem::ChannelNotPublished);
        };
        if let Some(taint) = &device.taint {
            return Some(NodeProblem::Tainted(taint.clone()));
        }
        if let Some(claim) = &device.allocated_to {
            return Some(NodeProblem::ChannelTaken(claim.clone()));
        }
        if self.free_gpus == 0 {
            return Some(NodeProblem::NoFreeGpu);
        }
        None
    }
}

/// The NVLink fabric as the ResourceSlices of one driver show it: cliques and their nodes, plus how
/// many nodes publish devices but no channel (no fabric: never used for a domain).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fabric {
    /// Clique (`<clusterUUID>.<cliqueId>`) → node name → node.
    pub cliques: BTreeMap<String, BTreeMap<String, FabricNode>>,
    pub nodes_without_fabric: usize,
}

impl Fabric {
    /// Reads the node-local slices of `driver` (the newest generation of each pool) and the allocations
    /// of `claims`.
    pub fn from_cluster(
        driver: &str,
        slices: &[ResourceSlice],
        claims: &[ResourceClaim],
    ) -> Fabric {
        let mut allocated: BTreeMap<(String, String), String> = BTreeMap::new();
        for claim in claims {
            let key = format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim.metadata.name.as_deref().unwrap_or_default()
            );
            let results = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_deref())
                .unwrap_or_default();
            for result in results.iter().filter(|r| r.driver == driver) {
                allocated.insert((result.pool.clone(), result.device.clone()), key.clone());
            }
        }
        let mut newest: BTreeMap<&str, i64> = BTreeMap::new();
        for slice in slices.iter().filter(|s| s.spec.driver == driver) {
            let generation = newest.entry(&slice.spec.pool.name).or_insert(i64::MIN);
            *generation = (*generation).max(slice.spec.pool.generation);
        }
        // Node → (clique seen on its channels, the node).
        let mut nodes: BTreeMap<String, (Option<String>, FabricNode)> = BTreeMap::new();
        for slice in slices.iter().filter(|s| s.spec.driver == driver) {
            let Some(node_name) = slice.spec.node_name.as_deref() else {
                continue;
            };
            if newest.get(slice.spec.pool.name.as_str()) != Some(&slice.spec.pool.generation) {
                continue;
            }
            let (clique, node) = nodes.entry(node_name.to_string()).or_default();
            for device in slice.spec.devices.iter().flatten() {
                let attributes = device.attributes.as_ref();
                let attribute = |name: &str| attributes.and_then(|a| a.get(name));
                let kind = attribute("type").and_then(|a| a.string.as_deref());
                let holder = allocated.get(&(slice.spec.pool.name.clone(), device.name.clone()));
                if kind == Some(CHANNEL_TYPE) {
                    let channel = attribute(CHANNEL_ATTRIBUTE)
                        .and_then(|a| a.int)
                        .and_then(|n| u32::try_from(n).ok());
                    let device_clique = attribute(CLIQUE_ATTRIBUTE).and_then(|a| a.string.clone());
                    let (Some(channel), Some(device_clique)) = (channel, device_clique) else {
                        continue;
                    };
                    // A node is in one clique; a channel that names another is not usable with it.
                    if clique.get_or_insert_with(|| device_clique.clone()) != &device_clique {
                        continue;
                    }
                    // A node serves one domain at a time, through channel 0; other numbers are
                    // what an older plugin published.
                    if channel != 0 {
                        continue;
                    }
                    let taint = device
                        .taints
                        .iter()
                        .flatten()
                        .find(|t| BLOCKING_EFFECTS.contains(&t.effect.as_str()))
                        .map(|t| match &t.value {
                            Some(value) => format!("{}={value}:{}", t.key, t.effect),
                            None => format!("{}:{}", t.key, t.effect),
                        });
                    node.channel = Some(ChannelDevice {
                        taint,
                        allocated_to: holder.cloned(),
                    });
                } else if kind.is_some_and(|k| GPU_TYPES.contains(&k)) && holder.is_none() {
                    node.free_gpus += 1;
                }
            }
        }
        let mut fabric = Fabric::default();
        for (name, (clique, node)) in nodes {
            match clique {
                Some(clique) => {
                    fabric.cliques.entry(clique).or_default().insert(name, node);
                }
                None => fabric.nodes_without_fabric += 1,
            }
        }
        fabric
    }
}

/// Where a domain goes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Placed {
    pub clique: String,
}

/// What the controller does with one domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Placed before (its ComputeDomainPlacement); stays where it is.
    Kept(Placed),
    /// Placed now: its ComputeDomainPlacement is to be written, then the template.
    New(Placed),
    /// Its spec cannot be served (no channel template); retried when the spec changes.
    Refused(String),
    /// No clique has room now; retried when slices or claims change.
    Waiting(String),
}

impl Decision {
    pub fn placed(&self) -> Option<&Placed> {
        match self {
            Decision::Kept(placed) | Decision::New(placed) => Some(placed),
            Decision::Refused(_) | Decision::Waiting(_) => None,
        }
    }

    /// Why the domain is not placed, when it is not.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Decision::Kept(_) | Decision::New(_) => None,
            Decision::Refused(reason) | Decision::Waiting(reason) => Some(reason),
        }
    }
}

/// How many nodes a domain needs: `numNodes`, and at least one (0 means "any number").
pub fn nodes_needed(domain: &DomainObject) -> usize {
    usize::try_from(domain.spec.num_nodes)
        .unwrap_or(usize::MAX)
        .max(1)
}

/// Why a domain's spec cannot be served, if it cannot.
pub fn spec_problem(domain: &DomainObject) -> Option<String> {
    let Some(channel) = &domain.spec.channel else {
        return Some(
            "spec.channel is not set: the controller writes the channel ResourceClaimTemplate named in \
             spec.channel.resourceClaimTemplate.name, and without one the domain's pods have no IMEX \
             channel to claim"
                .into(),
        );
    };
    if channel.resource_claim_template.name.is_empty() {
        return Some("spec.channel.resourceClaimTemplate.name is empty".into());
    }
    match channel.allocation_mode.as_deref() {
        None | Some(SINGLE) | Some(ALL) => None,
        Some(other) => Some(format!(
            "spec.channel.allocationMode {other:?} is not one of \"{SINGLE}\" (each pod gets channel 0) \
             and \"{ALL}\" (each pod gets every channel of its node)"
        )),
    }
}

/// Decides every domain, keyed by UID: a domain with a placement (`placements`: domain UID → clique,
/// only those the controller wrote for that very domain) keeps it; the others are placed on the clique
/// with the most free nodes. Domains being deleted are not placed anew.
pub fn place_all(
    domains: &[DomainObject],
    placements: &BTreeMap<String, String>,
    fabric: &Fabric,
) -> BTreeMap<String, Decision> {
    let mut decisions = BTreeMap::new();
    for domain in domains {
        let decision = if let Some(clique) = placements.get(&domain.uid) {
            Decision::Kept(Placed {
                clique: clique.clone(),
            })
        } else if domain.deleting {
            continue;
        } else if let Some(problem) = spec_problem(domain) {
            Decision::Refused(problem)
        } else {
            match choose(nodes_needed(domain), fabric) {
                Ok(placed) => Decision::New(placed),
                Err(reason) => Decision::Waiting(reason),
            }
        };
        decisions.insert(domain.uid.clone(), decision);
    }
    decisions
}

/// How many nodes of a clique could take a domain's pod now.
fn free_nodes(nodes: &BTreeMap<String, FabricNode>) -> usize {
    nodes
        .values()
        .filter(|node| node.problem().is_none())
        .count()
}

/// The clique with the most nodes free for a new domain of `need` nodes (ties: the name that sorts
/// first); or why none has room.
fn choose(need: usize, fabric: &Fabric) -> Result<Placed, String> {
    let offers: Vec<(&String, usize, usize)> = fabric
        .cliques
        .iter()
        .map(|(clique, nodes)| (clique, free_nodes(nodes), nodes.len()))
        .collect();
    let best = offers
        .iter()
        .filter(|(_, free, _)| *free >= need)
        // Most free nodes first; `min_by` keeps the first of equals, and cliques come sorted by name.
        .min_by(|a, b| b.1.cmp(&a.1));
    if let Some((clique, _, _)) = best {
        return Ok(Placed {
            clique: (*clique).clone(),
        });
    }
    if offers.is_empty() {
        return Err(format!(
            "no node publishes an IMEX channel: no node's GPUs have joined an NVLink fabric ({} node(s) \
             without one)",
            fabric.nodes_without_fabric
        ));
    }
    let mut ranked = offers.clone();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let counts: Vec<String> = ranked
        .iter()
        .map(|(clique, free, nodes)| format!("{clique} has {free} (of {nodes})"))
        .collect();
    Err(format!(
        "no NVLink clique has {need} free node{}: {}; nodes without an NVLink fabric are never used",
        if need == 1 { "" } else { "s" },
        counts.join(", ")
    ))
}

/// What keeps one node of a placed domain's clique from taking one of its pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeProblem {
    /// The node publishes no channel device.
    ChannelNotPublished,
    /// The channel device is tainted (`key=value:effect`).
    Tainted(String),
    /// The channel device is allocated (`namespace/name` of the claim): one domain's pod per node.
    ChannelTaken(String),
    NoFreeGpu,
}

impl fmt::Display for NodeProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeProblem::ChannelNotPublished => write!(f, "publishes no IMEX channel"),
            NodeProblem::Tainted(taint) => write!(f, "channel tainted {taint}"),
            NodeProblem::ChannelTaken(claim) => write!(f, "channel taken by claim {claim}"),
            NodeProblem::NoFreeGpu => write!(f, "no free GPU"),
        }
    }
}

/// Why a pending pod of a domain cannot run yet, as far as the domain is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PendingReason {
    /// The domain has no clique yet (its template does not exist).
    NotPlaced(String),
    /// No node of the domain's clique can take another of its pods.
    CliqueFull {
        clique: String,
        nodes: usize,
        /// Node → what stops it, for every node of the clique.
        problems: BTreeMap<String, NodeProblem>,
    },
    /// Placed with room, but fewer nodes' IMEX daemons are Ready than the domain needs.
    NotReady { ready: usize, needed: usize },
}

impl fmt::Display for PendingReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PendingReason::NotPlaced(reason) => {
                write!(f, "the ComputeDomain is not placed: {reason}")
            }
            PendingReason::CliqueFull {
                clique,
                nodes,
                problems,
            } => {
                // Group the nodes by problem so 18 nodes read as a few lines.
                let mut by_problem: BTreeMap<String, Vec<&str>> = BTreeMap::new();
                for (node, problem) in problems {
                    by_problem
                        .entry(problem.to_string())
                        .or_default()
                        .push(node);
                }
                let groups: Vec<String> = by_problem
                    .iter()
                    .map(|(problem, nodes)| {
                        format!("{} ({}): {problem}", nodes.len(), nodes.join(", "))
                    })
                    .collect();
                write!(
                    f,
                    "0 of the {nodes} nodes of NVLink clique {clique} are free for the ComputeDomain's pods: {}",
                    groups.join("; ")
                )
            }
            PendingReason::NotReady { ready, needed } => write!(
                f,
                "the ComputeDomain is not Ready: {ready} of {needed} nodes' IMEX daemons are Ready"
            ),
        }
    }
}

/// Why a pending pod of `domain` (decided `decision`) cannot be placed; `None` when nothing of the
/// domain stops it (some node of its clique is free, and the domain is Ready).
pub fn why_pending(
    domain: &DomainObject,
    decision: &Decision,
    fabric: &Fabric,
) -> Option<PendingReason> {
    let placed = match decision {
        Decision::Kept(placed) | Decision::New(placed) => placed,
        Decision::Refused(reason) | Decision::Waiting(reason) => {
            return Some(PendingReason::NotPlaced(reason.clone()))
        }
    };
    let nodes = fabric.cliques.get(&placed.clique);
    let problems: BTreeMap<String, NodeProblem> = nodes
        .into_iter()
        .flatten()
        .filter_map(|(name, node)| Some((name.clone(), node.problem()?)))
        .collect();
    let total = nodes.map_or(0, BTreeMap::len);
    if problems.len() == total {
        return Some(PendingReason::CliqueFull {
            clique: placed.clique.clone(),
            nodes: total,
            problems,
        });
    }
    let ready = domain
        .status
        .nodes
        .iter()
        .filter(|n| n.status == READY)
        .count();
    let needed = nodes_needed(domain);
    if ready < needed {
        return Some(PendingReason::NotReady {
            ready: ready.min(needed),
            needed,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domains::api::{
        ChannelSpec, ComputeDomainNode, ComputeDomainSpec, DomainGroup, TemplateRef,
    };
    use serde_json::{json, Value};

    const DRIVER: &str = "gpu.dra.dev";
    const A: &str = "cluster-1.0";
    const B: &str = "cluster-1.1";

    /// A node's slice: `gpus` GPUs and channels 0..`channels` of `clique` (none without a clique).
    fn slice(node: &str, clique: Option<&str>, gpus: usize, channels: u32) -> Value {
        let mut devices: Vec<Value> = (0..gpus)
            .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"type": {"string": "gpu"}}}))
            .collect();
        if let Some(clique) = clique {
            devices.extend((0..channels).map(|n| {
                json!({"name": format!("imex-channel-{n}"), "attributes": {
                    "type": {"string": "imex-channel"},
                    "channel": {"int": n},
                    "nvlinkDomain": {"string": clique},
                }})
            }));
        }
        json!({
            "metadata": {"name": format!("{node}-{DRIVER}")},
            "spec": {"driver": DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices},
        })
    }

    fn taint(slice: &mut Value, channel: u32, effect: &str) {
        let devices = slice["spec"]["devices"].as_array_mut().unwrap();
        let device = devices
            .iter_mut()
            .find(|d| d["name"] == format!("imex-channel-{channel}"))
            .unwrap();
        device["taints"] = json!([{"key": "maintenance", "value": "soon", "effect": effect}]);
    }

    /// A claim allocated `devices` (`node`, `device`) of our driver.
    fn claim(name: &str, devices: &[(&str, &str)]) -> ResourceClaim {
        let results: Vec<Value> = devices
            .iter()
            .map(|(pool, device)| {
                json!({"request": "r", "driver": DRIVER, "pool": pool, "device": device})
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "team"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results}}},
        }))
        .unwrap()
    }

    fn fabric(slices: &[Value], claims: &[ResourceClaim]) -> Fabric {
        let slices: Vec<ResourceSlice> = slices
            .iter()
            .map(|s| serde_json::from_value(s.clone()).unwrap())
            .collect();
        Fabric::from_cluster(DRIVER, &slices, claims)
    }

    /// Two cliques (A: 4 nodes, B: 2) and a node without fabric, each with 2 GPUs and its channel.
    fn cluster() -> Vec<Value> {
        let mut slices: Vec<Value> = (0..4)
            .map(|i| slice(&format!("a{i}"), Some(A), 2, 1))
            .collect();
        slices.extend((0..2).map(|i| slice(&format!("b{i}"), Some(B), 2, 1)));
        slices.push(slice("plain", None, 8, 1));
        slices
    }

    fn domain(name: &str, num_nodes: u32) -> DomainObject {
        DomainObject {
            group: DomainGroup::Ours,
            namespace: "team".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            resource_version: None,
            deleting: false,
            annotations: Default::default(),
            spec: ComputeDomainSpec {
                num_nodes,
                channel: Some(ChannelSpec {
                    resource_claim_template: TemplateRef {
                        name: format!("{name}-channel"),
                    },
                    allocation_mode: None,
                }),
            },
            status: Default::default(),
        }
    }

    fn placements(placed: &[(&str, &str)]) -> BTreeMap<String, String> {
        placed
            .iter()
            .map(|(uid, clique)| (uid.to_string(), clique.to_string()))
            .collect()
    }

    fn new(clique: &str) -> Decision {
        Decision::New(Placed {
            clique: clique.into(),
        })
    }

    #[test]
    fn the_fabric_has_two_cliques_and_one_node_without() {
        let fabric = fabric(&cluster(), &[]);
        assert_eq!(fabric.cliques.len(), 2);
        assert_eq!(fabric.cliques[A].len(), 4);
        assert_eq!(fabric.cliques[B].len(), 2);
        assert_eq!(fabric.nodes_without_fabric, 1);
        assert_eq!(fabric.cliques[A]["a0"].free_gpus, 2);
        assert_eq!(
            fabric.cliques[A]["a0"].channel,
            Some(ChannelDevice::default())
        );
    }

    #[test]
    fn a_domain_goes_to_the_clique_with_most_free_nodes() {
        let fabric = fabric(&cluster(), &[]);
        let none = BTreeMap::new();
        let decisions = place_all(&[domain("d", 2)], &none, &fabric);
        assert_eq!(decisions["uid-d"], new(A));
        // Four nodes fit only A; one node too (numNodes 0 means at least one).
        let decisions = place_all(&[domain("four", 4), domain("any", 0)], &none, &fabric);
        assert_eq!(decisions["uid-four"], new(A));
        assert_eq!(decisions["uid-any"], new(A));
    }

    #[test]
    fn placed_domains_stay_and_empty_ones_hold_no_node() {
        let fabric = fabric(&cluster(), &[]);
        // Forty placed domains without workers: the clique's nodes are all still free for the next.
        let mut domains: Vec<DomainObject> =
            (0..40).map(|i| domain(&format!("empty-{i}"), 4)).collect();
        let placed: Vec<(String, &str)> = domains.iter().map(|d| (d.uid.clone(), A)).collect();
        let placed: BTreeMap<String, String> = placed
            .into_iter()
            .map(|(uid, clique)| (uid, clique.to_string()))
            .collect();
        domains.push(domain("next", 4));
        let decisions = place_all(&domains, &placed, &fabric);
        assert_eq!(
            decisions["uid-empty-7"],
            Decision::Kept(Placed { clique: A.into() })
        );
        assert_eq!(decisions["uid-next"], new(A));
        // A placement for another UID (a copied one) is not this domain's.
        let decisions = place_all(&[domain("d", 1)], &placements(&[("uid-other", B)]), &fabric);
        assert_eq!(decisions["uid-d"], new(A));
    }

    #[test]
    fn a_domain_too_big_for_every_clique_waits_and_says_why() {
        let fabric = fabric(&cluster(), &[]);
        let decisions = place_all(&[domain("big", 5)], &BTreeMap::new(), &fabric);
        let Decision::Waiting(reason) = &decisions["uid-big"] else {
            panic!("{:?}", decisions["uid-big"]);
        };
        assert_eq!(
            reason,
            "no NVLink clique has 5 free nodes: cluster-1.0 has 4 (of 4), cluster-1.1 has 2 (of 2); \
             nodes without an NVLink fabric are never used"
        );
    }

    #[test]
    fn busy_gpus_and_taken_or_tainted_channels_make_nodes_not_free() {
        let mut slices = cluster();
        // a0: both GPUs allocated; a1: channel tainted NoSchedule; a2: channel tainted
        // PreferNoSchedule (does not keep claims off); a3: channel taken by another domain's worker.
        taint(&mut slices[1], 0, "NoSchedule");
        taint(&mut slices[2], 0, "PreferNoSchedule");
        let claims = [
            claim("busy", &[("a0", "gpu-0"), ("a0", "gpu-1")]),
            claim("worker", &[("a3", "imex-channel-0")]),
        ];
        let fabric = fabric(&slices, &claims);
        assert_eq!(fabric.cliques[A]["a0"].free_gpus, 0);
        assert_eq!(
            fabric.cliques[A]["a0"].problem(),
            Some(NodeProblem::NoFreeGpu)
        );
        assert_eq!(
            fabric.cliques[A]["a1"].problem(),
            Some(NodeProblem::Tainted("maintenance=soon:NoSchedule".into()))
        );
        assert_eq!(fabric.cliques[A]["a2"].problem(), None);
        assert_eq!(
            fabric.cliques[A]["a3"].problem(),
            Some(NodeProblem::ChannelTaken("team/worker".into()))
        );
        // A has 1 free node, B 2: two nodes go to B.
        let decisions = place_all(&[domain("two", 2)], &BTreeMap::new(), &fabric);
        assert_eq!(decisions["uid-two"], new(B));
        let decisions = place_all(&[domain("three", 3)], &BTreeMap::new(), &fabric);
        let reason = decisions["uid-three"].reason().unwrap();
        assert!(
            reason.contains("cluster-1.1 has 2 (of 2), cluster-1.0 has 1 (of 4)"),
            "{reason}"
        );
    }

    #[test]
    fn equal_cliques_tie_on_the_name_that_sorts_first() {
        let slices: Vec<Value> = ["y0", "y1", "x0", "x1"]
            .iter()
            .map(|n| {
                slice(
                    n,
                    Some(if n.starts_with('y') { "y.0" } else { "x.0" }),
                    1,
                    1,
                )
            })
            .collect();
        let decisions = place_all(&[domain("d", 2)], &BTreeMap::new(), &fabric(&slices, &[]));
        assert_eq!(decisions["uid-d"], new("x.0"));
    }

    #[test]
    fn only_channel_0_counts() {
        // An older plugin published channels 1..; a node without channel 0 is not free.
        let mut slices = vec![slice("n0", Some(A), 1, 1), slice("n1", Some(A), 1, 4)];
        slices[1]["spec"]["devices"]
            .as_array_mut()
            .unwrap()
            .retain(|d| d["name"] != "imex-channel-0");
        let fabric = fabric(&slices, &[]);
        assert_eq!(
            fabric.cliques[A]["n1"].problem(),
            Some(NodeProblem::ChannelNotPublished)
        );
        let decisions = place_all(&[domain("d", 2)], &BTreeMap::new(), &fabric);
        let reason = decisions["uid-d"].reason().unwrap();
        assert!(reason.contains("cluster-1.0 has 1 (of 2)"), "{reason}");
    }

    #[test]
    fn without_any_fabric_nothing_is_placed() {
        let decisions = place_all(
            &[domain("d", 1)],
            &BTreeMap::new(),
            &fabric(&[slice("plain", None, 8, 0)], &[]),
        );
        let reason = decisions["uid-d"].reason().unwrap();
        assert!(
            reason.starts_with("no node publishes an IMEX channel"),
            "{reason}"
        );
        assert!(reason.contains("1 node(s) without one"), "{reason}");
    }

    #[test]
    fn specs_without_a_channel_or_with_an_unknown_mode_are_refused() {
        let fabric = fabric(&cluster(), &[]);
        let mut no_channel = domain("none", 1);
        no_channel.spec.channel = None;
        let mut some = domain("some", 1);
        some.spec.channel.as_mut().unwrap().allocation_mode = Some("Some".into());
        let mut all = domain("all", 1);
        all.spec.channel.as_mut().unwrap().allocation_mode = Some("All".into());
        let decisions = place_all(&[no_channel, some, all], &BTreeMap::new(), &fabric);
        assert!(
            matches!(&decisions["uid-none"], Decision::Refused(r) if r.starts_with("spec.channel is not set"))
        );
        assert!(
            matches!(&decisions["uid-some"], Decision::Refused(r) if r.contains("allocationMode \"Some\""))
        );
        assert_eq!(decisions["uid-all"], new(A));
    }

    #[test]
    fn a_domain_being_deleted_keeps_its_placement_and_is_not_placed_anew() {
        let fabric = fabric(&cluster(), &[]);
        let mut leaving = domain("leaving", 1);
        leaving.deleting = true;
        let mut unplaced = domain("unplaced", 1);
        unplaced.deleting = true;
        let decisions = place_all(
            &[leaving, unplaced],
            &placements(&[("uid-leaving", B)]),
            &fabric,
        );
        assert_eq!(
            decisions["uid-leaving"],
            Decision::Kept(Placed { clique: B.into() })
        );
        assert!(!decisions.contains_key("uid-unplaced"));
    }

    #[test]
    fn older_pool_generations_are_ignored() {
        let mut old = slice("a0", Some(B), 2, 4);
        old["metadata"]["name"] = json!("old");
        old["spec"]["pool"]["generation"] = json!(0);
        let fabric = fabric(&[old, slice("a0", Some(A), 2, 4)], &[]);
        assert_eq!(fabric.cliques.keys().collect::<Vec<_>>(), vec![A]);
    }

    #[test]
    fn a_pending_pod_is_explained() {
        let mut slices = cluster();
        taint(&mut slices[4], 0, "NoExecute");
        let claims = [
            claim("pod-0-channel", &[("b1", "imex-channel-0")]),
            claim("pod-1-channel", &[("a0", "imex-channel-0")]),
        ];
        let fabric = fabric(&slices, &claims);

        let on_b = domain("on-b", 2);
        let decision = Decision::Kept(Placed { clique: B.into() });
        let why = why_pending(&on_b, &decision, &fabric).unwrap();
        let PendingReason::CliqueFull { problems, .. } = &why else {
            panic!("{why:?}");
        };
        assert_eq!(
            problems["b1"],
            NodeProblem::ChannelTaken("team/pod-0-channel".into())
        );
        assert_eq!(
            why.to_string(),
            "0 of the 2 nodes of NVLink clique cluster-1.1 are free for the ComputeDomain's pods: \
             1 (b0): channel tainted maintenance=soon:NoExecute; 1 (b1): channel taken by claim team/pod-0-channel"
        );

        // On A, three nodes are free: the pod fits, but the domain is not Ready yet.
        let mut on_a = domain("on-a", 2);
        let decision = Decision::Kept(Placed { clique: A.into() });
        assert_eq!(
            why_pending(&on_a, &decision, &fabric),
            Some(PendingReason::NotReady {
                ready: 0,
                needed: 2
            })
        );
        on_a.status.nodes = ["a0", "a1"]
            .iter()
            .map(|n| ComputeDomainNode {
                name: n.to_string(),
                status: READY.into(),
                ..Default::default()
            })
            .collect();
        assert_eq!(why_pending(&on_a, &decision, &fabric), None);

        let waiting = Decision::Waiting("no room".into());
        assert_eq!(
            why_pending(&on_a, &waiting, &fabric).unwrap().to_string(),
            "the ComputeDomain is not placed: no room"
        );
    }
}
