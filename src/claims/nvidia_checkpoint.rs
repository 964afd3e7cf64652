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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvidiaClaim {
    pub uid: String,
    /// `namespace/name`, where the checkpoint has them (v2); empty for v1 entries.
    pub name: String,
    /// `PrepareCompleted` or `PrepareStarted`.
    pub state: String,
    /// The prepared devices' names, as in the ResourceSlices NVIDIA published.
    pub devices: Vec<String>,
    /// What NVIDIA's plugin answered the kubelet for each device, and what it made for it.
    pub prepared: Vec<NvidiaDevice>,
    /// The ids of the MPS control daemons NVIDIA's plugin started for the claim (one per device
    /// group with an MPS config): Deployment `mps-control-daemon-<id>` and `<plugin dir>/mps/<id>`.
    pub mps_daemons: Vec<String>,
}

/// One device of a claim NVIDIA's plugin prepared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvidiaDevice {
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    pub cdi_device_ids: Vec<String>,
    /// The UUID of a whole GPU (`gpu.info.uuid`).
    pub gpu_uuid: Option<String>,
    /// A MIG device as it exists (`mig.concrete` of v25.12 on; older releases had static MIG only,
    /// and record just `mig.info.uuid`).
    pub mig: Option<NvidiaMig>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvidiaMig {
    pub uuid: String,
    pub parent_uuid: String,
    pub gpu_instance_id: Option<u32>,
    pub compute_instance_id: Option<u32>,
}

/// NVIDIA's checkpoint as read: its claims, and the boot it was written in where it says (later
/// releases write `v2.nodeBootID`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvidiaCheckpoint {
    pub node_boot_id: String,
    pub claims: Vec<NvidiaClaim>,
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
    #[serde(default, rename = "nodeBootID")]
    node_boot_id: String,
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
    Ok(read_checkpoint(path)?.map(|checkpoint| checkpoint.claims))
}

/// [`read`], with the boot the checkpoint names.
pub fn read_checkpoint(path: &Path) -> Result<Option<NvidiaCheckpoint>, String> {
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
    let mut node_boot_id = String::new();
    let claims = match (file.v2, file.v1) {
        (Some(v2), _) => {
            node_boot_id = v2.node_boot_id;
            v2.prepared_claims
                .into_iter()
                .map(|(uid, claim)| NvidiaClaim {
                    uid,
                    name: if claim.name.is_empty() {
                        String::new()
                    } else {
                        format!("{}/{}", claim.namespace, claim.name)
                    },
                    state: claim.checkpoint_state,
                    ..prepared(&claim.prepared_devices)
                })
                .collect()
        }
        (None, Some(v1)) => v1
            .prepared_claims
            .into_iter()
            .map(|(uid, claim)| NvidiaClaim {
                uid,
                name: String::new(),
                state: "PrepareCompleted".to_string(),
                ..prepared(&claim.prepared_devices)
            })
            .collect(),
        (None, None) => {
            return Err(format!(
                "{}: not a checkpoint of NVIDIA's plugin: neither v1 nor v2",
                path.display()
            ))
        }
    };
    Ok(Some(NvidiaCheckpoint {
        node_boot_id,
        claims,
    }))
}

/// The devices of `preparedDevices` (groups of `devices`, each `{gpu|mig|vfio: {info|concrete,
/// device: {Requests, PoolName, DeviceName, CDIDeviceIDs}}}` beside the group's `configState`), in
/// order, and the group's MPS daemons.
fn prepared(groups: &Value) -> NvidiaClaim {
    let mut claim = NvidiaClaim::default();
    for group in groups.as_array().into_iter().flatten() {
        if let Some(id) = group
            .get("configState")
            .and_then(|state| state.get("mpsControlDaemonID"))
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
        {
            claim.mps_daemons.push(id.to_string());
        }
        for entry in group
            .get("devices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            for kind in ["gpu", "mig", "vfio"] {
                let Some(of_kind) = entry.get(kind).filter(|v| v.is_object()) else {
                    continue;
                };
                let Some(device) = of_kind.get("device") else {
                    continue;
                };
                let Some(name) = device.get("DeviceName").and_then(Value::as_str) else {
                    continue;
                };
                let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
                let texts = |key: &str| -> Vec<String> {
                    device
                        .get(key)
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                };
                let number = |v: Option<&Value>| {
                    v.and_then(Value::as_u64)
                        .and_then(|n| u32::try_from(n).ok())
                };
                let mig = match kind {
                    "mig" => {
                        let concrete = of_kind.get("concrete").filter(|v| v.is_object());
                        let info = of_kind.get("info").filter(|v| v.is_object());
                        concrete
                            .map(|c| NvidiaMig {
                                uuid: text(c.get("migUUID")).unwrap_or_default(),
                                parent_uuid: text(c.get("parentUUID")).unwrap_or_default(),
                                gpu_instance_id: number(c.get("giId")),
                                compute_instance_id: number(c.get("ciId")),
                            })
                            .or_else(|| {
                                info.map(|i| NvidiaMig {
                                    uuid: text(i.get("uuid")).unwrap_or_default(),
                                    parent_uuid: text(i.get("parentUUID")).unwrap_or_default(),
                                    gpu_instance_id: number(i.get("giId")),
                                    compute_instance_id: number(i.get("ciId")),
                                })
                            })
                    }
                    _ => None,
                };
                claim.devices.push(name.to_string());
                claim.prepared.push(NvidiaDevice {
                    requests: texts("Requests"),
                    pool: text(device.get("PoolName")).unwrap_or_default(),
                    device: name.to_string(),
                    cdi_device_ids: texts("CDIDeviceIDs"),
                    gpu_uuid: (kind == "gpu")
                        .then(|| text(of_kind.get("info").and_then(|i| i.get("uuid"))))
                        .flatten(),
                    mig,
                });
            }
        }
    }
    claim
}

