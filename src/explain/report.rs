//! What `explain` prints: a summary on top ("would fit on 3 of 12 nodes; the scheduler picks among
//! them" / "fits on no node"), the claims it placed, and one line per node: the devices it would get
//! there, or why not. As a table for people, or JSON / YAML (same fields) for tools.
//!
//! ```text
//! Pod ml/train: fits on no node (3 nodes: 2 too few free devices, 1 excluded by node affinity)
//! scheduler: 0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 2 cannot allocate all claims.
//! claim ml/train-gpu (pod claim gpu, from template two-gpus): gpu: 2 of class gpu.dra.dev
//!
//! NODE    FITS  DEVICES OR WHY NOT
//! node-a  no    request gpu (2 wanted): 8 GPUs: 1 free, 5 allocated to other claims, 2 tainted gpu.dra.dev/xid=79:NoExecute
//! ```

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::subject::{ClaimSource, SubjectClaim};

/// `-o`: how the report is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Output {
    #[default]
    Table,
    Json,
    Yaml,
}

/// Why a node does not take the pod, by kind; JSON names are the camelCase of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ReasonKind {
    /// The pod is bound to another node (`spec.nodeName`).
    NodeName,
    /// The node is cordoned and the pod does not tolerate that.
    Unschedulable,
    /// A NoSchedule or NoExecute taint of the node that the pod does not tolerate.
    NodeTaint,
    /// The pod's `nodeSelector` or required node affinity does not select the node.
    NodeAffinity,
    /// The node's device plugin has too few of an extended resource left (NodeResourcesFit).
    InsufficientResource,
    /// An extended resource that no DeviceClass maps and the node does not advertise.
    UnservedResource,
    /// The claim the scheduler made for the pod's extended resources in an earlier attempt is still
    /// there: the scheduler deletes it first.
    StaleClaim,
    /// A claim of the pod is allocated, and its allocation's node selector does not select the node.
    ClaimElsewhere,
    /// A claim of the pod comes from the channel template of a ComputeDomain that is not placed:
    /// the template, and so the claim, do not exist yet.
    DomainNotPlaced,
    /// No device of any driver is published for the node.
    NoDevices,
    /// A pool of the node is being updated: not all its slices of the newest generation are there.
    PoolIncomplete,
    /// A pool of the node is invalid (duplicate names, bad counters or selectors) and is not used.
    PoolInvalid,
    /// The class's or the request's selectors match none of the node's devices.
    NoMatch,
    /// Devices match, but too few are free: allocated to other claims, tainted, or sharing counters
    /// with allocated devices.
    TooFewFree,
    /// Enough devices are free, but not a set that meets a `matchAttribute` / `distinctAttribute`.
    Constraint,
    /// Each request could be met alone, but not all together.
    Together,
    /// What the allocator said, where no finer reason was found.
    Other,
}

impl ReasonKind {
    /// A few words for the summary's count of nodes.
    pub fn summary(self) -> &'static str {
        match self {
            ReasonKind::NodeName => "bound to another node",
            ReasonKind::Unschedulable => "unschedulable",
            ReasonKind::NodeTaint => "untolerated node taint",
            ReasonKind::NodeAffinity => "excluded by node affinity",
            ReasonKind::InsufficientResource => "device plugin",
            ReasonKind::UnservedResource => "not advertised, no DeviceClass maps it",
            ReasonKind::StaleClaim => "extended resource claim of an earlier attempt",
            ReasonKind::ClaimElsewhere => "a claim is allocated elsewhere",
            ReasonKind::DomainNotPlaced => "ComputeDomain not placed",
            ReasonKind::NoDevices => "no devices",
            ReasonKind::PoolIncomplete => "pool incomplete",
            ReasonKind::PoolInvalid => "pool invalid",
            ReasonKind::NoMatch => "no matching devices",
            ReasonKind::TooFewFree => "too few free devices",
            ReasonKind::Constraint => "constraint not met",
            ReasonKind::Together => "not enough for all requests together",
            ReasonKind::Other => "cannot allocate",
        }
    }
}

/// One reason a node does not take the pod.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Reason {
    pub kind: ReasonKind,
    pub message: String,
    /// For reasons about one request: how the node's devices fared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<DeviceCounts>,
    /// For reasons about an extended resource: its name (`nvidia.com/gpu`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
}

impl Reason {
    pub fn new(kind: ReasonKind, message: impl Into<String>) -> Reason {
        Reason {
            kind,
            message: message.into(),
            devices: None,
            resource: None,
        }
    }

