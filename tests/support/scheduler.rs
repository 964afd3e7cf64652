//! The scheduler's allocation step through the API: reads the slices, DeviceClasses, claims and the
//! Node, lets [`simulate`] decide (the function behind `gpu-dra selectors allocate`), and records the
//! allocation (status.allocation and reservedFor) the way the real scheduler does. For a pod's extended
//! resources backed by DRA (gate `DRAExtendedResource`) it also plays the scheduler's PreBind: creates the
//! pod's special claim, allocates it and records `status.extendedResourceClaimStatus` in the pod.

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult, DeviceClass,
    DeviceRequestAllocationResult, ResourceClaim, ResourceClaimConsumerReference,
    ResourceClaimSpec, ResourceClaimStatus, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use thiserror::Error;

pub use super::allocator::Candidate;
use super::allocator::{self, InUse, Pools};
use crate::cel::extended_resources::{self as extended, NodeNeed};
use crate::cel::input::NamedClaim;
use crate::cel::selectors::simulate::{simulate, Decision, Simulation, SimulationError};

#[derive(Debug, Error)]
pub enum AllocationError {
    #[error("API server: {0}")]
    Api(#[from] kube::Error),
    #[error("ResourceClaim {claim} has no spec")]
    NoSpec { claim: String },
    #[error("ResourceClaim {claim} cannot be allocated on node {node}: {reason}")]
    Unallocatable {
        claim: String,
        node: String,
        reason: String,
    },
    #[error("pod {pod} does not fit node {node}: it asks for {resource}, which no DeviceClass maps and the node does not advertise")]
    UnmappedResource {
        pod: String,
        node: String,
        resource: String,
    },
    /// A CEL error or an invalid claim: the scheduler aborts allocation.
    #[error("ResourceClaim {claim}: {source}")]
    Aborted {
        claim: String,
        source: SimulationError,
    },
}

/// Whether a claim of `spec` could be allocated on `node` now (the scheduler's Filter for one claim):
/// `Err` says why not, as [`allocate`] would.
pub async fn fits(
    client: &kube::Client,
    label: &str,
    spec: &ResourceClaimSpec,
    node: &str,
) -> Result<(), AllocationError> {
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let classes = Api::<DeviceClass>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let node_labels = Api::<Node>::all(client.clone())
        .get_opt(node)
        .await?
        .and_then(|n| n.metadata.labels)
        .unwrap_or_default();
    let simulation = Simulation {
        claim: NamedClaim {
            name: label.to_string(),
            spec: spec.clone(),
        },
        classes,
        slices,
        node: Some(node.to_string()),
        node_labels,
        in_use: allocated_devices(client).await?,
    };
    match simulate(&simulation) {
        Ok(Decision::Allocated { .. }) => Ok(()),
        Ok(Decision::Unallocatable { node, reason }) => Err(AllocationError::Unallocatable {
            claim: label.to_string(),
            node,
            reason,
        }),
        Err(source) => Err(AllocationError::Aborted {
            claim: label.to_string(),
            source,
        }),
    }
}

/// Allocates the claim on `node` as the scheduler would (first fit in slice-name and device order, with
/// counters, taints, selectors and constraints) and reserves it for a pod named `consumer`. Returns the
/// updated claim.
pub async fn allocate(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    node: &str,
    consumer: (&str, &str),
) -> Result<ResourceClaim, AllocationError> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let mut claim = claims.get(name).await?;
    let label = format!("{namespace}/{name}");
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let slices = slices.list(&ListParams::default()).await?.items;
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let classes = classes.list(&ListParams::default()).await?.items;
    let nodes: Api<Node> = Api::all(client.clone());
    let node_labels = nodes
        .get_opt(node)
        .await?
        .and_then(|n| n.metadata.labels)
        .unwrap_or_default();
    let in_use = allocated_devices(client).await?;
    let spec = claim.spec.clone().ok_or_else(|| AllocationError::NoSpec {
        claim: label.clone(),
    })?;
    let class_list = classes.clone();
    let simulation = Simulation {
        claim: NamedClaim {
            name: label.clone(),
            spec,
        },
        classes,
        slices,
        node: Some(node.to_string()),
        node_labels,
        in_use,
    };
    let results = match simulate(&simulation) {
        Ok(Decision::Allocated { results, .. }) => results,
        Ok(Decision::Unallocatable { node, reason }) => {
            return Err(AllocationError::Unallocatable {
                claim: label,
                node,
                reason,
            })
        }
        Err(source) => {
            return Err(AllocationError::Aborted {
                claim: label,
                source,
            })
        }
    };

