//! The API server double, driven through the real `kube` client: CRUD, preconditions, selectors, watches,
//! ResourceSlice validation, the status subresource, faults and the test hooks.
//! Here the fixtures; the checks are in `objects` (CRUD, preconditions, selectors, status, finalizers),
//! `watches`, `validation` and `hooks` (faults, latency, kubeconfig, test hooks, tokens).

mod hooks;
mod objects;
mod validation;
mod watches;

use gpu_dra::support::apiserver::ApiServer;
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use serde_json::Value;

const DRIVER: &str = "gpu.dra.dev";

fn slice(name: &str, node: &str, driver: &str, devices: usize) -> ResourceSlice {
    let devices = (0..devices)
        .map(|i| Device {
            name: format!("gpu-{i}"),
            attributes: Some(
                [
                    (
                        "type".to_string(),
                        DeviceAttribute {
                            string: Some("gpu".into()),
                            ..Default::default()
                        },
                    ),
                    (
                        "driverVersion".to_string(),
                        DeviceAttribute {
                            version: Some("580.95.5".into()),
                            ..Default::default()
                        },
                    ),
                ]
                .into(),
            ),
            ..Default::default()
        })
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 0,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

fn slice_value(name: &str) -> Value {
    serde_json::to_value(slice(name, "node-a", DRIVER, 2)).expect("a slice serializes")
}

async fn start() -> (ApiServer, Api<ResourceSlice>) {
    let server = ApiServer::start().await.expect("server starts");
    let api = Api::all(server.client());
    (server, api)
}

/// The API status of a failed call.
fn status(result: Result<impl std::fmt::Debug, kube::Error>) -> Box<kube::core::Status> {
    match result {
        Err(kube::Error::Api(status)) => status,
        other => panic!("expected an API error, got {other:?}"),
    }
}
