//! The `GpuNodePolicy` custom resource (gpu.dra.dev/v1alpha1, cluster-scoped): which nodes it selects,
//! how GPU health events become taints there, the MIG mode, whether GPUs are published for sharing, and
//! whether the plugin labels its Node as GPU feature discovery does.
//! `validate` names every problem by field path; `select` picks the policy in force for a node's labels.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::{BTreeMap, HashSet};
use std::fmt;

use kube::{CustomResource, ResourceExt};

pub use super::mps_shares::{MpsMemoryShares, QuantityText, ShareSizes, Shares, SharingSpec};
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};

/// The condition type every node writes into a policy's status.
pub const CONDITION_ACCEPTED: &str = "Accepted";
/// `Accepted=True`: the policy is valid and in force on the nodes that chose it.
pub const REASON_VALID: &str = "Valid";
/// `Accepted=False`: the spec fails validation; the message lists the problems.
pub const REASON_INVALID: &str = "Invalid";
/// `Accepted=False`: the policy is valid and selects a node, but another policy wins there.
pub const REASON_SUPERSEDED: &str = "Superseded";

/// An admin's policy for the GPU nodes that `nodeSelector` selects.
// Clippy reads two printcolumns with `type_ = "string"` as a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "gpu.dra.dev",
    version = "v1alpha1",
    kind = "GpuNodePolicy",
    plural = "gpunodepolicies",
    shortname = "gnp",
    status = "GpuNodePolicyStatus",
    derive = "PartialEq",
    printcolumn(name = "Priority", type_ = "integer", json_path = ".spec.priority"),
    printcolumn(name = "MigMode", type_ = "string", json_path = ".spec.migMode"),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    doc = "An admin policy for GPU nodes: health taints, MIG mode and GPU sharing for the nodes it selects."
)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodePolicySpec {
    /// The nodes this policy applies to; an empty selector selects every node.
    #[serde(default)]
    pub node_selector: LabelSelector,
    /// How GPU health events (XIDs) become device taints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthSpec>,
    /// How the driver manages MIG: none, static or dynamic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_mode: Option<MigModeSpec>,
    /// Whether and how GPUs and MIG devices are published for sharing among claims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<SharingSpec>,
    /// GPUs published for VFIO passthrough to virtual machines (KubeVirt, Kata) instead of as GPUs:
    /// bound to vfio-pci at prepare and given back to their driver at unprepare.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passthrough: Option<PassthroughSpec>,
    /// Label this node as GPU feature discovery does (`nvidia.com/gpu.present`, `nvidia.com/gpu.product`,
    /// `nvidia.com/gpu.count`, `nvidia.com/gpu.memory`, `nvidia.com/mig.capable`), so that nodeSelectors
    /// written for the device plugin keep working. Do not turn it on where GPU feature discovery runs.
    #[serde(default)]
    pub classic_node_labels: bool,
    /// Among several policies that select a node, the highest priority wins; ties go to the oldest
    /// policy, then to the name that sorts first.
    #[serde(default)]
    pub priority: i32,
}

/// Which GPUs of the selected nodes are published for passthrough (only as passthrough devices,
/// `gpu-vfio-<n>`, never as GPUs or MIG devices at the same time).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PassthroughSpec {
    /// `all`, or GPUs by PCI address (`0000:41:00.0`) or by device name (`gpu-<minor>`, resolved
    /// while the NVIDIA driver holds the GPU; a PCI address stays right while vfio-pci holds it).
    pub gpus: Vec<String>,
}

impl PassthroughSpec {
    /// Whether the GPU with this minor (when the NVIDIA driver holds it) and PCI address is chosen.
    pub fn selects(&self, minor: Option<u32>, pci_address: &str) -> bool {
        self.gpus.iter().any(|entry| {
            entry == "all"
                || entry.eq_ignore_ascii_case(pci_address)
                || minor.is_some_and(|m| *entry == format!("gpu-{m}"))
        })
    }

