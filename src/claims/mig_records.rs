//! Which MIG devices are the plugin's to destroy. Every MIG device the plugin is about to create is
//! written into the checkpoint first ([`MadeMig`]) and forgotten once it is destroyed, so the start-up
//! sweep of dynamic MIG destroys only devices the plugin made whose claim is gone; a MIG device it did
//! not make (an admin's, kept from static MIG mode) is reported and left alone.

use std::collections::BTreeSet;

use tracing::{info, warn};

use super::checkpoint::{CheckpointData, MadeMig, PreparedMig};
use super::gpu_modes::GpuOp;
use super::mig::{self, MigTarget};
use super::{lock, ClaimError, ClaimRecord, ClaimRef, PreparedDevice, Preparer};
use crate::gpu::{Inventory, MigDestroyed, MigInstance, MigRequest};

/// What the start-up sweep did.
#[derive(Debug, Default)]
pub(super) struct Sweep {
    /// UUIDs of the MIG devices destroyed: made by the plugin, owned by no kept claim.
    pub destroyed: Vec<String>,
    /// MIG devices the plugin did not make, left alone (UUID, or `<GPU UUID>/gi<id>` for a GPU
    /// instance without compute instance).
    pub left_alone: Vec<String>,
    /// Records of devices that could not be destroyed now; the next start tries again.
    pub still_made: Vec<MadeMig>,
}

impl Preparer {
    /// Records the MIG device in the checkpoint, then creates it for `claim`. Where a record of the
    /// same device was there already (an earlier attempt the kubelet cancelled mid-create, or whose
    /// create did not return in time), a device found at that place is adopted; any other device in
    /// the way makes the create fail.
    pub(super) async fn create_recorded(
        &self,
        claim: &ClaimRef,
        target: &MigTarget,
    ) -> Result<PreparedMig, String> {
        if target.compute_instance.is_some() {
            return Err("dynamic MIG makes MIG devices with one compute instance only".into());
        }
        let record = MadeMig {
            claim_uid: claim.uid.clone(),
            parent_uuid: target.gpu.uuid.clone(),
            profile_id: target.profile.id,
            placement: target.placement,
            uuid: None,
        };
        let recorded_before = self.note_made(&record);
        if let Err(error) = self.persist(claim).await {
            if !recorded_before {
                self.forget_made(|made| same_place(made, &record));
            }
            let cause = match error {
                ClaimError::Checkpoint { source, .. } => source.to_string(),
                other => other.to_string(),
            };
            return Err(format!(
                "not created, because it cannot be recorded in the checkpoint first: {cause}"
            ));
        }
        match mig::create(&self.gpu_modes, &self.backend, target, recorded_before).await {
            Ok(made) => {
                let mut state = lock(&self.state);
                if let Some(found) = state
                    .data
                    .mig_devices_made
                    .iter_mut()
                    .find(|made| same_place(made, &record))
                {
                    found.uuid = Some(made.uuid.clone());
                }
                state.revision += 1;
                Ok(made)
            }
            Err(error) => {
                // The record stays while the device may exist or still come to: a create that has
                // not returned (the kubelet's retry adopts what it makes, the next start's sweep
                // destroys it), or one that failed leaving a device (or that cannot be checked). A
                // create that never started needs no record, unless an earlier attempt's is there.
                let forget = if error.may_still_take_effect() {
                    false
                } else if error.not_started() {
                    !recorded_before
                } else {
                    !self.anything_made_at(&record).await
                };
                if forget {
                    self.forget_made(|made| same_place(made, &record));
                }
                Err(error.to_string())
            }
        }
    }

    /// Destroys the MIG devices these devices of claim `claim_uid` created (see
    /// [`mig::destroy_created`]) and forgets the records of those that are gone. A device that
    /// another claim holds a share of (recorded, made or still being made for it) is left to the last
    /// claim that holds it. Returns the first error.
    pub(super) async fn destroy_created(
        &self,
        claim_uid: &str,
        devices: &[PreparedDevice],
    ) -> Option<String> {
        let own: Vec<PreparedDevice> = devices
            .iter()
            .filter(|d| match self.share_holder(claim_uid, &d.device) {
                Some(holder) => {
                    if d.mig.as_ref().is_some_and(|m| m.created) {
                        info!(device = %d.device, claim = %holder, "MIG device left in place: another claim holds a share of it");
                    }
                    false
                }
                None => true,
            })
            .cloned()
            .collect();
        let (first_error, gone) = mig::destroy_created(&self.gpu_modes, &self.backend, &own).await;
        if !gone.is_empty() {
            self.forget_made(|made| made.uuid.as_ref().is_some_and(|uuid| gone.contains(uuid)));
        }
        first_error
    }

