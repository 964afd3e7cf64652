//! Prepare and unprepare: what happens when the kubelet calls NodePrepareResources for a claim.
//! Read top to bottom: validate the claim reference → fetch the ResourceClaim → take this driver's
//! results for this node's pool → reserve the devices (exclusive, in memory) → make MIG devices and
//! write the CDI spec → checkpoint `completed` → answer. Calls for different claims run in parallel;
//! calls for one claim are serialised by a per-claim lock.
//!
//! Nothing on the path is fsynced, and a prepare in progress is not written down, except each MIG
//! device it is about to create (`mig_records.rs`): after a crash, recovery removes every CDI spec,
//! MPS daemon and recorded MIG device that no completed claim owns, so only `completed` needs a
//! record, and a record in the page cache survives a crash of the process.
//! A power cut is a reboot, after which the kubelet prepares every claim again and recovery checks
//! each record of the earlier boot against the API server first (`recovery.rs`).

mod allocation;
mod channels;
pub mod checkpoint;
pub mod configs;
pub mod daemon_pod;
mod edits;
mod error;
mod gpu_modes;
mod mig;
mod mig_records;
pub mod mps;
pub mod names;
mod nvidia_adoption;
pub mod nvidia_checkpoint;
mod reboot;
mod rebuild;
mod recovery;
mod sharing;
mod state;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{info, info_span, warn, Instrument};

pub use allocation::allocation_results;
pub use checkpoint::{ClaimRecord, ClaimState, PreparedDevice, PreparedMig};
use edits::write_spec_with;
pub use edits::{container_edits, DriverEdits};
pub use error::ClaimError;
pub use gpu_modes::SHARING_TIMEOUT;
pub use nvidia_adoption::{Adoption, DEFAULT_NVIDIA_NAMESPACE};

use crate::cdi::CdiRegistry;
use crate::devices::MigMode;
use crate::gpu::{GpuBackend, Inventory};
use crate::observability::Metrics;
use checkpoint::{CheckpointData, CheckpointFile};
use state::{describe, lock, State};

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    pub uid: String,
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// What a restart found and did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Completed claims kept.
    pub kept: Vec<String>,
    /// Claims whose prepare had started but not completed; rolled back.
    pub rolled_back: Vec<String>,
    /// CDI spec files no claim owned; removed.
    pub orphan_specs_removed: Vec<String>,
    /// MIG devices (UUIDs) this plugin made that no kept claim owned, destroyed in dynamic MIG mode.
    pub mig_devices_destroyed: Vec<String>,
    /// MIG devices no kept claim owns that this plugin did not make (an admin's), left alone in
    /// dynamic MIG mode: UUIDs, or `<GPU UUID>/gi<id>` for a GPU instance without compute instance.
    pub mig_devices_left_alone: Vec<String>,
    /// Whether the node rebooted since the checkpoint was written.
    pub rebooted: bool,
    /// Completed claims of an earlier boot that the API server did not confirm (gone, replaced, no
    /// longer allocated here, or no answer); dropped, so they hold no device.
    pub dropped_after_reboot: Vec<String>,
    /// Set when the checkpoint could not be used and was set aside; `kept` then holds the claims
    /// rebuilt from the CDI specs on disk and the API server.
    pub checkpoint_set_aside: Option<CheckpointSetAside>,
    /// Set (to where the checkpoint should have been) when there was none although CDI specs of
    /// this driver were on disk: rebuilt as for a set-aside one, `kept` as there.
    pub checkpoint_missing: Option<std::path::PathBuf>,
    /// Claim UIDs whose CDI spec could not be matched to a claim prepared here; the spec (and, in
    /// dynamic MIG mode, every MIG device) is left in place until the kubelet prepares or unprepares it.
    pub left_in_place: Vec<String>,
    /// Claims whose MPS daemon was still running and was taken over.
    pub mps_daemons_taken_over: Vec<String>,
    /// Claims whose MPS daemon had died (with the old plugin's container) and was started again.
    pub mps_daemons_restarted: Vec<String>,
    /// MPS daemons (by claim UID) no kept claim owned; stopped and their directories removed.
    pub mps_daemons_cleaned_up: Vec<String>,
    /// Under NVIDIA's driver name: the claims taken over from NVIDIA's checkpoint.
    pub nvidia: Adoption,
}

