//! A claim's life on this node, as one state machine. Its record (`ClaimRecord`, in the checkpoint)
//! moves through the phases below, and each thing prepare makes on the node is written into the record
//! before it is made, so that an unprepare, a roll-back, a cancelled call and a restart all undo the
//! claim from the record alone.
//!
//! | phase | what may exist on the node, as the record names it | what undo does |
//! |---|---|---|
//! | `reserved` | nothing: the devices are held against other claims | forget the claim |
//! | `migDevices` | MIG devices being made: each is in the MIG journal (`mig_records.rs`) before its create, and in the claim's devices once made | destroy what the claim made |
//! | `gpuModes` | GPU sharing modes: each is in the checkpoint (`gpu_modes`) before it is set | set each GPU to what the other claims need |
//! | `mpsDaemon` | the claim's tmpfs and MPS daemon Pod: `mps` is written before either is made | delete the Pod, unmount, remove the directories |
//! | `vfioBinding` | the claim's IOMMU groups bound to vfio-pci: `vfio` names every function and its driver before the first bind | give each function back to its driver |
//! | `domain` | this node's entry in a ComputeDomain and its IMEX daemon: `domain` is written before the join | leave, unless another claim here holds the domain |
//! | `cdiSpec` | the claim's CDI spec, named by the claim's UID | remove it |
//! | `completed` | all of the above, as recorded | all of the above, last made first |
//! | `unpreparing` | what is left of the above while undo runs | the same again: each step is idempotent |
//!
//! A call's work runs in a task of its own that outlives the call (`Preparer::prepare`): when the
//! kubelet gives up at its deadline or the pod goes, the work finishes in the background, under the
//! claim's lock, and the next call for the claim finds its outcome (a completed record, or one rolled
//! back). A call answers within [`CALL_BUDGET`] in any case. After a crash, recovery rolls back every
//! claim whose record is not `completed` from what the record names, and the start-up sweeps catch
//! what a crash between recording and making left unrecorded (`recovery.rs`).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::edits::write_spec_with;
use super::state::lock;
use super::{channels, ClaimError, ClaimRecord, ClaimRef, ClaimState, PreparedDevice, Preparer};
use crate::gpu::Inventory;

/// How long a NodePrepareResources or NodeUnprepareResources call waits for its claims' work before
/// it answers: the kubelet cancels the call after 45 s (its DRA client's `defaultClientCallTimeout`),
/// so the answer must leave before that. Work still running then goes on in the background; the kubelet's retry
/// gets its outcome.
pub const CALL_BUDGET: Duration = Duration::from_secs(40);

/// Where a claim's record is in its life (see the module's table).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Phase {
    #[default]
    Reserved,
    MigDevices,
    GpuModes,
    MpsDaemon,
    VfioBinding,
    Domain,
    CdiSpec,
    Completed,
    Unpreparing,
    /// A phase a newer release added; recovery rolls the claim back (undo reads only what the
    /// record names). Never written.
    #[serde(other)]
    Unknown,
}

impl Phase {
    /// Whether the claim is fully prepared as recorded.
    pub fn is_completed(self) -> bool {
        self == Phase::Completed
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Reserved => "reserved",
            Phase::MigDevices => "migDevices",
            Phase::GpuModes => "gpuModes",
            Phase::MpsDaemon => "mpsDaemon",
            Phase::VfioBinding => "vfioBinding",
            Phase::Domain => "domain",
            Phase::CdiSpec => "cdiSpec",
            Phase::Completed => "completed",
            Phase::Unpreparing => "unpreparing",
            Phase::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A point in a prepare right after something was made on the node and before the record says the
/// step finished: where a cancelled call or a crash hurts most. Test doubles can hold a claim's
/// prepare at each ([`holds`]); in a node build they cost nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    MigCreate,
    ModeChange,
    TmpfsMount,
    DaemonPodStart,
    DomainJoin,
    SpecWrite,
    VfioBind,
}

impl Step {
    pub const ALL: [Step; 7] = [
        Step::MigCreate,
        Step::ModeChange,
        Step::TmpfsMount,
        Step::DaemonPodStart,
        Step::DomainJoin,
        Step::SpecWrite,
        Step::VfioBind,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Step::MigCreate => "mig-create",
            Step::ModeChange => "mode-change",
            Step::TmpfsMount => "tmpfs-mount",
            Step::DaemonPodStart => "daemon-pod-start",
            Step::DomainJoin => "domain-join",
            Step::SpecWrite => "spec-write",
            Step::VfioBind => "vfio-bind",
        }
    }

    pub fn parse(name: &str) -> Option<Step> {
        Step::ALL.into_iter().find(|step| step.as_str() == name)
    }
}

