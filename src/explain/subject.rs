//! What `explain` places on the nodes: a pod's claims, one named claim, or the claims of a file. A
//! pod's `resourceClaimName` is that claim; its `resourceClaimTemplateName` is the claim made for the
//! pod from the template (named in the pod's `status.resourceClaimStatuses`), or, before that claim
//! exists, the claim the template would make. A pod also brings the node filters the scheduler runs
//! before DRA: `nodeName`, `nodeSelector`, required node affinity and tolerations.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, Pod, Toleration};
use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim, ResourceClaimSpec};

use super::cluster::Cluster;
use super::extended::PodExtended;
use super::ExplainError;

/// What the user asked about.
#[derive(Debug, Clone)]
pub enum Target {
    Pod {
        namespace: String,
        name: String,
    },
    Claim {
        namespace: String,
        name: String,
    },
    /// Claims (or templates) read from a file, placed together as one pod's claims would be.
    Claims {
        origin: String,
        claims: Cluster,
    },
}

impl Target {
    /// `NS/NAME`, or `NAME` in `namespace`.
    pub fn split_name(text: &str, namespace: &str) -> (String, String) {
        match text.split_once('/') {
            Some((ns, name)) => (ns.to_string(), name.to_string()),
            None => (namespace.to_string(), text.to_string()),
        }
    }
}

/// Where a claim to place comes from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum ClaimSource {
    /// A ResourceClaim in the cluster (or in the `--claim` file).
    ResourceClaim,
    /// Made for the pod from this template; `created` when the claim exists (then it is what is
    /// placed), else the template's spec is placed as the claim it would make.
    Template { template: String, created: bool },
    /// The claim the scheduler makes for the pod's extended resources (`nvidia.com/gpu: 2`), one
    /// request per container and resource; `created` when it exists (annotated, owned by the pod).
    ExtendedResources {
        resources: Vec<String>,
        created: bool,
    },
}

/// One claim to place.
#[derive(Debug, Clone)]
pub struct SubjectClaim {
    /// `namespace/name`; for a claim not created yet, `namespace/<template>`.
    pub name: String,
    /// The pod's name for it (`spec.resourceClaims[].name`).
    pub pod_claim: Option<String>,
    pub source: ClaimSource,
    pub spec: ResourceClaimSpec,
    /// Its allocation, when it has one: it is not allocated again, and pins the pod to the nodes the
    /// allocation's node selector selects.
    pub allocation: Option<AllocationResult>,
    /// For the extended resources' claim: request name → `nvidia.com/gpu of container main`.
    pub request_labels: BTreeMap<String, String>,
}

/// The node filters of the pod that the scheduler runs before DRA's.
#[derive(Debug, Clone, Default)]
pub struct PodScheduling {
    pub node_name: Option<String>,
    pub node_selector: BTreeMap<String, String>,
    pub required_affinity: Option<NodeSelector>,
    pub tolerations: Vec<Toleration>,
}

/// The resolved subject.
#[derive(Debug, Clone)]
pub struct Subject {
    /// `Pod`, `ResourceClaim` or `file`.
    pub kind: &'static str,
    /// `namespace/name`, or the file.
    pub name: String,
    pub pod: Option<PodScheduling>,
    pub claims: Vec<SubjectClaim>,
    /// Claims of the cluster that subject claims stand in for (same `namespace/name`): what they
    /// hold is not counted as held by other claims.
    pub replaces: Vec<String>,
    pub notes: Vec<String>,
    /// The pod's extended resources (`nvidia.com/gpu: 2`), when it requests any.
    pub extended: Option<PodExtended>,
    /// Pod claims whose template does not exist yet because it is the channel template of a
    /// ComputeDomain that is not placed: the pod waits for the domain.
    pub domain_waits: Vec<DomainWait>,
}

/// A pod claim from the channel template of a ComputeDomain that its controller has not written yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainWait {
    pub pod_claim: String,
    /// `namespace/name` of the template.
    pub template: String,
    /// `namespace/name` of the domain.
    pub domain: String,
}

/// The templates of `pod` whose claim is not named in its status yet.
pub fn templates_to_read(pod: &Pod) -> Vec<String> {
    let statuses = claim_statuses(pod);
    pod.spec
        .iter()
        .flat_map(|spec| spec.resource_claims.iter().flatten())
        .filter(|c| !statuses.contains_key(&c.name))
        .filter_map(|c| c.resource_claim_template_name.clone())
        .collect()
}

