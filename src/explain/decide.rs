//! One verdict per node. First the node filters the scheduler runs before DRA (unschedulable, node
//! name, taints, node affinity), then the pod's allocated claims (each pins the pod to the nodes its
//! allocation selects), then the allocator on the node's pools for the claims that still need devices,
//! with what other claims hold. A "no" from the allocator is broken down in [`super::reasons`].
//!
//! The work is indexed once for the whole cluster ([`super::index`]). A pod's extended resources
//! ([`super::extended`]) add NodeResourcesFit after the node filters, and on nodes that serve them by
//! DRA, the claim the scheduler makes for them.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::{NodeSelector, Taint, Toleration};
use k8s_openapi::api::resource::v1::{DeviceRequest, DeviceRequestAllocationResult};

use crate::cel::allocator::{self, AllocationError, Pools};

use super::cluster::Cluster;
use super::extended;
use super::index::{Held, SliceIndex};
use super::joint::{Joint, Outcome};
use super::plan::{self, ClaimPlan};
use super::reasons::{self, NodeState};
use super::report::{
    ClaimSummary, NodeVerdict, PlacedDevice, Reason, ReasonKind, Report, SubjectSummary,
};
use super::subject::{PodScheduling, Subject, SubjectClaim};
use super::ExplainError;

/// What the scheduler's DRA plugin reports for a node where the allocator found nothing.
const CANNOT_ALLOCATE: &str = "cannot allocate all claims";

/// A node as the filters and the allocator see it.
struct NodeInfo {
    name: String,
    labels: BTreeMap<String, String>,
    taints: Vec<Taint>,
    unschedulable: bool,
    /// `status.allocatable`, for the extended resources device plugins advertise.
    allocatable: BTreeMap<String, i64>,
}

/// The claims to place on a node, with how they go to the allocator: the subject's, plus the claim
/// the scheduler makes for the pod's extended resources where the node needs one (its requests
/// depend on what the node's device plugins advertise, so nodes share a variant where they agree).
struct Variant {
    claims: Vec<SubjectClaim>,
    joint: Joint,
    plans: BTreeMap<usize, ClaimPlan>,
}

impl Variant {
    fn new(
        claims: Vec<SubjectClaim>,
        classes: &BTreeMap<String, Vec<String>>,
    ) -> Result<Variant, ExplainError> {
        let joint = Joint::new(&claims);
        let plans = joint
            .pending
            .iter()
            .map(|&i| Ok((i, plan::plan(&claims[i], classes)?)))
            .collect::<Result<_, ExplainError>>()?;
        Ok(Variant {
            claims,
            joint,
            plans,
        })
    }

    fn empty() -> Variant {
        Variant {
            claims: Vec::new(),
            joint: Joint::new(&[]),
            plans: BTreeMap::new(),
        }
    }
}

/// What tells variants apart: the extended resources' claim's requests (none: no such claim).
type VariantKey = Vec<(String, String, i64)>;

fn variant_key(requests: &[DeviceRequest]) -> VariantKey {
    requests
        .iter()
        .map(|r| {
            let exactly = r.exactly.as_ref();
            (
                r.name.clone(),
                exactly
                    .map(|e| e.device_class_name.clone())
                    .unwrap_or_default(),
                exactly.and_then(|e| e.count).unwrap_or(1),
            )
        })
        .collect()
}

