//! A pod's way to a node through the doubles, as the control plane takes it: the resourceclaim controller
//! makes the claims of its templates (1.34's `pkg/controller/resourceclaim`: `generateName`
//! `<pod>-<pod claim>-`, controlled by the pod, annotation `resource.kubernetes.io/pod-claim-name`, names
//! recorded in `status.resourceClaimStatuses`), then the scheduler allocates the pod's claims and its
//! extended resources on one node ([`scheduler`]). The kubelet's part is `kubelet_pods::prepare_pod`.
//!
//! Not modelled: the scheduler's choice of node (the caller names it), waiting for claims, binding the pod.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    ResourceClaim, ResourceClaimConsumerReference, ResourceClaimTemplate,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use super::scheduler::{self, AllocationError};

/// The annotation on a claim made from a template, naming the pod's claim entry.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// Makes the claims of the pod's templates, allocates every claim of the pod on `node` (reserved for the
/// pod), then its extended resources. Returns the names of the claims allocated, the special one last.
pub async fn schedule_pod(
    client: &kube::Client,
    namespace: &str,
    pod_name: &str,
    node: &str,
) -> Result<Vec<String>, AllocationError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods.get(pod_name).await?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), namespace);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let mut names = Vec::new();
    let mut statuses = Vec::new();
    for pod_claim in pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
    {
        let name = match (
            &pod_claim.resource_claim_name,
            &pod_claim.resource_claim_template_name,
        ) {
            (Some(name), _) => name.clone(),
            (None, Some(template)) => {
                let template = templates.get(template).await?;
                let claim = ResourceClaim {
                    metadata: ObjectMeta {
                        namespace: Some(namespace.to_string()),
                        generate_name: Some(format!("{pod_name}-{}-", pod_claim.name)),
                        annotations: Some(
                            [(
                                POD_CLAIM_NAME_ANNOTATION.to_string(),
                                pod_claim.name.clone(),
                            )]
                            .into(),
                        ),
                        owner_references: Some(vec![scheduler::controlling_pod(pod_name, &uid)]),
                        ..Default::default()
                    },
                    spec: template.spec.and_then(|s| s.spec),
                    status: None,
                };
                let created = claims.create(&PostParams::default(), &claim).await?;
                let name = created.metadata.name.unwrap_or_default();
                statuses.push(json!({"name": pod_claim.name, "resourceClaimName": name}));
                name
            }
            (None, None) => continue,
        };
        let claim = claims.get(&name).await?;
        match claim.status.as_ref().and_then(|s| s.allocation.as_ref()) {
            // Allocated for another pod already (a shared claim): the pod is added to its consumers.
            Some(_) => reserve(&claims, claim, pod_name, &uid).await?,
            None => {
                scheduler::allocate(client, namespace, &name, node, (pod_name, &uid)).await?;
            }
        }
        names.push(name);
    }
    if !statuses.is_empty() {
        let status = json!({"status": {"resourceClaimStatuses": statuses}});
        pods.patch_status(pod_name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
    }
    if let Some(special) =
        scheduler::allocate_extended_resources(client, namespace, pod_name, node).await?
    {
        names.push(special.metadata.name.unwrap_or_default());
    }
    Ok(names)
}

/// Adds the pod to an allocated claim's `status.reservedFor`, as the scheduler does for a claim that
/// another pod already uses.
async fn reserve(
    claims: &Api<ResourceClaim>,
    mut claim: ResourceClaim,
    pod_name: &str,
    uid: &str,
) -> Result<(), AllocationError> {
    let name = claim.metadata.name.clone().unwrap_or_default();
    let status = claim.status.get_or_insert_with(Default::default);
    let consumers = status.reserved_for.get_or_insert_with(Vec::new);
    if !consumers.iter().any(|c| c.uid == uid) {
        consumers.push(ResourceClaimConsumerReference {
            resource: "pods".to_string(),
            name: pod_name.to_string(),
            uid: uid.to_string(),
            ..Default::default()
        });
        claims
            .replace_status(&name, &PostParams::default(), &claim)
            .await?;
    }
    Ok(())
}
