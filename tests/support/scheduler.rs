//! The scheduler's allocation step through the API: reads the slices, DeviceClasses, claims and the
//! Node, lets [`simulate`] decide (the function behind `gpu-dra selectors allocate`), and records the
//! allocation (status.allocation and reservedFor) the way the real scheduler does.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, DeviceClass, ResourceClaim,
    ResourceClaimConsumerReference, ResourceClaimStatus, ResourceSlice,
};
use kube::api::{Api, ListParams, PostParams};
use thiserror::Error;

pub use super::allocator::Candidate;
use super::allocator::{self, Pools};
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
    /// A CEL error or an invalid claim: the scheduler aborts allocation.
    #[error("ResourceClaim {claim}: {source}")]
    Aborted {
        claim: String,
        source: SimulationError,
    },
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

    claim.status = Some(ResourceClaimStatus {
        allocation: Some(AllocationResult {
            devices: Some(DeviceAllocationResult {
                results: Some(results),
                config: None,
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

/// Devices already allocated to some claim (admin access excepted, as in the scheduler).
async fn allocated_devices(
    client: &kube::Client,
) -> Result<std::collections::BTreeSet<Candidate>, kube::Error> {
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