/// Decides the subject on every node of the cluster.
pub fn decide(cluster: &Cluster, subject: &Subject) -> Result<Report, ExplainError> {
    let classes = allocator::class_selectors(&cluster.classes);
    let mut variants: HashMap<VariantKey, Variant> = HashMap::new();
    variants.insert(Vec::new(), Variant::new(subject.claims.clone(), &classes)?);
    let index = SliceIndex::new(&cluster.slices);
    let held = Held::new(cluster, subject);
    let mut notes = subject.notes.clone();
    let mut nodes: Vec<NodeInfo> = cluster
        .nodes
        .iter()
        .map(|node| {
            let spec = node.spec.clone().unwrap_or_default();
            NodeInfo {
                name: node.metadata.name.clone().unwrap_or_default(),
                labels: node.metadata.labels.clone().unwrap_or_default(),
                taints: spec.taints.unwrap_or_default(),
                unschedulable: spec.unschedulable == Some(true),
                allocatable: extended::allocatable(node),
            }
        })
        .collect();
    if nodes.is_empty() && !index.local.is_empty() {
        notes.push(
            "no Node objects: the nodes are those the ResourceSlices name, without labels or taints"
                .into(),
        );
        nodes = index
            .local
            .keys()
            .map(|name| NodeInfo {
                name: name.clone(),
                labels: BTreeMap::new(),
                taints: Vec::new(),
                unschedulable: false,
                allocatable: BTreeMap::new(),
            })
            .collect();
    }
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    if !cluster.ignored.is_empty() {
        let kinds: Vec<String> = cluster
            .ignored
            .iter()
            .map(|(kind, n)| format!("{n} {kind}"))
            .collect();
        notes.push(format!("ignored: {}", kinds.join(", ")));
    }
    // Each node's extended resources' claim: none, or requests that pick (or make) its variant.
    let mut needs = Vec::with_capacity(nodes.len());
    for node in &nodes {
        let need = match &subject.extended {
            Some(extended) => extended.node_requests(&node.allocatable),
            None => Ok(None),
        };
        let key = match &need {
            Ok(Some(requests)) => {
                let key = variant_key(requests);
                if let (false, Some(extended)) = (variants.contains_key(&key), &subject.extended) {
                    let mut claims = subject.claims.clone();
                    claims.push(extended.claim(requests.clone()));
                    variants.insert(key.clone(), Variant::new(claims, &classes)?);
                }
                Ok(key)
            }
            Ok(None) => Ok(Vec::new()),
            Err(resource) => Err(resource.clone()),
        };
        needs.push(key);
    }
    let decider = Decider {
        subject,
        classes: &classes,
        index: &index,
        held: &held,
    };
    let verdicts = nodes
        .iter()
        .zip(&needs)
        .map(|(node, key)| match key {
            Ok(key) => decider.node(node, &variants[key]),
            Err(resource) => decider.unserved(node, resource),
        })
        .collect();
    let mut claims: Vec<ClaimSummary> = subject.claims.iter().map(ClaimSummary::of).collect();
    let shown = subject.extended.as_ref().and_then(|e| e.display_claim());
    claims.extend(shown.as_ref().map(ClaimSummary::of));
    Ok(Report::new(
        SubjectSummary {
            kind: subject.kind.to_string(),
            name: subject.name.clone(),
        },
        claims,
        verdicts,
        notes,
    ))
}

struct Decider<'a> {
    subject: &'a Subject,
    classes: &'a BTreeMap<String, Vec<String>>,
    index: &'a SliceIndex<'a>,
    held: &'a Held,
}

