//! Which GPU each container has, the way monitoring agents find out: the kubelet's PodResources API
//! (`List`, on `<kubelet root>/pod-resources/kubelet.sock`) reports each container's DRA devices as
//! `(driver, pool, device)`, and the node's ResourceSlices map each to a GPU by its attributes. This is
//! dcgm-exporter's chain (its DRA support): a device of `type` `gpu` is the GPU of its `uuid`; one of
//! `type` `mig` is a MIG device of the GPU `parentUUID`, with its `profile` and own `uuid`. dcgm-exporter
//! reads only slices and claim devices of driver `gpu.nvidia.com`; `gpu-dra pod-devices` reads those
//! of any driver name it is given.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde::Serialize;
use tokio::net::UnixStream;

use crate::proto::podresources_v1::pod_resources_lister_client::PodResourcesListerClient;
use crate::proto::podresources_v1::{ListPodResourcesRequest, ListPodResourcesResponse};

/// Where the kubelet serves the PodResources API, under its default root directory.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    #[error("cannot reach the kubelet's PodResources API at {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the kubelet's PodResources List failed: {0}")]
    List(String),
}

/// One DRA device of one container, as the kubelet reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDevice {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// `namespace/name` of the ResourceClaim.
    pub claim: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// The CDI devices the driver returned for it at prepare.
    pub cdi_devices: Vec<String>,
}

/// What the node's slices say a device is: the attributes dcgm-exporter reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceIdentity {
    /// `gpu` or `mig`.
    #[serde(rename = "type")]
    pub kind: String,
    pub uuid: Option<String>,
    #[serde(rename = "parentUUID")]
    pub parent_uuid: Option<String>,
    pub profile: Option<String>,
}

impl DeviceIdentity {
    /// The GPU a metric of this device belongs to, as dcgm-exporter keys it: a GPU's own UUID, a MIG
    /// device's parent's.
    pub fn gpu_uuid(&self) -> Option<&str> {
        match self.kind.as_str() {
            "mig" => self.parent_uuid.as_deref(),
            _ => self.uuid.as_deref(),
        }
    }
}

/// Asks the kubelet for every container's resources.
pub async fn list(socket: &Path) -> Result<ListPodResourcesResponse, PodResourcesError> {
    let path = socket.to_path_buf();
    // The URI is a placeholder: the connector dials the socket, and the kubelet ignores :authority.
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|source| PodResourcesError::Connect {
            path: socket.to_path_buf(),
            source,
        })?;
    PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| PodResourcesError::List(status.message().to_string()))
}

/// Every DRA device of every container in `response`, of `driver` only when given.
pub fn dra_devices(
    response: &ListPodResourcesResponse,
    driver: Option<&str>,
) -> Vec<ContainerDevice> {
    let mut devices = Vec::new();
    for pod in &response.pod_resources {
        for container in &pod.containers {
            for claim in &container.dynamic_resources {
                for resource in &claim.claim_resources {
                    if driver.is_some_and(|d| d != resource.driver_name) {
                        continue;
                    }
                    devices.push(ContainerDevice {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: container.name.clone(),
                        claim: format!("{}/{}", claim.claim_namespace, claim.claim_name),
                        driver: resource.driver_name.clone(),
                        pool: resource.pool_name.clone(),
                        device: resource.device_name.clone(),
                        cdi_devices: resource
                            .cdi_devices
                            .iter()
                            .map(|d| d.name.clone())
                            .collect(),
                    });
                }
            }
        }
    }
    devices
}

/// `(driver, pool, device)` → what the slices say it is. Attribute names are read as the scheduler
/// does: unqualified, or qualified with the slice's driver name.
pub fn identities(slices: &[ResourceSlice]) -> BTreeMap<(String, String, String), DeviceIdentity> {
    let mut known = BTreeMap::new();
    for slice in slices {
        let spec = &slice.spec;
        for device in spec.devices.iter().flatten() {
            let Some(attributes) = &device.attributes else {
                continue;
            };
            let string = |name: &str| {
                attributes
                    .get(name)
                    .or_else(|| attributes.get(&format!("{}/{name}", spec.driver)))
                    .and_then(|a| a.string.clone())
            };
            known.insert(
                (
                    spec.driver.clone(),
                    spec.pool.name.clone(),
                    device.name.clone(),
                ),
                DeviceIdentity {
                    kind: string("type").unwrap_or_default(),
                    uuid: string("uuid"),
                    parent_uuid: string("parentUUID"),
                    profile: string("profile"),
                },
            );
        }
    }
    known
}

/// A container's device with what the slices say it is (`None`: no slice names it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResolvedDevice {
    #[serde(flatten)]
    pub device: ContainerDevice,
    pub identity: Option<DeviceIdentity>,
}

pub fn resolve(devices: Vec<ContainerDevice>, slices: &[ResourceSlice]) -> Vec<ResolvedDevice> {
    let known = identities(slices);
    devices
        .into_iter()
        .map(|device| {
            let key = (
                device.driver.clone(),
                device.pool.clone(),
                device.device.clone(),
            );
            let identity = known.get(&key).cloned();
            ResolvedDevice { device, identity }
        })
        .collect()
}

