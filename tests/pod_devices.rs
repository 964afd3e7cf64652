//! The chain monitoring agents (dcgm-exporter) follow to attribute GPU metrics to pods: the kubelet's
//! PodResources `List` reports a container's claim devices as `(driver, pool, device)` with the CDI
//! devices the plugin returned at prepare, and the node's ResourceSlices resolve each to its GPU's UUID.
//! The kubelet's side here serves what the kubelet would after this prepare (its PodResources server
//! fills `dynamic_resources` from the claim's allocation and the prepare answer); `gpu-dra pod-devices`,
//! the real binary, reads it over the socket and the slices from the API server.

use std::path::PathBuf;

use gpu_dra::proto::podresources_v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpu_dra::proto::podresources_v1::{
    CdiDevice, ClaimResource, ContainerResources, DynamicResource, GetPodResourcesRequest,
    GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use gpu_dra::support::harness::{Harness, DRIVER};
use tokio_stream::wrappers::UnixListenerStream;

struct Kubelet(ListPodResourcesResponse);

#[tonic::async_trait]
impl PodResourcesLister for Kubelet {
    async fn list(
        &self,
        _: tonic::Request<ListPodResourcesRequest>,
    ) -> Result<tonic::Response<ListPodResourcesResponse>, tonic::Status> {
        Ok(tonic::Response::new(self.0.clone()))
    }

    async fn get(
        &self,
        _: tonic::Request<GetPodResourcesRequest>,
    ) -> Result<tonic::Response<GetPodResourcesResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("not used"))
    }
}

fn serve(socket: PathBuf, response: ListPodResourcesResponse) {
    let listener = tokio::net::UnixListener::bind(socket).expect("socket binds");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PodResourcesListerServer::new(Kubelet(response)))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_devices_maps_each_container_device_to_its_gpu_uuid() {
    let node = Harness::new("dgx-h100").await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let claim = node.allocated_claim("trainer-gpus", 2).await;
    let prepared = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let devices = prepared[&claim.uid].clone().expect("prepared");
    assert_eq!(devices.len(), 2);

    let response = ListPodResourcesResponse {
        pod_resources: vec![PodResources {
            name: "trainer".into(),
            namespace: "default".into(),
            containers: vec![ContainerResources {
                name: "main".into(),
                dynamic_resources: vec![DynamicResource {
                    claim_name: claim.name.clone(),
                    claim_namespace: claim.namespace.clone(),
                    claim_resources: devices
                        .iter()
                        .map(|d| ClaimResource {
                            cdi_devices: d
                                .cdi_device_ids
                                .iter()
                                .map(|id| CdiDevice { name: id.clone() })
                                .collect(),
                            driver_name: DRIVER.into(),
                            pool_name: d.pool_name.clone(),
                            device_name: d.device_name.clone(),
                        })
                        .collect(),
                }],
                ..Default::default()
            }],
        }],
    };
    let socket = node.dir.path().join("pod-resources.sock");
    serve(socket.clone(), response);
    let kubeconfig = node.dir.path().join("kubeconfig");
    node.api.write_kubeconfig(&kubeconfig).unwrap();

    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .arg("pod-devices")
        .arg("--pod-resources-socket")
        .arg(&socket)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--driver-name", DRIVER, "-o", "json"])
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(rows.len(), 2);

    // Each device's GPU, as the backend knows it.
    for (row, device) in rows.iter().zip(&devices) {
        assert_eq!(row["pod"], "trainer");
        assert_eq!(row["container"], "main");
        assert_eq!(row["claim"], "default/trainer-gpus");
        assert_eq!(row["device"], device.device_name.as_str());
        assert_eq!(row["identity"]["type"], "gpu");
        assert_eq!(
            row["identity"]["uuid"],
            node.gpu_uuid(&device.device_name).as_str()
        );
        assert_eq!(row["cdiDevices"].as_array().map(Vec::len), Some(1));
    }
    plugin.shutdown().await;
}
