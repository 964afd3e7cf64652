//! The kubelet's DRA manager for one pod (1.34's `pkg/kubelet/cm/dra/manager.go`), on top of the kubelet
//! double's gRPC calls: which claims a pod's start prepares, the checks made before the plugin is called,
//! and which CDI devices each container gets. With the `DRAExtendedResource` gate the scheduler's claim for
//! the pod's extended resources (`status.extendedResourceClaimStatus`) is prepared after the pod's own
//! claims, in the same call, and its devices go to containers through `requestMappings`, matched against
//! the request names the plugin returned for each device. On a real 1.34.2 kubelet a pod with a template
//! claim and `nvidia.com/gpu` was prepared with one call holding both claims, the special one last.
//!
//! Not modelled: several drivers (one call per driver), the claim info cache across pods, and
//! unprepare (the pod's claims are unprepared with [`KubeletDouble::unprepare`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;

use super::kubelet::{ClaimRef, KubeletDouble, KubeletError, PreparedDevice};
use crate::cel::extended_resources::{container_requests, containers, is_extended_resource_name};

/// Why the kubelet did not start the pod's containers.
#[derive(Debug, thiserror::Error)]
pub enum PodPrepareError {
    #[error("API server: {0}")]
    Api(#[from] kube::Error),
    /// `resourceclaim.Name`: a claim from a template whose name the pod's status does not record yet.
    #[error(
        "pod {pod}: no ResourceClaim name for pod claim {claim} in status.resourceClaimStatuses"
    )]
    NoClaimName { pod: String, claim: String },
    #[error("fetch ResourceClaim {claim}: {error}")]
    Fetch { claim: String, error: kube::Error },
    /// `resourceclaim.IsForPod`: a claim made from a template must be owned by the pod.
    #[error("ResourceClaim {claim} was not created for pod {pod} (pod is not owner)")]
    NotOwned { pod: String, claim: String },
    #[error("pod {pod} ({uid}) is not allowed to use ResourceClaim {claim}")]
    NotReserved {
        pod: String,
        uid: String,
        claim: String,
    },
    #[error("NodePrepareResources: {0}")]
    Kubelet(#[from] KubeletError),
    #[error("prepare claim {claim}: {error}")]
    Claim { claim: String, error: String },
}

/// What the kubelet passed and what the containers got.
#[derive(Debug, Clone, Default)]
pub struct PreparedPod {
    /// The claims of the one NodePrepareResources call, in the kubelet's order.
    pub claims: Vec<ClaimRef>,
    /// The plugin's answer per claim name.
    pub devices: BTreeMap<String, Vec<PreparedDevice>>,
    /// Container name → CDI device IDs, as the runtime gets them.
    pub cdi_devices: BTreeMap<String, Vec<String>>,
}