impl Decider<'_> {
    /// A node where the pod requests an extended resource that neither the node advertises nor a
    /// class maps. NodeResourcesFit says no first (see [`Decider::node`]); this only answers when it
    /// does not, as the DRA step would.
    fn unserved(&self, node: &NodeInfo, resource: &str) -> NodeVerdict {
        let mut verdict = self.node(node, &Variant::empty());
        if verdict.fits {
            verdict.fits = false;
            verdict.devices.clear();
            let mut reason = Reason::new(
                ReasonKind::UnservedResource,
                format!(
                    "Insufficient {resource}: no DeviceClass maps it and the node does not advertise it"
                ),
            );
            reason.resource = Some(resource.to_string());
            verdict.reasons = vec![reason];
            verdict.scheduler_reason = Some("cannot fit resource".into());
        }
        verdict
    }

    fn node(&self, node: &NodeInfo, variant: &Variant) -> NodeVerdict {
        let mut verdict = NodeVerdict {
            node: node.name.clone(),
            fits: false,
            devices: Vec::new(),
            reasons: Vec::new(),
            extended_resources: Vec::new(),
            scheduler_reason: None,
            more_scheduler_reasons: Vec::new(),
            allocator: None,
            error: None,
        };
        let allocator_node = allocator::Node {
            name: node.name.clone(),
            labels: node.labels.clone(),
        };
        if let Some(pod) = &self.subject.pod {
            match node_filters(pod, node, &allocator_node) {
                Ok(None) => {}
                Ok(Some((reasons, scheduler))) => {
                    verdict.reasons = reasons;
                    verdict.scheduler_reason = Some(scheduler);
                    return verdict;
                }
                Err(error) => {
                    verdict.error = Some(error);
                    return verdict;
                }
            }
        }
        if let Some(extended) = &self.subject.extended {
            let (resources, insufficient) = extended.fit(&node.name, &node.allocatable);
            verdict.extended_resources = resources;
            if !insufficient.is_empty() {
                let (reasons, scheduler): (Vec<Reason>, Vec<String>) =
                    insufficient.into_iter().unzip();
                verdict.reasons = reasons;
                let mut scheduler = scheduler.into_iter();
                verdict.scheduler_reason = scheduler.next();
                verdict.more_scheduler_reasons = scheduler.collect();
                return verdict;
            }
            if let Some(reason) = extended.stale_claim() {
                verdict.reasons.push(reason);
                verdict.scheduler_reason = Some(extended::STALE_CLAIM.into());
                return verdict;
            }
        }
        for claim in &variant.claims {
            let Some(allocation) = &claim.allocation else {
                continue;
            };
            let selected = match &allocation.node_selector {
                None => Ok(true),
                Some(selector) => allocator_node.matches(None, None, Some(selector)),
            };
            match selected {
                Ok(true) => {
                    let results = allocation
                        .devices
                        .iter()
                        .flat_map(|d| d.results.iter().flatten());
                    verdict
                        .devices
                        .extend(results.map(|r| placed(&claim.name, r, true)));
                }
                Ok(false) => verdict.reasons.push(Reason::new(
                    ReasonKind::ClaimElsewhere,
                    format!(
                        "claim {} is allocated {}",
                        claim.name,
                        allocated_where(allocation.node_selector.as_ref())
                    ),
                )),
                Err(error) => {
                    verdict.error = Some(format!(
                        "claim {}: allocation node selector: {error}",
                        claim.name
                    ));
                    return verdict;
                }
            }
        }
        if !verdict.reasons.is_empty() {
            verdict.devices.clear();
            verdict.scheduler_reason = Some("resourceclaim not available on the node".into());
            return verdict;
        }
        if variant.joint.pending.is_empty() {
            verdict.fits = true;
            return verdict;
        }
        let slices = self.index.slices_for(&node.name);
        let pools = Pools::from_slices(&slices, Some(&allocator_node));
        let in_use = self.held.for_pools(self.index.pools_for(&node.name));
        let failure = match variant.joint.allocate(&pools, self.classes, &in_use) {
            Outcome::Allocated(results) => {
                verdict.fits = true;
                verdict.devices.extend(
                    results
                        .iter()
                        .map(|(claim, r)| placed(&variant.claims[*claim].name, r, false)),
                );
                return verdict;
            }
            Outcome::Failed(failure) => failure,
        };
        verdict.allocator = Some(failure.message.clone());
        match &failure.error {
            AllocationError::NotEnoughDevices { .. }
            | AllocationError::Unsatisfiable { .. }
            | AllocationError::PoolNotReady { .. }
            | AllocationError::AllModeConstraint { .. }
            // The scheduler (1.35+) skips invalid pools and calls the node unschedulable.
            | AllocationError::InvalidPools { .. } => {}
            // A CEL runtime error, the step limit, or an error the checks before the nodes did not
            // catch: the scheduler stops there, so this is an error, not a "no".
            _ => {
                verdict.error = Some(failure.message);
                return verdict;
            }
        }
        let mut pod_held = self.held.by_subject.clone();
        let mut seen = Cow::Borrowed(&in_use);
        if !failure.picks.is_empty() {
            let owned = seen.to_mut();
            for (claim, candidate) in &failure.picks {
                owned.devices.insert(candidate.clone());
                pod_held.insert(candidate.clone(), variant.claims[*claim].name.clone());
            }
        }
        let plans: Vec<&ClaimPlan> = failure
            .claims
            .iter()
            .filter_map(|i| variant.plans.get(i))
            .collect();
        let state = NodeState {
            pools: &pools,
            in_use: &seen,
            pod_held: &pod_held,
        };
        verdict.reasons = reasons::explain(
            &state,
            &plans,
            variant.claims.len() > 1,
            &failure.error,
            &failure.message,
        );
        verdict.scheduler_reason = Some(CANNOT_ALLOCATE.into());
        verdict
    }
}

