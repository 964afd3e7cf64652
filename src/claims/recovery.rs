//! Start-up recovery: converge the node's files with the checkpoint after a crash or a reboot.

use std::collections::BTreeMap;

use tracing::{info, warn};

use super::checkpoint::{self, CheckpointData, CheckpointError};
use super::edits::write_spec_with;
use super::{describe, lock, ClaimError, ClaimState, Preparer, Recovery};

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
                    // /var/run/cdi is tmpfs: after a reboot the spec is gone and is written again;
                    // one that a power cut left unreadable is replaced the same way.
                    if !matches!(self.cdi.read_claim_spec(&uid), Ok(Some(_))) {
                        write_spec_with(&self.cdi, &uid, &record.devices, &inventory).map_err(
                            |source| ClaimError::Cdi {
                                claim: describe(&uid, &record),
                                source,
                            },
                        )?;
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
        self.checkpoint.store(&data).map_err(checkpoint_error)?;
        let mut state = lock(&self.state);
        state.data = data;
        info!(
            kept = recovery.kept.len(),
            rolled_back = recovery.rolled_back.len(),
            orphans_removed = recovery.orphan_specs_removed.len(),
            rebooted = recovery.rebooted,
            "claims recovered from checkpoint"
        );
        Ok(recovery)
    }
}
