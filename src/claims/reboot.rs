//! Records of an earlier boot. The checkpoint is not fsynced, so after a power cut it may be stale (a
//! claim unprepared since still recorded), and after any reboot a recorded claim may be gone, replaced
//! or allocated elsewhere. So no such record holds a device until the API server confirms it; what it
//! does not confirm is dropped. The kubelet prepares every claim again after a reboot, before any
//! container of the pod starts (it loads its own checkpoint with every claim marked not prepared), so
//! a dropped record that a pod still needs is simply prepared anew.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;

use super::{ClaimRecord, ClaimRef, Preparer};
use crate::gpu::Inventory;

/// What the check of an earlier boot's records decided.
#[derive(Debug, Default)]
pub(super) struct Checked {
    /// Confirmed by the API server, by claim UID; they go on to recovery as if the boot had not changed.
    pub kept: BTreeMap<String, ClaimRecord>,
    /// Claim UIDs dropped, with why.
    pub dropped: Vec<(String, String)>,
}

impl Preparer {
    /// Keeps each record whose ResourceClaim the API server still has under the same UID, allocated to
    /// this driver in this pool with the same devices, and reserved for a pod. One GET per record (the
    /// record names the claim), all at once, within the start-up API timeout: a record that cannot be
    /// checked in time is dropped too, because it must not hold a device on a guess.
    pub(super) async fn check_earlier_boot(
        &self,
        records: BTreeMap<String, ClaimRecord>,
    ) -> Checked {
        let inventory = self.inventory.borrow().clone();
        let lookups = records.into_iter().map(|(uid, record)| {
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &record.namespace);
            let inventory = inventory.clone();
            async move {
                let looked_up =
                    tokio::time::timeout(self.startup_api_timeout, api.get_opt(&record.name)).await;
                let verdict = match looked_up {
                    Ok(Ok(found)) => self.still_prepared_here(&uid, &record, found, &inventory),
                    Ok(Err(error)) => {
                        self.metrics.api_error("get_claim");
                        Err(format!("reading the ResourceClaim failed: {error}"))
                    }
                    Err(_) => {
                        self.metrics.api_timeout("get_claim");
                        Err(not_answered(self.startup_api_timeout))
                    }
                };
                (uid, record, verdict)
            }
        });
        let mut checked = Checked::default();
        for (uid, record, verdict) in futures::future::join_all(lookups).await {
            match verdict {
                Ok(()) => {
                    checked.kept.insert(uid, record);
                }
                Err(reason) => checked.dropped.push((uid, reason)),
            }
        }
        checked
    }

    /// `Ok` when the claim the API server has is the recorded one, still allocated here with the same
    /// devices and reserved for a pod; otherwise why not.
    fn still_prepared_here(
        &self,
        uid: &str,
        record: &ClaimRecord,
        found: Option<ResourceClaim>,
        inventory: &Inventory,
    ) -> Result<(), String> {
        let claim = found.ok_or("the ResourceClaim is gone")?;
        let found_uid = claim.metadata.uid.as_deref().unwrap_or_default();
        if found_uid != uid {
            return Err(format!(
                "the ResourceClaim was replaced: the API server has UID {found_uid}"
            ));
        }
        let claim_ref = ClaimRef {
            uid: uid.to_string(),
            namespace: record.namespace.clone(),
            name: record.name.clone(),
        };
        let allocated = self
            .allocated_devices(&claim_ref, &claim, inventory)
            .map_err(|error| format!("no longer allocated as recorded: {error}"))?;
        let devices = |list: &[super::PreparedDevice]| -> BTreeSet<(String, Option<String>)> {
            list.iter()
                .map(|d| (d.device.clone(), d.share_id.clone()))
                .collect()
        };
        if devices(&allocated) != devices(&record.devices) {
            return Err(format!(
                "allocated other devices now ({}); the record holds {}",
                names(&allocated),
                names(&record.devices)
            ));
        }
        if !super::rebuild::is_reserved(&claim) {
            return Err("the ResourceClaim is not reserved for any pod".to_string());
        }
        Ok(())
    }
}

fn names(devices: &[super::PreparedDevice]) -> String {
    devices
        .iter()
        .map(|d| d.device.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn not_answered(waited: Duration) -> String {
    format!("the API server did not answer within {waited:?}")
}
