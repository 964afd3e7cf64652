//! The scheduler's allocation step through the API: reads the slices, DeviceClasses and claims, lets
//! the pure [`allocator`](super::allocator) decide, and records the allocation (status.allocation and
//! reservedFor) the way the real scheduler does.

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, DeviceClass, ResourceClaim,
    ResourceClaimConsumerReference, ResourceClaimStatus, ResourceSlice,
};
use kube::api::{Api, ListParams, PostParams};
use thiserror::Error;

pub use super::allocator::Candidate;
use super::allocator::{self, Pools};

#[derive(Debug, Error)]
pub enum AllocationError {
    #[error("API server: {0}")]
    Api(#[from] kube::Error),
    #[error("ResourceClaim {claim} has no spec")]
    NoSpec { claim: String },
    #[error("ResourceClaim {claim} cannot be allocated on node {node}: {source}")]
    Unallocatable {
        claim: String,
        node: String,
        source: allocator::AllocationError,
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
    let pools = Pools::from_slices(&slices, Some(&allocator::Node::named(node)));
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let classes = allocator::class_selectors(&classes.list(&ListParams::default()).await?.items);
    let in_use = allocated_devices(client).await?;
    let spec = claim.spec.clone().ok_or_else(|| AllocationError::NoSpec {
        claim: label.clone(),
    })?;
    let results = allocator::allocate(&pools, &classes, &in_use, &spec).map_err(|source| {
        AllocationError::Unallocatable {
            claim: label.clone(),
            node: node.to_string(),
            source,
        }
    })?;

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