/// Prepares the pod's claims as the kubelet does before starting its containers, with the
/// `DRAExtendedResource` gate on or off in the kubelet.
pub async fn prepare_pod(
    kubelet: &KubeletDouble,
    client: &kube::Client,
    namespace: &str,
    pod_name: &str,
    extended_resource_gate: bool,
) -> Result<PreparedPod, PodPrepareError> {
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get(pod_name)
        .await?;
    let label = format!("{namespace}/{pod_name}");
    let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let status = pod.status.clone().unwrap_or_default();

    // (pod claim name or None for the special claim, claim name, whether it must be owned by the pod)
    let mut wanted: Vec<(Option<String>, String, bool)> = Vec::new();
    for pod_claim in spec.resource_claims.iter().flatten() {
        if let Some(name) = &pod_claim.resource_claim_name {
            wanted.push((Some(pod_claim.name.clone()), name.clone(), false));
        } else if pod_claim.resource_claim_template_name.is_some() {
            let recorded = status
                .resource_claim_statuses
                .iter()
                .flatten()
                .find(|s| s.name == pod_claim.name)
                .ok_or_else(|| PodPrepareError::NoClaimName {
                    pod: label.clone(),
                    claim: pod_claim.name.clone(),
                })?;
            // A nil name: no claim was needed for this pod claim; nothing to do.
            if let Some(name) = &recorded.resource_claim_name {
                wanted.push((Some(pod_claim.name.clone()), name.clone(), true));
            }
        }
    }
    let extended = status
        .extended_resource_claim_status
        .as_ref()
        .filter(|_| extended_resource_gate);
    if let Some(extended) = extended {
        wanted.push((None, extended.resource_claim_name.clone(), false));
    }

    let claims_api: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let mut refs = Vec::new();
    for (_, name, must_own) in &wanted {
        let claim = claims_api
            .get(name)
            .await
            .map_err(|error| PodPrepareError::Fetch {
                claim: name.clone(),
                error,
            })?;
        let owned = claim
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.uid == pod_uid && o.controller == Some(true));
        if *must_own && !owned {
            return Err(PodPrepareError::NotOwned {
                pod: label,
                claim: name.clone(),
            });
        }
        let reserved = claim
            .status
            .iter()
            .flat_map(|s| s.reserved_for.iter().flatten())
            .any(|r| r.resource == "pods" && r.uid == pod_uid);
        if !reserved {
            return Err(PodPrepareError::NotReserved {
                pod: label,
                uid: pod_uid,
                claim: name.clone(),
            });
        }
        refs.push(ClaimRef::new(
            namespace,
            name.clone(),
            claim.metadata.uid.clone().unwrap_or_default(),
        ));
    }

    let mut prepared = PreparedPod {
        claims: refs.clone(),
        ..Default::default()
    };
    if refs.is_empty() {
        return Ok(prepared);
    }
    let mut answers = kubelet.prepare(&refs).await?;
    for claim in &refs {
        // `prepare` already refused an answer that leaves a claim out.
        let Some(answer) = answers.remove(&claim.uid) else {
            continue;
        };
        let devices = answer.map_err(|error| PodPrepareError::Claim {
            claim: claim.name.clone(),
            error,
        })?;
        prepared.devices.insert(claim.name.clone(), devices);
    }

    for container in containers(&pod) {
        let mut ids = Vec::new();
        // Claims the container names, each request or (no request) all of the claim.
        for used in container
            .resources
            .iter()
            .flat_map(|r| r.claims.iter().flatten())
        {
            let Some((_, name, _)) = wanted
                .iter()
                .find(|(pod_claim, _, _)| pod_claim.as_deref() == Some(used.name.as_str()))
            else {
                continue;
            };
            let request = used.request.as_deref().unwrap_or("");
            ids.extend(devices_for(&prepared.devices[name], request));
        }
        // Extended resources: the request the pod's status maps this container's resource to.
        if let Some(extended) = extended {
            for (resource, value) in container_requests(container) {
                if value.sign() == 0 || !is_extended_resource_name(&resource) {
                    continue;
                }
                let request = extended
                    .request_mappings
                    .iter()
                    .find(|m| m.container_name == container.name && m.resource_name == resource)
                    .map(|m| m.request_name.as_str());
                if let Some(request) = request.filter(|r| !r.is_empty()) {
                    let devices = &prepared.devices[&extended.resource_claim_name];
                    ids.extend(devices_for(devices, request));
                }
            }
        }
        prepared.cdi_devices.insert(container.name.clone(), ids);
    }
    Ok(prepared)
}

/// `cdiDevicesAsList`: the CDI IDs of the devices serving `request` ("" for all); a device that names no
/// request serves every one.
fn devices_for<'a>(
    devices: &'a [PreparedDevice],
    request: &'a str,
) -> impl Iterator<Item = String> + 'a {
    devices
        .iter()
        .filter(move |d| {
            request.is_empty()
                || d.request_names.is_empty()
                || d.request_names.iter().any(|r| r == request)
        })
        .flat_map(|d| d.cdi_device_ids.iter().cloned())
}