/// Whether `name` is the directory of one of NVIDIA's MPS daemons under `<plugin dir>/mps`:
/// `<claim UID>-<first 5 hex digits of a SHA-256>`. Ours are named by the bare claim UID.
pub fn is_nvidia_mps_dir(name: &str) -> bool {
    let Some((uid, hash)) = name.rsplit_once('-') else {
        return false;
    };
    hash.len() == 5
        && hash.bytes().all(|b| b.is_ascii_hexdigit())
        && uid.len() == 36
        && uid.bytes().enumerate().all(|(i, b)| {
            matches!(i, 8 | 13 | 18 | 23) == (b == b'-') && (b == b'-' || b.is_ascii_hexdigit())
        })
}

/// The name of the claim spec NVIDIA's plugin writes into the CDI root: CDI's transient spec name
/// for vendor `k8s.gpu.nvidia.com`, class `claim`, with the `.yaml` its releases write.
pub fn cdi_spec_file_name(claim_uid: &str) -> String {
    format!("k8s.{NVIDIA_DRIVER_NAME}-claim_{claim_uid}.yaml")
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
              "configState": {"containerEdits": null, "mpsControlDaemonID": "c1-0a1b2"}
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
        let summary: Vec<(&str, &str, &str, Vec<String>)> = claims
            .iter()
            .map(|c| {
                (
                    c.uid.as_str(),
                    c.name.as_str(),
                    c.state.as_str(),
                    c.devices.clone(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    "c1",
                    "gpu-test-mps/shared-gpu-abcde",
                    "PrepareCompleted",
                    vec!["gpu-0".to_string()]
                ),
                (
                    "c2",
                    "default/mig-claim",
                    "PrepareStarted",
                    vec!["gpu-1-mig-1g10gb-19-6".to_string()]
                ),
            ]
        );
        assert_eq!(
            claims[0].prepared,
            vec![NvidiaDevice {
                requests: vec!["mps-gpu".into()],
                pool: "node-1".into(),
                device: "gpu-0".into(),
                cdi_device_ids: vec!["k8s.gpu.nvidia.com/claim=c1-gpu-0".into()],
                gpu_uuid: Some("GPU-0".into()),
                mig: None,
            }]
        );
        assert_eq!(claims[0].mps_daemons, vec!["c1-0a1b2".to_string()]);
        assert_eq!(
            claims[1].prepared[0].mig,
            Some(NvidiaMig {
                uuid: String::new(),
                parent_uuid: "GPU-1".into(),
                gpu_instance_id: Some(1),
                compute_instance_id: Some(0),
            })
        );
        assert_eq!(
            read_checkpoint(&path).unwrap().unwrap().node_boot_id,
            "boot-1"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), V2);
        assert_eq!(
            describe(&claims),
            "gpu-test-mps/shared-gpu-abcde (c1) on gpu-0; default/mig-claim (c2) on gpu-1-mig-1g10gb-19-6 [PrepareStarted]"
        );
    }

    #[test]
    fn tells_nvidias_mps_directories_from_ours() {
        let uid = "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d02";
        assert!(is_nvidia_mps_dir(&format!("{uid}-3fa9c")));
        // Ours: the bare claim UID.
        assert!(!is_nvidia_mps_dir(uid));
        assert!(!is_nvidia_mps_dir(&format!("{uid}-3fa9")));
        assert!(!is_nvidia_mps_dir(&format!("{uid}-3fa9z")));
        assert!(!is_nvidia_mps_dir("x-3fa9c"));
        assert!(!is_nvidia_mps_dir("../../etc-3fa9c"));
        assert_eq!(
            cdi_spec_file_name(uid),
            format!("k8s.gpu.nvidia.com-claim_{uid}.yaml")
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
