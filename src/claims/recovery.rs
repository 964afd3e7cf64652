//! Start-up recovery: converge the node's files and MIG devices with the checkpoint after a crash or a
//! reboot.

use std::collections::{BTreeMap, BTreeSet};

use tracing::{info, warn};

use super::checkpoint::{self, CheckpointData, CheckpointError};
use super::edits::write_spec_with;
use super::{describe, lock, mig, ClaimError, ClaimRecord, ClaimState, Preparer, Recovery};
use crate::devices::MigMode;
use crate::gpu::{Inventory, MigRequest};

impl Preparer {
    pub(super) fn recover(&self) -> Result<Recovery, ClaimError> {
        let checkpoint_error = |source| ClaimError::Checkpoint {
            claim: "(startup)".to_string(),
            source,
        };
        let boot_id = checkpoint::current_boot_id();
        let stored = match self.checkpoint.load() {
            Ok(stored) => stored.unwrap_or_default(),
            Err(error @ CheckpointError::Corrupt { .. }) => {
                // Keep the evidence, start empty: the kubelet prepares again whatever it still needs.
                let aside = self.checkpoint.path().with_extension("corrupt");
                warn!(%error, moved_to = %aside.display(), "checkpoint unreadable; starting with no prepared claims");
                std::fs::rename(self.checkpoint.path(), &aside).map_err(|source| {
                    checkpoint_error(CheckpointError::Write {
                        path: aside.display().to_string(),
                        source,
                    })
                })?;
                CheckpointData::default()
            }
            Err(error) => return Err(checkpoint_error(error)),
        };
        let mut recovery = Recovery {
            rebooted: !stored.boot_id.is_empty() && stored.boot_id != boot_id,
            ..Default::default()
        };
        let inventory = self.inventory.borrow().clone();
        let mut data = CheckpointData {
            boot_id,
            claims: BTreeMap::new(),
        };
        for (uid, record) in stored.claims {
            match record.state {
                ClaimState::Started => {
                    self.cdi
                        .remove_claim_spec(&uid)
                        .map_err(|source| ClaimError::Cdi {
                            claim: describe(&uid, &record),
                            source,
                        })?;
                    recovery.rolled_back.push(uid);
                }
                ClaimState::Completed => {
                    let mut record = record;
                    let mut rewrite = false;
                    if let Err(reason) =
                        self.restore_mig_devices(&inventory, &mut record, &mut rewrite)
                    {
                        warn!(claim = %describe(&uid, &record), %reason, "MIG device of a prepared claim is gone and cannot be made again; rolling the claim back");
                        self.cdi
                            .remove_claim_spec(&uid)
                            .map_err(|source| ClaimError::Cdi {
                                claim: describe(&uid, &record),
                                source,
                            })?;
                        recovery.rolled_back.push(uid);
                        continue;
                    }
                    // /var/run/cdi is tmpfs: after a reboot the spec is gone and is written again;
                    // one that a power cut left unreadable is replaced the same way.
                    if rewrite || !matches!(self.cdi.read_claim_spec(&uid), Ok(Some(_))) {
                        write_spec_with(
                            &self.cdi,
                            &uid,
                            &record.devices,
                            &inventory,
                            &self.driver_edits,
                        )
                        .map_err(|source| ClaimError::Cdi {
                            claim: describe(&uid, &record),
                            source,
                        })?;
                    }
                    recovery.kept.push(uid.clone());
                    data.claims.insert(uid, record);
                }
            }
        }
        let on_disk = self.cdi.claim_specs().map_err(|source| ClaimError::Cdi {
            claim: "(startup)".to_string(),
            source,
        })?;
        for uid in on_disk {
            if !data.claims.contains_key(&uid) {
                self.cdi
                    .remove_claim_spec(&uid)
                    .map_err(|source| ClaimError::Cdi {
                        claim: uid.clone(),
                        source,
                    })?;
                recovery.orphan_specs_removed.push(uid);
            }
        }
        if *self.mig_mode.borrow() == MigMode::Dynamic {
            let owned: BTreeSet<(String, u32)> = data
                .claims
                .values()
                .flat_map(|record| &record.devices)
                .filter_map(|device| device.mig.as_ref())
                .map(|mig| (mig.parent_uuid.clone(), mig.gpu_instance_id))
                .collect();
            let current = self.backend.inventory().map_err(|e| ClaimError::Internal {
                claim: "(startup)".to_string(),
                reason: format!("reading the GPUs: {e}"),
            })?;
            recovery.mig_devices_destroyed =
                mig::destroy_unowned(self.backend.as_ref(), &current, &owned);
        }
        self.checkpoint.store(&data).map_err(checkpoint_error)?;
        let mut state = lock(&self.state);
        state.data = data;
        info!(
            kept = recovery.kept.len(),
            rolled_back = recovery.rolled_back.len(),
            orphans_removed = recovery.orphan_specs_removed.len(),
            mig_devices_destroyed = recovery.mig_devices_destroyed.len(),
            rebooted = recovery.rebooted,
            "claims recovered from checkpoint"
        );
        Ok(recovery)
    }

    /// Makes sure a kept claim's created MIG devices still exist; after a reboot they are gone (MIG
    /// configuration does not survive one) and are created again at the same placement, which gives
    /// them new UUIDs, so the spec must be rewritten (`rewrite`).
    fn restore_mig_devices(
        &self,
        inventory: &Inventory,
        record: &mut ClaimRecord,
        rewrite: &mut bool,
    ) -> Result<(), String> {
        for device in record.devices.iter_mut() {
            let Some(prepared) = device.mig.as_mut() else {
                continue;
            };
            let target = mig::resolve(inventory, &device.device)?
                .ok_or_else(|| format!("{} is no MIG device", device.device))?;
            if target
                .existing
                .as_ref()
                .is_some_and(|existing| existing.uuid == prepared.uuid)
            {
                continue;
            }
            if !prepared.created {
                return Err(format!(
                    "static MIG device {} ({}) no longer exists",
                    device.device, prepared.uuid
                ));
            }
            let instance = self
                .backend
                .create_mig(&MigRequest {
                    parent_uuid: target.gpu.uuid.clone(),
                    profile_id: target.profile.id,
                    placement: target.placement,
                })
                .map_err(|e| e.to_string())?;
            info!(device = %device.device, uuid = %instance.uuid, "MIG device of a prepared claim made again");
            prepared.uuid = instance.uuid;
            prepared.gpu_instance_id = instance.gpu_instance_id;
            prepared.compute_instance_id = instance.compute_instance_id;
            prepared.device_files = instance.device_files;
            *rewrite = true;
        }
        Ok(())
    }
}
