//! Extended resources (`resources.limits: nvidia.com/gpu: 2`) as the 1.34 scheduler treats them with
//! the `DRAExtendedResource` gate: on a node whose allocatable lists the resource, NodeResourcesFit
//! counts it against the device plugin; elsewhere, a DeviceClass whose `extendedResourceName` names it
//! lets the DRA step allocate it through a claim the scheduler makes for the pod; a resource neither
//! advertised nor mapped does not fit. The scheduler's own functions are in
//! [`crate::cel::extended_resources`]; this module decides per node what they mean for `explain`.
//!
//! Explain cannot ask the scheduler whether the gate is on. The API server drops `extendedResourceName`
//! when it is off, so the gate counts as on when some DeviceClass has the field; without one, only the
//! node's allocatable decides, which is the truth for a cluster with the gate off.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClaim, DeviceRequest, ResourceClaimSpec};

use crate::cel::extended_resources::{
    self as er, is_extended_resource_name, NodeNeed, CLAIM_NAME_SUFFIX, IMPLICIT_CLASS_PREFIX,
};

use super::cluster::Cluster;
use super::report::{ExtendedResourceVerdict, Reason, ReasonKind, ResourceSource};
use super::subject::{ClaimSource, SubjectClaim};

/// What the DRA step does with a pod that still has the claim of an earlier attempt (1.34's
/// `filterExtendedResources`: it deletes the claim in PostFilter and tries again).
pub(super) const STALE_CLAIM: &str = "cannot schedule extended resource claim";

/// A resource the scheduler counts for this pod: an extended resource name, or a DeviceClass's implicit
/// name (`deviceclass.resource.kubernetes.io/<class>`), which lies under `kubernetes.io/`.
fn counted(resource: &str) -> bool {
    is_extended_resource_name(resource) || resource.starts_with(IMPLICIT_CLASS_PREFIX)
}

/// Whether `pod` requests an extended resource (or a class's implicit name): then `explain` needs the
/// pods bound to each node, for what their device plugins have left.
pub fn requests_extended(pod: &Pod) -> bool {
    er::pod_requests(pod)
        .iter()
        .any(|(name, value)| *value != 0 && counted(name))
}

/// The pod's extended resources and what the cluster does with them.
#[derive(Debug, Clone)]
pub struct PodExtended {
    pod: Pod,
    /// Some DeviceClass has `extendedResourceName`: the gate is on.
    pub gate_on: bool,
    mapping: BTreeMap<String, String>,
    /// The pod's requests (`PodRequests`) of counted resources, non-zero.
    requests: BTreeMap<String, i64>,
    /// NodeResourcesFit's `resourceToDeviceClass` is set: the pod requests an extended resource name.
    has_extended: bool,
    /// The scheduler makes the special claim per node (mapped resources, and no claim exists yet).
    synthesize: bool,
    /// The special claim of an earlier attempt, for a pod not bound yet.
    stale: Option<String>,
    /// What the pods bound to each node request of the counted resources.
    used: HashMap<String, BTreeMap<String, i64>>,
}