/// The scheduler's filters before DRA, in its order (NodeUnschedulable, NodeName, TaintToleration,
/// NodeAffinity): every reason that applies, and the scheduler's words for the first.
fn node_filters(
    pod: &PodScheduling,
    node: &NodeInfo,
    allocator_node: &allocator::Node,
) -> Result<Option<(Vec<Reason>, String)>, String> {
    let mut found: Vec<(Reason, String)> = Vec::new();
    let cordon = Taint {
        key: "node.kubernetes.io/unschedulable".into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    };
    if node.unschedulable && !pod.tolerations.iter().any(|t| tolerates(t, &cordon)) {
        found.push((
            Reason::new(
                ReasonKind::Unschedulable,
                "node is unschedulable (cordoned)",
            ),
            "node(s) were unschedulable".into(),
        ));
    }
    if let Some(bound) = pod.node_name.as_deref().filter(|n| *n != node.name) {
        found.push((
            Reason::new(
                ReasonKind::NodeName,
                format!("the pod is bound to node {bound}"),
            ),
            "node(s) didn't match the requested node name".into(),
        ));
    }
    let untolerated: Vec<&Taint> = node
        .taints
        .iter()
        .filter(|taint| matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute"))
        .filter(|taint| !pod.tolerations.iter().any(|t| tolerates(t, taint)))
        .collect();
    if !untolerated.is_empty() {
        let shown: Vec<String> = untolerated.iter().map(|t| show_taint(t)).collect();
        found.push((
            Reason::new(
                ReasonKind::NodeTaint,
                format!("node taint {} not tolerated by the pod", shown.join(", ")),
            ),
            // The v1.34 scheduler's words; older releases named the first taint ("{key: value}").
            "node(s) had untolerated taint(s)".into(),
        ));
    }
    let mut excluded = Vec::new();
    for (key, value) in &pod.node_selector {
        if node.labels.get(key) != Some(value) {
            excluded.push(format!("nodeSelector {key}={value}"));
        }
    }
    if let Some(affinity) = &pod.required_affinity {
        if !allocator_node.matches(None, None, Some(affinity))? {
            excluded.push("required node affinity".into());
        }
    }
    if !excluded.is_empty() {
        found.push((
            Reason::new(
                ReasonKind::NodeAffinity,
                format!("node affinity excludes it ({})", excluded.join(", ")),
            ),
            "node(s) didn't match Pod's node affinity/selector".into(),
        ));
    }
    let Some((_, scheduler)) = found.first() else {
        return Ok(None);
    };
    let scheduler = scheduler.clone();
    Ok(Some((
        found.into_iter().map(|(r, _)| r).collect(),
        scheduler,
    )))
}

/// `v1helper.ToleratesTaint`.
fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    allocator::toleration_matches(
        [
            &toleration.key,
            &toleration.operator,
            &toleration.value,
            &toleration.effect,
        ],
        [
            &taint.key,
            taint.value.as_deref().unwrap_or_default(),
            &taint.effect,
        ],
    )
}

fn show_taint(taint: &Taint) -> String {
    match taint.value.as_deref().filter(|v| !v.is_empty()) {
        Some(value) => format!("{}={value}:{}", taint.key, taint.effect),
        None => format!("{}:{}", taint.key, taint.effect),
    }
}

/// "on node-3" for the scheduler's usual `metadata.name In [node]` selector, else a general phrase.
fn allocated_where(selector: Option<&NodeSelector>) -> String {
    let names: Vec<&str> = selector
        .iter()
        .flat_map(|s| &s.node_selector_terms)
        .flat_map(|t| t.match_fields.iter().flatten())
        .filter(|r| r.key == "metadata.name" && r.operator == "In")
        .flat_map(|r| r.values.iter().flatten())
        .map(String::as_str)
        .collect();
    if names.is_empty() {
        "to nodes its node selector picks, not this one".into()
    } else {
        format!("on {}", names.join(", "))
    }
}

fn placed(claim: &str, result: &DeviceRequestAllocationResult, allocated: bool) -> PlacedDevice {
    PlacedDevice {
        claim: claim.to_string(),
        request: result.request.clone(),
        driver: result.driver.clone(),
        pool: result.pool.clone(),
        device: result.device.clone(),
        allocated,
    }
}