    /// Another claim than `claim_uid` that holds a share of `device` (not with admin access), named
    /// for messages.
    pub(super) fn share_holder(&self, claim_uid: &str, device: &str) -> Option<String> {
        let state = lock(&self.state);
        state.data.claims.iter().find_map(|(uid, record)| {
            let holds = uid != claim_uid
                && record
                    .devices
                    .iter()
                    .any(|d| d.device == device && d.share_id.is_some() && !d.admin_access);
            holds.then(|| super::describe(uid, record))
        })
    }

    /// Adds the record (in memory); `true` when one of the same device was there already.
    fn note_made(&self, record: &MadeMig) -> bool {
        let mut state = lock(&self.state);
        let list = &mut state.data.mig_devices_made;
        let existed = match list.iter_mut().find(|made| same_place(made, record)) {
            Some(found) => {
                found.claim_uid = record.claim_uid.clone();
                true
            }
            None => {
                list.push(record.clone());
                false
            }
        };
        state.revision += 1;
        existed
    }

    fn forget_made(&self, forget: impl Fn(&MadeMig) -> bool) {
        let mut state = lock(&self.state);
        state.data.mig_devices_made.retain(|made| !forget(made));
        state.revision += 1;
    }

    /// Makes a kept claim's MIG device again at start (after a reboot), recording it in the checkpoint
    /// on file (`journal`: the records as loaded) first. A device found where an earlier start
    /// recorded making one (and died before it finished) is adopted.
    pub(super) fn recreate_recorded(
        &self,
        claim_uid: &str,
        target: &MigTarget,
        journal: &mut CheckpointData,
    ) -> Result<MigInstance, String> {
        let record = MadeMig {
            claim_uid: claim_uid.to_string(),
            parent_uuid: target.gpu.uuid.clone(),
            profile_id: target.profile.id,
            placement: target.placement,
            uuid: None,
        };
        let adopt = journal
            .mig_devices_made
            .iter()
            .any(|made| made.uuid.is_none() && same_place(made, &record));
        if !adopt {
            journal.mig_devices_made.push(record);
        }
        self.checkpoint.store(journal).map_err(|error| {
            format!(
                "not made again, because it cannot be recorded in the checkpoint first: {error}"
            )
        })?;
        let request = MigRequest {
            parent_uuid: target.gpu.uuid.clone(),
            profile_id: target.profile.id,
            placement: target.placement,
        };
        let op = GpuOp::CreateMig {
            profile: target.profile.name.clone(),
            start: target.placement.start,
        };
        let backend = self.backend.clone();
        // Start-up runs on a blocking thread of the runtime; the create is bounded as at prepare.
        let made = tokio::runtime::Handle::current().block_on(self.gpu_modes.mig(
            &target.gpu.uuid,
            &mig::gpu_name(&target.gpu),
            op,
            move || {
                if adopt {
                    backend
                        .create_or_adopt_mig(&request)
                        .map(|(instance, _)| instance)
                } else {
                    backend.create_mig(&request)
                }
            },
        ));
        made.map_err(|error| error.to_string())
    }

    /// Whether a MIG device matching the record exists now; `true` when the GPUs cannot be read (in
    /// time: a driver stuck on the GPU may hold up reading it too).
    async fn anything_made_at(&self, record: &MadeMig) -> bool {
        let backend = self.backend.clone();
        let read = tokio::task::spawn_blocking(move || backend.inventory());
        let Ok(Ok(Ok(now))) = tokio::time::timeout(self.gpu_modes.mig_timeout(), read).await else {
            return true;
        };
        now.gpus
            .iter()
            .filter(|gpu| gpu.uuid == record.parent_uuid)
            .filter_map(|gpu| gpu.mig.as_ref())
            .flat_map(|mig| &mig.instances)
            .any(|instance| record.is(&record.parent_uuid, instance))
    }

