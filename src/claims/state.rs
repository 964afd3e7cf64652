//! The claim table, in memory and on disk: reserving a claim's devices against every other claim's
//! (exclusive, except shares and admin access), marking it completed or releasing it, and writing the
//! checkpoint when it is behind; one lock per claim serialises the calls for that claim.

use std::sync::{Arc, Mutex};

use super::checkpoint::CheckpointData;
use super::lifecycle::Phase;
use super::{
    mig, sharing, ClaimError, ClaimRecord, ClaimRef, ClaimState, PreparedDevice, Preparer,
};
use crate::gpu::Inventory;

pub(super) struct State {
    pub(super) data: CheckpointData,
    /// Bumped on every change of `data`; the checkpoint writer persists up to a revision.
    pub(super) revision: u64,
}

impl Preparer {
    /// Takes the devices for the claim and records it as started (in memory), or fails if another claim holds one
    /// of them or a device that overlaps it (a whole GPU and its MIG devices, MIG devices sharing
    /// memory slices). Devices are exclusive, except that admin access (monitoring, debugging) shares
    /// a device with whoever else has it.
    pub(super) fn reserve(
        &self,
        claim: &ClaimRef,
        inventory: &Inventory,
        devices: &[PreparedDevice],
    ) -> Result<(), ClaimError> {
        let mut state = lock(&self.state);
        for device in devices.iter().filter(|d| !d.admin_access) {
            if let Some(reason) = sharing::interval_conflict(&state.data.claims, &claim.uid, device)
            {
                return Err(ClaimError::SharingConflict {
                    claim: claim.to_string(),
                    device: device.device.clone(),
                    reason,
                });
            }
            // NVIDIA's rule under its --consumable-shares; under our own name each share keeps its
            // own config, as far as the GPU can honour all of them (one interval, checked above).
            let nvidia = self.shares.borrow().is_some_and(|s| s.nvidia);
            let disagrees = state.data.claims.iter().filter(|_| nvidia).find_map(|(uid, record)| {
                let held = record.devices.iter().find(|held| {
                    *uid != claim.uid
                        && !held.admin_access
                        && held.device == device.device
                        && held.share_id.is_some()
                        && device.share_id.is_some()
                })?;
                let why = sharing::share_conflict(&held.sharing, &device.sharing)?;
                Some(format!(
                    "requested device {} has conflicting configuration with already prepared claim {}: {why}",
                    device.device,
                    describe(uid, record)
                ))
            });
            if let Some(reason) = disagrees {
                return Err(ClaimError::SharingConflict {
                    claim: claim.to_string(),
                    device: device.device.clone(),
                    reason,
                });
            }
            let holder = state.data.claims.iter().find_map(|(uid, record)| {
                let held = record.devices.iter().find(|held| {
                    // Shares of a device published with allowMultipleAllocations (each has a
                    // shareID) go to several claims; the scheduler has counted their capacity.
                    let both_shares = held.device == device.device
                        && held.share_id.is_some()
                        && device.share_id.is_some();
                    !held.admin_access
                        && !both_shares
                        && mig::conflict(inventory, &held.device, &device.device)
                });
                (*uid != claim.uid)
                    .then_some(held)
                    .flatten()
                    .map(|held| (uid, record, held))
            });
            if let Some((uid, record, held)) = holder {
                let owner = if held.device == device.device {
                    describe(uid, record)
                } else {
                    format!("{} (which holds {})", describe(uid, record), held.device)
                };
                return Err(ClaimError::DeviceInUse {
                    claim: claim.to_string(),
                    device: device.device.clone(),
                    owner,
                });
            }
        }
        // A claim NVIDIA's plugin prepared before the swap holds its devices until it is unprepared.
        let adopted = state.data.nvidia_claims.iter().find_map(|(uid, adopted)| {
            let held = adopted.devices.iter().find(|held| {
                devices
                    .iter()
                    .filter(|d| !d.admin_access)
                    .any(|device| mig::conflict(inventory, &held.device, &device.device))
            })?;
            (*uid != claim.uid).then_some((uid, adopted, held))
        });
        if let Some((uid, adopted, held)) = adopted {
            return Err(ClaimError::DeviceInUse {
                claim: claim.to_string(),
                device: held.device.clone(),
                owner: format!(
                    "{}/{} ({uid}), prepared by NVIDIA's plugin before the swap",
                    adopted.namespace, adopted.name
                ),
            });
        }
        state.data.claims.insert(
            claim.uid.clone(),
            ClaimRecord {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                state: ClaimState::Started,
                phase: Phase::Reserved,
                devices: devices.to_vec(),
                mps: None,
                domain: None,
                vfio: None,
            },
        );
        // A spec left in place by a rebuild is this claim's again from here on.
        state.data.left_in_place.remove(&claim.uid);
        state.revision += 1;
        Ok(())
    }

    /// Marks the claim completed with its devices as prepared (MIG devices included).
    pub(super) fn complete(&self, claim: &ClaimRef, devices: &[PreparedDevice]) {
        let mut state = lock(&self.state);
        if let Some(record) = state.data.claims.get_mut(&claim.uid) {
            record.state = ClaimState::Completed;
            record.phase = Phase::Completed;
            record.devices = devices.to_vec();
        }
        state.revision += 1;
    }

    /// Forgets the claim and frees its devices (in memory; the caller persists).
    pub(super) fn release(&self, claim: &ClaimRef) {
        let mut state = lock(&self.state);
        state.data.claims.remove(&claim.uid);
        state.data.left_in_place.remove(&claim.uid);
        state.revision += 1;
    }

    /// Writes the checkpoint if it is behind the in-memory state. Concurrent callers share one write:
    /// whoever takes the writer lock writes everything changed so far.
    pub(super) async fn persist(&self, claim: &ClaimRef) -> Result<(), ClaimError> {
        self.note_held_ways();
        let wanted = lock(&self.state).revision;
        let mut persisted = self.persisted.lock().await;
        if *persisted >= wanted {
            return Ok(());
        }
        let (snapshot, revision) = {
            let state = lock(&self.state);
            (state.data.clone(), state.revision)
        };
        // In place on this worker: it reaches only the page cache (see `make_devices`).
        self.checkpoint
            .store(&snapshot)
            .map_err(|source| ClaimError::Checkpoint {
                claim: claim.to_string(),
                source,
            })?;
        *persisted = revision;
        Ok(())
    }

    /// Runs `work` under the claim's lock, waiting at most `wait` for it; `None` when an earlier
    /// call for the claim held the lock all that time.
    pub(super) async fn with_claim_lock<T>(
        &self,
        uid: &str,
        wait: std::time::Duration,
        work: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        let claim_lock = lock(&self.claim_locks)
            .entry(uid.to_string())
            .or_default()
            .clone();
        let result = match tokio::time::timeout(wait, claim_lock.lock()).await {
            Ok(_guard) => Some(work.await),
            Err(_) => None,
        };
        // Drop the lock's map entry when nobody else is waiting on it, so the map does not grow forever.
        let mut locks = lock(&self.claim_locks);
        if Arc::strong_count(&claim_lock) == 2 {
            locks.remove(uid);
        }
        result
    }
}

pub(super) fn describe(uid: &str, record: &ClaimRecord) -> String {
    format!("{}/{} ({uid})", record.namespace, record.name)
}

/// Locks a std mutex, recovering the data if a panicking thread poisoned it: every critical section
/// here leaves the state consistent before anything that could panic.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
