//! Under NVIDIA's driver name, the claims NVIDIA's plugin prepared before the swap are taken over
//! from its checkpoint (`nvidia_checkpoint.rs`), so that the pods started before the swap are
//! unprepared correctly after it. At start each completed claim of NVIDIA's checkpoint that is still
//! in force on the node (its claim spec is in the CDI root, and the checkpoint names this boot where
//! it names one) is recorded in ours; a repeated prepare answers what NVIDIA's plugin answered. Its
//! unprepare undoes what NVIDIA's `Unprepare` would have: its MPS daemons stopped (Deployment
//! `mps-control-daemon-<id>` in NVIDIA's namespace, then the daemon's tmpfs and directory), its GPUs
//! back to the sharing mode our claims want (the default when none), and its claim spec removed.
//! Its MIG devices stay, whatever our MIG mode: NVIDIA's checkpoint records a MIG device the same
//! way whether its plugin made it (DynamicMIG) or found it (an admin's static layout), so none of
//! them is known to be ours to destroy (see [`adopted`]). NVIDIA's checkpoint is never written: the
//! claims done with are remembered in ours instead.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, DeleteParams};
use tracing::{info, warn};

use super::checkpoint::{AdoptedClaim, CheckpointData};
use super::mps::shm;
use super::nvidia_checkpoint::{self, NvidiaClaim};
use super::state::lock;
use super::{ClaimError, ClaimRef, PreparedDevice, PreparedMig, Preparer};
use crate::api::NVIDIA_DRIVER_NAME;

/// NVIDIA's chart installs into this namespace, where its plugin makes the MPS daemons' Deployments.
pub const DEFAULT_NVIDIA_NAMESPACE: &str = "nvidia-dra-driver-gpu";

/// How long an unprepare waits for NVIDIA's MPS Deployment (and so its Pod) to go: well inside the
/// kubelet's deadline for the call, which retries it.
const DEPLOYMENT_GONE_TIMEOUT: Duration = Duration::from_secs(20);

/// What start-up did with NVIDIA's checkpoint.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Adoption {
    /// Claims taken over now: `ns/name (uid)`.
    pub adopted: Vec<String>,
    /// Claims of NVIDIA's checkpoint not taken over, with why (prepare not completed, an earlier
    /// boot, its claim spec gone).
    pub not_adopted: Vec<String>,
    /// Set when NVIDIA's checkpoint could not be read.
    pub error: Option<String>,
    /// Claims NVIDIA's checkpoint still lists as prepared that gpu-dra has unprepared since (it never
    /// writes that file). NVIDIA's plugin, swapped back, would refuse their devices to other claims.
    pub unprepared_since: Vec<String>,
    /// Where NVIDIA's checkpoint is.
    pub checkpoint: Option<std::path::PathBuf>,
}

