//! The fault state across plugin restarts: the faults the backend has not reported recovered, kept in
//! a small JSON file in the plugin's directory (written atomically), so that a restarted plugin
//! publishes the taints from its first ResourceSlice write instead of offering a faulty GPU again.
//! The file carries the node's boot id: a reboot resets every GPU, so faults of an earlier boot go.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{Fault, FaultTarget};
use crate::fsutil::write_atomically;

/// The format (major) version this build writes; added fields and fault kinds keep it.
pub const FAULTS_VERSION: u32 = 1;

#[derive(Debug, Error)]
pub enum FaultFileError {
    #[error("reading fault state {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("writing fault state {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("fault state {path} is corrupt: {reason}")]
    Corrupt { path: String, reason: String },
    #[error("fault state {path} has version {found}, newer than the {FAULTS_VERSION} this plugin understands")]
    TooNew { path: String, found: u32 },
}

impl FaultFileError {
    /// A short label for metrics: `unreadable`, `unwritable`, `corrupt`, `too_new`.
    pub fn kind(&self) -> &'static str {
        match self {
            FaultFileError::Read { .. } => "unreadable",
            FaultFileError::Write { .. } => "unwritable",
            FaultFileError::Corrupt { .. } => "corrupt",
            FaultFileError::TooNew { .. } => "too_new",
        }
    }
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stored {
    version: u32,
    boot_id: String,
    /// Read entry by entry, so that a fault kind a newer release added is skipped, not fatal.
    faults: Vec<serde_json::Value>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    gpu_uuid: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gpu_instance_id: Option<u32>,
    /// `xid`, `doubleBitEcc`, `retirementPending`, `rowRemapFailure`, `lost`.
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    xid: Option<u64>,
}

impl Entry {
    fn of(target: &FaultTarget, fault: &Fault) -> Entry {
        let (kind, xid) = match fault {
            Fault::Xid(xid) => ("xid", Some(*xid)),
            Fault::DoubleBitEcc => ("doubleBitEcc", None),
            Fault::RetirementPending => ("retirementPending", None),
            Fault::RowRemapFailure => ("rowRemapFailure", None),
            Fault::Lost => ("lost", None),
        };
        Entry {
            gpu_uuid: target.gpu_uuid.clone(),
            gpu_instance_id: target.gpu_instance_id,
            kind: kind.to_string(),
            xid,
        }
    }

    fn fault(self) -> Option<(FaultTarget, Fault)> {
        let fault = match (self.kind.as_str(), self.xid) {
            ("xid", Some(xid)) => Fault::Xid(xid),
            ("doubleBitEcc", _) => Fault::DoubleBitEcc,
            ("retirementPending", _) => Fault::RetirementPending,
            ("rowRemapFailure", _) => Fault::RowRemapFailure,
            ("lost", _) => Fault::Lost,
            _ => return None,
        };
        let target = FaultTarget {
            gpu_uuid: self.gpu_uuid,
            gpu_instance_id: self.gpu_instance_id,
        };
        Some((target, fault))
    }
}

/// What a fault file held.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LoadedFaults {
    /// The faults of this boot, oldest first.
    pub faults: Vec<(FaultTarget, Fault)>,
    /// Entries skipped: of a kind this build does not know, or of an earlier boot.
    pub skipped: usize,
}

/// The fault state file, `<plugin dir>/faults.json`.
#[derive(Debug, Clone)]
pub struct FaultFile {
    path: PathBuf,
}