    let config = allocation_configs(&simulation.claim.spec, &class_list, &results);
    claim.status = Some(ResourceClaimStatus {
        allocation: Some(AllocationResult {
            devices: Some(DeviceAllocationResult {
                results: Some(results),
                config: (!config.is_empty()).then_some(config),
            }),
            node_selector: Some(node_selector(node)),
            ..Default::default()
        }),
        reserved_for: Some(vec![ResourceClaimConsumerReference {
            resource: "pods".to_string(),
            name: consumer.0.to_string(),
            uid: consumer.1.to_string(),
            ..Default::default()
        }]),
        ..Default::default()
    });
    Ok(claims
        .replace_status(name, &PostParams::default(), &claim)
        .await?)
}

/// The scheduler's handling of the pod's extended resources on `node` (1.34's dynamicresources plugin):
/// when some are served by DRA there (a class maps them and the node's allocatable does not list them, or
/// the pod has claims of its own: then 1.34 asks DRA for every mapped resource, advertised or not),
/// creates the pod's special claim (`<pod>-extended-resources-<random>`, annotated, controlled by the pod)
/// with one request per container and resource, allocates it on `node` and reserves it for the pod, and
/// writes `status.extendedResourceClaimStatus` (the claim's name and which container gets which request)
/// into the pod. `None` when the pod has nothing served by DRA on the node. Call it after the pod's own
/// claims are allocated: their devices are then in use, as within one scheduling cycle.
pub async fn allocate_extended_resources(
    client: &kube::Client,
    namespace: &str,
    pod_name: &str,
    node: &str,
) -> Result<Option<ResourceClaim>, AllocationError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods.get(pod_name).await?;
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let mapping = extended::class_mapping(&classes.list(&ListParams::default()).await?.items);
    if extended::mapped_resources(&pod, &mapping).is_empty() {
        return Ok(None);
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let advertised = nodes
        .get_opt(node)
        .await?
        .and_then(|n| n.status?.allocatable)
        .map(|a| a.into_keys().collect())
        .unwrap_or_default();
    let requests = match extended::node_requests(&pod, &mapping, &advertised) {
        Ok(NodeNeed::Devices(requests)) => requests,
        Ok(NodeNeed::Nothing) => return Ok(None),
        Err(resource) => {
            return Err(AllocationError::UnmappedResource {
                pod: format!("{namespace}/{pod_name}"),
                node: node.to_string(),
                resource,
            })
        }
    };
    let request_names: Vec<String> = requests.iter().map(|r| r.name.clone()).collect();
    let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
    let special = ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some(namespace.to_string()),
            generate_name: Some(format!("{pod_name}{}", extended::CLAIM_NAME_SUFFIX)),
            annotations: Some(
                [(extended::CLAIM_ANNOTATION.to_string(), "true".to_string())].into(),
            ),
            owner_references: Some(vec![controlling_pod(pod_name, &pod_uid)]),
            ..Default::default()
        },
        spec: Some(ResourceClaimSpec {
            devices: Some(k8s_openapi::api::resource::v1::DeviceClaim {
                requests: Some(requests),
                ..Default::default()
            }),
        }),
        status: None,
    };
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let created = claims.create(&PostParams::default(), &special).await?;
    let claim_name = created.metadata.name.clone().unwrap_or_default();
    let allocated = allocate(client, namespace, &claim_name, node, (pod_name, &pod_uid)).await?;
    let status = serde_json::json!({"status": {"extendedResourceClaimStatus": {
        "resourceClaimName": claim_name,
        "requestMappings": extended::request_mappings(&pod, &request_names),
    }}});
    pods.patch_status(pod_name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(Some(allocated))
}