    fn problems(&self, path: &str) -> Vec<String> {
        let mut problems = Vec::new();
        if self.gpus.is_empty() {
            problems.push(format!(
                "{path}.gpus: must not be empty (`all`, PCI addresses or gpu-<minor> names)"
            ));
        }
        let mut seen = HashSet::new();
        for (index, entry) in self.gpus.iter().enumerate() {
            let at = format!("{path}.gpus[{index}]");
            let name_ok = entry.strip_prefix("gpu-").is_some_and(|m| {
                !m.is_empty()
                    && m.bytes().all(|b| b.is_ascii_digit())
                    && (m == "0" || !m.starts_with('0'))
                    && m.parse::<u32>().is_ok()
            });
            if entry != "all" && !name_ok && !is_pci_address(entry) {
                problems.push(format!(
                    "{at}: {entry:?} is neither `all`, a PCI address (0000:41:00.0) nor a GPU device name (gpu-<minor>)"
                ));
            }
            if entry == "all" && self.gpus.len() > 1 {
                problems.push(format!("{at}: `all` must be the only entry"));
            }
            if !seen.insert(entry.to_ascii_lowercase()) {
                problems.push(format!("{at}: {entry:?} is listed twice"));
            }
        }
        problems
    }
}

/// `dddd:bb:dd.f` in hexadecimal, as sysfs names PCI functions.
fn is_pci_address(text: &str) -> bool {
    let hex =
        |part: &str, len: usize| part.len() == len && part.bytes().all(|b| b.is_ascii_hexdigit());
    let Some((rest, function)) = text.rsplit_once('.') else {
        return false;
    };
    let parts: Vec<&str> = rest.split(':').collect();
    matches!(parts.as_slice(), [domain, bus, device] if hex(domain, 4) && hex(bus, 2) && hex(device, 2))
        && function.len() == 1
        && function.bytes().all(|b| (b'0'..=b'7').contains(&b))
}

/// A Kubernetes label selector: every `matchLabels` entry and every expression must hold.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

/// One expression of a label selector, as in `metav1.LabelSelectorRequirement`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct LabelSelectorRequirement {
    pub key: String,
    pub operator: SelectorOperator,
    /// Required for In and NotIn, forbidden for Exists and DoesNotExist.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// How GPU health events on the selected nodes are handled.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthSpec {
    /// XIDs treated as informational, like application errors: effect `informationalEffect`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ignored_xids: Vec<i64>,
    /// XIDs treated as fatal in addition to the built-in table.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fatal_xids: Vec<i64>,
    /// Taint effect for informational events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub informational_effect: Option<TaintEffect>,
    /// Taint effect for events after which the GPU needs a reset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_required_effect: Option<TaintEffect>,
    /// Taint effect for fatal events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fatal_effect: Option<TaintEffect>,
    /// Whether a taint is removed once the device is healthy again (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clear_on_recovery: Option<bool>,
}

/// The status every node reports into.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct GpuNodePolicyStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<PolicyCondition>,
}

/// A condition in the shape of `metav1.Condition`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyCondition {
    #[serde(rename = "type")]
    pub type_: String,
    /// "True", "False" or "Unknown".
    pub status: String,
    pub reason: String,
    #[serde(default)]
    pub message: String,
    /// When `status` last changed (RFC 3339).
    #[schemars(extend("format" = "date-time"))]
    pub last_transition_time: String,
    /// The `metadata.generation` the condition was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Defines an enum that (de)serializes as one of fixed strings, keeping any other string as `Unknown` so
/// that one bad value makes its policy invalid instead of breaking the decoding of every policy.
macro_rules! string_enum {
    ($(#[$doc:meta])* $name:ident, $what:literal { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(from = "String", into = "String")]
        pub enum $name {
            $($variant,)+
            /// A value this version does not know; `validate` reports it.
            Unknown(String),
        }

        impl $name {
            /// The values the API accepts.
            pub const VALUES: &'static [&'static str] = &[$($text),+];

            pub fn as_str(&self) -> &str {
                match self {
                    $(Self::$variant => $text,)+
                    Self::Unknown(text) => text,
                }
            }

            /// The validation message for an unknown value, if this is one.
            pub(super) fn problem(&self) -> Option<String> {
                match self {
                    Self::Unknown(text) => Some(format!(
                        "unknown {} {text:?}; expected one of {}",
                        $what,
                        Self::VALUES.join(", ")
                    )),
                    _ => None,
                }
            }
        }

        impl From<String> for $name {
            fn from(text: String) -> Self {
                match text.as_str() {
                    $($text => Self::$variant,)+
                    _ => Self::Unknown(text),
                }
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.as_str().to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }

            fn inline_schema() -> bool {
                true
            }

            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({ "type": "string", "enum": [$($text),+] })
            }
        }
    };
}