fn claim_statuses(pod: &Pod) -> BTreeMap<String, String> {
    pod.status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten())
        .filter_map(|s| Some((s.name.clone(), s.resource_claim_name.clone()?)))
        .collect()
}

fn name_of(namespace: Option<&str>, name: Option<&str>) -> String {
    format!(
        "{}/{}",
        namespace.unwrap_or("default"),
        name.unwrap_or_default()
    )
}

fn claim_name(claim: &ResourceClaim) -> String {
    name_of(
        claim.metadata.namespace.as_deref(),
        claim.metadata.name.as_deref(),
    )
}

impl Subject {
    pub fn resolve(cluster: &Cluster, target: &Target) -> Result<Subject, ExplainError> {
        match target {
            Target::Pod { namespace, name } => Self::pod(cluster, namespace, name),
            Target::Claim { namespace, name } => {
                let wanted = format!("{namespace}/{name}");
                let claim = cluster
                    .claims
                    .iter()
                    .find(|c| claim_name(c) == wanted)
                    .ok_or(ExplainError::NotFound {
                        kind: "ResourceClaim",
                        name: wanted.clone(),
                    })?;
                Ok(Subject {
                    kind: "ResourceClaim",
                    name: wanted,
                    pod: None,
                    claims: vec![existing(claim, None, ClaimSource::ResourceClaim)?],
                    replaces: Vec::new(),
                    notes: Vec::new(),
                    extended: None,
                    domain_waits: Vec::new(),
                })
            }
            Target::Claims { origin, claims } => Self::file(origin, claims),
        }
    }

    fn pod(cluster: &Cluster, namespace: &str, name: &str) -> Result<Subject, ExplainError> {
        let wanted = format!("{namespace}/{name}");
        let pod = cluster
            .pods
            .iter()
            .find(|p| {
                name_of(p.metadata.namespace.as_deref(), p.metadata.name.as_deref()) == wanted
            })
            .ok_or(ExplainError::NotFound {
                kind: "Pod",
                name: wanted.clone(),
            })?;
        let spec = pod.spec.clone().unwrap_or_default();
        let statuses = claim_statuses(pod);
        let mut claims = Vec::new();
        let mut notes = Vec::new();
        let mut domain_waits = Vec::new();
        for entry in spec.resource_claims.iter().flatten() {
            let invalid = |message: String| ExplainError::Subject {
                subject: format!("Pod {wanted}"),
                message,
            };
            let find = |claim: &str| {
                let full = format!("{namespace}/{claim}");
                cluster.claims.iter().find(|c| claim_name(c) == full).ok_or(
                    ExplainError::NotFound {
                        kind: "ResourceClaim",
                        name: full,
                    },
                )
            };
            let pod_claim = Some(entry.name.clone());
            match (
                &entry.resource_claim_name,
                &entry.resource_claim_template_name,
            ) {
                (Some(claim), None) => {
                    claims.push(existing(find(claim)?, pod_claim, ClaimSource::ResourceClaim)?)
                }
                (None, Some(template)) => {
                    if let Some(generated) = statuses.get(&entry.name) {
                        let source = ClaimSource::Template {
                            template: template.clone(),
                            created: true,
                        };
                        claims.push(existing(find(generated)?, pod_claim, source)?);
                        continue;
                    }
                    let full = format!("{namespace}/{template}");
                    let found = cluster.templates.iter().find(|t| {
                        name_of(t.metadata.namespace.as_deref(), t.metadata.name.as_deref())
                            == full
                    });
                    // The controller writes a ComputeDomain's channel template only once it placed
                    // the domain: until then the pod waits for the domain, which is not an error.
                    let domain = super::domains::channel_domain(cluster, namespace, template);
                    if let (None, Some(domain)) = (found, domain) {
                        domain_waits.push(DomainWait {
                            pod_claim: entry.name.clone(),
                            template: full,
                            domain: domain.key(),
                        });
                        continue;
                    }
                    let found = found.ok_or(ExplainError::NotFound {
                            kind: "ResourceClaimTemplate",
                            name: full.clone(),
                        })?;
                    let spec = found
                        .spec
                        .as_ref()
                        .and_then(|t| t.spec.clone())
                        .ok_or_else(|| invalid(format!("ResourceClaimTemplate {full} has no spec")))?;
                    notes.push(format!(
                        "the claim for pod claim {} is not created yet; the spec of ResourceClaimTemplate {full} \
                         stands in for it (the scheduler itself waits: \"ResourceClaim not created yet\")",
                        entry.name
                    ));
                    claims.push(SubjectClaim {
                        name: full,
                        pod_claim,
                        source: ClaimSource::Template {
                            template: template.clone(),
                            created: false,
                        },
                        spec,
                        allocation: None,
                        request_labels: BTreeMap::new(),
                    });
                }
                _ => {
                    return Err(invalid(format!(
                        "resourceClaims[{}] needs exactly one of resourceClaimName and resourceClaimTemplateName",
                        entry.name
                    )))
                }
            }
        }
        let extended = PodExtended::resolve(cluster, pod, &mut claims, &mut notes);
        if claims.is_empty() && extended.is_none() && domain_waits.is_empty() {
            notes.push("the pod has no resource claims: only the node filters apply".into());
        }
        let affinity = spec
            .affinity
            .as_ref()
            .and_then(|a| a.node_affinity.as_ref())
            .and_then(|a| {
                a.required_during_scheduling_ignored_during_execution
                    .clone()
            });
        Ok(Subject {
            kind: "Pod",
            name: wanted,
            pod: Some(PodScheduling {
                node_name: spec.node_name.clone().filter(|n| !n.is_empty()),
                node_selector: spec.node_selector.clone().unwrap_or_default(),
                required_affinity: affinity,
                tolerations: spec.tolerations.clone().unwrap_or_default(),
            }),
            claims,
            replaces: Vec::new(),
            notes,
            extended,
            domain_waits,
        })
    }

