//! The checkpoint: which claims this plugin prepared, so that a restart knows what to keep and what to
//! roll back, and which GPUs it set to a sharing mode other than the default. Versioned JSON with a SHA-256 checksum over the `data` object as stored, so a file written
//! by a newer version with added fields still verifies; carries the node's boot id. Writes are atomic
//! but not fsynced: a crash of the process loses nothing, and after a power cut (a reboot) recovery
//! checks every record of the earlier boot against the API server before it holds a device
//! (`recovery.rs`), so a stale, torn or missing file costs only a re-prepare, which the kubelet makes
//! after every reboot anyway.
//! `version` is the format's major version: a compatible change (added fields, new claim states) keeps
//! it, so the previous release reads what the next one wrote; only an incompatible change raises it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::api::config::SharingSettings;
use crate::fsutil::{finish_interrupted_replace, replace_for_this_boot};
use crate::gpu::GpuSharingMode;
use crate::gpu::MigPlacement;

/// The format (major) version this build writes; a file with a higher one is refused rather than misread
/// (recovery sets it aside and rebuilds, see `recovery.rs`).
pub const CHECKPOINT_VERSION: u32 = 1;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("reading checkpoint {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("writing checkpoint {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("checkpoint {path} is corrupt: {reason}")]
    Corrupt { path: String, reason: String },
    #[error("checkpoint {path} has version {found}, newer than the {CHECKPOINT_VERSION} this plugin understands")]
    TooNew { path: String, found: u32 },
}

impl CheckpointError {
    /// A short label for metrics and Events: `unreadable`, `unwritable`, `corrupt`, `too_new`.
    pub fn kind(&self) -> &'static str {
        match self {
            CheckpointError::Read { .. } => "unreadable",
            CheckpointError::Write { .. } => "unwritable",
            CheckpointError::Corrupt { .. } => "corrupt",
            CheckpointError::TooNew { .. } => "too_new",
        }
    }
}

/// Where a claim is in its life on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ClaimState {
    /// Prepare began; anything it created may be half done and is rolled back after a crash. Reaches
    /// the file only when another claim's write catches it (or from releases that wrote it first).
    Started,
    /// Prepare finished and was (or will be) reported to the kubelet.
    Completed,
    /// A state a newer release added; recovery checks such a claim against the API server rather
    /// than guess what it meant. Never written.
    #[serde(other)]
    Unknown,
}

/// One device prepared for a claim, as reported to the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool: String,
    pub device: String,
    pub cdi_device_ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// Allocated with admin access: the device is not taken away from other claims.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin_access: bool,
    /// The MIG device behind a MIG device name, once known (created, or found in static mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<PreparedMig>,
    /// How the device is shared, from the claim's configs (absent: exclusive).
    #[serde(default, skip_serializing_if = "SharingSettings::is_exclusive")]
    pub sharing: SharingSettings,
    /// An IMEX channel claim with `allocationMode: All`: the container gets channels 0 to N-1 (absent:
    /// the device's own channel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imex_channels: Option<u32>,
}

/// A MIG device a claim uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedMig {
    pub parent_uuid: String,
    /// `MIG-...`, as CUDA sees it.
    pub uuid: String,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    /// Capability files (`/dev/nvidia-caps/nvidia-cap<N>`) the container needs for it.
    pub device_files: Vec<String>,
    /// Created for this claim (dynamic MIG), so unprepare destroys it; static MIG devices stay.
    pub created: bool,
}

/// A MIG device this plugin is creating or has created, written down before the create starts and
/// forgotten once the device is destroyed: the start-up sweep destroys only these, never a MIG
/// device someone else made (an admin's, left from static MIG mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MadeMig {
    /// The claim it is made for (for the logs).
    pub claim_uid: String,
    pub parent_uuid: String,
    pub profile_id: u32,
    pub placement: MigPlacement,
    /// Known once the create returned. Until then (a crash mid-create) the device is known by its
    /// GPU, profile and placement, where no other MIG device can be at the same time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

