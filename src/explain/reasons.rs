//! Why the allocator said no on a node, in specific words. The allocator's own message names one
//! request and counts; this looks at the node's devices per request the way the allocator does
//! (class selectors, then the request's, first "false" wins; then in use, taints, shared counters) and
//! counts each cause: "request gpu (2 wanted): 8 GPUs: 1 free, 5 allocated to other claims, 2 tainted
//! gpu.dra.dev/xid=79:NoExecute", "class gpu.dra.dev: selector `...` matches 0 of 8 devices", "no two
//! free GPUs share nvlinkDomain". Where nothing finer explains it, the allocator's message stands.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::resource::v1::{Device, DeviceToleration};

use crate::cel::allocator::{
    share_shortfall, untolerated_taint, AllocationError, Candidate, InUse, Pools,
};
use crate::cel::quantity::Quantity;
use crate::cel::DeviceView;

use super::plan::{Alternative, ClaimPlan, RequestPlan};
use super::report::{DeviceCounts, Reason, ReasonKind};

/// What the breakdown of one node works from.
pub(super) struct NodeState<'a> {
    pub(super) pools: &'a Pools,
    /// What other claims hold, plus what the pod's earlier claims took.
    pub(super) in_use: &'a InUse,
    /// Devices of `in_use` that claims of this pod hold, with the claim's name.
    pub(super) pod_held: &'a HashMap<Candidate, String>,
}

struct Dev<'a> {
    candidate: &'a Candidate,
    device: &'a Device,
    view: &'a DeviceView,
}

/// How one alternative fares on the node.
struct Tally {
    counts: DeviceCounts,
    /// The first selector that matched none of the devices it saw: (selector, the devices it saw).
    cut: Option<(usize, Vec<usize>)>,
    /// Device indexes that match, and those of them that are free.
    matching: Vec<usize>,
    free: Vec<usize>,
}

impl Tally {
    fn satisfied(&self) -> bool {
        match self.counts.wanted {
            Some(wanted) => wanted > 0 && self.free.len() >= wanted,
            None => !self.matching.is_empty() && self.free.len() == self.matching.len(),
        }
    }

    fn wanted(&self) -> usize {
        self.counts.wanted.unwrap_or(self.matching.len())
    }
}

/// The reasons for the allocator's `failure` on this node, for the claims in `plans` (with `prefix`
/// naming the claim when the pod has several).
pub(super) fn explain(
    node: &NodeState<'_>,
    plans: &[&ClaimPlan],
    several_claims: bool,
    error: &AllocationError,
    allocator_message: &str,
) -> Vec<Reason> {
    let devices: Vec<Dev<'_>> = node
        .pools
        .device_views()
        .map(|(candidate, device, view)| Dev {
            candidate,
            device,
            view,
        })
        .collect();
    let mut reasons = Vec::new();
    let skipped: Vec<Reason> = node
        .pools
        .skipped()
        .iter()
        .map(|p| {
            let (kind, reason) = if p.invalid {
                (ReasonKind::PoolInvalid, format!("invalid: {}", p.reason))
            } else {
                (ReasonKind::PoolIncomplete, p.reason.clone())
            };
            Reason::new(kind, format!("pool {}/{} {reason}", p.driver, p.pool))
        })
        .collect();
    if devices.is_empty() {
        if skipped.is_empty() {
            reasons.push(Reason::new(
                ReasonKind::NoDevices,
                "no devices published for this node",
            ));
        }
        reasons.extend(skipped);
        return reasons;
    }
    match error {
        AllocationError::PoolNotReady { invalid, .. } => {
            let kind = if *invalid {
                ReasonKind::PoolInvalid
            } else {
                ReasonKind::PoolIncomplete
            };
            reasons.push(Reason::new(kind, allocator_message));
        }
        AllocationError::AllModeConstraint { .. } => {
            reasons.push(Reason::new(ReasonKind::Constraint, allocator_message));
        }
        _ => {}
    }
    let remaining = node.pools.remaining_counters(node.in_use);
    let prefix = |claim: &str| {
        if several_claims {
            format!("claim {claim}: ")
        } else {
            String::new()
        }
    };
    // Per claim, per request: the tally of the first alternative that is met alone, else all of them.
    let mut met: Vec<(&ClaimPlan, &RequestPlan, Tally)> = Vec::new();
    for plan in plans {
        for request in &plan.requests {
            let mut tallies: Vec<(&Alternative, Tally)> = request
                .alternatives
                .iter()
                .map(|a| (a, tally(a, &plan.name, &devices, node, &remaining)))
                .collect();
            if let Some(i) = tallies.iter().position(|(_, t)| t.satisfied()) {
                met.push((plan, request, tallies.swap_remove(i).1));
                continue;
            }
            for (alternative, tally) in tallies {
                reasons.push(shortfall(&prefix(&plan.name), alternative, tally, &devices));
            }
        }
    }
    if reasons.is_empty() {
        reasons.extend(constraints(plans, &met, &devices, &prefix));
    }
    if reasons.is_empty() {
        reasons.extend(together(&met, &devices));
    }
    if reasons.is_empty() {
        reasons.push(Reason::new(ReasonKind::Other, allocator_message));
    }
    reasons.extend(skipped);
    reasons
}

