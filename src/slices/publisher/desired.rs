//! The ResourceSlices this node should have (pure): the planner's slices as API objects, owned by the
//! Node so that they go with it, in one pool named after the node, under a generateName prefix the
//! server accepts as it is.

use k8s_openapi::api::resource::v1::{ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::devices::NodeDevices;
use crate::slices::planner::{plan, ServerVersion};

/// `MaxGeneratedNameLength` of the API server: longer generateName prefixes are cut by the server.
const MAX_GENERATE_NAME_PREFIX: usize = 58;

/// The slices this node should have, without pool generation (the publisher sets it).
pub fn desired_slices(
    driver: &str,
    node_name: &str,
    node_uid: &str,
    node: &NodeDevices,
    version: ServerVersion,
) -> Vec<ResourceSlice> {
    let planned = plan(node, version);
    let count = planned.len() as i64;
    planned
        .into_iter()
        .map(|slice| ResourceSlice {
            metadata: ObjectMeta {
                generate_name: Some(generate_name_prefix(node_name, driver)),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".to_string(),
                    kind: "Node".to_string(),
                    name: node_name.to_string(),
                    uid: node_uid.to_string(),
                    controller: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: driver.to_string(),
                node_name: Some(node_name.to_string()),
                pool: ResourcePool {
                    name: node_name.to_string(),
                    generation: 0,
                    resource_slice_count: count,
                },
                // Counter-only slices leave `devices` out: from 1.35 a slice holds one or the other.
                devices: (!slice.devices.is_empty() || slice.shared_counters.is_empty())
                    .then_some(slice.devices),
                shared_counters: (!slice.shared_counters.is_empty())
                    .then_some(slice.shared_counters),
                ..Default::default()
            },
        })
        .collect()
}

/// `<node>-<driver>-`, cut so the server does not have to, and never ending in a character that would
/// make the generated name invalid.
fn generate_name_prefix(node_name: &str, driver: &str) -> String {
    let mut prefix = format!("{node_name}-{driver}");
    prefix.truncate(MAX_GENERATE_NAME_PREFIX - 1);
    let trimmed = prefix.trim_end_matches(['-', '.']);
    format!("{trimmed}-")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{self, MigMode};
    use crate::gpu::{FakeBackend, GpuBackend};

    const V1_35: ServerVersion = ServerVersion { minor: 35 };

    fn node(profile: &str, mig_mode: MigMode) -> NodeDevices {
        devices::node_devices(
            &FakeBackend::new("node-a", profile)
                .unwrap()
                .inventory()
                .unwrap(),
            mig_mode,
        )
    }

    fn h100_devices() -> NodeDevices {
        node("dgx-h100", MigMode::Static)
    }

    #[test]
    fn owner_is_the_node_and_prefix_fits_generate_name() {
        let desired = desired_slices("gpu.dra.dev", "node-a", "uid-1", &h100_devices(), V1_35);
        let owner = &desired[0].metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("Node", "uid-1", Some(true))
        );
        assert_eq!(desired[0].spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(desired[0].spec.pool.resource_slice_count, 1);
        let long = generate_name_prefix(&"n".repeat(200), "gpu.dra.dev");
        assert!(long.len() <= MAX_GENERATE_NAME_PREFIX && long.ends_with('-'));
        assert_eq!(
            generate_name_prefix("node-a", "gpu.dra.dev"),
            "node-a-gpu.dra.dev-"
        );
    }
}