impl MadeMig {
    /// Whether `instance` on GPU `parent_uuid` is this device.
    pub fn is(&self, parent_uuid: &str, instance: &crate::gpu::MigInstance) -> bool {
        match &self.uuid {
            Some(uuid) => *uuid == instance.uuid && !uuid.is_empty(),
            None => {
                self.parent_uuid == parent_uuid
                    && self.profile_id == instance.profile_id
                    && self.placement == instance.placement
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRecord {
    pub namespace: String,
    pub name: String,
    pub state: ClaimState,
    /// Where the claim is in its life (`lifecycle.rs`); a record of a release before phases reads
    /// as `reserved`, which its `state` overrides.
    #[serde(default)]
    pub phase: super::lifecycle::Phase,
    pub devices: Vec<PreparedDevice>,
    /// The claim's MPS control daemon: written before its tmpfs or Pod are made, kept until both
    /// are gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<super::mps::MpsDaemonRecord>,
    /// The ComputeDomain the claim's IMEX channel is for: written before this node joins it, kept
    /// until it left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<crate::domains::membership::ChannelMembership>,
    /// The IOMMU groups a passthrough claim binds to vfio-pci, with every function's driver before:
    /// written before the first bind, kept until every function is given back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vfio: Option<super::vfio::VfioRecord>,
}

/// The checkpoint's content.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointData {
    pub boot_id: String,
    /// Keyed by claim UID.
    pub claims: BTreeMap<String, ClaimRecord>,
    /// Claim UIDs whose CDI spec a rebuild (after the checkpoint was set aside) could not match to a
    /// claim prepared here, and left in place: the orphan sweep leaves them until the kubelet
    /// prepares or unprepares the claim.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub left_in_place: BTreeSet<String>,
    /// Sharing modes other than the default that this plugin set on GPUs, or was about to set, by
    /// GPU UUID: written before each change and dropped once the GPU is reset. NVML cannot read a
    /// time-slice interval back, so after a crash this is how start-up knows which GPUs to reset.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_modes: BTreeMap<String, RecordedGpuMode>,
    /// The MIG devices this plugin made and has not destroyed (dynamic MIG). A checkpoint of a
    /// release before this record has none: only the MIG devices its claims record as `created`
    /// then count as the plugin's (see `recovery.rs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices_made: Vec<MadeMig>,
    /// Under NVIDIA's driver name: claims NVIDIA's plugin prepared on this node before the swap,
    /// taken over from its checkpoint (`nvidia_adoption.rs`), by claim UID, until they are unprepared.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub nvidia_claims: BTreeMap<String, AdoptedClaim>,
    /// Claim UIDs of NVIDIA's checkpoint that this plugin unprepared, or found unusable: NVIDIA's
    /// checkpoint is never written, so this is what keeps them from being taken over again.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub nvidia_claims_done: BTreeSet<String>,
}

/// A claim NVIDIA's plugin prepared, and what unprepare must undo of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdoptedClaim {
    pub namespace: String,
    pub name: String,
    /// As NVIDIA's plugin reported them to the kubelet (its CDI ids, into its own claim spec), so a
    /// repeated prepare answers the same. A MIG device is `created` where this plugin runs in
    /// dynamic MIG mode, as NVIDIA's did when it made one per claim.
    pub devices: Vec<PreparedDevice>,
    /// Whole GPUs whose sharing mode NVIDIA's plugin may have changed (time-slicing, MPS).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
    /// NVIDIA's MPS control daemons of the claim, by id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mps_daemons: Vec<String>,
}

/// A GPU's sharing mode as recorded. One a newer release wrote that this one does not know is kept
/// as it was read, and counts as "not the default" (the GPU is reset at start).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RecordedGpuMode {
    Known(GpuSharingMode),
    Unknown(serde_json::Value),
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    version: u32,
    checksum: String,
    data: serde_json::Value,
}

/// The checkpoint file.
#[derive(Debug, Clone)]
pub struct CheckpointFile {
    path: PathBuf,
}

impl CheckpointFile {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        CheckpointFile { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored checkpoint, or `None` if there is none yet. Finishes a write that a crash
    /// interrupted between its renames (see [`replace_for_this_boot`]).
    pub fn load(&self) -> Result<Option<CheckpointData>, CheckpointError> {
        let shown = self.path.display().to_string();
        finish_interrupted_replace(&self.path).map_err(|source| CheckpointError::Read {
            path: shown.clone(),
            source,
        })?;
        let bytes = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: shown,
                    source,
                })
            }
        };
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: shown.clone(),
            reason,
        };
        let envelope: Envelope = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(format!("not a checkpoint: {e}")))?;
        if envelope.version > CHECKPOINT_VERSION {
            return Err(CheckpointError::TooNew {
                path: shown,
                found: envelope.version,
            });
        }
        if checksum(&envelope.data) != envelope.checksum {
            return Err(corrupt("checksum mismatch".to_string()));
        }
        let data = serde_json::from_value(envelope.data)
            .map_err(|e| corrupt(format!("unreadable data: {e}")))?;
        Ok(Some(data))
    }

    pub fn store(&self, data: &CheckpointData) -> Result<(), CheckpointError> {
        let write_error = |source| CheckpointError::Write {
            path: self.path.display().to_string(),
            source,
        };
        let data = serde_json::to_value(data).map_err(|e| write_error(std::io::Error::other(e)))?;
        replace_for_this_boot(&self.path, &envelope_bytes(&data), 0o600).map_err(write_error)
    }
}