/// Marks that `claim_uid`'s prepare just did `step`; a test double may hold it here.
pub(crate) async fn reached(claim_uid: &str, step: Step) {
    #[cfg(feature = "doubles")]
    holds::wait_if_held(claim_uid, step).await;
    #[cfg(not(feature = "doubles"))]
    let _ = (claim_uid, step);
}

/// What a prepare that failed leaves for its task to do after the answer went out.
pub(super) struct Failed {
    pub error: ClaimError,
    /// The record names things made on the node: roll them back.
    pub roll_back: bool,
}

impl From<ClaimError> for Failed {
    fn from(error: ClaimError) -> Self {
        Failed {
            error,
            roll_back: false,
        }
    }
}

impl Preparer {
    /// Prepares one claim: reads it, reserves its devices, then makes what they need, phase by
    /// phase, each recorded before it is made. On failure the caller answers first and then rolls
    /// back (`Failed::roll_back`), so a slow roll-back never delays the kubelet's answer.
    pub(super) async fn prepare_one(
        &self,
        claim: &ClaimRef,
    ) -> Result<Vec<PreparedDevice>, Failed> {
        super::check_ref(claim)?;
        let earlier = lock(&self.state).data.claims.get(&claim.uid).cloned();
        if let Some(record) = earlier {
            if record.state == ClaimState::Completed && record.phase != Phase::Unpreparing {
                return Ok(record.devices.clone());
            }
            // An earlier attempt whose roll-back (or an unprepare) did not finish: what it recorded
            // is undone first, so the new attempt's record starts from nothing made; while that
            // cannot be done (a GPU is stuck), the claim fails with the reason.
            self.roll_back(claim).await?;
        }
        if let Some(devices) = self.adopted_devices(&claim.uid) {
            return Ok(devices);
        }
        let fetched = self.fetch_within_budget(claim).await?;
        let inventory = self.inventory.borrow().clone();
        let mut devices = self.allocated_devices(claim, &fetched.claim, &inventory)?;
        let channel = self.channel_request(claim, &fetched, &devices, &inventory)?;
        let vfio = self.vfio_request(claim, &fetched, &devices)?;
        match (&channel, vfio) {
            (Some(request), _) => Self::apply_allocation_mode(request, &mut devices),
            (None, Some(_)) => {}
            (None, None) => self.resolve_sharing(claim, &fetched, &inventory, &mut devices)?,
        }

        self.reserve(claim, &inventory, &devices)?;
        let made = match (&channel, vfio) {
            (Some(request), _) => {
                self.make_channel(claim, &inventory, request, &devices)
                    .await
            }
            (None, Some(api_device)) => {
                self.make_vfio(claim, &inventory, api_device, &devices, &fetched.claim)
                    .await
            }
            (None, None) => self.make_devices(claim, &inventory, &mut devices).await,
        };
        let failed = |error| Failed {
            error,
            roll_back: true,
        };
        made.map_err(failed)?;
        self.complete(claim, &devices);
        self.persist(claim).await.map_err(failed)?;
        if devices
            .iter()
            .any(|d| d.mig.as_ref().is_some_and(|m| m.created))
        {
            tokio::spawn(super::mig::report_status(
                self.client.clone(),
                self.driver.clone(),
                claim.clone(),
                devices.clone(),
            ));
        }
        info!(devices = ?devices.iter().map(|d| &d.device).collect::<Vec<_>>(), "claim prepared");
        Ok(devices)
    }

    /// MIG devices, then the GPUs' sharing modes, then the claim's MPS daemon, then the CDI spec,
    /// which names them all.
    async fn make_devices(
        &self,
        claim: &ClaimRef,
        inventory: &Arc<Inventory>,
        devices: &mut [PreparedDevice],
    ) -> Result<(), ClaimError> {
        let mig_mode = *self.mig_mode.borrow();
        if devices
            .iter()
            .any(|d| super::mig::resolve(inventory, &d.device).is_ok_and(|t| t.is_some()))
        {
            self.enter(claim, Phase::MigDevices);
            let made = self
                .prepare_mig_devices(claim, inventory, mig_mode, devices)
                .await;
            // What was made is the record's before anything else happens (the failure path
            // destroyed what it made and cleared it).
            self.note_devices(claim, devices);
            made.map_err(|(device, reason)| ClaimError::Mig {
                claim: claim.to_string(),
                device,
                reason,
            })?;
            if devices.iter().any(|d| d.mig.is_some()) {
                reached(&claim.uid, Step::MigCreate).await;
            }
        }
        self.enter(claim, Phase::GpuModes);
        self.sync_gpu_modes(claim, inventory, devices, None)
            .await
            .map_err(|reason| ClaimError::Sharing {
                claim: claim.to_string(),
                reason,
            })?;
        if devices.iter().any(|d| !d.sharing.is_exclusive()) {
            reached(&claim.uid, Step::ModeChange).await;
        }
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
        self.write_spec(claim, devices, inventory, mps_edits.as_ref())
            .await
    }