/// A checkpoint that could not be used: why, and where it went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointSetAside {
    /// `corrupt`, `unreadable` or `too_new`
    /// (see [`CheckpointError::kind`](checkpoint::CheckpointError::kind)).
    pub kind: &'static str,
    /// The error, for people.
    pub reason: String,
    /// The `<checkpoint>.corrupt-<time>` file, or `None` when it could not be moved.
    pub moved_to: Option<std::path::PathBuf>,
}

pub struct ClaimsConfig {
    pub driver_name: String,
    /// This node's name, which is also the pool name.
    pub pool: String,
    pub cdi: CdiRegistry,
    pub checkpoint_path: std::path::PathBuf,
    /// How MIG devices are handled now; the admin's policy may change it while the plugin runs.
    pub mig_mode: watch::Receiver<MigMode>,
    pub driver_edits: DriverEdits,
    /// How long start-up waits for the API server when it rebuilds a checkpoint it had to set aside.
    pub startup_api_timeout: Duration,
    /// How long one prepare may spend reading its ResourceClaim (retries included) before that claim
    /// gets a per-claim error; well inside the kubelet's 45 s deadline for the whole call.
    pub claim_read_budget: Duration,
    /// The claims' MPS control daemons.
    pub mps: mps::MpsDaemons,
    /// How long one change of a GPU's sharing mode may take before it counts as stuck
    /// ([`SHARING_TIMEOUT`]).
    pub sharing_timeout: Duration,
    /// Under NVIDIA's driver name: where NVIDIA's plugin ran its MPS daemons' Deployments.
    pub nvidia_namespace: String,
    /// This node's side of ComputeDomains; `None` refuses claims for IMEX channels.
    pub domains: Option<Arc<crate::domains::membership::Membership>>,
}

/// The claim state machine of one plugin instance.
pub struct Preparer {
    driver: String,
    pool: String,
    client: kube::Client,
    cdi: CdiRegistry,
    checkpoint: CheckpointFile,
    backend: Arc<dyn GpuBackend>,
    mig_mode: watch::Receiver<MigMode>,
    driver_edits: DriverEdits,
    startup_api_timeout: Duration,
    claim_read_budget: Duration,
    inventory: watch::Receiver<Arc<Inventory>>,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
    /// The revision last written to disk; held while writing, so concurrent changes share one write.
    persisted: tokio::sync::Mutex<u64>,
    claim_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    mps: Arc<mps::MpsDaemons>,
    /// The sharing mode last set on each GPU, with one lock per GPU held while its mode changes.
    gpu_modes: gpu_modes::GpuModes,
    nvidia_namespace: String,
    domains: Option<Arc<crate::domains::membership::Membership>>,
    /// The API groups of ComputeDomains this driver name serves.
    domain_groups: Vec<crate::domains::api::DomainGroup>,
}

impl Preparer {
    /// Loads the checkpoint and converges after a crash: started claims are rolled back, completed ones
    /// kept (their CDI specs re-written if the node lost them), CDI specs no claim owns removed, and in
    /// dynamic MIG mode MIG devices no claim owns destroyed. A checkpoint that cannot be used is set
    /// aside and rebuilt instead, deleting nothing (see `recovery.rs`).
    pub async fn start(
        config: ClaimsConfig,
        client: kube::Client,
        backend: Arc<dyn GpuBackend>,
        inventory: watch::Receiver<Arc<Inventory>>,
        metrics: Arc<Metrics>,
    ) -> Result<(Arc<Preparer>, Recovery), ClaimError> {
        let preparer = Arc::new(Preparer {
            driver: config.driver_name.clone(),
            pool: config.pool,
            client,
            cdi: config.cdi,
            checkpoint: CheckpointFile::new(config.checkpoint_path),
            backend,
            mig_mode: config.mig_mode,
            driver_edits: config.driver_edits,
            startup_api_timeout: config.startup_api_timeout,
            claim_read_budget: config.claim_read_budget,
            inventory,
            metrics,
            state: Mutex::new(State {
                data: CheckpointData::default(),
                revision: 0,
            }),
            persisted: tokio::sync::Mutex::new(0),
            claim_locks: Mutex::new(HashMap::new()),
            mps: Arc::new(config.mps),
            gpu_modes: gpu_modes::GpuModes::new(config.sharing_timeout),
            nvidia_namespace: config.nvidia_namespace,
            domain_groups: crate::domains::api::DomainGroup::served_by(&config.driver_name),
            domains: config.domains,
        });
        let recovery = preparer.recover_at_start().await?;
        Ok((preparer, recovery))
    }