/// The file's bytes: what serde writes for an [`Envelope`] of `data`, with `data` turned into text
/// once, for the checksum and the file both (this runs on every prepare and unprepare).
fn envelope_bytes(data: &serde_json::Value) -> Vec<u8> {
    let text = data.to_string();
    let checksum = hex::encode(Sha256::digest(text.as_bytes()));
    format!("{{\"version\":{CHECKPOINT_VERSION},\"checksum\":\"{checksum}\",\"data\":{text}}}")
        .into_bytes()
}

/// SHA-256 over the canonical JSON of `data` (serde_json sorts object keys), in hex.
fn checksum(data: &serde_json::Value) -> String {
    hex::encode(Sha256::digest(data.to_string().as_bytes()))
}

pub use crate::boot::current_boot_id;

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointData {
        let mut data = CheckpointData {
            boot_id: "boot-1".into(),
            ..Default::default()
        };
        data.claims.insert(
            "uid-1".into(),
            ClaimRecord {
                namespace: "default".into(),
                name: "claim".into(),
                state: ClaimState::Completed,
                phase: super::super::lifecycle::Phase::Completed,
                devices: vec![PreparedDevice {
                    request_names: vec!["gpu".into()],
                    pool: "node-a".into(),
                    device: "gpu-0".into(),
                    cdi_device_ids: vec!["k8s.gpu.dra.dev/gpu=uid-1-gpu-0".into()],
                    share_id: None,
                    admin_access: false,
                    mig: None,
                    sharing: Default::default(),
                    imex_channels: None,
                }],
                mps: None,
                domain: None,
                vfio: None,
            },
        );
        data
    }

    #[test]
    fn the_envelope_is_written_as_serde_writes_it() {
        let data = serde_json::to_value(sample()).unwrap();
        let envelope = Envelope {
            version: CHECKPOINT_VERSION,
            checksum: checksum(&data),
            data: data.clone(),
        };
        assert_eq!(
            envelope_bytes(&data),
            serde_json::to_vec(&envelope).unwrap()
        );
    }

    #[test]
    fn round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let file = CheckpointFile::new(dir.path().join("checkpoint.json"));
        assert_eq!(file.load().unwrap(), None);
        file.store(&sample()).unwrap();
        assert_eq!(file.load().unwrap(), Some(sample()));
    }

    #[test]
    fn tampering_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let file = CheckpointFile::new(dir.path().join("checkpoint.json"));
        file.store(&sample()).unwrap();
        let text = std::fs::read_to_string(file.path()).unwrap();
        std::fs::write(file.path(), text.replace("gpu-0", "gpu-1")).unwrap();
        let err = file.load().unwrap_err().to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
        std::fs::write(file.path(), &text[..text.len() / 2]).unwrap();
        assert!(matches!(file.load(), Err(CheckpointError::Corrupt { .. })));
    }

    #[test]
    fn fields_added_by_a_newer_writer_still_verify() {
        let dir = tempfile::tempdir().unwrap();
        let file = CheckpointFile::new(dir.path().join("checkpoint.json"));
        // What a later version might write: extra fields inside data, checksummed over what it stored.
        let mut data = serde_json::to_value(sample()).unwrap();
        data["futureField"] = serde_json::json!({"x": 1});
        data["claims"]["uid-1"]["mig"] = serde_json::json!("added");
        let envelope = serde_json::json!({"version": 1, "checksum": checksum(&data), "data": data});
        std::fs::write(file.path(), envelope.to_string()).unwrap();
        assert_eq!(file.load().unwrap(), Some(sample()));
    }

    #[test]
    fn claim_states_added_by_a_newer_minor_are_read_as_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let file = CheckpointFile::new(dir.path().join("checkpoint.json"));
        let mut data = serde_json::to_value(sample()).unwrap();
        data["claims"]["uid-1"]["state"] = serde_json::json!("unpreparing");
        data["claims"]["uid-1"]["devices"][0]["futureField"] = serde_json::json!([1, 2]);
        let envelope = serde_json::json!({"version": 1, "minor": 3, "checksum": checksum(&data), "data": data});
        std::fs::write(file.path(), envelope.to_string()).unwrap();
        let loaded = file.load().unwrap().unwrap();
        assert_eq!(loaded.claims["uid-1"].state, ClaimState::Unknown);
        assert_eq!(
            loaded.claims["uid-1"].devices,
            sample().claims["uid-1"].devices
        );
    }

    #[test]
    fn gpu_modes_round_trip_are_absent_from_older_files_and_keep_values_of_newer_ones() {
        use crate::gpu::TimeSliceInterval;
        let dir = tempfile::tempdir().unwrap();
        let file = CheckpointFile::new(dir.path().join("checkpoint.json"));
        let mut data = sample();
        data.gpu_modes.insert(
            "GPU-a".into(),
            RecordedGpuMode::Known(GpuSharingMode::TimeSlice(TimeSliceInterval::Long)),
        );
        data.gpu_modes.insert(
            "GPU-b".into(),
            RecordedGpuMode::Known(GpuSharingMode::ExclusiveProcess),
        );
        file.store(&data).unwrap();
        let text = std::fs::read_to_string(file.path()).unwrap();
        assert!(
            text.contains(
                r#""gpuModes":{"GPU-a":{"timeSlice":"Long"},"GPU-b":"exclusiveProcess"}"#
            ),
            "{text}"
        );
        assert_eq!(file.load().unwrap(), Some(data));

        // A file from before the field (and one without modes) has none, and writes none.
        file.store(&sample()).unwrap();
        let text = std::fs::read_to_string(file.path()).unwrap();
        assert!(!text.contains("gpuModes"), "{text}");
        assert!(file.load().unwrap().unwrap().gpu_modes.is_empty());

        // A mode a newer release added is kept as it was written.
        let mut value = serde_json::to_value(sample()).unwrap();
        value["gpuModes"] = serde_json::json!({"GPU-c": {"timeSliceMicros": 500}});
        let envelope =
            serde_json::json!({"version": 1, "checksum": checksum(&value), "data": value});
        std::fs::write(file.path(), envelope.to_string()).unwrap();
        let loaded = file.load().unwrap().unwrap();
        assert_eq!(
            loaded.gpu_modes["GPU-c"],
            RecordedGpuMode::Unknown(serde_json::json!({"timeSliceMicros": 500}))
        );
    }

    #[test]
    fn a_checkpoint_of_a_release_without_mig_records_loads_with_none() {
        let dir = tempfile::tempdir().unwrap();
        let file = CheckpointFile::new(dir.path().join("checkpoint.json"));
        let data = serde_json::to_value(sample()).unwrap();
        assert!(data.get("migDevicesMade").is_none(), "{data}");
        let envelope = serde_json::json!({"version": 1, "checksum": checksum(&data), "data": data});
        std::fs::write(file.path(), envelope.to_string()).unwrap();
        assert!(file.load().unwrap().unwrap().mig_devices_made.is_empty());
    }

    #[test]
    fn a_made_mig_device_is_known_by_uuid_once_created_and_by_place_before() {
        let placement = MigPlacement { start: 6, size: 1 };
        let instance = crate::gpu::MigInstance {
            uuid: "MIG-made".into(),
            profile_id: 19,
            placement,
            gpu_instance_id: 13,
            compute_instance_id: 0,
            device_files: Vec::new(),
            compute: None,
            index: None,
        };
        let mut made = MadeMig {
            claim_uid: "uid-1".into(),
            parent_uuid: "GPU-1".into(),
            profile_id: 19,
            placement,
            uuid: None,
        };
        assert!(made.is("GPU-1", &instance));
        assert!(!made.is("GPU-2", &instance));
        let other_profile = crate::gpu::MigInstance {
            profile_id: 20,
            ..instance.clone()
        };
        assert!(!made.is("GPU-1", &other_profile));
        // Once created, only that device: not another one an admin made at the same place later.
        made.uuid = Some("MIG-made".into());
        assert!(made.is("GPU-1", &instance));
        let admins = crate::gpu::MigInstance {
            uuid: "MIG-admin".into(),
            ..instance
        };
        assert!(!made.is("GPU-1", &admins));
    }

    #[test]
    fn newer_versions_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = CheckpointFile::new(dir.path().join("checkpoint.json"));
        let data = serde_json::to_value(sample()).unwrap();
        let envelope = serde_json::json!({"version": 2, "checksum": checksum(&data), "data": data});
        std::fs::write(file.path(), envelope.to_string()).unwrap();
        assert!(matches!(
            file.load(),
            Err(CheckpointError::TooNew { found: 2, .. })
        ));
    }
}
