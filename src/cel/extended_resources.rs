//! Extended resources backed by DRA (KEP-5004, gate `DRAExtendedResource`, alpha in 1.34): how the
//! scheduler turns a pod's `nvidia.com/gpu: 2` into the requests of the special ResourceClaim it creates
//! for the pod, and how the kubelet finds which container gets which request. Pure functions, shared by
//! `gpu-dra explain` and the scheduler and kubelet doubles, following upstream 1.34
//! (`pkg/scheduler/framework/plugins/dynamicresources`, `.../extended/util.go`, `pkg/kubelet/cm/dra`).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Container, ContainerExtendedResourceRequest, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, DeviceRequest, ExactDeviceRequest, ResourceClaim,
};

use crate::claims::names::is_dns_subdomain;
use crate::quantity::Quantity;

/// Every DeviceClass without `extendedResourceName` answers to this prefix plus its name.
pub const IMPLICIT_CLASS_PREFIX: &str = "deviceclass.resource.kubernetes.io/";
/// The annotation (value `"true"`) that marks the claim the scheduler made for a pod's extended resources.
pub const CLAIM_ANNOTATION: &str = "resource.kubernetes.io/extended-resource-claim";
/// The scheduler's `generateName` for the special claim is the pod's name plus this.
pub const CLAIM_NAME_SUFFIX: &str = "-extended-resources-";

/// Extended resource name → DeviceClass name, as the scheduler maps them: a class's
/// `extendedResourceName`, or `deviceclass.resource.kubernetes.io/<class>` for a class without one (not
/// both). Where several classes name the same resource, the last in `classes` wins, as in upstream's map
/// (whose list order is the informer's, so a cluster should not rely on it).
pub fn class_mapping(classes: &[DeviceClass]) -> BTreeMap<String, String> {
    let mut mapping = BTreeMap::new();
    for class in classes {
        let Some(name) = class.metadata.name.clone() else {
            continue;
        };
        let explicit = class
            .spec
            .as_ref()
            .and_then(|s| s.extended_resource_name.as_ref());
        let resource = match explicit {
            Some(resource) => resource.clone(),
            None => format!("{IMPLICIT_CLASS_PREFIX}{name}"),
        };
        mapping.insert(resource, name);
    }
    mapping
}

/// `v1helper.IsExtendedResourceName`: a resource outside the `kubernetes.io/` namespace (so with a `/`),
/// not starting with `requests.`, that makes a qualified name behind `requests.`. Note that
/// `deviceclass.resource.kubernetes.io/...` is in the `kubernetes.io/` namespace, so in 1.34 no pod request
/// for such a name is handed to DRA.
pub fn is_extended_resource_name(name: &str) -> bool {
    if !name.contains('/') || name.contains("kubernetes.io/") || name.starts_with("requests.") {
        return false;
    }
    let qualified = format!("requests.{name}");
    let (prefix, local) = qualified.split_once('/').unwrap_or(("", &qualified));
    is_dns_subdomain(prefix, 253) && is_qualified_local_name(local)
}

/// The name part of a qualified name: 1 to 63 of `[-_.A-Za-z0-9]`, alphanumeric at both ends.
fn is_qualified_local_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
}

/// A container's requests as the API server stores them: a resource with a limit and no request gets
/// the limit as its request (defaulting), which is what the scheduler and the kubelet read.
pub fn container_requests(container: &Container) -> BTreeMap<String, Quantity> {
    let Some(resources) = &container.resources else {
        return BTreeMap::new();
    };
    let mut requests = BTreeMap::new();
    let limits = resources.limits.iter().flatten();
    for (name, value) in resources.requests.iter().flatten().chain(limits) {
        if let Ok(quantity) = Quantity::parse(&value.0) {
            requests.entry(name.clone()).or_insert(quantity);
        }
    }
    requests
}

/// Init containers, then containers: the order in which the request names count containers.
pub fn containers(pod: &Pod) -> Vec<&Container> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    spec.init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .collect()
}

/// The pod's non-zero requests of extended resources that a DeviceClass maps, by resource name.
pub fn mapped_resources(pod: &Pod, mapping: &BTreeMap<String, String>) -> BTreeSet<String> {
    containers(pod)
        .into_iter()
        .flat_map(container_requests)
        .filter(|(name, value)| {
            value.sign() != 0 && is_extended_resource_name(name) && mapping.contains_key(name)
        })
        .map(|(name, _)| name)
        .collect()
}

/// The name of the request for `resource` in the container at `index` (init containers first):
/// `container-<index>-request-<j>`, `j` being the resource's place among all the container's requests
/// sorted by name (cpu and memory included).
pub fn request_name(index: usize, requests: &BTreeMap<String, Quantity>, resource: &str) -> String {
    let position = requests.keys().position(|k| k == resource).unwrap_or(0);
    format!("container-{index}-request-{position}")
}

/// What the pod's extended resources need from DRA on one node.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeNeed {
    /// Nothing: the pod requests no extended resource that a class maps, or the node's device plugin
    /// advertises every one it requests (then the node's allocatable decides, as for any resource).
    Nothing,
    /// The requests of the special claim for this node, one per container and resource.
    Devices(Vec<DeviceRequest>),
}

/// Whether the pod has claims of its own (`spec.resourceClaims`): then the scheduler's DRA step runs for
/// it on every node, whatever its extended resources.
pub fn has_claims_of_its_own(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .is_some_and(|claims| !claims.is_empty())
}

