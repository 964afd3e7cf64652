//! NVIDIA's DRA plugin keeps its checkpoint at `<kubelet plugins dir>/gpu.nvidia.com/checkpoint.json`,
//! the very place ours would take when started as `gpu.nvidia.com`. That file is NVIDIA's: this module
//! only reads it, to say which claims NVIDIA's plugin prepared on the node before a swap. Our own
//! checkpoint takes another name under that driver name ([`checkpoint_file_name`]), so it is never
//! moved aside as corrupt, rewritten or deleted, and swapping back finds it as NVIDIA left it.
//!
//! The format is public (`cmd/gpu-kubelet-plugin/checkpoint*.go`): `{"checksum", "v1", "v2"}`, where
//! `v2.preparedClaims` maps a claim UID to `{checkpointState, name, namespace, status,
//! preparedDevices}` and the older `v1.preparedClaims` lacks the state and names (every v1 entry was
//! completed). Each prepared device sits in a group's `devices[]` as `{gpu|mig|vfio: {device: {...}}}`
//! with the kubelet's fields (`PoolName`, `DeviceName`, `CDIDeviceIDs`). Unknown fields are ignored,
//! as NVIDIA's own non-strict decoder does for checkpoints of other versions.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::api::NVIDIA_DRIVER_NAME;

/// The file name of our checkpoint in the plugin directory of `driver`: `checkpoint.json`, except
/// under NVIDIA's driver name, where that name is NVIDIA's checkpoint.
pub fn checkpoint_file_name(driver: &str) -> &'static str {
    if driver == NVIDIA_DRIVER_NAME {
        "gpu-dra-checkpoint.json"
    } else {
        "checkpoint.json"
    }
}

/// Where NVIDIA's plugin keeps its checkpoint, given the plugin directory of `gpu.nvidia.com`.
pub fn nvidia_checkpoint_path(plugin_dir: &Path) -> std::path::PathBuf {
    plugin_dir.join("checkpoint.json")
}

/// A claim NVIDIA's plugin recorded as prepared (or being prepared) on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvidiaClaim {
    pub uid: String,
    /// `namespace/name`, where the checkpoint has them (v2); empty for v1 entries.
    pub name: String,
    /// `PrepareCompleted` or `PrepareStarted`.
    pub state: String,
    /// The prepared devices' names, as in the ResourceSlices NVIDIA published.
    pub devices: Vec<String>,
}

#[derive(Deserialize)]
struct File {
    #[serde(default)]
    v1: Option<Claims<ClaimV1>>,
    #[serde(default)]
    v2: Option<Claims<ClaimV2>>,
}

#[derive(Deserialize)]
struct Claims<T> {
    #[serde(default = "BTreeMap::new", rename = "preparedClaims")]
    prepared_claims: BTreeMap<String, T>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClaimV2 {
    #[serde(default)]
    checkpoint_state: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    prepared_devices: Value,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClaimV1 {
    #[serde(default)]
    prepared_devices: Value,
}

/// Reads NVIDIA's checkpoint: `Ok(None)` when there is none, the claims it records otherwise (v2
/// when present, as NVIDIA's plugin prefers it). A file that is not such a checkpoint is an error
/// that names what is wrong; the file is left as it is either way.
pub fn read(path: &Path) -> Result<Option<Vec<NvidiaClaim>>, String> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let file: File = serde_json::from_slice(&text).map_err(|e| {
        format!(
            "{}: not a checkpoint of NVIDIA's plugin: {e}",
            path.display()
        )
    })?;
    let claims = match (file.v2, file.v1) {
        (Some(v2), _) => v2
            .prepared_claims
            .into_iter()
            .map(|(uid, claim)| NvidiaClaim {
                uid,
                name: if claim.name.is_empty() {
                    String::new()
                } else {
                    format!("{}/{}", claim.namespace, claim.name)
                },
                state: claim.checkpoint_state,
                devices: device_names(&claim.prepared_devices),
            })
            .collect(),
        (None, Some(v1)) => v1
            .prepared_claims
            .into_iter()
            .map(|(uid, claim)| NvidiaClaim {
                uid,
                name: String::new(),
                state: "PrepareCompleted".to_string(),
                devices: device_names(&claim.prepared_devices),
            })
            .collect(),
        (None, None) => {
            return Err(format!(
                "{}: not a checkpoint of NVIDIA's plugin: neither v1 nor v2",
                path.display()
            ))
        }
    };
    Ok(Some(claims))
}

/// The `DeviceName` of every prepared device in `preparedDevices` (groups of `devices`, each
/// `{gpu|mig|vfio: {device: {DeviceName}}}`), in order.
fn device_names(prepared: &Value) -> Vec<String> {
    let mut names = Vec::new();
    for group in prepared.as_array().into_iter().flatten() {
        for device in group
            .get("devices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            for kind in ["gpu", "mig", "vfio"] {
                if let Some(name) = device
                    .get(kind)
                    .and_then(|d| d.get("device"))
                    .and_then(|d| d.get("DeviceName"))
                    .and_then(Value::as_str)
                {
                    names.push(name.to_string());
                }
            }
        }
    }
    names
}