    /// The start-up sweep of dynamic MIG: every MIG device no kept claim owns (`owned`: parent UUID
    /// and GPU instance id) is destroyed if the plugin made it (`made`), and reported and left alone
    /// if not. Records that match no device any more are dropped: their devices are gone. Each
    /// destroy is an operation on its GPU, bounded in time: one that does not return leaves its
    /// record for the next start, and the GPU stuck. Runs on a blocking thread of the runtime.
    pub(super) fn sweep_mig(
        &self,
        inventory: &Inventory,
        owned: &BTreeSet<(String, u32)>,
        made: &[MadeMig],
    ) -> Sweep {
        let runtime = tokio::runtime::Handle::current();
        let mut sweep = Sweep::default();
        for gpu in &inventory.gpus {
            let Some(mig) = &gpu.mig else { continue };
            for instance in &mig.instances {
                if owned.contains(&(gpu.uuid.clone(), instance.gpu_instance_id)) {
                    continue;
                }
                let Some(record) = made.iter().find(|made| made.is(&gpu.uuid, instance)) else {
                    let shown = shown(&gpu.uuid, instance);
                    warn!(gpu = %gpu.uuid, mig_device = %shown, profile_id = instance.profile_id, start = instance.placement.start, "dynamic MIG: MIG device left alone, because this plugin did not make it (an admin's, one NVIDIA's plugin made or found, or a leftover of a release that did not record the MIG devices it made); destroy it with nvidia-smi if nothing uses it");
                    sweep.left_alone.push(shown);
                    continue;
                };
                let (backend, parent, gpu_instance, uuid) = (
                    self.backend.clone(),
                    gpu.uuid.clone(),
                    instance.gpu_instance_id,
                    instance.uuid.clone(),
                );
                let op = GpuOp::DestroyMig {
                    uuid: instance.uuid.clone(),
                };
                let destroyed = runtime.block_on(self.gpu_modes.mig(
                    &gpu.uuid,
                    &mig::gpu_name(gpu),
                    op,
                    move || backend.destroy_mig(&parent, gpu_instance, &uuid),
                ));
                match destroyed {
                    Ok(MigDestroyed::Destroyed) => {
                        info!(uuid = %instance.uuid, claim_uid = %record.claim_uid, "MIG device this plugin made for a claim no longer prepared here destroyed");
                        sweep.destroyed.push(instance.uuid.clone());
                    }
                    Ok(_) => {}
                    Err(error) => {
                        warn!(uuid = %instance.uuid, %error, "destroying a MIG device this plugin made failed; the next start tries again");
                        sweep.still_made.push(record.clone());
                    }
                }
            }
        }
        sweep
    }
}

/// Same GPU, profile and placement: the same device, made or about to be.
pub(super) fn same_place(a: &MadeMig, b: &MadeMig) -> bool {
    a.parent_uuid == b.parent_uuid && a.profile_id == b.profile_id && a.placement == b.placement
}

/// The records of `records` that do not stand for a device of `kept` (same UUID, or about to be
/// made at the same place).
pub(super) fn not_among(records: Vec<MadeMig>, kept: &[MadeMig]) -> Vec<MadeMig> {
    records
        .into_iter()
        .filter(|record| {
            !kept.iter().any(|k| match &record.uuid {
                Some(uuid) => k.uuid.as_ref() == Some(uuid),
                None => same_place(record, k),
            })
        })
        .collect()
}

/// The records of the MIG devices kept claims created, from their device names and UUIDs: how a
/// checkpoint of a release before the record, or a rebuilt one, comes to hold them.
pub(super) fn made_for_claims<'a>(
    claims: impl Iterator<Item = (&'a String, &'a ClaimRecord)>,
    inventory: &Inventory,
) -> Vec<MadeMig> {
    let mut made = Vec::new();
    for (uid, record) in claims {
        for device in &record.devices {
            let Some(prepared) = device.mig.as_ref().filter(|m| m.created) else {
                continue;
            };
            // A device name that no longer resolves belongs to a claim that was rolled back.
            let Ok(Some(target)) = mig::resolve(inventory, &device.device) else {
                continue;
            };
            made.push(MadeMig {
                claim_uid: uid.clone(),
                parent_uuid: prepared.parent_uuid.clone(),
                profile_id: target.profile.id,
                placement: target.placement,
                uuid: Some(prepared.uuid.clone()),
            });
        }
    }
    made
}

fn shown(parent_uuid: &str, instance: &MigInstance) -> String {
    if instance.uuid.is_empty() {
        format!("{parent_uuid}/gi{}", instance.gpu_instance_id)
    } else {
        instance.uuid.clone()
    }
}