/// The owner reference of a claim made for a pod (from a template, or for its extended resources): the pod
/// controls it, so the claim goes with the pod.
pub fn controlling_pod(name: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "v1".to_string(),
        kind: "Pod".to_string(),
        name: name.to_string(),
        uid: uid.to_string(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The configs the scheduler copies into the allocation, as upstream's allocator does: for each request
/// (the chosen subrequest of a `firstAvailable` one) its class's configs, once per class, naming the
/// requests that use the class; then the claim's configs, each once per request it names (once when it
/// names none).
fn allocation_configs(
    spec: &ResourceClaimSpec,
    classes: &[DeviceClass],
    results: &[DeviceRequestAllocationResult],
) -> Vec<DeviceAllocationConfiguration> {
    let requests = spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.clone())
        .unwrap_or_default();
    // The name a request's results carry (`main/sub` for a chosen subrequest) and its class.
    let chosen: Vec<(String, Option<String>)> = requests
        .iter()
        .map(
            |request| match (&request.exactly, &request.first_available) {
                (Some(exactly), _) => (
                    request.name.clone(),
                    Some(exactly.device_class_name.clone()),
                ),
                (None, Some(subs)) => {
                    let prefix = format!("{}/", request.name);
                    let picked = results
                        .iter()
                        .find_map(|r| r.request.strip_prefix(&prefix).map(str::to_string));
                    let class = picked.as_ref().and_then(|name| {
                        subs.iter()
                            .find(|s| &s.name == name)
                            .map(|s| s.device_class_name.clone())
                    });
                    (
                        picked.map_or(request.name.clone(), |p| format!("{prefix}{p}")),
                        class,
                    )
                }
                (None, None) => (request.name.clone(), None),
            },
        )
        .collect();
    let mut config: Vec<DeviceAllocationConfiguration> = Vec::new();
    let mut class_ranges: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
    for (name, class) in &chosen {
        let Some(class) = class else { continue };
        if let Some((start, end)) = class_ranges.get(class) {
            for entry in &mut config[*start..*end] {
                entry
                    .requests
                    .get_or_insert_with(Vec::new)
                    .push(name.clone());
            }
            continue;
        }
        let start = config.len();
        if let Some(found) = classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(class))
        {
            for entry in found.spec.iter().flat_map(|s| s.config.iter().flatten()) {
                config.push(DeviceAllocationConfiguration {
                    source: "FromClass".to_string(),
                    requests: Some(vec![name.clone()]),
                    opaque: entry.opaque.clone(),
                });
            }
        }
        class_ranges.insert(class.clone(), (start, config.len()));
    }
    for entry in spec
        .devices
        .as_ref()
        .and_then(|d| d.config.clone())
        .unwrap_or_default()
    {
        let named = entry.requests.clone().unwrap_or_default();
        let from_claim = || DeviceAllocationConfiguration {
            source: "FromClaim".to_string(),
            requests: entry.requests.clone(),
            opaque: entry.opaque.clone(),
        };
        if named.is_empty() {
            config.push(from_claim());
            continue;
        }
        for (request, (chosen_name, _)) in requests.iter().zip(&chosen) {
            if named.contains(&request.name) || named.contains(chosen_name) {
                config.push(from_claim());
            }
        }
    }
    config
}

/// Devices of `node` in pools that are complete at their newest generation, in the order the
/// scheduler tries them.
pub async fn published_devices(
    client: &kube::Client,
    node: &str,
) -> Result<Vec<Candidate>, kube::Error> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let items = slices.list(&ListParams::default()).await?.items;
    let pools = Pools::from_slices(&items, Some(&allocator::Node::named(node)));
    Ok(pools
        .devices()
        .map(|(candidate, _)| candidate.clone())
        .collect())
}

/// What other claims hold, as the scheduler gathers it from their allocation results: devices held
/// whole, and shares of shared devices with the capacity they consume (admin access excepted).
async fn allocated_devices(client: &kube::Client) -> Result<InUse, kube::Error> {
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    let items = claims.list(&ListParams::default()).await?.items;
    Ok(allocator::in_use(
        items.iter().flat_map(crate::claims::allocation_results),
    ))
}

fn node_selector(node: &str) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".to_string(),
                operator: "In".to_string(),
                values: Some(vec![node.to_string()]),
            }]),
            ..Default::default()
        }],
    }
}