    /// The last phase: the claim's CDI spec, which names everything made before it. Written in
    /// place on this worker, like every file on the prepare path: without fsync a write only reaches
    /// the page cache, which costs less than a hand-off to a blocking thread.
    pub(super) async fn write_spec(
        &self,
        claim: &ClaimRef,
        devices: &[PreparedDevice],
        inventory: &Inventory,
        mps_edits: Option<&crate::cdi::ContainerEdits>,
    ) -> Result<(), ClaimError> {
        self.enter(claim, Phase::CdiSpec);
        write_spec_with(
            &self.cdi,
            &claim.uid,
            devices,
            inventory,
            &self.driver_edits,
            mps_edits,
        )
        .map_err(|source| ClaimError::Cdi {
            claim: claim.to_string(),
            source,
        })?;
        reached(&claim.uid, Step::SpecWrite).await;
        Ok(())
    }

    /// Records the channel's domain, joins it on this node (its daemon ready), writes the CDI spec.
    async fn make_channel(
        &self,
        claim: &ClaimRef,
        inventory: &Arc<Inventory>,
        request: &channels::ChannelRequest,
        devices: &[PreparedDevice],
    ) -> Result<(), ClaimError> {
        let member = self.resolve_domain(claim, request).await?;
        {
            let mut state = lock(&self.state);
            if let Some(record) = state.data.claims.get_mut(&claim.uid) {
                record.domain = Some(member.clone());
                record.phase = Phase::Domain;
            }
            state.revision += 1;
        }
        // On file before the node's status entry or daemon exist, so a crash leaves a record that
        // says which domain to leave.
        self.persist(claim).await?;
        self.join_domain(claim, &member).await?;
        reached(&claim.uid, Step::DomainJoin).await;
        self.write_spec(claim, devices, inventory, None).await
    }

