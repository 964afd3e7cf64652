//! The channel ResourceClaimTemplate of a placed domain (pure): one request `channel` of the IMEX
//! channel DeviceClass whose CEL selector names the domain's clique and channel 0, so the scheduler puts
//! the domain's pods only on that clique's nodes, one per node (the node's one channel device); and the
//! opaque config that tells the driver which domain the channel is for and how many channels the
//! container gets (`allocationMode`, as the domain's spec says).

use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use serde_json::json;

use crate::domains::api::{DomainObject, CHANNEL_CONFIG_KIND, DOMAIN_LABEL};
use crate::domains::channels::{CHANNEL_ATTRIBUTE, CLIQUE_ATTRIBUTE};
use crate::domains::placement::Placed;

/// The name of the request in the template (and of the config's request list).
pub const CHANNEL_REQUEST: &str = "channel";

/// The selector of channel 0 on clique `placed.clique` under `driver`.
pub fn channel_selector(driver: &str, placed: &Placed) -> String {
    // The clique is `<uuid>.<number>` as a node's fabric reports it: no quote or backslash, but JSON
    // string escaping is valid CEL string escaping should one ever hold them.
    let clique = serde_json::Value::String(placed.clique.clone()).to_string();
    format!(
        "device.attributes[\"{driver}\"].{CLIQUE_ATTRIBUTE} == {clique} && \
         device.attributes[\"{driver}\"].{CHANNEL_ATTRIBUTE} == 0"
    )
}

/// The template of `domain`, placed at `placed`, of DeviceClass `device_class`.
pub fn channel_template(
    driver: &str,
    device_class: &str,
    domain: &DomainObject,
    template_name: &str,
    placed: &Placed,
) -> Result<ResourceClaimTemplate, serde_json::Error> {
    let api = domain.group.api_resource();
    let mut parameters = json!({
        "apiVersion": domain.group.config_api_version(),
        "kind": CHANNEL_CONFIG_KIND,
        "domainID": domain.uid,
    });
    if let Some(mode) = domain
        .spec
        .channel
        .as_ref()
        .and_then(|c| c.allocation_mode.as_ref())
    {
        parameters["allocationMode"] = json!(mode);
    }
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": template_name,
            "namespace": domain.namespace,
            "labels": {DOMAIN_LABEL: domain.uid},
            "ownerReferences": [{
                "apiVersion": api.api_version,
                "kind": api.kind,
                "name": domain.name,
                "uid": domain.uid,
                "controller": true,
            }],
        },
        "spec": {
            "metadata": {"labels": {DOMAIN_LABEL: domain.uid}},
            "spec": {"devices": {
                "requests": [{
                    "name": CHANNEL_REQUEST,
                    "exactly": {
                        "deviceClassName": device_class,
                        "selectors": [{"cel": {"expression": channel_selector(driver, placed)}}],
                    },
                }],
                "config": [{
                    "requests": [CHANNEL_REQUEST],
                    "opaque": {"driver": driver, "parameters": parameters},
                }],
            }},
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domains::api::{ChannelConfig, DomainGroup};

    #[test]
    fn the_template_selects_the_clique_and_channel_0_and_names_the_domain() {
        let mut domain = DomainObject {
            group: DomainGroup::Nvidia,
            namespace: "team".into(),
            name: "d".into(),
            uid: "u1".into(),
            resource_version: None,
            deleting: false,
            annotations: Default::default(),
            spec: Default::default(),
            status: Default::default(),
        };
        let placed = Placed {
            clique: "abc.1".into(),
        };
        let template =
            channel_template("gpu.nvidia.com", "imex", &domain, "channel", &placed).unwrap();
        let value = serde_json::to_value(&template).unwrap();
        let request = &value["spec"]["spec"]["devices"]["requests"][0];
        assert_eq!(
            request["exactly"]["selectors"][0]["cel"]["expression"],
            "device.attributes[\"gpu.nvidia.com\"].nvlinkDomain == \"abc.1\" && \
             device.attributes[\"gpu.nvidia.com\"].channel == 0"
        );
        assert_eq!(
            value["metadata"]["ownerReferences"][0]["apiVersion"],
            "resource.nvidia.com/v1beta1"
        );
        let parameters = &value["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"];
        let config = ChannelConfig::parse("gpu.nvidia.com", parameters)
            .unwrap()
            .unwrap();
        assert_eq!(config.domain_id, "u1");
        assert!(!config.all_channels());

        // allocationMode All reaches the plugin through the config.
        domain.spec.channel = Some(crate::domains::api::ChannelSpec {
            resource_claim_template: crate::domains::api::TemplateRef {
                name: "channel".into(),
            },
            allocation_mode: Some("All".into()),
        });
        let template =
            channel_template("gpu.nvidia.com", "imex", &domain, "channel", &placed).unwrap();
        let value = serde_json::to_value(&template).unwrap();
        let parameters = &value["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"];
        let config = ChannelConfig::parse("gpu.nvidia.com", parameters)
            .unwrap()
            .unwrap();
        assert!(config.all_channels());
    }
}