string_enum!(
    /// The effect of a device taint.
    TaintEffect, "effect" {
        None => "None",
        NoSchedule => "NoSchedule",
        NoExecute => "NoExecute",
    }
);

string_enum!(
    /// How the driver manages MIG on the selected nodes.
    MigModeSpec, "MIG mode" {
        None => "none",
        Static => "static",
        Dynamic => "dynamic",
    }
);

string_enum!(
    /// The operator of a label selector expression.
    SelectorOperator, "operator" {
        In => "In",
        NotIn => "NotIn",
        Exists => "Exists",
        DoesNotExist => "DoesNotExist",
    }
);

string_enum!(
    /// How a shared device is counted out among claims.
    ShareMode, "share mode" {
        Memory => "Memory",
        Count => "Count",
        Unlimited => "Unlimited",
    }
);

string_enum!(
    /// Which devices are published for sharing.
    ShareDeviceKind, "device kind" {
        Gpus => "Gpus",
        MigDevices => "MigDevices",
    }
);

string_enum!(
    /// What keeps the claims on one shared device apart.
    ShareEnforcement, "enforcement" {
        Mps => "MPS",
        TimeSlicing => "TimeSlicing",
        None => "None",
    }
);

string_enum!(
    /// The time slice of a whole GPU shared with enforcement TimeSlicing.
    ShareInterval, "interval" {
        Default => "Default",
        Short => "Short",
        Medium => "Medium",
        Long => "Long",
    }
);

/// The largest XID NVML reports (a 32-bit event data word).
const MAX_XID: i64 = u32::MAX as i64;

impl GpuNodePolicySpec {
    /// Checks the spec; the error lists every problem, each prefixed with its field path.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut problems = self.node_selector.problems("spec.nodeSelector");
        if let Some(health) = &self.health {
            problems.extend(health.problems("spec.health"));
        }
        if let Some(problem) = self.mig_mode.as_ref().and_then(MigModeSpec::problem) {
            problems.push(format!("spec.migMode: {problem}"));
        }
        if let Some(sharing) = &self.sharing {
            problems.extend(sharing.problems("spec.sharing"));
        }
        if let Some(passthrough) = &self.passthrough {
            problems.extend(passthrough.problems("spec.passthrough"));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }
}

impl LabelSelector {
    /// Whether `labels` satisfy every requirement; an empty selector matches every node.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(key, value)| labels.get(key) == Some(value))
            && self
                .match_expressions
                .iter()
                .all(|requirement| requirement.matches(labels))
    }

    fn problems(&self, path: &str) -> Vec<String> {
        let mut problems = Vec::new();
        if self.match_labels.contains_key("") {
            problems.push(format!("{path}.matchLabels: a label key must not be empty"));
        }
        for (index, requirement) in self.match_expressions.iter().enumerate() {
            let path = format!("{path}.matchExpressions[{index}]");
            if requirement.key.is_empty() {
                problems.push(format!("{path}.key: must not be empty"));
            }
            let needs_values = match &requirement.operator {
                SelectorOperator::In | SelectorOperator::NotIn => true,
                SelectorOperator::Exists | SelectorOperator::DoesNotExist => false,
                unknown @ SelectorOperator::Unknown(_) => {
                    if let Some(problem) = unknown.problem() {
                        problems.push(format!("{path}.operator: {problem}"));
                    }
                    continue;
                }
            };
            let operator = &requirement.operator;
            match (needs_values, requirement.values.is_empty()) {
                (true, true) => problems.push(format!(
                    "{path}.values: must not be empty for operator {operator}"
                )),
                (false, false) => problems.push(format!(
                    "{path}.values: must be empty for operator {operator}"
                )),
                _ => {}
            }
        }
        problems
    }
}