    /// How the summary counts it: the kind, and for an extended resource the scheduler's words.
    fn summary(&self) -> String {
        match &self.resource {
            Some(resource) => format!("Insufficient {resource} ({})", self.kind.summary()),
            None => self.kind.summary().to_string(),
        }
    }
}

/// Where an extended resource of the pod comes from on a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ResourceSource {
    /// The node's allocatable lists it: NodeResourcesFit counts it.
    DevicePlugin,
    /// A DeviceClass maps it and the node does not advertise it: the claim made for the pod.
    Dra,
    /// Neither the device plugin nor DRA counts it (a class's implicit name, see the notes).
    Ignored,
    /// No DeviceClass maps it and the node does not advertise it.
    Unavailable,
}

/// One extended resource of the pod on one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtendedResourceVerdict {
    pub resource: String,
    pub source: ResourceSource,
    /// The pod's request (init containers counted as the scheduler does).
    pub requested: i64,
    /// What the pods bound to the node request (device plugin only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used: Option<i64>,
    /// The node's allocatable (device plugin only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocatable: Option<i64>,
    pub fits: bool,
}

/// How the devices of a node fared for one request (one alternative of a `firstAvailable` request).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceCounts {
    pub claim: String,
    /// `req`, or `req/sub` for a subrequest.
    pub request: String,
    /// The node's devices (every driver).
    pub on_node: usize,
    /// Those the class's and the request's selectors match.
    pub matching: usize,
    pub free: usize,
    /// How many the request wants; `None` for allocation mode All.
    pub wanted: Option<usize>,
    pub allocated_to_other_claims: usize,
    /// Held by claims of the same pod: allocated ones, or picks of earlier claims.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub held_by_pod: BTreeMap<String, usize>,
    /// By taint, `key=value:Effect`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tainted: BTreeMap<String, usize>,
    /// Devices whose shared counters (the GPU's memory and engines, for MIG) allocated devices use up.
    pub shared_counters_used_up: usize,
    /// Devices whose capacities cannot give the request what it asks (shares of other claims took
    /// it, or the request policy refuses it), with why, by device name.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub capacity_short: BTreeMap<String, String>,
    /// Selector errors on devices, by message.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub selector_errors: BTreeMap<String, usize>,
}

/// A device the pod would get on the node, or has (`allocated`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlacedDevice {
    pub claim: String,
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// Allocated already (the claim's `status.allocation`), rather than what the allocator picks now.
    pub allocated: bool,
}

/// The answer for one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeVerdict {
    pub node: String,
    pub fits: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<PlacedDevice>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<Reason>,
    /// The pod's extended resources here: from the device plugin, through DRA, or not at all.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub extended_resources: Vec<ExtendedResourceVerdict>,
    /// The reason as the scheduler words it for this node (its event counts these).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler_reason: Option<String>,
    /// Further reasons the scheduler gives for the node (NodeResourcesFit names each insufficient
    /// resource), counted in its event as well.
    #[serde(skip)]
    pub more_scheduler_reasons: Vec<String>,
    /// What the allocator itself said, when it said no.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<String>,
    /// An error that stops scheduling (a CEL runtime error): exit code 2.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A claim that was placed.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimSummary {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_claim: Option<String>,
    pub source: ClaimSource,
    pub allocated: bool,
    /// Its requests in short: `gpu: 2 of class gpu.dra.dev`.
    pub requests: Vec<String>,
    /// Its constraints in short: `matchAttribute gpu.dra.dev/nvlinkDomain`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub constraints: Vec<String>,
}