    fn file(origin: &str, file: &Cluster) -> Result<Subject, ExplainError> {
        let others = file.pods.len()
            + file.classes.len()
            + file.slices.len()
            + file.nodes.len()
            + file.domains.len();
        if others > 0 || !file.ignored.is_empty() {
            return Err(ExplainError::Input {
                origin: origin.to_string(),
                message: "--claim takes ResourceClaims and ResourceClaimTemplates only".into(),
            });
        }
        let mut claims = Vec::new();
        let mut replaces = Vec::new();
        for claim in &file.claims {
            let subject = existing(claim, None, ClaimSource::ResourceClaim)?;
            replaces.push(subject.name.clone());
            claims.push(subject);
        }
        for template in &file.templates {
            let name = name_of(
                template.metadata.namespace.as_deref(),
                template.metadata.name.as_deref(),
            );
            let spec = template
                .spec
                .as_ref()
                .and_then(|t| t.spec.clone())
                .ok_or_else(|| ExplainError::Input {
                    origin: origin.to_string(),
                    message: format!("ResourceClaimTemplate {name} has no spec"),
                })?;
            claims.push(SubjectClaim {
                name: name.clone(),
                pod_claim: None,
                source: ClaimSource::Template {
                    template: name,
                    created: false,
                },
                spec,
                allocation: None,
                request_labels: BTreeMap::new(),
            });
        }
        if claims.is_empty() {
            return Err(ExplainError::Input {
                origin: origin.to_string(),
                message: "no ResourceClaim or ResourceClaimTemplate in the file".into(),
            });
        }
        Ok(Subject {
            kind: "file",
            name: origin.to_string(),
            pod: None,
            claims,
            replaces,
            notes: Vec::new(),
            extended: None,
            domain_waits: Vec::new(),
        })
    }
}

fn existing(
    claim: &ResourceClaim,
    pod_claim: Option<String>,
    source: ClaimSource,
) -> Result<SubjectClaim, ExplainError> {
    let name = claim_name(claim);
    let spec = claim.spec.clone().ok_or_else(|| ExplainError::Claim {
        claim: name.clone(),
        message: "it has no spec".into(),
    })?;
    Ok(SubjectClaim {
        name,
        pod_claim,
        source,
        spec,
        allocation: claim.status.as_ref().and_then(|s| s.allocation.clone()),
        request_labels: BTreeMap::new(),
    })
}
