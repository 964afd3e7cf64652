//! The `ComputeDomain` resource, in our group (`gpu.dra.dev/v1alpha1`) and, in NVIDIA compatibility
//! mode, NVIDIA's (`resource.nvidia.com/v1beta1`, the same spec and status fields), so that manifests
//! written for NVIDIA's driver work unchanged. Both are read as [`DynamicObject`]s through
//! [`DomainGroup::api_resource`] and converted with [`DomainObject::from_dynamic`]; only our own group
//! gets a CRD from this crate (`crd/gpu.dra.dev_computedomains.yaml`).
//!
//! Where a domain was placed (its NVLink clique) is kept in a cluster-scoped [`ComputeDomainPlacement`]
//! named by the domain's UID, which only the controller writes: never in the domain itself, whose
//! metadata its namespace's users write (a preset annotation must change nothing) and whose status
//! NVIDIA's CRD prunes of fields it does not know.

use kube::api::{ApiResource, DynamicObject};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Our group and version.
pub const GROUP: &str = "gpu.dra.dev";
pub const VERSION: &str = "v1alpha1";
/// NVIDIA's group and version, served in compatibility mode.
pub const NVIDIA_GROUP: &str = "resource.nvidia.com";
pub const NVIDIA_VERSION: &str = "v1beta1";
pub const KIND: &str = "ComputeDomain";
pub const PLURAL: &str = "computedomains";

/// `status.status` and `status.nodes[].status` values (NVIDIA's).
pub const READY: &str = "Ready";
pub const NOT_READY: &str = "NotReady";

/// Why the domain is not placed (yet), for people and `gpu-dra explain`; the controller writes it and
/// nothing trusts it.
pub const PLACEMENT_ANNOTATION: &str = "gpu.dra.dev/placement";
/// The plural of [`ComputeDomainPlacement`].
pub const PLACEMENT_PLURAL: &str = "computedomainplacements";
/// The label on everything made for one domain (its ResourceClaimTemplate, its IMEX daemon Pods):
/// the domain's UID.
pub const DOMAIN_LABEL: &str = "gpu.dra.dev/compute-domain";

/// The opaque config kind in the channel claims the controller writes (ours and NVIDIA's).
pub const CHANNEL_CONFIG_KIND: &str = "ComputeDomainChannelConfig";
/// The DeviceClass of IMEX channels under our driver name.
pub const CHANNEL_DEVICE_CLASS: &str = "imex-channel.gpu.dra.dev";

/// A set of GPUs on several nodes that share NVLink memory: how many nodes, and the name of the
/// ResourceClaimTemplate its workload pods use for their IMEX channel.
// Clippy reads two printcolumns with `type_ = "string"` as a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "gpu.dra.dev",
    version = "v1alpha1",
    kind = "ComputeDomain",
    plural = "computedomains",
    shortname = "cd",
    namespaced,
    status = "ComputeDomainStatus",
    derive = "PartialEq",
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".spec.numNodes"),
    printcolumn(name = "Status", type_ = "string", json_path = ".status.status"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    doc = "Pods on several nodes of one NVLink clique that share GPU memory through IMEX."
)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomainSpec {
    /// How many nodes the domain spans; it is Ready when that many nodes' IMEX daemons are. 0: any
    /// number (Ready as soon as one node is).
    #[serde(default)]
    pub num_nodes: u32,
    /// The channel claim template the controller writes for the workload pods.
    pub channel: Option<ChannelSpec>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ChannelSpec {
    pub resource_claim_template: TemplateRef,
    /// `Single` (the default): the container gets the node's channel 0. `All`: every channel the
    /// driver has (`channel0` … `channel2047`), as NVIDIA's driver gives them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_mode: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateRef {
    pub name: String,
}

/// NVIDIA's status fields, plus conditions (pruned by NVIDIA's CRD, kept by ours).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomainStatus {
    /// `Ready` or `NotReady`.
    #[serde(default)]
    pub status: String,
    /// The nodes that joined: one per node whose plugin prepared a channel of this domain.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<ComputeDomainNode>,
    /// `Placed` and `Ready`, with reasons.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<DomainCondition>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomainNode {
    pub name: String,
    /// The address the other nodes' IMEX daemons reach this node's at.
    #[serde(default)]
    pub ip_address: String,
    /// `<clusterUUID>.<cliqueId>`.
    #[serde(rename = "cliqueID", default)]
    pub clique_id: String,
    /// Unique per clique within the domain (NVIDIA's DNS-name index).
    #[serde(default)]
    pub index: u32,
    /// `Ready` when the node's IMEX daemon is; `NotReady` otherwise.
    #[serde(default)]
    pub status: String,
    /// Why it is not Ready (ours; NVIDIA's CRD prunes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DomainCondition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
}

