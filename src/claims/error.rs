//! The per-claim error of prepare and unprepare: what the kubelet shows for one claim, so each
//! message names the claim and, where it applies, the device and the cause.

use std::time::Duration;

use thiserror::Error;

use super::checkpoint::CheckpointError;

/// Why one claim could not be prepared or unprepared; the message names the claim and, where it
/// applies, the device, in words an operator can act on.
#[derive(Debug, Error)]
pub enum ClaimError {
    #[error("ResourceClaim {claim}: {reason}")]
    Invalid { claim: String, reason: String },
    #[error("ResourceClaim {claim}: reading it from the API server: {source}")]
    Fetch { claim: String, source: kube::Error },
    #[error("ResourceClaim {claim}: the API server did not answer in time (within {waited:?}); the kubelet will retry")]
    ApiTimeout { claim: String, waited: Duration },
    #[error("ResourceClaim {claim} not found in the API server")]
    NotFound { claim: String },
    #[error("ResourceClaim {claim} was replaced: the API server has UID {found}")]
    Replaced { claim: String, found: String },
    #[error("ResourceClaim {claim} is not allocated")]
    NotAllocated { claim: String },
    #[error("ResourceClaim {claim} has no devices of driver {driver} in pool {pool}")]
    NoDevicesHere {
        claim: String,
        driver: String,
        pool: String,
    },
    #[error("ResourceClaim {claim}: device {device} is not published by this node: {reason}")]
    UnknownDevice {
        claim: String,
        device: String,
        reason: String,
    },
    #[error("ResourceClaim {claim}: MIG device {device}: {reason}")]
    Mig {
        claim: String,
        device: String,
        reason: String,
    },
    #[error("ResourceClaim {claim}: device {device} is already prepared for claim {owner}")]
    DeviceInUse {
        claim: String,
        device: String,
        owner: String,
    },
    #[error("ResourceClaim {claim}: {reason}")]
    Config { claim: String, reason: String },
    #[error("ResourceClaim {claim}: device {device} cannot be shared as asked: {reason}")]
    SharingConflict {
        claim: String,
        device: String,
        reason: String,
    },
    #[error("ResourceClaim {claim}: sharing: {reason}")]
    Sharing { claim: String, reason: String },
    #[error("ResourceClaim {claim}: passthrough device {device}: {reason}")]
    Vfio {
        claim: String,
        device: String,
        reason: String,
    },
    #[error("ResourceClaim {claim}: ComputeDomain: {reason}")]
    Domain { claim: String, reason: String },
    #[error("ResourceClaim {claim}: writing CDI spec: {source}")]
    Cdi {
        claim: String,
        source: crate::cdi::CdiError,
    },
    #[error("ResourceClaim {claim}: {source}")]
    Checkpoint {
        claim: String,
        source: CheckpointError,
    },
    #[error("ResourceClaim {claim}: {what} has not finished within {waited:?} (the claim's record is in phase {phase}); it goes on in the background, and the kubelet's retry gets its outcome")]
    StillRunning {
        claim: String,
        what: &'static str,
        waited: Duration,
        phase: String,
    },
    #[error("ResourceClaim {claim}: internal error: {reason}")]
    Internal { claim: String, reason: String },
}