impl ClaimSummary {
    /// The claim in short, for the report's header.
    pub fn of(claim: &SubjectClaim) -> ClaimSummary {
        let devices = claim.spec.devices.as_ref();
        let describe = |count: Option<i64>, mode: Option<&str>, class: &str, selectors: usize| {
            let count = match mode {
                Some("All") => "all".to_string(),
                _ => count.unwrap_or(1).to_string(),
            };
            let extra = match selectors {
                0 => String::new(),
                1 => " with 1 selector".into(),
                n => format!(" with {n} selectors"),
            };
            format!("{count} of class {class}{extra}")
        };
        let requests = devices
            .and_then(|d| d.requests.as_ref())
            .into_iter()
            .flatten()
            .map(|r| match (&r.exactly, &r.first_available) {
                (Some(e), _) => {
                    let described = describe(
                        e.count,
                        e.allocation_mode.as_deref(),
                        &e.device_class_name,
                        e.selectors.as_ref().map_or(0, Vec::len),
                    );
                    match claim.request_labels.get(&r.name) {
                        Some(label) => format!("{}: {described} ({label})", r.name),
                        None => format!("{}: {described}", r.name),
                    }
                }
                (None, Some(subs)) => {
                    let alternatives: Vec<String> = subs
                        .iter()
                        .map(|s| {
                            format!(
                                "{}: {}",
                                s.name,
                                describe(
                                    s.count,
                                    s.allocation_mode.as_deref(),
                                    &s.device_class_name,
                                    s.selectors.as_ref().map_or(0, Vec::len)
                                )
                            )
                        })
                        .collect();
                    format!(
                        "{}: first available of {}",
                        r.name,
                        alternatives.join(" | ")
                    )
                }
                _ => format!("{}: (empty)", r.name),
            })
            .collect();
        let constraints = devices
            .and_then(|d| d.constraints.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|c| {
                let (kind, attribute) = match (&c.match_attribute, &c.distinct_attribute) {
                    (Some(a), _) => ("matchAttribute", a),
                    (None, Some(a)) => ("distinctAttribute", a),
                    _ => return None,
                };
                let scope = c.requests.as_deref().unwrap_or_default();
                Some(if scope.is_empty() {
                    format!("{kind} {attribute}")
                } else {
                    format!("{kind} {attribute} over {}", scope.join(", "))
                })
            })
            .collect();
        ClaimSummary {
            name: claim.name.clone(),
            pod_claim: claim.pod_claim.clone(),
            source: claim.source.clone(),
            allocated: claim.allocation.is_some(),
            requests,
            constraints,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SubjectSummary {
    pub kind: String,
    pub name: String,
}

/// Everything `explain` found.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub subject: SubjectSummary,
    pub summary: String,
    /// `0/12 nodes are available: ...`, as the scheduler's event would put it (pods only, when the
    /// pod fits nowhere).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<String>,
    pub fits: bool,
    pub fitting_nodes: usize,
    pub node_count: usize,
    pub claims: Vec<ClaimSummary>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Set when some node hit an error that stops scheduling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub nodes: Vec<NodeVerdict>,
}

impl Report {
    /// Fills in the summary, the scheduler's line and the error from the verdicts.
    pub fn new(
        subject: SubjectSummary,
        claims: Vec<ClaimSummary>,
        nodes: Vec<NodeVerdict>,
        notes: Vec<String>,
    ) -> Report {
        let fitting: Vec<&str> = nodes
            .iter()
            .filter(|n| n.fits)
            .map(|n| n.node.as_str())
            .collect();
        let total = nodes.len();
        let summary = match fitting.as_slice() {
            [] => {
                let mut by_kind: BTreeMap<(ReasonKind, String), usize> = BTreeMap::new();
                for node in &nodes {
                    if let Some(first) = node.reasons.first() {
                        *by_kind.entry((first.kind, first.summary())).or_default() += 1;
                    }
                }
                let errors = nodes.iter().filter(|n| n.error.is_some()).count();
                let mut parts: Vec<String> = by_kind
                    .iter()
                    .map(|((_, summary), count)| format!("{count} {summary}"))
                    .collect();
                if errors > 0 {
                    parts.push(format!("{errors} error"));
                }
                match total {
                    0 => "fits on no node: the cluster has no nodes".to_string(),
                    _ => format!("fits on no node ({total} nodes: {})", parts.join(", ")),
                }
            }
            [one] => format!("would fit on 1 of {total} nodes: {one}"),
            many => format!(
                "would fit on {} of {total} nodes; the scheduler picks among them",
                many.len()
            ),
        };
        let scheduler = (subject.kind == "Pod" && fitting.is_empty() && total > 0).then(|| {
            let mut histogram: BTreeMap<&str, usize> = BTreeMap::new();
            for node in &nodes {
                let reasons = node.scheduler_reason.iter();
                for reason in reasons.chain(&node.more_scheduler_reasons) {
                    *histogram.entry(reason).or_default() += 1;
                }
            }
            // As the scheduler's FitError: "N reason" strings, sorted.
            let mut counted: Vec<String> = histogram
                .iter()
                .map(|(reason, count)| format!("{count} {reason}"))
                .collect();
            counted.sort();
            format!("0/{total} nodes are available: {}.", counted.join(", "))
        });
        let error = nodes
            .iter()
            .find_map(|n| n.error.as_ref().map(|e| format!("node {}: {e}", n.node)));
        Report {
            subject,
            summary,
            scheduler,
            fits: !fitting.is_empty(),
            fitting_nodes: fitting.len(),
            node_count: total,
            claims,
            notes,
            error,
            nodes,
        }
    }

    /// 0 when the subject fits on some node, 1 when on none, 2 when a node hit an error.
    pub fn exit_code(&self) -> i32 {
        match (&self.error, self.fits) {
            (Some(_), _) => 2,
            (None, true) => 0,
            (None, false) => 1,
        }
    }

    pub fn render(&self, output: Output) -> String {
        match output {
            Output::Table => self.to_table(),
            // Serializing plain data with string keys cannot fail.
            Output::Json => serde_json::to_string_pretty(self).unwrap_or_default() + "\n",
            Output::Yaml => serde_yaml::to_string(self).unwrap_or_default(),
        }
    }

    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} {}: {}",
            self.subject.kind, self.subject.name, self.summary
        );
        if let Some(line) = &self.scheduler {
            let _ = writeln!(out, "scheduler: {line}");
        }
        if let Some(error) = &self.error {
            let _ = writeln!(out, "error: {error}");
        }
        for claim in &self.claims {
            let _ = writeln!(out, "{}", claim_line(claim));
        }
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        if self.nodes.is_empty() {
            return out;
        }
        let several = self.claims.len() > 1;
        let rows: Vec<(&str, &str, String)> = self
            .nodes
            .iter()
            .map(|n| {
                let fits = match (&n.error, n.fits) {
                    (Some(_), _) => "error",
                    (None, true) => "yes",
                    (None, false) => "no",
                };
                (n.node.as_str(), fits, node_text(n, several))
            })
            .collect();
        let width = rows
            .iter()
            .map(|r| r.0.len())
            .max()
            .unwrap_or(0)
            .max("NODE".len());
        let _ = writeln!(out, "\n{:width$}  FITS   DEVICES OR WHY NOT", "NODE");
        for (node, fits, text) in rows {
            let _ = writeln!(out, "{node:width$}  {fits:5}  {text}");
        }
        out
    }
}

