//! The e2e workloads and the examples: every template requests devices of DeviceClasses in `deploy/`,
//! and every Pod claims a device (from a template in its namespace, used by a container) or asks for
//! an extended resource a class answers to.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;

use super::{manifests, Doc};

#[test]
fn workloads_reference_existing_templates_and_device_classes() {
    let (objects, partial) = manifests();
    let classes: BTreeSet<&str> = objects
        .iter()
        .filter(|d| d.kind() == "DeviceClass")
        .map(Doc::name)
        .collect();
    // Extended resources that a class answers to, in deploy/ or in a component's patch of a class there.
    let extended_resources: BTreeSet<&str> = objects
        .iter()
        .chain(&partial)
        .filter(|d| d.kind() == "DeviceClass" && classes.contains(d.name()))
        .filter_map(|d| d.value["spec"]["extendedResourceName"].as_str())
        .collect();
    let templates: BTreeSet<(&str, &str)> = objects
        .iter()
        .filter(|d| d.kind() == "ResourceClaimTemplate")
        .map(|d| (d.namespace(), d.name()))
        .collect();
    for doc in objects
        .iter()
        .filter(|d| d.kind() == "ResourceClaimTemplate")
    {
        let template: ResourceClaimTemplate = doc.typed();
        let requests = template
            .spec
            .and_then(|s| s.spec?.devices?.requests)
            .unwrap_or_default();
        assert!(
            !requests.is_empty(),
            "{}: the template requests no device",
            doc.origin
        );
        for request in &requests {
            let class = request
                .exactly
                .as_ref()
                .map(|e| e.device_class_name.as_str())
                .unwrap_or_else(|| {
                    panic!("{}: request {} has no `exactly`", doc.origin, request.name)
                });
            assert!(
                classes.contains(class),
                "{}: DeviceClass {class} is not in deploy/",
                doc.origin
            );
        }
    }
    for doc in objects.iter().filter(|d| d.kind() == "Pod") {
        let pod: Pod = doc.typed();
        let spec = pod.spec.unwrap_or_default();
        let claims = spec.resource_claims.unwrap_or_default();
        let asks_for_extended_resource = spec.containers.iter().any(|c| {
            c.resources
                .iter()
                .flat_map(|r| r.limits.iter().chain(r.requests.iter()).flatten())
                .any(|(name, _)| extended_resources.contains(name.as_str()))
        });
        assert!(
            !claims.is_empty() || asks_for_extended_resource,
            "{}: the workload claims no device and asks for no extended resource a class answers to ({extended_resources:?})",
            doc.origin
        );
        for claim in &claims {
            if let Some(template) = &claim.resource_claim_template_name {
                assert!(
                    templates.contains(&(doc.namespace(), template.as_str())),
                    "{}: ResourceClaimTemplate {template} is not in its namespace",
                    doc.origin
                );
            }
            let used = spec.containers.iter().any(|c| {
                c.resources
                    .as_ref()
                    .and_then(|r| r.claims.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.name == claim.name))
            });
            assert!(
                used,
                "{}: no container uses claim {}",
                doc.origin, claim.name
            );
        }
    }
}