impl Preparer {
    /// Takes over the claims of NVIDIA's checkpoint not yet taken over (into `stored`), and drops
    /// those taken over earlier whose claim spec is gone (a reboot emptied the CDI root): the
    /// kubelet prepares those claims again, this time with ours.
    pub(super) async fn adopt_nvidia_claims(&self, stored: &mut CheckpointData) -> Adoption {
        let mut adoption = Adoption::default();
        if self.driver != NVIDIA_DRIVER_NAME {
            return adoption;
        }
        let Some(plugin_dir) = self.checkpoint.path().parent().map(Path::to_path_buf) else {
            return adoption;
        };
        let path = nvidia_checkpoint::nvidia_checkpoint_path(&plugin_dir);
        let checkpoint = match nvidia_checkpoint::read_checkpoint(&path) {
            Ok(Some(checkpoint)) => checkpoint,
            Ok(None) => {
                stored.nvidia_claims_done.clear();
                return adoption;
            }
            Err(error) => {
                warn!(%error, "NVIDIA's checkpoint cannot be read; none of its claims is taken over");
                adoption.error = Some(error);
                return adoption;
            }
        };
        adoption.checkpoint = Some(path.clone());
        let listed: BTreeSet<&str> = checkpoint.claims.iter().map(|c| c.uid.as_str()).collect();
        // Done with, and no longer in NVIDIA's file: nothing can bring them back.
        stored
            .nvidia_claims_done
            .retain(|uid| listed.contains(uid.as_str()));

        let gone: Vec<String> = stored
            .nvidia_claims
            .keys()
            .filter(|uid| !self.nvidia_spec_path(uid).exists())
            .cloned()
            .collect();
        let mut daemons = Vec::new();
        for uid in gone {
            let Some(claim) = stored.nvidia_claims.remove(&uid) else {
                continue;
            };
            daemons.extend(claim.mps_daemons.into_iter().map(|id| (uid.clone(), id)));
            info!(claim_uid = %uid, "claim taken over from NVIDIA's plugin dropped: its CDI spec is gone (a reboot); the kubelet prepares it again if a pod still needs it");
            stored.nvidia_claims_done.insert(uid);
        }
        // What a reboot does not end: the Deployments of NVIDIA's MPS daemons, stopped side by side.
        let stops = daemons.iter().map(|(_, id)| self.stop_nvidia_mps(id));
        let bound = super::NVIDIA_MPS_STOP_BOUND;
        let outcomes = super::recovery::bounded(stops, super::MPS_RESTORE_PARALLELISM, bound).await;
        for ((uid, id), outcome) in daemons.iter().zip(outcomes) {
            let error = match outcome {
                Some(Ok(())) => continue,
                Some(Err(error)) => error,
                None => format!("not stopped within {}s", bound.as_secs()),
            };
            warn!(claim_uid = %uid, daemon = %id, %error, "stopping NVIDIA's MPS daemon of a claim whose spec is gone");
        }

        let this_boot = super::checkpoint::current_boot_id();
        // What NVIDIA's file still lists that this plugin has unprepared (taking over below adds
        // nothing to that set), for the Event that says to move the file aside.
        adoption.unprepared_since = checkpoint
            .claims
            .iter()
            .filter(|c| c.state == "PrepareCompleted" && stored.nvidia_claims_done.contains(&c.uid))
            .map(|c| nvidia_checkpoint::describe(std::slice::from_ref(c)))
            .collect();
        for claim in checkpoint.claims {
            let uid = claim.uid.clone();
            if stored.nvidia_claims.contains_key(&uid)
                || stored.nvidia_claims_done.contains(&uid)
                || stored.claims.contains_key(&uid)
            {
                continue;
            }
            let why_not = if claim.state != "PrepareCompleted" {
                Some(format!(
                    "its prepare did not complete ({}); the kubelet prepares it again",
                    claim.state
                ))
            } else if !checkpoint.node_boot_id.is_empty() && checkpoint.node_boot_id != this_boot {
                Some("written in an earlier boot".to_string())
            } else if !self.nvidia_spec_path(&uid).exists() {
                Some(format!(
                    "its CDI spec {} is gone",
                    nvidia_checkpoint::cdi_spec_file_name(&uid)
                ))
            } else {
                None
            };
            let who = nvidia_checkpoint::describe(std::slice::from_ref(&claim));
            if let Some(reason) = why_not {
                info!(claim = %who, %reason, "claim of NVIDIA's checkpoint not taken over");
                adoption.not_adopted.push(format!("{who}: {reason}"));
                continue;
            }
            info!(claim = %who, "claim prepared by NVIDIA's plugin taken over");
            adoption.adopted.push(who);
            stored.nvidia_claims.insert(uid, adopted(claim));
        }
        adoption
    }

    /// A repeated prepare of a claim taken over: what NVIDIA's plugin answered.
    pub(super) fn adopted_devices(&self, claim_uid: &str) -> Option<Vec<PreparedDevice>> {
        lock(&self.state)
            .data
            .nvidia_claims
            .get(claim_uid)
            .map(|claim| claim.devices.clone())
    }