impl PodExtended {
    /// The pod's extended resources, or `None` when it requests none. Adds the special claim to
    /// `claims` when it exists (then it is placed like any claim), and notes to `notes`.
    pub(super) fn resolve(
        cluster: &Cluster,
        pod: &Pod,
        claims: &mut Vec<SubjectClaim>,
        notes: &mut Vec<String>,
    ) -> Option<PodExtended> {
        let requests: BTreeMap<String, i64> = er::pod_requests(pod)
            .into_iter()
            .filter(|(name, value)| *value != 0 && counted(name))
            .collect();
        if requests.is_empty() {
            return None;
        }
        let gate_on = cluster.classes.iter().any(|c| {
            c.spec
                .as_ref()
                .is_some_and(|s| s.extended_resource_name.is_some())
        });
        let mapping = if gate_on {
            er::class_mapping(&cluster.classes)
        } else {
            BTreeMap::new()
        };
        let mapped = er::mapped_resources(pod, &mapping);
        let bound = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .is_some_and(|n| !n.is_empty());
        let mut stale = None;
        let existing = cluster.claims.iter().find(|c| er::is_claim_of(c, pod));
        if let Some(claim) = existing {
            let name = format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or("default"),
                claim.metadata.name.as_deref().unwrap_or_default()
            );
            let has_requests = claim
                .spec
                .as_ref()
                .and_then(|s| s.devices.as_ref())
                .is_some_and(|d| d.requests.is_some());
            if !bound && !mapped.is_empty() && has_requests {
                stale = Some(name.clone());
            }
            claims.push(SubjectClaim {
                name,
                pod_claim: None,
                source: ClaimSource::ExtendedResources {
                    resources: mapped.iter().cloned().collect(),
                    created: true,
                },
                spec: claim.spec.clone().unwrap_or_default(),
                allocation: claim.status.as_ref().and_then(|s| s.allocation.clone()),
                request_labels: labels(pod, claim.spec.as_ref()),
            });
        }
        let extended = PodExtended {
            pod: pod.clone(),
            gate_on,
            has_extended: requests.keys().any(|r| is_extended_resource_name(r)),
            requests,
            synthesize: existing.is_none() && !mapped.is_empty(),
            stale,
            used: used_by_pods(cluster, pod),
            mapping,
        };
        extended.notes(cluster, &mapped, notes);
        Some(extended)
    }

    /// Notes for what a reader may not expect: the gate taken as off, implicit class names, a
    /// resource that a class could serve if it named it, and 1.34's double count.
    fn notes(&self, cluster: &Cluster, mapped: &BTreeSet<String>, notes: &mut Vec<String>) {
        let extended: Vec<&str> = self
            .requests
            .keys()
            .filter(|r| is_extended_resource_name(r))
            .map(String::as_str)
            .collect();
        if !self.gate_on && !extended.is_empty() {
            notes.push(format!(
                "no DeviceClass has spec.extendedResourceName (the DRAExtendedResource gate, alpha in \
                 1.34, is off, and the API server drops the field, or no class uses it): {} can come \
                 from device plugins only",
                extended.join(", ")
            ));
        }
        for resource in self
            .requests
            .keys()
            .filter(|r| r.starts_with(IMPLICIT_CLASS_PREFIX))
        {
            notes.push(self.implicit_note(cluster, resource));
        }
        let unmapped: Vec<&str> = extended
            .iter()
            .copied()
            .filter(|r| !mapped.contains(*r))
            .collect();
        if let (false, Some(class)) = (unmapped.is_empty(), gpu_class(cluster)) {
            notes.push(format!(
                "hint: no DeviceClass maps {}; DeviceClass {class} selects gpu.dra.dev devices, and \
                 `spec.extendedResourceName: {}` on it would let the scheduler serve it with them \
                 (gate DRAExtendedResource on the API server and the scheduler)",
                unmapped.join(", "),
                unmapped[0]
            ));
        }
        let advertised_somewhere = cluster.nodes.iter().any(|node| {
            let allocatable = allocatable(node);
            mapped.iter().any(|r| allocatable.contains_key(r))
        });
        if er::has_claims_of_its_own(&self.pod) && self.synthesize && advertised_somewhere {
            notes.push(format!(
                "the pod has claims of its own, so on nodes whose device plugin advertises {} the 1.34 \
                 scheduler counts it against the device plugin and also allocates it through DRA \
                 (createDeviceRequests takes every mapped resource)",
                mapped.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
    }

    /// What 1.34.2 does with `deviceclass.resource.kubernetes.io/<class>`, in plain words.
    fn implicit_note(&self, cluster: &Cluster, resource: &str) -> String {
        let head = format!(
            "{resource} lies under kubernetes.io/, so to the 1.34 scheduler it is no extended resource \
             name and its DRA step never allocates a device for it"
        );
        let class = &resource[IMPLICIT_CLASS_PREFIX.len()..];
        let named = cluster
            .classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(class))
            .and_then(|c| c.spec.as_ref()?.extended_resource_name.clone());
        let tail = if !self.gate_on {
            "; without the gate, NodeResourcesFit counts it against the node's allocatable"
                .to_string()
        } else if self.mapping.contains_key(resource) || !self.has_extended {
            "; NodeResourcesFit leaves it to DRA, so it is ignored: the pod fits as if it did not ask, \
             and gets no device for it"
                .to_string()
        } else {
            "; no class answers to it, so NodeResourcesFit counts it against the node's allocatable"
                .to_string()
        };
        match named {
            Some(name) if self.gate_on => format!(
                "{head}{tail} (DeviceClass {class} answers only to its extendedResourceName {name})"
            ),
            _ => format!("{head}{tail}"),
        }
    }

    /// NodeResourcesFit (1.34 `fitsRequest`) for the counted resources on one node, and what is left to
    /// DRA: one verdict per resource, and the reasons the node does not fit (with the scheduler's).
    pub(super) fn fit(
        &self,
        node: &str,
        allocatable: &BTreeMap<String, i64>,
    ) -> (Vec<ExtendedResourceVerdict>, Vec<(Reason, String)>) {
        let empty = BTreeMap::new();
        let used = self.used.get(node).unwrap_or(&empty);
        let mut verdicts = Vec::new();
        let mut reasons = Vec::new();
        for (resource, &requested) in &self.requests {
            let advertised = allocatable.get(resource).copied();
            let mapped = self.mapping.contains_key(resource);
            // `resourceToDeviceClass` is nil unless the pod requests an extended resource name.
            let left_to_dra = self.gate_on && (mapped || !self.has_extended);
            if left_to_dra && advertised.is_none() {
                let source = if mapped && is_extended_resource_name(resource) {
                    ResourceSource::Dra
                } else {
                    ResourceSource::Ignored
                };
                verdicts.push(ExtendedResourceVerdict {
                    resource: resource.clone(),
                    source,
                    requested,
                    used: None,
                    allocatable: None,
                    fits: true,
                });
                continue;
            }
            let capacity = advertised.unwrap_or(0);
            let in_use = used.get(resource).copied().unwrap_or(0);
            let fits = requested <= capacity.saturating_sub(in_use);
            let (source, message) = match advertised {
                Some(_) => (
                    ResourceSource::DevicePlugin,
                    format!(
                        "device plugin: Insufficient {resource} (requested {requested}, used {in_use} of {capacity})"
                    ),
                ),
                None => (
                    ResourceSource::Unavailable,
                    format!(
                        "Insufficient {resource}: no DeviceClass maps it and the node does not advertise it"
                    ),
                ),
            };
            if !fits {
                let kind = match source {
                    ResourceSource::DevicePlugin => ReasonKind::InsufficientResource,
                    _ => ReasonKind::UnservedResource,
                };
                let mut reason = Reason::new(kind, message);
                reason.resource = Some(resource.clone());
                reasons.push((reason, format!("Insufficient {resource}")));
            }
            verdicts.push(ExtendedResourceVerdict {
                resource: resource.clone(),
                source,
                requested,
                used: advertised.map(|_| in_use),
                allocatable: advertised,
                fits,
            });
        }
        (verdicts, reasons)
    }

    /// The claim of an earlier attempt, which fails every node for a pod not bound yet.
    pub(super) fn stale_claim(&self) -> Option<Reason> {
        self.stale.as_ref().map(|name| {
            Reason::new(
                ReasonKind::StaleClaim,
                format!(
                    "claim {name} for the extended resources is left from an earlier attempt: the \
                     scheduler deletes it and tries again"
                ),
            )
        })
    }

    /// The special claim's requests on a node with this allocatable: `Ok(None)` when the node needs
    /// none, `Err(resource)` for a resource neither advertised nor mapped.
    pub(super) fn node_requests(
        &self,
        allocatable: &BTreeMap<String, i64>,
    ) -> Result<Option<Vec<DeviceRequest>>, String> {
        if !self.synthesize {
            return Ok(None);
        }
        let advertised: BTreeSet<String> = allocatable.keys().cloned().collect();
        match er::node_requests(&self.pod, &self.mapping, &advertised)? {
            NodeNeed::Nothing => Ok(None),
            NodeNeed::Devices(requests) => Ok(Some(requests)),
        }
    }

    /// The claim the scheduler would make for the pod, with these requests.
    pub(super) fn claim(&self, requests: Vec<DeviceRequest>) -> SubjectClaim {
        let spec = ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(requests),
                ..Default::default()
            }),
        };
        let resources = requests_of(&spec)
            .iter()
            .filter_map(|r| r.exactly.as_ref())
            .filter_map(|e| {
                self.mapping
                    .iter()
                    .find(|(_, class)| **class == e.device_class_name)
                    .map(|(resource, _)| resource.clone())
            })
            .collect::<BTreeSet<_>>();
        SubjectClaim {
            name: format!(
                "{}/{}{CLAIM_NAME_SUFFIX}*",
                self.pod.metadata.namespace.as_deref().unwrap_or("default"),
                self.pod.metadata.name.as_deref().unwrap_or_default()
            ),
            pod_claim: None,
            source: ClaimSource::ExtendedResources {
                resources: resources.into_iter().collect(),
                created: false,
            },
            request_labels: labels(&self.pod, Some(&spec)),
            spec,
            allocation: None,
        }
    }

    /// The claim as it would be on a node without device plugins (for the report's header).
    pub(super) fn display_claim(&self) -> Option<SubjectClaim> {
        match self.node_requests(&BTreeMap::new()) {
            Ok(Some(requests)) => Some(self.claim(requests)),
            _ => None,
        }
    }
}