    /// Prepares every claim in parallel; one result per claim, in order.
    pub async fn prepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<Vec<PreparedDevice>, ClaimError>)> {
        let calls = claims.into_iter().map(|claim| {
            let this = self.clone();
            async move {
                let span = info_span!("prepare", claim_uid = %claim.uid, namespace = %claim.namespace, claim = %claim.name);
                let started = Instant::now();
                let result = this.with_claim_lock(&claim.uid, this.prepare_one(&claim)).instrument(span).await;
                this.metrics.claim_prepared(result.is_ok(), started.elapsed());
                if let Err(error) = &result {
                    warn!(%error, "prepare failed");
                }
                (claim, result)
            }
        });
        futures::future::join_all(calls).await
    }

    /// Unprepares every claim in parallel; unknown or already unprepared claims succeed.
    pub async fn unprepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<(), ClaimError>)> {
        let calls = claims.into_iter().map(|claim| {
            let this = self.clone();
            async move {
                let span = info_span!("unprepare", claim_uid = %claim.uid, namespace = %claim.namespace, claim = %claim.name);
                let started = Instant::now();
                let result = this.with_claim_lock(&claim.uid, this.unprepare_one(&claim)).instrument(span).await;
                this.metrics.claim_unprepared(result.is_ok(), started.elapsed());
                if let Err(error) = &result {
                    warn!(%error, "unprepare failed");
                }
                (claim, result)
            }
        });
        futures::future::join_all(calls).await
    }

    /// Where the CDI spec of a claim lives.
    pub fn cdi_spec_path(&self, claim_uid: &str) -> std::path::PathBuf {
        self.cdi.spec_path(claim_uid)
    }

    /// Claims currently prepared (completed), by UID.
    pub fn prepared_claims(&self) -> BTreeMap<String, ClaimRecord> {
        lock(&self.state)
            .data
            .claims
            .iter()
            .filter(|(_, record)| record.state == ClaimState::Completed)
            .map(|(uid, record)| (uid.clone(), record.clone()))
            .collect()
    }

    async fn prepare_one(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        check_ref(claim)?;
        if let Some(record) = lock(&self.state).data.claims.get(&claim.uid) {
            if record.state == ClaimState::Completed {
                return Ok(record.devices.clone());
            }
        }
        if let Some(devices) = self.adopted_devices(&claim.uid) {
            return Ok(devices);
        }
        let fetched = self.fetch_within_budget(claim).await?;
        let inventory = self.inventory.borrow().clone();
        let mut devices = self.allocated_devices(claim, &fetched.claim, &inventory)?;
        let channel = self.channel_request(claim, &fetched, &devices, &inventory)?;
        match &channel {
            Some(request) => Self::apply_allocation_mode(request, &mut devices),
            None => self.resolve_sharing(claim, &fetched, &inventory, &mut devices)?,
        }

        self.reserve(claim, &inventory, &devices)?;
        // No `started` record on disk: whatever reaches the node before the `completed` record is
        // cleaned up after a crash all the same, because recovery removes every spec, MPS daemon and
        // recorded (dynamic) MIG device that no completed claim owns.
        let made = match &channel {
            Some(request) => {
                self.make_channel(claim, &inventory, request, &devices)
                    .await
            }
            None => self.make_devices(claim, &inventory, &mut devices).await,
        };
        if let Err(error) = made {
            self.roll_back(claim, &devices).await;
            return Err(error);
        }

        self.complete(claim, &devices);
        if let Err(error) = self.persist(claim).await {
            self.roll_back(claim, &devices).await;
            return Err(error);
        }
        if devices
            .iter()
            .any(|d| d.mig.as_ref().is_some_and(|m| m.created))
        {
            tokio::spawn(mig::report_status(
                self.client.clone(),
                self.driver.clone(),
                claim.clone(),
                devices.clone(),
            ));
        }
        info!(devices = ?devices.iter().map(|d| &d.device).collect::<Vec<_>>(), "claim prepared");
        Ok(devices)
    }

    /// Creates (or finds) the claim's MIG devices, sets the GPUs' sharing modes and starts the claim's
    /// MPS daemon, then writes its CDI spec, which names them.
    async fn make_devices(
        &self,
        claim: &ClaimRef,
        inventory: &Arc<Inventory>,
        devices: &mut [PreparedDevice],
    ) -> Result<(), ClaimError> {
        let mig_mode = *self.mig_mode.borrow();
        self.prepare_mig_devices(claim, inventory, mig_mode, devices)
            .await
            .map_err(|(device, reason)| ClaimError::Mig {
                claim: claim.to_string(),
                device,
                reason,
            })?;
        self.sync_gpu_modes(claim, inventory, devices, None)
            .await
            .map_err(|reason| ClaimError::Sharing {
                claim: claim.to_string(),
                reason,
            })?;
        let mps = self.start_mps(claim, devices, inventory).await?;
        let mps_edits =
            match mps {
                Some(record) => Some(self.mps.container_edits(&record).map_err(|error| {
                    ClaimError::Sharing {
                        claim: claim.to_string(),
                        reason: error.to_string(),
                    }
                })?),
                None => None,
            };
        for device in devices.iter_mut() {
            self.driver_edits.reference_toolkit(inventory, device);
        }
        // Written in place on this worker, like every file on the prepare path: without fsync a
        // write only reaches the page cache, which costs less than a hand-off to a blocking thread.
        write_spec_with(
            &self.cdi,
            &claim.uid,
            devices,
            inventory,
            &self.driver_edits,
            mps_edits.as_ref(),
        )
        .map_err(|source| ClaimError::Cdi {
            claim: claim.to_string(),
            source,
        })
    }

    /// Joins the channel's domain on this node (its daemon ready), records it, writes the CDI spec.
    async fn make_channel(
        &self,
        claim: &ClaimRef,
        inventory: &Arc<Inventory>,
        request: &channels::ChannelRequest,
        devices: &[PreparedDevice],
    ) -> Result<(), ClaimError> {
        let member = self.join_domain(claim, request).await?;
        if let Some(record) = lock(&self.state).data.claims.get_mut(&claim.uid) {
            record.domain = Some(member);
        }
        write_spec_with(
            &self.cdi,
            &claim.uid,
            devices,
            inventory,
            &self.driver_edits,
            None,
        )
        .map_err(|source| ClaimError::Cdi {
            claim: claim.to_string(),
            source,
        })
    }

    async fn unprepare_one(&self, claim: &ClaimRef) -> Result<(), ClaimError> {
        check_ref(claim)?;
        let adopted = lock(&self.state)
            .data
            .nvidia_claims
            .get(&claim.uid)
            .cloned();
        if let Some(adopted) = adopted {
            return self.unprepare_adopted(claim, adopted).await;
        }
        let held = lock(&self.state).data.claims.get(&claim.uid).cloned();
        let known = held.is_some();
        if let Some(record) = held {
            let devices = record.devices.clone();
            // The MPS daemon and MIG devices go first, then the GPUs' sharing modes: if one of them
            // fails the claim stays recorded and the kubelet's retry tries again.
            if let Err(reason) = self.stop_mps(&record).await {
                return Err(ClaimError::Sharing {
                    claim: claim.to_string(),
                    reason,
                });
            }
            if let Some(held) = lock(&self.state).data.claims.get_mut(&claim.uid) {
                held.mps = None;
            }
            self.leave_domain(claim, &record).await?;
            if let Some(reason) = self.destroy_created(&devices).await {
                return Err(ClaimError::Mig {
                    claim: claim.to_string(),
                    device: devices
                        .iter()
                        .find(|d| d.mig.is_some())
                        .map(|d| d.device.clone())
                        .unwrap_or_default(),
                    reason,
                });
            }
            let inventory = self.inventory.borrow().clone();
            if let Err(reason) = self
                .sync_gpu_modes(claim, &inventory, &devices, Some(&claim.uid))
                .await
            {
                return Err(ClaimError::Sharing {
                    claim: claim.to_string(),
                    reason: format!("resetting the GPU: {reason}"),
                });
            }
            self.release(claim);
        } else if lock(&self.state).data.left_in_place.contains(&claim.uid) {
            // A spec a rebuild left in place: the kubelet is done with it, so it goes now.
            self.release(claim);
        }
        // The spec is removed even for a claim we no longer know: an earlier attempt may have
        // forgotten the claim and then failed to remove it. The checkpoint is written after the
        // removal, and a crash between them converges (a kept claim's missing spec is written again
        // for the kubelet's retry).
        self.cdi
            .remove_claim_spec(&claim.uid)
            .map_err(|source| ClaimError::Cdi {
                claim: claim.to_string(),
                source,
            })?;
        self.persist(claim).await?;
        if known {
            info!("claim unprepared");
        }
        Ok(())
    }

    /// Undoes a prepare that failed half way: MIG devices it created destroyed, spec removed, devices
    /// freed, checkpoint updated. Failures here are logged; the restart recovery finishes the job if
    /// the plugin dies meanwhile.
    async fn roll_back(&self, claim: &ClaimRef, devices: &[PreparedDevice]) {
        let held = lock(&self.state).data.claims.get(&claim.uid).cloned();
        if let Some(record) = held {
            if let Err(error) = self.stop_mps(&record).await {
                warn!(%error, "stopping the MPS daemon during roll-back");
            }
        }
        self.destroy_created(devices).await;
        let inventory = self.inventory.borrow().clone();
        if let Err(error) = self
            .sync_gpu_modes(claim, &inventory, devices, Some(&claim.uid))
            .await
        {
            warn!(%error, "resetting the GPU's sharing mode during roll-back");
        }
        if let Err(error) = self.cdi.remove_claim_spec(&claim.uid) {
            warn!(%error, "removing CDI spec during roll-back");
        }
        self.release(claim);
        if let Err(error) = self.persist(claim).await {
            warn!(%error, "writing checkpoint during roll-back");
        }
    }
}

fn check_ref(claim: &ClaimRef) -> Result<(), ClaimError> {
    names::check_uid(&claim.uid)
        .and_then(|_| names::check_namespace(&claim.namespace))
        .and_then(|_| names::check_claim_name(&claim.name))
        .map_err(|reason| ClaimError::Invalid {
            // The parts may be garbage: show them through Debug so control characters stay visible.
            claim: format!(
                "{:?}/{:?} ({:?})",
                names::truncated(&claim.namespace),
                names::truncated(&claim.name),
                names::truncated(&claim.uid)
            ),
            reason,
        })
}

fn internal(claim: &str, error: impl std::fmt::Display) -> ClaimError {
    ClaimError::Internal {
        claim: claim.to_string(),
        reason: error.to_string(),
    }
}

/// The checkpoint's place: beside the DRA socket, in the plugin's own directory; under NVIDIA's
/// driver name not at NVIDIA's `checkpoint.json` ([`nvidia_checkpoint`]).
pub fn checkpoint_path(plugin_dir: &Path, driver: &str) -> std::path::PathBuf {
    plugin_dir.join(nvidia_checkpoint::checkpoint_file_name(driver))
}
