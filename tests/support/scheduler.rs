//! The scheduler's allocation step, reduced to first fit: enough for the demo, the tests and the
//! benchmark to get claims allocated the way the real scheduler would record them (status.allocation
//! and reservedFor written through the API). Selectors are not evaluated here.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim,
    ResourceClaimConsumerReference, ResourceClaimStatus, ResourceSlice,
};
use kube::api::{Api, ListParams, PostParams};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum AllocationError {
    #[error("API server: {0}")]
    Api(#[from] kube::Error),
    #[error("ResourceClaim {0} has no requests")]
    NoRequests(String),
    #[error("request {request} of ResourceClaim {claim}: only {free} free devices on node {node}, {wanted} wanted")]
    NotEnoughDevices {
        claim: String,
        request: String,
        node: String,
        free: usize,
        wanted: usize,
    },
}

/// A device of a published, complete pool.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Candidate {
    pub driver: String,
    pub pool: String,
    pub device: String,
}

/// Allocates every request of the claim on `node` (first free devices in slice-name and device order)
/// and reserves the claim for a pod named `consumer`. Returns the updated claim.
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
    let candidates = published_devices(client, node).await?;
    let mut in_use = allocated_devices(client).await?;

    let requests = claim
        .spec
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .and_then(|d| d.requests.clone())
        .unwrap_or_default();
    if requests.is_empty() {
        return Err(AllocationError::NoRequests(label));
    }
    let mut results = Vec::new();
    for request in requests {
        let exactly = request.exactly.unwrap_or_default();
        let free: Vec<&Candidate> = candidates.iter().filter(|c| !in_use.contains(*c)).collect();
        let wanted = match exactly.allocation_mode.as_deref() {
            Some("All") => free.len().max(1),
            _ => exactly.count.unwrap_or(1).max(1) as usize,
        };
        if free.len() < wanted {
            return Err(AllocationError::NotEnoughDevices {
                claim: label,
                request: request.name,
                node: node.to_string(),
                free: free.len(),
                wanted,
            });
        }
        for chosen in free.into_iter().take(wanted).cloned().collect::<Vec<_>>() {
            results.push(DeviceRequestAllocationResult {
                request: request.name.clone(),
                driver: chosen.driver.clone(),
                pool: chosen.pool.clone(),
                device: chosen.device.clone(),
                ..Default::default()
            });
            in_use.insert(chosen);
        }
    }

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
/// scheduler tries them: slices by name, devices in slice order.
pub async fn published_devices(
    client: &kube::Client,
    node: &str,
) -> Result<Vec<Candidate>, kube::Error> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let mut items = slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items;
    items.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut newest: BTreeMap<(String, String), i64> = BTreeMap::new();
    for slice in &items {
        let key = (slice.spec.driver.clone(), slice.spec.pool.name.clone());
        let generation = newest.entry(key).or_insert(slice.spec.pool.generation);
        *generation = (*generation).max(slice.spec.pool.generation);
    }
    let current = |slice: &ResourceSlice| {
        newest.get(&(slice.spec.driver.clone(), slice.spec.pool.name.clone()))
            == Some(&slice.spec.pool.generation)
    };
    let mut candidates = Vec::new();
    for slice in items.iter().filter(|s| current(s)) {
        let siblings = items
            .iter()
            .filter(|s| {
                current(s)
                    && s.spec.driver == slice.spec.driver
                    && s.spec.pool.name == slice.spec.pool.name
            })
            .count() as i64;
        if siblings != slice.spec.pool.resource_slice_count {
            continue; // An incomplete pool is skipped, as the scheduler does.
        }
        for device in slice.spec.devices.iter().flatten() {
            candidates.push(Candidate {
                driver: slice.spec.driver.clone(),
                pool: slice.spec.pool.name.clone(),
                device: device.name.clone(),
            });
        }
    }
    Ok(candidates)
}

/// Devices already allocated to some claim.
async fn allocated_devices(client: &kube::Client) -> Result<BTreeSet<Candidate>, kube::Error> {
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    Ok(claims
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .flat_map(crate::claims::allocation_results)
        .map(|r| Candidate {
            driver: r.driver.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
        })
        .collect())
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
