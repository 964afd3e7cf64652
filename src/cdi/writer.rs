//! The per-claim CDI spec files of this driver: `<root>/k8s.<driver>-gpu_<claimUID>.json`, holding devices
//! named `<claimUID>-<device>` of kind `k8s.<driver>/gpu`. One file per claim lets unprepare delete exactly
//! what prepare wrote, and never puts the same device in two files (runtimes drop such devices).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::spec::{check_device_name, minimum_version, validate, ContainerEdits, Device, Spec};
use super::CdiError;
use crate::fsutil::{is_leftover_temp_file, remove_for_this_boot, write_for_this_boot};

/// Runtimes run as root, but tools that list devices on the node may not.
const SPEC_FILE_MODE: u32 = 0o644;
const CLASS: &str = "gpu";

/// The CDI spec directory as seen by this driver: reads and writes only its own spec files.
#[derive(Clone, Debug)]
pub struct CdiRegistry {
    root: PathBuf,
    vendor: String,
}

impl CdiRegistry {
    pub fn new(root: impl Into<PathBuf>, driver_name: &str) -> Self {
        Self {
            root: root.into(),
            vendor: format!("k8s.{driver_name}"),
        }
    }

    /// The CDI spec directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The spec `kind`, e.g. `k8s.gpu.dra.dev/gpu`.
    pub fn kind(&self) -> String {
        format!("{}/{CLASS}", self.vendor)
    }

    /// Where the claim's spec lives; only meaningful for a claim UID that [`Self::write_claim_spec`] accepts.
    pub fn spec_path(&self, claim_uid: &str) -> PathBuf {
        self.root
            .join(format!("{}{claim_uid}.json", self.file_prefix()))
    }

    /// The id the kubelet passes to the runtime, e.g. `k8s.gpu.dra.dev/gpu=<claimUID>-gpu-0`.
    pub fn qualified_device_id(&self, claim_uid: &str, device: &str) -> String {
        format!("{}={}", self.kind(), device_name(claim_uid, device))
    }

    /// Builds, validates (with the minimum `cdiVersion` set) and atomically writes the claim's spec (mode 0644,
    /// creating the root directory if missing); returns the qualified CDI ids in the order of `devices`.
    pub fn write_claim_spec(
        &self,
        claim_uid: &str,
        devices: &[(String, ContainerEdits)],
    ) -> Result<Vec<String>, CdiError> {
        self.write_claim_spec_with(claim_uid, &ContainerEdits::default(), devices)
    }

    /// [`write_claim_spec`](Self::write_claim_spec) with spec-level edits (`common`), which the runtime
    /// applies once to a container that gets any device of the spec: the driver's libraries, say.
    pub fn write_claim_spec_with(
        &self,
        claim_uid: &str,
        common: &ContainerEdits,
        devices: &[(String, ContainerEdits)],
    ) -> Result<Vec<String>, CdiError> {
        let path = self.checked_spec_path(claim_uid)?;
        let invalid = |reason: String| CdiError::InvalidClaimSpec {
            claim_uid: claim_uid.to_owned(),
            path: path.clone(),
            reason,
        };
        let mut spec = Spec {
            kind: self.kind(),
            devices: devices
                .iter()
                .map(|(device, edits)| Device {
                    name: device_name(claim_uid, device),
                    container_edits: edits.clone(),
                    ..Default::default()
                })
                .collect(),
            container_edits: common.clone(),
            ..Default::default()
        };
        spec.cdi_version = minimum_version(&spec).to_owned();
        validate(&spec).map_err(|e| invalid(e.to_string()))?;
        let mut json =
            serde_json::to_vec_pretty(&spec).map_err(|e| invalid(format!("serializing: {e}")))?;
        json.push(b'\n');

        let io_error = |action, source| CdiError::Io {
            claim_uid: claim_uid.to_owned(),
            action,
            path: path.clone(),
            source,
        };
        fs::create_dir_all(&self.root).map_err(|e| io_error("creating the directory of", e))?;
        write_for_this_boot(&path, &json, SPEC_FILE_MODE).map_err(|e| io_error("writing", e))?;
        tracing::debug!(claim_uid, path = %path.display(), devices = devices.len(), "wrote CDI spec");
        Ok(devices
            .iter()
            .map(|(device, _)| self.qualified_device_id(claim_uid, device))
            .collect())
    }

    /// Deletes the claim's spec; a spec that is already gone is fine (unprepare is retried).
    pub fn remove_claim_spec(&self, claim_uid: &str) -> Result<(), CdiError> {
        let path = self.checked_spec_path(claim_uid)?;
        remove_for_this_boot(&path).map_err(|source| CdiError::Io {
            claim_uid: claim_uid.to_owned(),
            action: "removing",
            path,
            source,
        })
    }