/// One line for logs and Events: `ns/name (uid) on gpu-0, gpu-1`.
pub fn describe(claims: &[NvidiaClaim]) -> String {
    claims
        .iter()
        .map(|claim| {
            let who = if claim.name.is_empty() {
                claim.uid.clone()
            } else {
                format!("{} ({})", claim.name, claim.uid)
            };
            let state = if claim.state == "PrepareCompleted" {
                String::new()
            } else {
                format!(" [{}]", claim.state)
            };
            format!("{who} on {}{state}", claim.devices.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    // Written from the Go types of NVIDIA's plugin (checkpointv.go, prepared.go, deviceinfo.go): a
    // v2 checkpoint as v25.12 writes it, with the v1 copy it keeps for downgrades.
    const V2: &str = r#"{
      "checksum": 1234,
      "v1": {"preparedClaims": {"c1": {"status": {}, "preparedDevices": []}}},
      "v2": {
        "checksum": 5678,
        "nodeBootID": "boot-1",
        "preparedClaims": {
          "c1": {
            "checkpointState": "PrepareCompleted",
            "name": "shared-gpu-abcde", "namespace": "gpu-test-mps",
            "status": {"allocation": {"devices": {"results": [
              {"request": "mps-gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"}]}}},
            "preparedDevices": [{
              "devices": [{"gpu": {"info": {"uuid": "GPU-0"}, "device": {
                "Requests": ["mps-gpu"], "PoolName": "node-1", "DeviceName": "gpu-0",
                "CDIDeviceIDs": ["k8s.gpu.nvidia.com/claim=c1-gpu-0"]}}, "mig": null}],
              "configState": {"containerEdits": null, "MpsControlDaemonID": "abc"}
            }]
          },
          "c2": {
            "checkpointState": "PrepareStarted",
            "name": "mig-claim", "namespace": "default",
            "preparedDevices": [{"devices": [
              {"gpu": null, "mig": {"concrete": {"parentUUID": "GPU-1", "giId": 1, "ciId": 0},
               "device": {"PoolName": "node-1", "DeviceName": "gpu-1-mig-1g10gb-19-6"}}}],
              "configState": {}}],
            "someFieldOfALaterRelease": true
          }
        }
      }
    }"#;

    fn write(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn our_checkpoint_never_takes_nvidias_file_name() {
        assert_eq!(checkpoint_file_name("gpu.dra.dev"), "checkpoint.json");
        assert_eq!(checkpoint_file_name("example.com"), "checkpoint.json");
        let ours = checkpoint_file_name(NVIDIA_DRIVER_NAME);
        let theirs = nvidia_checkpoint_path(Path::new("/p"));
        assert_ne!(Path::new("/p").join(ours), theirs);
    }

    #[test]
    fn reads_the_claims_of_a_v2_checkpoint_and_leaves_the_file_alone() {
        let (_dir, path) = write(V2);
        let claims = read(&path).unwrap().unwrap();
        assert_eq!(
            claims,
            vec![
                NvidiaClaim {
                    uid: "c1".into(),
                    name: "gpu-test-mps/shared-gpu-abcde".into(),
                    state: "PrepareCompleted".into(),
                    devices: vec!["gpu-0".into()],
                },
                NvidiaClaim {
                    uid: "c2".into(),
                    name: "default/mig-claim".into(),
                    state: "PrepareStarted".into(),
                    devices: vec!["gpu-1-mig-1g10gb-19-6".into()],
                },
            ]
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), V2);
        assert_eq!(
            describe(&claims),
            "gpu-test-mps/shared-gpu-abcde (c1) on gpu-0; default/mig-claim (c2) on gpu-1-mig-1g10gb-19-6 [PrepareStarted]"
        );
    }

    #[test]
    fn reads_a_v1_checkpoint_of_an_older_release() {
        let (_dir, path) = write(
            r#"{"checksum": 1, "v1": {"preparedClaims": {"old": {"status": {}, "preparedDevices": [
                {"devices": [{"gpu": {"device": {"DeviceName": "gpu-3"}}}]}]}}}}"#,
        );
        let claims = read(&path).unwrap().unwrap();
        assert_eq!(claims.len(), 1);
        assert_eq!(claims[0].state, "PrepareCompleted");
        assert_eq!(claims[0].devices, vec!["gpu-3".to_string()]);
    }

    #[test]
    fn no_file_is_no_claims_and_garbage_is_an_error_that_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(&dir.path().join("checkpoint.json")).unwrap(), None);
        let (_dir, path) = write("{\"data\": \"ours, not NVIDIA's\"}");
        let error = read(&path).unwrap_err();
        assert!(error.contains("checkpoint.json: not a checkpoint of NVIDIA's plugin"));
        let (_dir2, path) = write("not json");
        assert!(read(&path).unwrap_err().contains("not a checkpoint"));
    }
}
