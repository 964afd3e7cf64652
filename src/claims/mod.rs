//! Prepare and unprepare: what happens when the kubelet calls NodePrepareResources for a claim.
//! Read top to bottom: validate the claim reference → fetch the ResourceClaim → take this driver's
//! results for this node's pool → reserve the devices (exclusive, in memory) → make MIG devices, GPU
//! sharing modes, the MPS daemon or the domain membership, and the CDI spec → checkpoint `completed` →
//! answer. Each claim's record moves through the phases of `lifecycle.rs`, which writes every thing
//! made on the node into the record before it is made and undoes a claim from the record alone.
//! Calls for different claims run in parallel; calls for one claim are serialised by a per-claim
//! lock, and each runs in a task of its own, so a call the kubelet cancels still finishes.
//!
//! Nothing on the path is fsynced. A record in the page cache survives a crash of the process, and
//! recovery rolls back every claim whose record is not `completed` and removes every CDI spec, MPS
//! daemon and recorded (dynamic) MIG device that no completed claim owns. A power cut is a reboot,
//! after which the kubelet prepares every claim again and recovery checks each record of the earlier
//! boot against the API server first (`recovery.rs`).

mod allocation;
mod channels;
pub mod checkpoint;
pub mod configs;
pub mod daemon_pod;
pub mod device_metadata;
mod edits;
mod error;
mod gpu_modes;
pub mod lifecycle;
mod mig;
mod mig_records;
pub mod mps;
mod mps_claims;
pub mod names;
mod nvidia_adoption;
pub mod nvidia_checkpoint;
mod reboot;
mod rebuild;
mod recovery;
mod sharing;
mod state;
pub mod vfio;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{info_span, warn, Instrument};