/// The table `gpu-dra pod-devices` prints.
pub fn table(devices: &[ResolvedDevice]) -> String {
    let mut out = String::from(
        "NAMESPACE\tPOD\tCONTAINER\tCLAIM\tDEVICE\tTYPE\tGPU UUID\tMIG UUID\tPROFILE\n",
    );
    for row in devices {
        let d = &row.device;
        let (kind, gpu, mig, profile) = match &row.identity {
            None => ("?", "(no slice names this device)", "-", "-"),
            Some(identity) => (
                identity.kind.as_str(),
                identity.gpu_uuid().unwrap_or("-"),
                if identity.kind == "mig" {
                    identity.uuid.as_deref().unwrap_or("-")
                } else {
                    "-"
                },
                identity.profile.as_deref().unwrap_or("-"),
            ),
        };
        out.push_str(&format!(
            "{}\t{}\t{}\t{}\t{}/{}/{}\t{kind}\t{gpu}\t{mig}\t{profile}\n",
            d.namespace, d.pod, d.container, d.claim, d.driver, d.pool, d.device
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::podresources_v1::{
        CdiDevice, ClaimResource, ContainerResources, DynamicResource, PodResources,
    };

    fn response() -> ListPodResourcesResponse {
        let resource = |driver: &str, device: &str| ClaimResource {
            cdi_devices: vec![CdiDevice {
                name: format!("k8s.{driver}/gpu=uid-{device}"),
            }],
            driver_name: driver.into(),
            pool_name: "node-a".into(),
            device_name: device.into(),
        };
        ListPodResourcesResponse {
            pod_resources: vec![PodResources {
                name: "trainer".into(),
                namespace: "ml".into(),
                containers: vec![ContainerResources {
                    name: "main".into(),
                    dynamic_resources: vec![DynamicResource {
                        claim_name: "trainer-gpu".into(),
                        claim_namespace: "ml".into(),
                        claim_resources: vec![
                            resource("gpu.nvidia.com", "gpu-0"),
                            resource("gpu.nvidia.com", "gpu-1-mig-1g10gb-19-0"),
                            resource("net.example.com", "nic-0"),
                        ],
                    }],
                    ..Default::default()
                }],
            }],
        }
    }

    fn slices() -> Vec<ResourceSlice> {
        serde_json::from_value(serde_json::json!([{
            "metadata": {"name": "s"},
            "spec": {"driver": "gpu.nvidia.com", "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "nodeName": "node-a", "devices": [
                {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-0"}}},
                {"name": "gpu-1-mig-1g10gb-19-0", "attributes": {"gpu.nvidia.com/type": {"string": "mig"},
                    "uuid": {"string": "MIG-9"}, "parentUUID": {"string": "GPU-1"}, "profile": {"string": "1g.10gb"}}}
            ]}
        }]))
        .unwrap()
    }

    #[test]
    fn each_device_resolves_to_its_gpu_as_dcgm_exporter_keys_it() {
        let devices = dra_devices(&response(), Some("gpu.nvidia.com"));
        assert_eq!(devices.len(), 2, "the NIC of another driver is left out");
        let resolved = resolve(devices, &slices());
        let gpu = resolved[0].identity.as_ref().unwrap();
        assert_eq!((gpu.kind.as_str(), gpu.gpu_uuid()), ("gpu", Some("GPU-0")));
        let mig = resolved[1].identity.as_ref().unwrap();
        assert_eq!(mig.kind, "mig");
        assert_eq!(mig.gpu_uuid(), Some("GPU-1"));
        assert_eq!(mig.uuid.as_deref(), Some("MIG-9"));
        assert_eq!(mig.profile.as_deref(), Some("1g.10gb"));
        assert_eq!(resolved[0].device.claim, "ml/trainer-gpu");
        let table = table(&resolved);
        assert!(table.contains("ml\ttrainer\tmain\tml/trainer-gpu\tgpu.nvidia.com/node-a/gpu-1-mig-1g10gb-19-0\tmig\tGPU-1\tMIG-9\t1g.10gb"), "{table}");
    }

    #[test]
    fn a_device_no_slice_names_says_so() {
        let devices = dra_devices(&response(), None);
        assert_eq!(devices.len(), 3);
        let resolved = resolve(devices, &slices());
        assert_eq!(resolved[2].identity, None);
        assert!(table(&resolved).contains("(no slice names this device)"));
        // The JSON output names the attributes as the slices do.
        let json =
            serde_json::to_value(resolve(dra_devices(&response(), None), &slices())).unwrap();
        assert_eq!(json[1]["identity"]["parentUUID"], "GPU-1");
        assert_eq!(
            json[1]["cdiDevices"][0],
            "k8s.gpu.nvidia.com/gpu=uid-gpu-1-mig-1g10gb-19-0"
        );
    }
}