fn claim_line(claim: &ClaimSummary) -> String {
    let mut origin = Vec::new();
    if let Some(pod_claim) = &claim.pod_claim {
        origin.push(format!("pod claim {pod_claim}"));
    }
    match &claim.source {
        ClaimSource::ResourceClaim => {}
        ClaimSource::Template { template, created } => {
            origin.push(format!("from template {template}"));
            if !created {
                origin.push("not created yet".into());
            }
        }
        ClaimSource::ExtendedResources { resources, created } => {
            origin.push(format!("for extended resources {}", resources.join(", ")));
            if !created {
                origin.push("made by the scheduler per node".into());
            }
        }
    }
    if claim.allocated {
        origin.push("allocated".into());
    }
    let mut text = format!("claim {}", claim.name);
    if !origin.is_empty() {
        text += &format!(" ({})", origin.join(", "));
    }
    text += &format!(": {}", claim.requests.join("; "));
    if !claim.constraints.is_empty() {
        text += &format!("; {}", claim.constraints.join("; "));
    }
    text
}

fn node_text(node: &NodeVerdict, several_claims: bool) -> String {
    if let Some(error) = &node.error {
        return error.clone();
    }
    if !node.fits {
        return node
            .reasons
            .iter()
            .map(|r| r.message.as_str())
            .collect::<Vec<_>>()
            .join("; ");
    }
    let plugin = node
        .extended_resources
        .iter()
        .filter_map(|r| match r.source {
            ResourceSource::DevicePlugin => Some(format!(
                "device plugin: {} fits (requested {}, {} of {} free)",
                r.resource,
                r.requested,
                r.allocatable.unwrap_or(0) - r.used.unwrap_or(0),
                r.allocatable.unwrap_or(0)
            )),
            ResourceSource::Ignored => Some(format!("{} ignored (no device for it)", r.resource)),
            _ => None,
        });
    let plugin: Vec<String> = plugin.collect();
    if node.devices.is_empty() {
        if !plugin.is_empty() {
            return plugin.join("; ");
        }
        return "no devices needed".into();
    }
    let mut by_claim: Vec<(&str, Vec<String>)> = Vec::new();
    for device in &node.devices {
        let mut shown = if device.pool == node.node {
            device.device.clone()
        } else {
            format!("{}/{}", device.pool, device.device)
        };
        if device.allocated {
            shown += " (allocated)";
        }
        match by_claim.iter_mut().find(|(c, _)| *c == device.claim) {
            Some((_, list)) => list.push(shown),
            None => by_claim.push((&device.claim, vec![shown])),
        }
    }
    by_claim
        .into_iter()
        .map(|(claim, devices)| {
            if several_claims {
                format!("{claim}: {}", devices.join(", "))
            } else {
                devices.join(", ")
            }
        })
        .chain(plugin)
        .collect::<Vec<_>>()
        .join("; ")
}
