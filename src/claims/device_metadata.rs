//! KEP-5304 device metadata for passthrough claims: KubeVirt finds the PCI address of the GPU it
//! passes to the VM in a JSON file the container reads at a well-known path. Kubernetes' kubelet
//! plugin library (Go) writes it for drivers that enable it (`EnableDeviceMetadata`, alpha in 1.36);
//! the kubelets this driver targets (1.34 and later) need nothing for it, since the file reaches
//! the container as a CDI bind mount. The same file and paths are written here:
//!
//! - host: `<plugin dir>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json`;
//! - container: `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json`,
//!   or `.../resourceclaimtemplates/<pod claim name>/<request>/...` for a claim made from a template
//!   (its `resource.kubernetes.io/pod-claim-name` annotation);
//! - content: a `DeviceMetadata` of `metadata.resource.k8s.io/v1alpha1` with each device's driver,
//!   pool, name and attributes as its ResourceSlice publishes them (`resource.kubernetes.io/pciBusID`).

use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1::{Device, ResourceClaim};
use serde::{Deserialize, Serialize};
use serde_json::json;

const CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
const POD_CLAIM_NAME: &str = "resource.kubernetes.io/pod-claim-name";
const HOST_SUBDIR: &str = "dra-device-metadata";

/// One metadata file of a claim: where it is on the host and where the container sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MetadataFile {
    pub host_path: String,
    pub container_path: String,
}

/// The directory of a claim's metadata files under the plugin's directory.
pub fn claim_dir(plugin_dir: &Path, namespace: &str, name: &str) -> PathBuf {
    plugin_dir
        .join(HOST_SUBDIR)
        .join(format!("{namespace}_{name}"))
}

/// The files for `claim`'s devices (`(request, device)` pairs, published as `published`), with
/// their text, ready to be recorded and written.
pub fn files(
    plugin_dir: &Path,
    driver: &str,
    pool: &str,
    claim: &ResourceClaim,
    devices: &[(String, Device)],
) -> Vec<(MetadataFile, String)> {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let pod_claim = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_CLAIM_NAME))
        .cloned();
    let mut requests: Vec<&str> = devices.iter().map(|(r, _)| r.as_str()).collect();
    requests.sort();
    requests.dedup();
    requests
        .into_iter()
        .map(|request| {
            let base = request.split('/').next().unwrap_or(request);
            let host = claim_dir(plugin_dir, &namespace, &name)
                .join(base)
                .join("metadata.json");
            let container = match &pod_claim {
                Some(pod_claim) => format!("{CONTAINER_DIR}/resourceclaimtemplates/{pod_claim}/{base}/{driver}-metadata.json"),
                None => format!("{CONTAINER_DIR}/resourceclaims/{name}/{base}/{driver}-metadata.json"),
            };
            let listed: Vec<_> = devices
                .iter()
                .filter(|(r, _)| r == request)
                .map(|(_, d)| json!({"driver": driver, "pool": pool, "name": d.name, "attributes": d.attributes}))
                .collect();
            let mut metadata = json!({
                "name": name, "namespace": namespace,
                "uid": claim.metadata.uid.clone().unwrap_or_default(),
            });
            if let Some(generation) = claim.metadata.generation {
                metadata["generation"] = json!(generation);
            }
            let mut document = json!({
                "kind": "DeviceMetadata",
                "apiVersion": "metadata.resource.k8s.io/v1alpha1",
                "metadata": metadata,
                "requests": [{"name": request, "devices": listed}],
            });
            if let Some(pod_claim) = &pod_claim {
                document["podClaimName"] = json!(pod_claim);
            }
            (
                MetadataFile {
                    host_path: host.display().to_string(),
                    container_path: container,
                },
                format!("{document}\n"),
            )
        })
        .collect()
}

/// Writes each file (atomically, readable by the container's user).
pub fn write(files: &[(MetadataFile, String)]) -> std::io::Result<()> {
    for (file, text) in files {
        let path = Path::new(&file.host_path);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        crate::fsutil::write_atomically(path, text.as_bytes(), 0o644)?;
    }
    Ok(())
}

/// Removes a claim's metadata directory; a missing one is fine.
pub fn remove(plugin_dir: &Path, namespace: &str, name: &str) -> std::io::Result<()> {
    match std::fs::remove_dir_all(claim_dir(plugin_dir, namespace, name)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The read-only bind mount of a file into the container.
pub fn mount(file: &MetadataFile) -> crate::cdi::Mount {
    crate::cdi::Mount {
        host_path: file.host_path.clone(),
        container_path: file.container_path.clone(),
        options: vec!["ro".into(), "bind".into()],
        mount_type: None,
    }
}