impl FaultFile {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FaultFile { path: path.into() }
    }

    /// The file in the plugin's own directory.
    pub fn in_dir(plugin_dir: &Path) -> Self {
        FaultFile::new(plugin_dir.join("faults.json"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The faults recorded during boot `boot_id`; none when there is no file.
    pub fn load(&self, boot_id: &str) -> Result<LoadedFaults, FaultFileError> {
        let shown = self.path.display().to_string();
        let bytes = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(LoadedFaults::default())
            }
            Err(source) => {
                return Err(FaultFileError::Read {
                    path: shown,
                    source,
                })
            }
        };
        let stored: Stored =
            serde_json::from_slice(&bytes).map_err(|e| FaultFileError::Corrupt {
                path: shown.clone(),
                reason: e.to_string(),
            })?;
        if stored.version > FAULTS_VERSION {
            return Err(FaultFileError::TooNew {
                path: shown,
                found: stored.version,
            });
        }
        let total = stored.faults.len();
        if stored.boot_id != boot_id {
            return Ok(LoadedFaults {
                faults: Vec::new(),
                skipped: total,
            });
        }
        let faults: Vec<(FaultTarget, Fault)> = stored
            .faults
            .into_iter()
            .filter_map(|value| serde_json::from_value::<Entry>(value).ok()?.fault())
            .collect();
        Ok(LoadedFaults {
            skipped: total - faults.len(),
            faults,
        })
    }

    pub fn store(
        &self,
        boot_id: &str,
        faults: &[(FaultTarget, Fault)],
    ) -> Result<(), FaultFileError> {
        let write_error = |source| FaultFileError::Write {
            path: self.path.display().to_string(),
            source,
        };
        let stored = Stored {
            version: FAULTS_VERSION,
            boot_id: boot_id.to_string(),
            faults: faults
                .iter()
                .map(|(target, fault)| serde_json::to_value(Entry::of(target, fault)))
                .collect::<Result<_, _>>()
                .map_err(|e| write_error(std::io::Error::other(e)))?,
        };
        let bytes =
            serde_json::to_vec(&stored).map_err(|e| write_error(std::io::Error::other(e)))?;
        write_atomically(&self.path, &bytes, 0o600).map_err(write_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(gi: Option<u32>) -> FaultTarget {
        FaultTarget {
            gpu_uuid: "GPU-1".into(),
            gpu_instance_id: gi,
        }
    }

    #[test]
    fn round_trips_every_fault_kind_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = FaultFile::in_dir(dir.path());
        assert_eq!(file.load("boot").unwrap(), LoadedFaults::default());
        let faults = vec![
            (target(None), Fault::Xid(79)),
            (target(Some(3)), Fault::DoubleBitEcc),
            (target(None), Fault::RetirementPending),
            (target(None), Fault::RowRemapFailure),
            (target(None), Fault::Lost),
        ];
        file.store("boot", &faults).unwrap();
        let loaded = file.load("boot").unwrap();
        assert_eq!(loaded.faults, faults);
        assert_eq!(loaded.skipped, 0);
    }

    #[test]
    fn faults_of_an_earlier_boot_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let file = FaultFile::in_dir(dir.path());
        file.store("boot-1", &[(target(None), Fault::Xid(48))])
            .unwrap();
        let loaded = file.load("boot-2").unwrap();
        assert!(loaded.faults.is_empty());
        assert_eq!(loaded.skipped, 1);
    }

    #[test]
    fn a_newer_minor_is_read_and_its_unknown_kinds_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let file = FaultFile::in_dir(dir.path());
        let text = serde_json::json!({
            "version": 1, "bootId": "b", "futureField": true,
            "faults": [
                {"gpuUuid": "GPU-1", "kind": "thermalRunaway"},
                {"gpuUuid": "GPU-1", "kind": "xid", "xid": 79, "addedField": 1}
            ]
        });
        std::fs::write(file.path(), text.to_string()).unwrap();
        let loaded = file.load("b").unwrap();
        assert_eq!(loaded.faults, vec![(target(None), Fault::Xid(79))]);
        assert_eq!(loaded.skipped, 1);
    }

    #[test]
    fn garbage_and_newer_majors_are_errors_that_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = FaultFile::in_dir(dir.path());
        std::fs::write(file.path(), b"\x00\x01not json").unwrap();
        let error = file.load("b").unwrap_err();
        assert_eq!(error.kind(), "corrupt");
        assert!(error.to_string().contains("faults.json"), "{error}");
        std::fs::write(file.path(), r#"{"version":2,"bootId":"b","faults":[]}"#).unwrap();
        assert_eq!(file.load("b").unwrap_err().kind(), "too_new");
    }
}