    /// The claim's spec as written, or `None` when there is no file.
    pub fn read_claim_spec(&self, claim_uid: &str) -> Result<Option<Spec>, CdiError> {
        let path = self.checked_spec_path(claim_uid)?;
        let data = match fs::read(&path) {
            Ok(data) => data,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CdiError::Io {
                    claim_uid: claim_uid.to_owned(),
                    action: "reading",
                    path,
                    source,
                })
            }
        };
        serde_json::from_slice(&data)
            .map(Some)
            .map_err(|source| CdiError::Parse {
                claim_uid: claim_uid.to_owned(),
                path,
                source,
            })
    }

    /// Claim UIDs of this driver's spec files in the root, sorted; files of other vendors are never touched.
    /// Also deletes the temp files a crash left behind, so call it when no write is in flight (at startup).
    pub fn claim_specs(&self) -> Result<Vec<String>, CdiError> {
        let list_error = |source| CdiError::List {
            dir: self.root.clone(),
            source,
        };
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(list_error(e)),
        };
        let prefix = self.file_prefix();
        let mut claims = Vec::new();
        for entry in entries {
            let entry = entry.map_err(list_error)?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if is_leftover_temp_file(&name, &prefix) {
                remove_leftover(&entry.path());
                continue;
            }
            let Some(claim_uid) = name
                .strip_prefix(&prefix)
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if entry.file_type().is_ok_and(|t| t.is_file()) && check_device_name(claim_uid).is_ok()
            {
                claims.push(claim_uid.to_owned());
            }
        }
        claims.sort();
        Ok(claims)
    }

    /// `<vendor>-<class>_`, the transient-spec naming of the CDI library. Driver names are DNS subdomains
    /// (no `_`), so no other driver's prefix can start with ours.
    fn file_prefix(&self) -> String {
        format!("{}-{CLASS}_", self.vendor)
    }

    /// The spec path, after refusing a claim UID that is not a valid CDI name prefix: that also keeps `/`,
    /// `..` and the empty string out of the path.
    fn checked_spec_path(&self, claim_uid: &str) -> Result<PathBuf, CdiError> {
        let path = self.spec_path(claim_uid);
        match check_device_name(claim_uid) {
            Ok(()) => Ok(path),
            Err(reason) => Err(CdiError::InvalidClaimSpec {
                claim_uid: claim_uid.to_owned(),
                path: self.root.clone(),
                reason: format!("claim UID cannot be used in a CDI device name: {reason}"),
            }),
        }
    }
}

fn device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// Best effort: a temp file that stays behind is harmless to runtimes (they skip `.tmp`), so log and go on.
fn remove_leftover(path: &Path) {
    match remove_for_this_boot(path) {
        Ok(()) => {
            tracing::info!(path = %path.display(), "removed a CDI spec temp file left by a crash")
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove a leftover CDI spec temp file")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry(root: &Path) -> CdiRegistry {
        CdiRegistry::new(root, "gpu.dra.dev")
    }

    fn edits() -> ContainerEdits {
        ContainerEdits {
            env: vec!["A=1".into()],
            ..Default::default()
        }
    }

    #[test]
    fn names_follow_the_design() {
        let reg = registry(Path::new("/var/run/cdi"));
        assert_eq!(reg.kind(), "k8s.gpu.dra.dev/gpu");
        assert_eq!(
            reg.spec_path("u1"),
            Path::new("/var/run/cdi/k8s.gpu.dra.dev-gpu_u1.json")
        );
        assert_eq!(
            reg.qualified_device_id("u1", "gpu-0"),
            "k8s.gpu.dra.dev/gpu=u1-gpu-0"
        );
    }

    #[test]
    fn refuses_claim_uids_and_device_names_that_escape_or_break_names() {
        let dir = std::env::temp_dir().join(format!("cdi-writer-refuse-{}", std::process::id()));
        let reg = registry(&dir);
        for uid in ["", "..", "../x", "a/b", "/abs", ".hidden"] {
            let err = reg.write_claim_spec(uid, &[("gpu-0".into(), edits())]);
            assert!(
                matches!(err, Err(CdiError::InvalidClaimSpec { .. })),
                "{uid:?}"
            );
            assert!(reg.remove_claim_spec(uid).is_err(), "{uid:?}");
            assert!(reg.read_claim_spec(uid).is_err(), "{uid:?}");
        }
        for device in ["", "gpu/0", "gpu-", "gpu 0"] {
            match reg.write_claim_spec("u1", &[(device.into(), edits())]) {
                Err(e @ CdiError::InvalidClaimSpec { .. }) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains("claim u1") && msg.contains("k8s.gpu.dra.dev-gpu_u1.json"),
                        "{msg}"
                    );
                }
                other => panic!("{device:?}: {other:?}"),
            }
        }
        assert!(!dir.exists(), "nothing may be written for refused input");
    }
}