fn requests_of(spec: &ResourceClaimSpec) -> &[DeviceRequest] {
    spec.devices
        .as_ref()
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default()
}

/// `container-1-request-2` → `nvidia.com/gpu of container main`, from the pod's containers.
fn labels(pod: &Pod, spec: Option<&ResourceClaimSpec>) -> BTreeMap<String, String> {
    let names: Vec<String> = spec
        .map(requests_of)
        .unwrap_or_default()
        .iter()
        .map(|r| r.name.clone())
        .collect();
    er::request_mappings(pod, &names)
        .into_iter()
        .map(|m| {
            (
                m.request_name,
                format!("{} of container {}", m.resource_name, m.container_name),
            )
        })
        .collect()
}

/// A node's allocatable, values rounded up as the scheduler keeps them.
pub(super) fn allocatable(node: &k8s_openapi::api::core::v1::Node) -> BTreeMap<String, i64> {
    node.status
        .iter()
        .flat_map(|s| s.allocatable.iter().flatten())
        .filter_map(|(name, q)| {
            let value = crate::quantity::Quantity::parse(&q.0)
                .ok()?
                .ceil_integer()?;
            Some((name.clone(), value))
        })
        .collect()
}

/// What the pods bound to each node request of the resources `pod` asks for: the scheduler's
/// `NodeInfo.Requested` (its pod informer leaves out Succeeded and Failed pods), without `pod`.
fn used_by_pods(cluster: &Cluster, pod: &Pod) -> HashMap<String, BTreeMap<String, i64>> {
    let wanted = er::pod_requests(pod);
    let same = |other: &Pod| {
        other.metadata.namespace == pod.metadata.namespace
            && other.metadata.name == pod.metadata.name
    };
    let mut used: HashMap<String, BTreeMap<String, i64>> = HashMap::new();
    for other in &cluster.pods {
        let node = other.spec.as_ref().and_then(|s| s.node_name.as_deref());
        let phase = other.status.as_ref().and_then(|s| s.phase.as_deref());
        let (Some(node), false) = (node.filter(|n| !n.is_empty()), same(other)) else {
            continue;
        };
        if matches!(phase, Some("Succeeded" | "Failed")) {
            continue;
        }
        let on_node = used.entry(node.to_string()).or_default();
        for (resource, value) in er::pod_requests(other) {
            if wanted.contains_key(&resource) && counted(&resource) {
                let total = on_node.entry(resource).or_default();
                *total = total.saturating_add(value);
            }
        }
    }
    used
}

/// A DeviceClass whose selectors match some published gpu.dra.dev device, for the hint.
fn gpu_class(cluster: &Cluster) -> Option<String> {
    let pools = crate::cel::allocator::Pools::from_slices(&cluster.slices, None);
    let views: Vec<_> = pools
        .device_views()
        .filter(|(candidate, _, _)| candidate.driver == "gpu.dra.dev")
        .map(|(_, _, view)| view)
        .collect();
    if views.is_empty() {
        return None;
    }
    let unnamed: Vec<_> = cluster
        .classes
        .iter()
        .filter(|c| {
            c.spec
                .as_ref()
                .is_none_or(|s| s.extended_resource_name.is_none())
        })
        .cloned()
        .collect();
    let classes = crate::cel::allocator::class_selectors(&unnamed);
    classes.iter().find_map(|(class, expressions)| {
        let selectors: Vec<crate::cel::Selector> = expressions
            .iter()
            .map(|e| crate::cel::Selector::compile(e).ok())
            .collect::<Option<_>>()?;
        views
            .iter()
            .any(|view| {
                selectors
                    .iter()
                    .all(|s| matches!(s.matches(view), Ok(true)))
            })
            .then(|| class.clone())
    })
}