/// Where the controller placed one ComputeDomain: cluster-scoped, named by the domain's UID, and
/// written by the controller alone (namespace users are granted nothing on it, the plugins only read
/// it). A plugin prepares a domain's channel only on a node of this clique, for a claim in the domain's
/// namespace. It holds no node and no channel: the nodes are taken by the workers' channel claims,
/// one domain per node, so a domain without workers keeps no one else's job from running.
// Clippy reads the printcolumns with `type_ = "string"` as a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "gpu.dra.dev",
    version = "v1alpha1",
    kind = "ComputeDomainPlacement",
    plural = "computedomainplacements",
    derive = "PartialEq",
    printcolumn(
        name = "Namespace",
        type_ = "string",
        json_path = ".spec.domain.namespace"
    ),
    printcolumn(name = "Domain", type_ = "string", json_path = ".spec.domain.name"),
    printcolumn(name = "Clique", type_ = "string", json_path = ".spec.clique"),
    doc = "The NVLink clique the controller chose for one ComputeDomain (named by its UID)."
)]
#[serde(rename_all = "camelCase")]
pub struct ComputeDomainPlacementSpec {
    pub domain: PlacedDomain,
    /// `<clusterUUID>.<cliqueId>`.
    pub clique: String,
}

/// The domain a placement is for.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlacedDomain {
    /// `gpu.dra.dev/v1alpha1` or `resource.nvidia.com/v1beta1`.
    pub api_version: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ComputeDomainPlacement {
    /// The placement of `domain` on `clique`.
    pub fn of(domain: &DomainObject, clique: &str) -> Self {
        ComputeDomainPlacement::new(
            &domain.uid,
            ComputeDomainPlacementSpec {
                domain: PlacedDomain {
                    api_version: domain.group.api_resource().api_version,
                    namespace: domain.namespace.clone(),
                    name: domain.name.clone(),
                    uid: domain.uid.clone(),
                },
                clique: clique.to_string(),
            },
        )
    }

    /// Whether this placement is the one of `domain` (its name alone is a UID anyone could copy).
    pub fn is_for(&self, domain: &DomainObject) -> bool {
        let placed = &self.spec.domain;
        self.metadata.name.as_deref() == Some(domain.uid.as_str())
            && placed.uid == domain.uid
            && placed.namespace == domain.namespace
            && placed.name == domain.name
            && placed.api_version == domain.group.api_resource().api_version
    }
}

/// Which API group a domain object came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DomainGroup {
    /// `gpu.dra.dev/v1alpha1`.
    Ours,
    /// `resource.nvidia.com/v1beta1` (compatibility mode).
    Nvidia,
}

impl DomainGroup {
    pub fn api_resource(self) -> ApiResource {
        let (group, version) = match self {
            DomainGroup::Ours => (GROUP, VERSION),
            DomainGroup::Nvidia => (NVIDIA_GROUP, NVIDIA_VERSION),
        };
        ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: format!("{group}/{version}"),
            kind: KIND.into(),
            plural: PLURAL.into(),
        }
    }

    /// The groups a driver name serves: ours always, NVIDIA's too under NVIDIA's driver name.
    pub fn served_by(driver: &str) -> Vec<DomainGroup> {
        if driver == crate::api::NVIDIA_DRIVER_NAME {
            vec![DomainGroup::Ours, DomainGroup::Nvidia]
        } else {
            vec![DomainGroup::Ours]
        }
    }

    /// The `apiVersion` of the channel config the claims of this group's domains carry.
    pub fn config_api_version(self) -> String {
        match self {
            DomainGroup::Ours => format!("{GROUP}/{VERSION}"),
            DomainGroup::Nvidia => format!("{NVIDIA_GROUP}/{NVIDIA_VERSION}"),
        }
    }
}

/// A domain read from either group, with what the driver needs of its metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainObject {
    pub group: DomainGroup,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: Option<String>,
    pub deleting: bool,
    pub annotations: std::collections::BTreeMap<String, String>,
    pub spec: ComputeDomainSpec,
    pub status: ComputeDomainStatus,
}