impl LabelSelectorRequirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match &self.operator {
            SelectorOperator::In => value.is_some_and(|v| self.values.contains(v)),
            SelectorOperator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            SelectorOperator::Exists => value.is_some(),
            SelectorOperator::DoesNotExist => value.is_none(),
            // Never reached for a validated policy; matching nothing is the safe reading.
            SelectorOperator::Unknown(_) => false,
        }
    }
}

impl HealthSpec {
    fn problems(&self, path: &str) -> Vec<String> {
        let mut problems = Vec::new();
        for (field, xids) in [
            ("ignoredXids", &self.ignored_xids),
            ("fatalXids", &self.fatal_xids),
        ] {
            let mut seen = HashSet::new();
            for (index, &xid) in xids.iter().enumerate() {
                let at = format!("{path}.{field}[{index}]");
                if xid < 0 {
                    problems.push(format!("{at}: XID {xid} must not be negative"));
                } else if xid > MAX_XID {
                    problems.push(format!("{at}: XID {xid} is larger than {MAX_XID}"));
                }
                if !seen.insert(xid) {
                    problems.push(format!("{at}: XID {xid} is listed twice"));
                }
            }
        }
        for (index, xid) in self.fatal_xids.iter().enumerate() {
            if self.ignored_xids.contains(xid) {
                problems.push(format!(
                    "{path}.fatalXids[{index}]: XID {xid} is also in ignoredXids"
                ));
            }
        }
        for (field, effect) in [
            ("informationalEffect", &self.informational_effect),
            ("resetRequiredEffect", &self.reset_required_effect),
            ("fatalEffect", &self.fatal_effect),
        ] {
            if let Some(problem) = effect.as_ref().and_then(TaintEffect::problem) {
                problems.push(format!("{path}.{field}: {problem}"));
            }
        }
        problems
    }
}

/// Orders policies by precedence: `Less` means `a` wins over `b`. Highest priority first, then the oldest
/// creationTimestamp (a policy without one counts as newest), then the name.
pub fn precedence(a: &GpuNodePolicy, b: &GpuNodePolicy) -> Ordering {
    let created = |p: &GpuNodePolicy| {
        let time = p.metadata.creation_timestamp.as_ref().map(|t| t.0);
        (time.is_none(), time)
    };
    b.spec
        .priority
        .cmp(&a.spec.priority)
        .then_with(|| created(a).cmp(&created(b)))
        .then_with(|| a.name_any().cmp(&b.name_any()))
}

/// The policy in force on a node with `node_labels`: the valid policy that selects it and wins by
/// [`precedence`], or `None` when no valid policy selects the node.
pub fn select<'a>(
    policies: &'a [GpuNodePolicy],
    node_labels: &BTreeMap<String, String>,
) -> Option<&'a GpuNodePolicy> {
    policies
        .iter()
        .filter(|p| p.spec.validate().is_ok() && p.spec.node_selector.matches(node_labels))
        .min_by(|a, b| precedence(a, b))
}

/// Why `loser` lost to `winner` on a node both select, for the loser's `Superseded` condition.
pub fn superseded_message(loser: &GpuNodePolicy, winner: &GpuNodePolicy) -> String {
    let (name, priority) = (winner.name_any(), winner.spec.priority);
    if priority != loser.spec.priority {
        return format!(
            "superseded by GpuNodePolicy {name:?}, which has priority {priority} (this policy has {})",
            loser.spec.priority
        );
    }
    let why = if loser.metadata.creation_timestamp != winner.metadata.creation_timestamp {
        "it is older"
    } else {
        "its name sorts first"
    };
    format!(
        "superseded by GpuNodePolicy {name:?}: both have priority {priority}, and {name:?} wins because {why}"
    )
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "policy_passthrough_tests.rs"]
mod passthrough_tests;