/// The special claim's requests on a node whose allocatable lists `node_resources` (what device plugins
/// advertise there), as upstream 1.34's `filterExtendedResources` and `createDeviceRequests` make them.
/// `Err(resource)`: the pod requests an extended resource that neither the node advertises nor a class
/// maps, so the pod does not fit there.
///
/// DRA is needed when a mapped resource is not advertised by the node, or when the pod has claims of
/// its own ([`has_claims_of_its_own`]: the DRA step runs anyway). Then the requests cover every mapped
/// resource of the pod, per container, as `ExactCount` of its class: also those the node's device
/// plugin advertises (1.34 records them with a zero count, but `createDeviceRequests` iterates over
/// all of them and takes the container's quantity), so such a pod is given devices by DRA and is
/// counted against the device plugin as well.
/// Only for pods with at least one mapped resource (`mapped_resources`): others never reach this step.
pub fn node_requests(
    pod: &Pod,
    mapping: &BTreeMap<String, String>,
    node_resources: &BTreeSet<String>,
) -> Result<NodeNeed, String> {
    let mut mapped = BTreeSet::new();
    let mut from_dra = false;
    for (name, value) in containers(pod).into_iter().flat_map(container_requests) {
        if value.sign() == 0 || !is_extended_resource_name(&name) {
            continue;
        }
        match (mapping.contains_key(&name), node_resources.contains(&name)) {
            (true, advertised) => {
                from_dra |= !advertised;
                mapped.insert(name);
            }
            (false, false) => return Err(name),
            (false, true) => {}
        }
    }
    if !from_dra && !has_claims_of_its_own(pod) {
        return Ok(NodeNeed::Nothing);
    }
    let mut requests = Vec::new();
    for resource in &mapped {
        for (index, container) in containers(pod).into_iter().enumerate() {
            let container_requests = container_requests(container);
            // A fraction (`500m`) is no device count: upstream skips it (AsInt64 fails).
            let Some(count) = container_requests
                .get(resource)
                .and_then(Quantity::as_integer)
                .filter(|count| *count != 0)
            else {
                continue;
            };
            requests.push(DeviceRequest {
                name: request_name(index, &container_requests, resource),
                exactly: Some(ExactDeviceRequest {
                    device_class_name: mapping[resource].clone(),
                    allocation_mode: Some("ExactCount".into()),
                    count: Some(count),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    }
    Ok(NodeNeed::Devices(requests))
}

/// `resourcehelper.PodRequests` for the scheduler: the containers' requests summed, sidecars (init
/// containers with `restartPolicy: Always`) added to them, then the maximum with each regular init
/// container (plus the sidecars before it), plus the pod's overhead. Values as the scheduler keeps
/// scalar resources: `Quantity.Value()`, rounded up to a whole number.
pub fn pod_requests(pod: &Pod) -> BTreeMap<String, i64> {
    let value = |q: &Quantity| q.ceil_integer().unwrap_or(i64::MAX);
    let add = |into: &mut BTreeMap<String, i64>, from: &BTreeMap<String, Quantity>| {
        for (name, quantity) in from {
            let total = into.entry(name.clone()).or_default();
            *total = total.saturating_add(value(quantity));
        }
    };
    let Some(spec) = &pod.spec else {
        return BTreeMap::new();
    };
    let mut requests = BTreeMap::new();
    for container in &spec.containers {
        add(&mut requests, &container_requests(container));
    }
    let mut sidecars = BTreeMap::new();
    let mut init_max: BTreeMap<String, i64> = BTreeMap::new();
    for container in spec.init_containers.iter().flatten() {
        let own = container_requests(container);
        let in_use = if container.restart_policy.as_deref() == Some("Always") {
            add(&mut requests, &own);
            add(&mut sidecars, &own);
            sidecars.clone()
        } else {
            let mut total = sidecars.clone();
            add(&mut total, &own);
            total
        };
        for (name, amount) in in_use {
            let max = init_max.entry(name).or_default();
            *max = (*max).max(amount);
        }
    }
    for (name, amount) in init_max {
        let max = requests.entry(name).or_default();
        *max = (*max).max(amount);
    }
    let overhead: BTreeMap<String, Quantity> = spec
        .overhead
        .iter()
        .flatten()
        .filter_map(|(name, q)| Some((name.clone(), Quantity::parse(&q.0).ok()?)))
        .collect();
    add(&mut requests, &overhead);
    requests
}

/// `pod.status.extendedResourceClaimStatus.requestMappings` for the special claim's requests: which
/// container's which resource each request serves.
pub fn request_mappings(
    pod: &Pod,
    request_names: &[String],
) -> Vec<ContainerExtendedResourceRequest> {
    let mut mappings = Vec::new();
    for (index, container) in containers(pod).into_iter().enumerate() {
        let requests = container_requests(container);
        for resource in requests.keys() {
            let name = request_name(index, &requests, resource);
            if request_names.contains(&name) {
                mappings.push(ContainerExtendedResourceRequest {
                    container_name: container.name.clone(),
                    resource_name: resource.clone(),
                    request_name: name,
                });
            }
        }
    }
    mappings
}

/// Whether `claim` is the special claim the scheduler made for `pod`: annotated, and controlled by
/// the pod (name and UID).
pub fn is_claim_of(claim: &ResourceClaim, pod: &Pod) -> bool {
    let annotated = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(CLAIM_ANNOTATION))
        .is_some_and(|v| v == "true");
    annotated
        && claim
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|owner| {
                owner.controller == Some(true)
                    && Some(&owner.name) == pod.metadata.name.as_ref()
                    && Some(&owner.uid) == pod.metadata.uid.as_ref()
            })
}

#[cfg(test)]
#[path = "extended_resources_tests.rs"]
mod tests;