impl DomainObject {
    /// Reads a domain; a spec that does not parse is an error that names the domain.
    pub fn from_dynamic(group: DomainGroup, object: &DynamicObject) -> Result<Self, String> {
        let meta = &object.metadata;
        let namespace = meta.namespace.clone().unwrap_or_default();
        let name = meta.name.clone().unwrap_or_default();
        let spec = object
            .data
            .get("spec")
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        let spec: ComputeDomainSpec = serde_json::from_value(spec)
            .map_err(|e| format!("ComputeDomain {namespace}/{name}: spec: {e}"))?;
        let status = match object.data.get("status") {
            Some(status) if !status.is_null() => serde_json::from_value(status.clone())
                .map_err(|e| format!("ComputeDomain {namespace}/{name}: status: {e}"))?,
            _ => ComputeDomainStatus::default(),
        };
        Ok(DomainObject {
            group,
            namespace,
            name,
            uid: meta.uid.clone().unwrap_or_default(),
            resource_version: meta.resource_version.clone(),
            deleting: meta.deletion_timestamp.is_some(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            spec,
            status,
        })
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The opaque config of a channel request: which domain the channel is for (its UID).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ChannelConfig {
    pub api_version: String,
    pub kind: String,
    #[serde(rename = "domainID")]
    pub domain_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_mode: Option<String>,
}

/// `allocationMode` values (NVIDIA's): one channel (`channel0`), or every channel of the node.
pub const SINGLE: &str = "Single";
pub const ALL: &str = "All";

impl ChannelConfig {
    /// Whether the container gets every channel of the node.
    pub fn all_channels(&self) -> bool {
        self.allocation_mode.as_deref() == Some(ALL)
    }

    /// Parses one opaque config's parameters; `None` when it is not a channel config of a group this
    /// driver serves, an error naming the field when it is one but malformed.
    pub fn parse(driver: &str, parameters: &serde_json::Value) -> Option<Result<Self, String>> {
        let api_version = parameters.get("apiVersion")?.as_str()?;
        let kind = parameters.get("kind")?.as_str()?;
        if kind != CHANNEL_CONFIG_KIND {
            return None;
        }
        let served = DomainGroup::served_by(driver)
            .into_iter()
            .any(|group| group.config_api_version() == api_version);
        if !served {
            return None;
        }
        Some(
            serde_json::from_value::<ChannelConfig>(parameters.clone())
                .map_err(|e| format!("{CHANNEL_CONFIG_KIND}: {e}"))
                .and_then(|config| {
                    if config.domain_id.is_empty() {
                        return Err(format!("{CHANNEL_CONFIG_KIND}: domainID is empty"));
                    }
                    match config.allocation_mode.as_deref() {
                        None | Some(SINGLE) | Some(ALL) => Ok(config),
                        Some(other) => Err(format!(
                            "{CHANNEL_CONFIG_KIND}: allocationMode {other:?} is not one of \"{SINGLE}\" (channel 0) and \"{ALL}\" (every channel of the node)"
                        )),
                    }
                }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_manifest_reads_unchanged() {
        let object: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "imex", "namespace": "team", "uid": "u1"},
            "spec": {"numNodes": 4, "channel": {"resourceClaimTemplate": {"name": "imex-channel"}}},
        }))
        .unwrap();
        let domain = DomainObject::from_dynamic(DomainGroup::Nvidia, &object).unwrap();
        assert_eq!(domain.spec.num_nodes, 4);
        assert_eq!(
            domain
                .spec
                .channel
                .as_ref()
                .unwrap()
                .resource_claim_template
                .name,
            "imex-channel"
        );
        assert_eq!(domain.key(), "team/imex");
    }

    #[test]
    fn channel_config_of_the_other_group_is_not_ours() {
        let nvidia = serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainChannelConfig", "domainID": "u1"});
        assert!(ChannelConfig::parse("gpu.dra.dev", &nvidia).is_none());
        assert_eq!(
            ChannelConfig::parse("gpu.nvidia.com", &nvidia)
                .unwrap()
                .unwrap()
                .domain_id,
            "u1"
        );
        let all = serde_json::json!({"apiVersion": "gpu.dra.dev/v1alpha1",
            "kind": "ComputeDomainChannelConfig", "domainID": "u1", "allocationMode": "All"});
        assert!(ChannelConfig::parse("gpu.dra.dev", &all)
            .unwrap()
            .unwrap()
            .all_channels());
        let some = serde_json::json!({"apiVersion": "gpu.dra.dev/v1alpha1",
            "kind": "ComputeDomainChannelConfig", "domainID": "u1", "allocationMode": "Some"});
        let error = ChannelConfig::parse("gpu.dra.dev", &some)
            .unwrap()
            .unwrap_err();
        assert!(error.contains("allocationMode \"Some\""), "{error}");
        let empty = serde_json::json!({"apiVersion": "gpu.dra.dev/v1alpha1",
            "kind": "ComputeDomainChannelConfig", "domainID": ""});
        assert!(ChannelConfig::parse("gpu.dra.dev", &empty)
            .unwrap()
            .is_err());
    }
}