    /// Undoes what NVIDIA's plugin set up for the claim, in the order its own unprepare does: MPS
    /// daemons, sharing modes, then the claim spec. Its MIG devices are left as they are, even where
    /// an older release recorded them as made for the claim (see [`adopted`]). A step that fails
    /// leaves the claim recorded, and the kubelet's retry starts over (each step is idempotent).
    pub(super) async fn unprepare_adopted(
        &self,
        claim: &ClaimRef,
        adopted: AdoptedClaim,
    ) -> Result<(), ClaimError> {
        for mig in adopted.devices.iter().filter_map(|d| d.mig.as_ref()) {
            info!(uuid = %mig.uuid, parent = %mig.parent_uuid, "MIG device of a claim prepared by NVIDIA's plugin left as it is: nothing says NVIDIA's plugin made it rather than an admin");
        }
        for id in &adopted.mps_daemons {
            self.stop_nvidia_mps(id)
                .await
                .map_err(|reason| ClaimError::Sharing {
                    claim: claim.to_string(),
                    reason,
                })?;
        }
        // NVIDIA's plugin set these GPUs' modes, which this plugin never saw: each is set again to
        // what our claims want of it.
        let inventory = self.inventory.borrow().clone();
        let mut gpus = Vec::new();
        for gpu in adopted
            .gpus
            .iter()
            .filter_map(|uuid| inventory.gpus.iter().find(|g| &g.uuid == uuid))
        {
            self.gpu_modes.forget(&gpu.uuid).await;
            gpus.push(PreparedDevice {
                request_names: Vec::new(),
                pool: self.pool.clone(),
                device: format!("gpu-{}", gpu.minor),
                cdi_device_ids: Vec::new(),
                share_id: None,
                admin_access: false,
                mig: None,
                sharing: Default::default(),
                imex_channels: None,
            });
        }
        self.sync_gpu_modes(claim, &inventory, &gpus, Some(&claim.uid))
            .await
            .map_err(|reason| ClaimError::Sharing {
                claim: claim.to_string(),
                reason: format!("resetting the GPU NVIDIA's plugin shared: {reason}"),
            })?;
        for path in [
            self.nvidia_spec_path(&claim.uid),
            self.nvidia_spec_path(&claim.uid).with_extension("json"),
        ] {
            match std::fs::remove_file(&path) {
                Ok(()) => info!(spec = %path.display(), "NVIDIA's CDI spec of the claim removed"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(ClaimError::Internal {
                        claim: claim.to_string(),
                        reason: format!("removing NVIDIA's CDI spec {}: {e}", path.display()),
                    })
                }
            }
        }
        let last = {
            let mut state = lock(&self.state);
            state.data.nvidia_claims.remove(&claim.uid);
            state.data.nvidia_claims_done.insert(claim.uid.clone());
            state.revision += 1;
            state.data.nvidia_claims.is_empty()
        };
        self.persist(claim).await?;
        info!("claim prepared by NVIDIA's plugin unprepared");
        if last {
            info!(
                checkpoint = %self.checkpoint.path().with_file_name("checkpoint.json").display(),
                "every claim taken over from NVIDIA's plugin is unprepared; NVIDIA's checkpoint still lists them (gpu-dra never writes it), so move it aside before NVIDIA's plugin runs on this node again, or it refuses their devices to new claims"
            );
        }
        Ok(())
    }

    /// NVIDIA's claim spec of `claim_uid` in the CDI root; only called with UIDs of NVIDIA's
    /// checkpoint or of the kubelet, which `check_ref` has vetted.
    fn nvidia_spec_path(&self, claim_uid: &str) -> std::path::PathBuf {
        self.cdi
            .root()
            .join(nvidia_checkpoint::cdi_spec_file_name(claim_uid))
    }