fn tally(
    alternative: &Alternative,
    claim: &str,
    devices: &[Dev<'_>],
    node: &NodeState<'_>,
    remaining: &BTreeMap<(String, String, String, String), Quantity>,
) -> Tally {
    let mut counts = DeviceCounts {
        claim: claim.to_string(),
        request: alternative.label.clone(),
        on_node: devices.len(),
        wanted: alternative.wanted,
        ..Default::default()
    };
    let mut seen: Vec<Vec<usize>> = vec![Vec::new(); alternative.selectors.len()];
    let mut passed = vec![0usize; alternative.selectors.len()];
    let (mut matching, mut free) = (Vec::new(), Vec::new());
    'devices: for (index, dev) in devices.iter().enumerate() {
        for (s, compiled) in alternative.selectors.iter().enumerate() {
            seen[s].push(index);
            match compiled.selector.matches(dev.view) {
                Ok(true) => passed[s] += 1,
                Ok(false) => continue 'devices,
                Err(e) => {
                    let message = format!("{}: selector #{s}: CEL {e}", compiled.origin);
                    *counts.selector_errors.entry(message).or_default() += 1;
                    continue 'devices;
                }
            }
        }
        matching.push(index);
        if !alternative.admin && node.in_use.devices.contains(dev.candidate) {
            match node.pod_held.get(dev.candidate) {
                Some(claim) => *counts.held_by_pod.entry(claim.clone()).or_default() += 1,
                None => counts.allocated_to_other_claims += 1,
            }
        } else if let Some(taint) = untolerated(dev.device, &alternative.tolerations) {
            *counts.tainted.entry(taint).or_default() += 1;
        } else if let Some(why) = share_shortfall(
            dev.device,
            alternative.capacity.as_ref(),
            node.in_use.shares.get(dev.candidate),
            node.in_use
                .share_holders
                .get(dev.candidate)
                .copied()
                .unwrap_or_default(),
        ) {
            counts.capacity_short.insert(dev.device.name.clone(), why);
        } else if !alternative.admin && counters_used_up(dev, remaining) {
            counts.shared_counters_used_up += 1;
        } else {
            free.push(index);
        }
    }
    counts.matching = matching.len();
    counts.free = free.len();
    let cut = (0..seen.len()).find(|s| !seen[*s].is_empty() && passed[*s] == 0);
    Tally {
        cut: cut.map(|s| (s, std::mem::take(&mut seen[s]))),
        counts,
        matching,
        free,
    }
}