pub use allocation::allocation_results;
pub use checkpoint::{ClaimRecord, ClaimState, PreparedDevice, PreparedMig};
pub use edits::{container_edits, DriverEdits};
pub use error::ClaimError;
pub use gpu_modes::{MIG_TIMEOUT, SHARING_TIMEOUT};
pub use lifecycle::{Phase, Step, CALL_BUDGET};
pub use nvidia_adoption::{Adoption, DEFAULT_NVIDIA_NAMESPACE};
pub use recovery::{
    recovery_bound, MPS_RESTORE_BOUND, MPS_RESTORE_PARALLELISM, MPS_SWEEP_BOUND,
    NVIDIA_MPS_STOP_BOUND, RECOVERY_LOCAL_WORK,
};

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
    /// What the node shares among claims and how it is enforced (`None`: nothing shared); the
    /// admin's policy may change it while the plugin runs.
    pub shares: watch::Receiver<Option<crate::devices::Shares>>,
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
    /// How long one MIG create or destroy may take before the GPU counts as stuck ([`MIG_TIMEOUT`]).
    pub mig_timeout: Duration,
    /// Under NVIDIA's driver name: where NVIDIA's plugin ran its MPS daemons' Deployments.
    pub nvidia_namespace: String,
    /// This node's side of ComputeDomains; `None` refuses claims for IMEX channels.
    pub domains: Option<Arc<crate::domains::membership::Membership>>,
    /// How long a kubelet call waits for its claims' work before it answers ([`CALL_BUDGET`]).
    pub call_budget: Duration,
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
    shares: watch::Receiver<Option<crate::devices::Shares>>,
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
    /// Operations on each GPU (sharing-mode changes, MIG creates and destroys), one at a time per
    /// GPU and bounded in time, with the sharing mode last set.
    gpu_modes: gpu_modes::GpuOps,
    nvidia_namespace: String,
    domains: Option<Arc<crate::domains::membership::Membership>>,
    /// The API groups of ComputeDomains this driver name serves.
    domain_groups: Vec<crate::domains::api::DomainGroup>,
    call_budget: Duration,
    /// The GPUs prepared claims hold as GPUs and as passthrough devices (`vfio.rs`).
    held_ways: watch::Sender<crate::devices::passthrough::HeldWays>,
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
            shares: config.shares,
            driver_edits: config.driver_edits,
            startup_api_timeout: config.startup_api_timeout,
            claim_read_budget: config.claim_read_budget,
            inventory,
            metrics: metrics.clone(),
            state: Mutex::new(State {
                data: CheckpointData::default(),
                revision: 0,
            }),
            persisted: tokio::sync::Mutex::new(0),
            claim_locks: Mutex::new(HashMap::new()),
            mps: Arc::new(config.mps),
            gpu_modes: gpu_modes::GpuOps::new(config.sharing_timeout, config.mig_timeout, metrics),
            nvidia_namespace: config.nvidia_namespace,
            domain_groups: crate::domains::api::DomainGroup::served_by(&config.driver_name),
            domains: config.domains,
            call_budget: config.call_budget,
            held_ways: watch::channel(Default::default()).0,
        });
        let recovery = preparer.recover_at_start().await?;
        preparer.note_held_ways();
        Ok((preparer, recovery))
    }

    /// Prepares every claim in parallel; one result per claim, in order. Each claim's work runs in
    /// a task of its own that finishes even when this call is dropped (the kubelet cancelled it), and
    /// a failed prepare is rolled back after its answer went out; the call answers within the call
    /// budget whatever the work does.
    pub async fn prepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<Vec<PreparedDevice>, ClaimError>)> {
        let calls = claims.into_iter().map(|claim| {
            let this = self.clone();
            async move {
                let (answer, answered) = tokio::sync::oneshot::channel();
                let (worker, uid) = (this.clone(), claim.clone());
                let span = info_span!("prepare", claim_uid = %claim.uid, namespace = %claim.namespace, claim = %claim.name);
                tokio::spawn(
                    async move {
                        let started = Instant::now();
                        let work = async {
                            match worker.prepare_one(&uid).await {
                                Ok(devices) => {
                                    worker.metrics.claim_prepared(true, started.elapsed());
                                    let _ = answer.send(Ok(devices));
                                }
                                Err(failed) => {
                                    worker.metrics.claim_prepared(false, started.elapsed());
                                    warn!(error = %failed.error, "prepare failed");
                                    let _ = answer.send(Err(failed.error));
                                    if failed.roll_back {
                                        // Logged there; the record stays for the next call.
                                        let _ = worker.roll_back(&uid).await;
                                    }
                                }
                            }
                        };
                        if worker
                            .with_claim_lock(&uid.uid, worker.call_budget, work)
                            .await
                            .is_none()
                        {
                            warn!("an earlier call for the claim is still running; prepare not started");
                        }
                    }
                    .instrument(span),
                );
                let result = this.answer_within_budget(&claim, "prepare", answered).await;
                (claim, result)
            }
        });
        futures::future::join_all(calls).await
    }

    /// Unprepares every claim in parallel; unknown or already unprepared claims succeed. Like
    /// [`prepare`](Self::prepare), each claim's work finishes even when the call is dropped.
    pub async fn unprepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<(), ClaimError>)> {
        let calls = claims.into_iter().map(|claim| {
            let this = self.clone();
            async move {
                let (answer, answered) = tokio::sync::oneshot::channel();
                let (worker, uid) = (this.clone(), claim.clone());
                let span = info_span!("unprepare", claim_uid = %claim.uid, namespace = %claim.namespace, claim = %claim.name);
                tokio::spawn(
                    async move {
                        let started = Instant::now();
                        let work = async {
                            let result = worker.unprepare_one(&uid).await;
                            worker
                                .metrics
                                .claim_unprepared(result.is_ok(), started.elapsed());
                            if let Err(error) = &result {
                                warn!(%error, "unprepare failed");
                            }
                            let _ = answer.send(result);
                        };
                        if worker
                            .with_claim_lock(&uid.uid, worker.call_budget, work)
                            .await
                            .is_none()
                        {
                            warn!("an earlier call for the claim is still running; unprepare not started");
                        }
                    }
                    .instrument(span),
                );
                let result = this
                    .answer_within_budget(&claim, "unprepare", answered)
                    .await;
                (claim, result)
            }
        });
        futures::future::join_all(calls).await
    }

    /// The claim task's answer, or why there is none within the call budget: the work (or an
    /// earlier call's, which holds the claim's lock) goes on, and the kubelet's retry gets its outcome.
    async fn answer_within_budget<T>(
        &self,
        claim: &ClaimRef,
        what: &'static str,
        answered: tokio::sync::oneshot::Receiver<Result<T, ClaimError>>,
    ) -> Result<T, ClaimError> {
        match tokio::time::timeout(self.call_budget, answered).await {
            Ok(Ok(result)) => result,
            // The task ended without answering: it waited for the claim's lock in vain.
            Ok(Err(_)) | Err(_) => Err(ClaimError::StillRunning {
                claim: claim.to_string(),
                what,
                waited: self.call_budget,
                phase: self
                    .phase_of(&claim.uid)
                    .map_or("none".to_string(), |phase| phase.to_string()),
            }),
        }
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
}

pub(super) fn check_ref(claim: &ClaimRef) -> Result<(), ClaimError> {
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