    /// Unprepares one claim from its record alone; an unknown or already unprepared claim succeeds.
    pub(super) async fn unprepare_one(&self, claim: &ClaimRef) -> Result<(), ClaimError> {
        super::check_ref(claim)?;
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
            if record.names_more_than_a_spec() {
                // On file, so a crash mid-way rolls the claim back at start instead of restoring it.
                self.enter(claim, Phase::Unpreparing);
                self.persist(claim).await?;
            }
            self.undo(claim, &record).await?;
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

    /// Undoes a prepare that failed (or ran out of time) from what its record names: everything
    /// made destroyed, spec removed, devices freed, checkpoint updated. A failure is logged and
    /// returned, and the record kept, so the kubelet's next prepare or unprepare (or the start-up
    /// recovery) finishes the job.
    pub(super) async fn roll_back(&self, claim: &ClaimRef) -> Result<(), ClaimError> {
        let held = lock(&self.state).data.claims.get(&claim.uid).cloned();
        let Some(record) = held else {
            return Ok(());
        };
        if let Err(error) = self.undo(claim, &record).await {
            warn!(%error, phase = %record.phase, "rolling back the failed prepare; the claim stays recorded for the next prepare or unprepare");
            if let Err(error) = self.persist(claim).await {
                warn!(%error, "writing checkpoint during roll-back");
            }
            return Err(error);
        }
        if let Err(error) = self.cdi.remove_claim_spec(&claim.uid) {
            warn!(%error, "removing CDI spec during roll-back");
        }
        self.release(claim);
        if let Err(error) = self.persist(claim).await {
            warn!(%error, "writing checkpoint during roll-back");
        }
        info!(phase = %record.phase, "failed prepare rolled back");
        Ok(())
    }

    /// Undoes what `record` names, last made first: the MPS daemon, the domain membership, the MIG
    /// devices the claim made, the GPUs' sharing modes. Each part that is undone leaves the record
    /// at once; the first failure stops it, and the rest stays recorded for the next try. The
    /// spec and the record itself are the caller's.
    async fn undo(&self, claim: &ClaimRef, record: &ClaimRecord) -> Result<(), ClaimError> {
        self.unbind_vfio(claim, record).await?;
        if let Err(reason) = self.stop_mps(record).await {
            return Err(ClaimError::Sharing {
                claim: claim.to_string(),
                reason,
            });
        }
        self.update_record(claim, |held| held.mps = None);
        self.leave_domain(claim, record).await?;
        self.update_record(claim, |held| held.domain = None);
        let devices = &record.devices;
        if let Some(reason) = self.destroy_created(&claim.uid, devices).await {
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
        self.update_record(claim, |held| {
            for device in &mut held.devices {
                if device.mig.as_ref().is_some_and(|m| m.created) {
                    device.mig = None;
                }
            }
        });
        let inventory = self.inventory.borrow().clone();
        if let Err(reason) = self
            .sync_gpu_modes(claim, &inventory, devices, Some(&claim.uid))
            .await
        {
            return Err(ClaimError::Sharing {
                claim: claim.to_string(),
                reason: format!("resetting the GPU: {reason}"),
            });
        }
        Ok(())
    }

    /// Moves the claim's record to `phase` (in memory: the steps that make something persist it
    /// themselves, before they make it).
    pub(super) fn enter(&self, claim: &ClaimRef, phase: Phase) {
        self.update_record(claim, |record| record.phase = phase);
    }

    /// The claim's devices as prepared so far, into its record (in memory).
    fn note_devices(&self, claim: &ClaimRef, devices: &[PreparedDevice]) {
        self.update_record(claim, |record| record.devices = devices.to_vec());
    }

    pub(super) fn update_record(&self, claim: &ClaimRef, change: impl FnOnce(&mut ClaimRecord)) {
        let mut state = lock(&self.state);
        if let Some(record) = state.data.claims.get_mut(&claim.uid) {
            change(record);
            state.revision += 1;
        }
    }

    /// The phase of the claim's record, if it has one.
    pub fn phase_of(&self, claim_uid: &str) -> Option<Phase> {
        lock(&self.state)
            .data
            .claims
            .get(claim_uid)
            .map(|record| record.phase)
    }
}

impl ClaimRecord {
    /// Whether undoing the claim does more than remove its spec: an MPS daemon, a domain, a MIG
    /// device it made or a GPU it may have set to a sharing mode.
    pub fn names_more_than_a_spec(&self) -> bool {
        self.mps.is_some()
            || self.domain.is_some()
            || self.vfio.is_some()
            || self
                .devices
                .iter()
                .any(|d| d.mig.as_ref().is_some_and(|m| m.created) || !d.sharing.is_exclusive())
    }
}

/// Holds for test doubles: a test holds a claim's prepare at a [`Step`], sees it get there, cancels
/// the kubelet's call or kills the plugin, and lets it go on. A plugin process started with
/// `GPU_DRA_PAUSE_AT=<step>` and `GPU_DRA_PAUSE_MARKER=<file>` writes the file when any claim's
/// prepare reaches the step and then waits there for ever, for a test that kills it.
#[cfg(feature = "doubles")]
pub mod holds {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use tokio::sync::Notify;

    use super::Step;

    #[derive(Default)]
    struct Hold {
        reached: Notify,
        released: Notify,
        state: Mutex<(bool, bool)>,
    }

    type Holds = Mutex<HashMap<(String, Step), Arc<Hold>>>;

    fn holds() -> &'static Holds {
        static HOLDS: OnceLock<Holds> = OnceLock::new();
        HOLDS.get_or_init(Default::default)
    }

    /// A claim's prepare held at one step, until [`Held::release`] (or drop).
    pub struct Held {
        key: (String, Step),
        hold: Arc<Hold>,
    }

    /// Holds `claim_uid`'s prepare once it reaches `step`.
    pub fn hold(claim_uid: &str, step: Step) -> Held {
        let key = (claim_uid.to_string(), step);
        let hold = Arc::new(Hold::default());
        super::lock(holds()).insert(key.clone(), hold.clone());
        Held { key, hold }
    }

    impl Held {
        /// Waits until the prepare is at the step.
        pub async fn reached(&self) {
            loop {
                let notified = self.hold.reached.notified();
                if super::lock(&self.hold.state).0 {
                    return;
                }
                notified.await;
            }
        }

        /// Lets the prepare go on (and every later one of the claim pass the step).
        pub fn release(&self) {
            super::lock(holds()).remove(&self.key);
            super::lock(&self.hold.state).1 = true;
            self.hold.released.notify_waiters();
        }
    }

    impl Drop for Held {
        fn drop(&mut self) {
            self.release();
        }
    }

    pub(super) async fn wait_if_held(claim_uid: &str, step: Step) {
        if let Ok(wanted) = std::env::var("GPU_DRA_PAUSE_AT") {
            if Step::parse(&wanted) == Some(step) {
                if let Ok(marker) = std::env::var("GPU_DRA_PAUSE_MARKER") {
                    let _ = std::fs::write(marker, claim_uid);
                }
                std::future::pending::<()>().await;
            }
        }
        let hold = super::lock(holds())
            .get(&(claim_uid.to_string(), step))
            .cloned();
        let Some(hold) = hold else {
            return;
        };
        super::lock(&hold.state).0 = true;
        hold.reached.notify_waiters();
        loop {
            let released = hold.released.notified();
            if super::lock(&hold.state).1 {
                return;
            }
            released.await;
        }
    }
}