fn shortfall(prefix: &str, alternative: &Alternative, tally: Tally, devices: &[Dev<'_>]) -> Reason {
    let counts = &tally.counts;
    let label = &alternative.label;
    let (kind, message) = if tally.matching.is_empty() {
        let message = match tally.cut {
            Some((s, saw)) => {
                let compiled = &alternative.selectors[s];
                let noun = noun_of(saw.len(), saw.iter().map(|i| devices[*i].device));
                let saw = saw.len();
                if compiled.from_class {
                    format!(
                        "{prefix}request {label}: {}: selector `{}` matches 0 of {saw} {noun}",
                        compiled.origin, compiled.expression
                    )
                } else {
                    format!(
                        "{prefix}request {label}: selector `{}` matches 0 of {saw} {noun} of class {}",
                        compiled.expression, alternative.class
                    )
                }
            }
            None => {
                let errors: Vec<String> = counts.selector_errors.keys().cloned().collect();
                format!(
                    "{prefix}request {label}: no device matches: selector errors: {}",
                    errors.join("; ")
                )
            }
        };
        (ReasonKind::NoMatch, message)
    } else {
        let matched = tally.matching.iter().map(|i| devices[*i].device);
        let noun = noun_of(tally.matching.len(), matched);
        let wanted = match counts.wanted {
            Some(n) => n.to_string(),
            None => format!("all {}", tally.matching.len()),
        };
        let mut parts = Vec::new();
        if counts.free > 0 {
            parts.push(format!("{} free", counts.free));
        }
        if counts.allocated_to_other_claims > 0 {
            parts.push(format!(
                "{} allocated to other claims",
                counts.allocated_to_other_claims
            ));
        }
        for (claim, n) in &counts.held_by_pod {
            parts.push(format!("{n} held by this pod's claim {claim}"));
        }
        for (taint, n) in &counts.tainted {
            parts.push(format!("{n} tainted {taint}"));
        }
        match counts.shared_counters_used_up {
            0 => {}
            1 => parts.push("1 overlaps allocated devices (shared counters used up)".into()),
            n => parts.push(format!(
                "{n} overlap allocated devices (shared counters used up)"
            )),
        }
        for (device, why) in &counts.capacity_short {
            parts.push(format!("{device}: {why}"));
        }
        if counts.free == 0 && parts.is_empty() {
            parts.push("0 free".into());
        }
        (
            ReasonKind::TooFewFree,
            format!(
                "{prefix}request {label} ({wanted} wanted): {} {noun}: {}",
                tally.matching.len(),
                parts.join(", ")
            ),
        )
    };
    Reason {
        kind,
        message,
        devices: Some(tally.counts),
        resource: None,
    }
}

/// `matchAttribute` / `distinctAttribute` constraints that the free devices cannot meet.
fn constraints(
    plans: &[&ClaimPlan],
    met: &[(&ClaimPlan, &RequestPlan, Tally)],
    devices: &[Dev<'_>],
    prefix: &dyn Fn(&str) -> String,
) -> Vec<Reason> {
    let mut reasons = Vec::new();
    for plan in plans {
        for (matching, attribute, scope) in &plan.constraints {
            let covered: Vec<&Tally> = met
                .iter()
                .filter(|(p, r, _)| {
                    p.name == plan.name
                        && (scope.is_empty()
                            || scope.iter().any(|s| {
                                s == &r.name || s.split('/').next() == Some(r.name.as_str())
                            }))
                })
                .map(|(_, _, t)| t)
                .collect();
            let wanted: usize = covered.iter().map(|t| t.wanted()).sum();
            let free: BTreeSet<usize> = covered
                .iter()
                .flat_map(|t| t.free.iter().copied())
                .collect();
            let mut groups: BTreeMap<String, usize> = BTreeMap::new();
            for &i in &free {
                if let Some(value) = attribute_value(&devices[i], attribute) {
                    *groups.entry(value).or_default() += 1;
                }
            }
            let short = attribute.rsplit('/').next().unwrap_or(attribute);
            let noun = noun_of(wanted, free.iter().map(|i| devices[*i].device));
            let message = if *matching {
                let largest = groups.values().copied().max().unwrap_or(0);
                (largest < wanted).then(|| {
                    let most = match largest {
                        0 => format!("none has {short}"),
                        1 => "each value has 1".to_string(),
                        n => format!("at most {n} do"),
                    };
                    format!(
                        "{}no {} free {noun} share {short} ({most})",
                        prefix(&plan.name),
                        number(wanted)
                    )
                })
            } else {
                (groups.len() < wanted).then(|| {
                    format!(
                        "{}no {} free {noun} have distinct {short} ({} values among the free ones)",
                        prefix(&plan.name),
                        number(wanted),
                        groups.len()
                    )
                })
            };
            if let Some(message) = message {
                reasons.push(Reason::new(ReasonKind::Constraint, message));
            }
        }
    }
    reasons
}

/// Requests that are each met alone but want more of the same free devices than there are.
fn together(met: &[(&ClaimPlan, &RequestPlan, Tally)], devices: &[Dev<'_>]) -> Vec<Reason> {
    if met.len() < 2 {
        return Vec::new();
    }
    let wanted: usize = met.iter().map(|(_, _, t)| t.wanted()).sum();
    let free: BTreeSet<usize> = met
        .iter()
        .flat_map(|(_, _, t)| t.free.iter().copied())
        .collect();
    if free.len() >= wanted {
        return Vec::new();
    }
    let names: Vec<String> = met
        .iter()
        .map(|(p, r, t)| {
            let claims: BTreeSet<&str> = met.iter().map(|(p, _, _)| p.name.as_str()).collect();
            let name = if claims.len() > 1 {
                format!("{}:{}", p.name, r.name)
            } else {
                r.name.clone()
            };
            format!("{name} {}", t.wanted())
        })
        .collect();
    let noun = noun_of(free.len(), free.iter().map(|i| devices[*i].device));
    vec![Reason::new(
        ReasonKind::Together,
        format!(
            "requests {} want {wanted} devices together; {} {noun} are free",
            names.join(", "),
            free.len()
        ),
    )]
}

/// The first NoSchedule / NoExecute taint no toleration tolerates (as the allocator decides it), as
/// `key=value:Effect`.
fn untolerated(device: &Device, tolerations: &[DeviceToleration]) -> Option<String> {
    let taint = untolerated_taint(device, tolerations)?;
    Some(match taint.value.as_deref() {
        Some(value) if !value.is_empty() => format!("{}={value}:{}", taint.key, taint.effect),
        _ => format!("{}:{}", taint.key, taint.effect),
    })
}

/// Whether a counter the device consumes has less left than it needs.
fn counters_used_up(
    dev: &Dev<'_>,
    remaining: &BTreeMap<(String, String, String, String), Quantity>,
) -> bool {
    let mut wanted: BTreeMap<(&str, &str), Quantity> = BTreeMap::new();
    for consumption in dev.device.consumes_counters.iter().flatten() {
        for (name, counter) in &consumption.counters {
            let Ok(amount) = Quantity::parse(&counter.value.0) else {
                continue;
            };
            let total = wanted
                .entry((consumption.counter_set.as_str(), name.as_str()))
                .or_insert_with(Quantity::zero);
            *total = total.add(&amount);
        }
    }
    wanted.iter().any(|((set, name), amount)| {
        let key = (
            dev.candidate.driver.clone(),
            dev.candidate.pool.clone(),
            set.to_string(),
            name.to_string(),
        );
        remaining.get(&key).is_some_and(|left| amount > left)
    })
}

/// The device's value of a fully qualified attribute (`gpu.dra.dev/nvlinkDomain`), comparable as text.
fn attribute_value(dev: &Dev<'_>, attribute: &str) -> Option<String> {
    let attributes = dev.device.attributes.as_ref()?;
    let found = attributes.get(attribute).or_else(|| {
        let (domain, id) = attribute.split_once('/')?;
        (domain == dev.candidate.driver).then(|| attributes.get(id))?
    })?;
    serde_json::to_string(found).ok()
}

/// `GPUs`, `MIG devices` or `devices`, by the `type` attribute the devices share.
fn noun_of<'a>(count: usize, devices: impl Iterator<Item = &'a Device>) -> String {
    let mut types = devices.map(|d| {
        d.attributes
            .as_ref()
            .and_then(|a| a.get("type"))
            .and_then(|a| a.string.as_deref())
            .unwrap_or_default()
            .to_string()
    });
    let first = types.next();
    let shared = first.filter(|t| types.all(|other| &other == t));
    let (one, many) = match shared.as_deref() {
        Some("gpu") => ("GPU", "GPUs"),
        Some("mig") => ("MIG device", "MIG devices"),
        _ => ("device", "devices"),
    };
    if count == 1 { one } else { many }.to_string()
}

fn number(n: usize) -> String {
    const WORDS: [&str; 11] = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    ];
    WORDS
        .get(n)
        .map_or_else(|| n.to_string(), |w| w.to_string())
}
