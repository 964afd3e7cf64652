//! Rebuilding prepared claims without a checkpoint: a claim whose CDI spec is on disk and whose
//! ResourceClaim in the API server is still allocated to this driver in this node's pool, and reserved
//! for a pod, was prepared here and is kept as completed. Anything else is reported, never deleted.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, ListParams};

use super::checkpoint::PreparedMig;
use super::{mig, ClaimRecord, ClaimRef, ClaimState, Preparer};
use crate::devices::MigMode;
use crate::gpu::Inventory;

/// What the API server confirmed.
#[derive(Debug, Default)]
pub(super) struct Verified {
    /// Claims prepared here, by UID, as the checkpoint would have held them.
    pub kept: BTreeMap<String, ClaimRecord>,
    /// Claim UIDs that could not be confirmed, with why.
    pub left: Vec<(String, String)>,
}

impl Preparer {
    /// Looks the claims up by UID in one LIST (ResourceClaims have no UID field selector), bounded by
    /// the start-up API timeout: a hung server leaves every claim unconfirmed instead of holding up
    /// the start.
    pub(super) async fn verify_claims(&self, uids: &[String]) -> Verified {
        let api: Api<ResourceClaim> = Api::all(self.client.clone());
        let listed =
            tokio::time::timeout(self.startup_api_timeout, api.list(&ListParams::default())).await;
        let claims = match listed {
            Ok(Ok(list)) => list.items,
            Ok(Err(error)) => {
                self.metrics.api_error("list_claims");
                return all_left(uids, format!("listing ResourceClaims failed: {error}"));
            }
            Err(_) => {
                self.metrics.api_error("list_claims");
                return all_left(
                    uids,
                    format!(
                        "the API server did not list ResourceClaims within {:?}",
                        self.startup_api_timeout
                    ),
                );
            }
        };
        let inventory = self.inventory.borrow().clone();
        let mode = *self.mig_mode.borrow();
        let mut verified = Verified::default();
        for uid in uids {
            let found = claims
                .iter()
                .find(|claim| claim.metadata.uid.as_deref() == Some(uid.as_str()));
            let outcome = match found {
                None => Err("the API server has no ResourceClaim with this UID".to_string()),
                Some(claim) => self.rebuilt_record(uid, claim, &inventory, mode),
            };
            match outcome {
                Ok(record) => {
                    verified.kept.insert(uid.clone(), record);
                }
                Err(reason) => verified.left.push((uid.clone(), reason)),
            }
        }
        verified
    }

    /// The completed record of a claim prepared here, from its allocation and the node's MIG devices.
    fn rebuilt_record(
        &self,
        uid: &str,
        claim: &ResourceClaim,
        inventory: &Inventory,
        mode: MigMode,
    ) -> Result<ClaimRecord, String> {
        let claim_ref = ClaimRef {
            uid: uid.to_string(),
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            name: claim.metadata.name.clone().unwrap_or_default(),
        };
        if !is_reserved(claim) {
            return Err(format!(
                "ResourceClaim {claim_ref} is not reserved for any pod"
            ));
        }
        let mut devices = self
            .allocated_devices(&claim_ref, claim, inventory)
            .map_err(|error| error.to_string())?;
        for device in devices.iter_mut() {
            if let Some(target) = mig::resolve(inventory, &device.device)? {
                let existing = target.existing.ok_or_else(|| {
                    format!(
                        "ResourceClaim {claim_ref}: MIG device {} does not exist",
                        device.device
                    )
                })?;
                device.mig = Some(PreparedMig {
                    parent_uuid: target.gpu.uuid.clone(),
                    uuid: existing.uuid,
                    gpu_instance_id: existing.gpu_instance_id,
                    compute_instance_id: existing.compute_instance_id,
                    device_files: existing.device_files,
                    // In dynamic MIG mode every MIG device is made for a claim and goes with it.
                    created: mode == MigMode::Dynamic,
                });
            }
            self.driver_edits.reference_toolkit(inventory, device);
        }
        Ok(ClaimRecord {
            namespace: claim_ref.namespace,
            name: claim_ref.name,
            state: ClaimState::Completed,
            phase: super::lifecycle::Phase::Completed,
            devices,
            // A rebuilt claim's MPS daemon is not known here; its directory is kept (see
            // `sweep_mps`) and the daemon goes with the next sweep after the claim is gone.
            mps: None,
            domain: None,
            vfio: None,
        })
    }
}

/// Whether the claim is reserved for a pod (or another consumer): still in use.
pub(super) fn is_reserved(claim: &ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|status| status.reserved_for.as_ref())
        .is_some_and(|pods| !pods.is_empty())
}

fn all_left(uids: &[String], reason: String) -> Verified {
    Verified {
        kept: BTreeMap::new(),
        left: uids
            .iter()
            .map(|uid| (uid.clone(), reason.clone()))
            .collect(),
    }
}