    /// Stops one of NVIDIA's MPS daemons as its own `Stop` does: nothing when its directory is gone;
    /// else its Deployment deleted (waiting until it is gone, so the daemon no longer runs), its
    /// tmpfs unmounted and its directory removed.
    async fn stop_nvidia_mps(&self, id: &str) -> Result<(), String> {
        if !nvidia_checkpoint::is_nvidia_mps_dir(id) {
            return Err(format!(
                "{id:?} is not the id of an MPS daemon of NVIDIA's plugin"
            ));
        }
        let dir = self.mps.root().join(id);
        if !dir.exists() {
            return Ok(());
        }
        let namespace = &self.nvidia_namespace;
        let name = format!("mps-control-daemon-{id}");
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), namespace);
        let hint = "(the plugin needs get and delete on deployments there: deploy/components/nvidia-migration, or the chart's nvidiaCompatibility.nvidiaNamespace; --nvidia-namespace names NVIDIA's namespace)";
        match api.delete(&name, &DeleteParams::foreground()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(format!(
                    "deleting Deployment {namespace}/{name} of NVIDIA's MPS daemon: {e} {hint}"
                ))
            }
        }
        let deadline = Instant::now() + DEPLOYMENT_GONE_TIMEOUT;
        loop {
            match api.get_opt(&name).await {
                Ok(None) => break,
                Ok(Some(_)) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await
                }
                Ok(Some(_)) => {
                    return Err(format!(
                        "Deployment {namespace}/{name} of NVIDIA's MPS daemon still there {}s after its deletion",
                        DEPLOYMENT_GONE_TIMEOUT.as_secs()
                    ))
                }
                Err(e) => {
                    return Err(format!(
                        "reading Deployment {namespace}/{name} of NVIDIA's MPS daemon: {e} {hint}"
                    ))
                }
            }
        }
        let shm_dir = dir.join("shm");
        if shm::is_mount_point(&shm_dir) {
            shm::unmount(&shm_dir).map_err(|e| format!("unmounting {}: {e}", shm_dir.display()))?;
        }
        std::fs::remove_dir_all(&dir).map_err(|e| format!("removing {}: {e}", dir.display()))?;
        info!(daemon = %id, "NVIDIA's MPS control daemon stopped");
        Ok(())
    }
}

/// The record of a claim NVIDIA's plugin prepared. Its MIG devices never count as made for the claim
/// (`created: false`), in any MIG mode: NVIDIA's checkpoint (v1, v2, up to its main branch) writes a
/// MIG device as `mig: {concrete|info, device}` whether its plugin created it under its DynamicMIG
/// feature gate or found it in an admin's static layout (its own unprepare decides by whether the
/// gate is on now, which its checkpoint does not record). Destroying them would tear down an admin's
/// layout as the claims end when a node moves from NVIDIA with static MIG to `--mig-mode dynamic`; a
/// device NVIDIA's plugin did make is left instead, and the start-up sweep reports it as a MIG device
/// this plugin did not make.
fn adopted(claim: NvidiaClaim) -> AdoptedClaim {
    let (namespace, name) = claim
        .name
        .split_once('/')
        .map(|(ns, name)| (ns.to_string(), name.to_string()))
        .unwrap_or_default();
    let mut gpus = Vec::new();
    let devices = claim
        .prepared
        .into_iter()
        .map(|device| {
            if let Some(uuid) = &device.gpu_uuid {
                gpus.push(uuid.clone());
            }
            PreparedDevice {
                request_names: device.requests,
                pool: device.pool,
                device: device.device,
                cdi_device_ids: device.cdi_device_ids,
                share_id: None,
                admin_access: false,
                mig: device.mig.and_then(|m| {
                    Some(PreparedMig {
                        parent_uuid: m.parent_uuid,
                        uuid: m.uuid,
                        gpu_instance_id: m.gpu_instance_id?,
                        compute_instance_id: m.compute_instance_id.unwrap_or_default(),
                        device_files: Vec::new(),
                        created: false,
                    })
                }),
                sharing: Default::default(),
                imex_channels: None,
            }
        })
        .collect();
    AdoptedClaim {
        namespace,
        name,
        devices,
        gpus,
        mps_daemons: claim.mps_daemons,
    }
}
