//! Start-up recovery: converge the node's files and MIG devices with the checkpoint after a crash or a
//! reboot. A checkpoint this build cannot use (corrupt, unreadable, a newer format) is set aside as
//! `<checkpoint>.corrupt-<time>` and rebuilt from the CDI specs on disk and the claims in the API
//! server (`rebuild.rs`); nothing is deleted on its account, so a downgrade never costs a running pod.
//! A missing checkpoint with CDI specs of this driver on disk (deleted by hand, or a changed
//! `--kubelet-plugins-dir`) is rebuilt the same way. Specs of another driver name are never listed,
//! so never touched; MIG devices are destroyed only where the plugin recorded making them.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tracing::{info, warn};

use super::checkpoint::{self, CheckpointData, CheckpointError};
use super::edits::write_spec_with;
use super::lifecycle::Phase;
use super::{
    describe, internal, lock, mig, mig_records, CheckpointSetAside, ClaimError, ClaimRecord,
    ClaimState, Preparer, Recovery,
};
use crate::devices::MigMode;
use crate::gpu::Inventory;

/// How many MPS daemons recovery restores (ours) or stops (NVIDIA's Deployments, under its driver
/// name) at once. Each waits seconds on the API server and the kubelet (a Pod deleted, created,
/// scheduled and Ready) and hardly uses this node, so side by side a node with many MPS claims
/// recovers in about the time of one; eight keeps the burst the API server sees (a create, then a GET
/// every 200 ms, per daemon) small beside what a kubelet sends when it starts a node's pods.
pub const MPS_RESTORE_PARALLELISM: usize = 8;

/// How long recovery waits for the MPS daemons of all kept claims together. One restart takes at most
/// 55 s (its old Pod gone: 25 s, the new one Ready: 30 s) and usually a few: this allows two rounds of
/// the slowest, or dozens of daemons that start as they should. A daemon not back by then is reported
/// and forgotten, and its claim stays prepared, as when its restart fails.
pub const MPS_RESTORE_BOUND: Duration = Duration::from_secs(120);

/// How long recovery spends stopping the MPS daemons of claims no longer prepared (`sweep_mps`, one
/// after another, each up to 25 s for its Pod to go); what is left then is stopped at the next start.
pub const MPS_SWEEP_BOUND: Duration = Duration::from_secs(60);

/// How long recovery spends stopping NVIDIA's MPS Deployments of claims taken over from its plugin
/// whose CDI spec a reboot removed (each waits up to 20 s for its Deployment to go), side by side.
pub const NVIDIA_MPS_STOP_BOUND: Duration = Duration::from_secs(30);

/// Recovery's work on the node itself, which no timeout bounds: MIG devices made again after a reboot
/// (about a second each), CDI specs and the checkpoint written, NVML read. Seconds in practice.
pub const RECOVERY_LOCAL_WORK: Duration = Duration::from_secs(60);

/// The longest a recovery at start takes, from the bounds of its steps, run one after another:
/// the records of an earlier boot checked with the API server (all at once, within the start-up API
/// timeout), a set-aside checkpoint rebuilt from one LIST of claims (the same), NVIDIA's MPS
/// Deployments stopped, the MPS daemons of kept claims restored, those of claims no longer prepared
/// stopped, every GPU's sharing mode set (side by side: one GPU's lock, then its change, each within
/// the sharing timeout), and the local work.
pub const fn recovery_bound(startup_api_timeout: Duration, sharing_timeout: Duration) -> Duration {
    startup_api_timeout
        .saturating_add(startup_api_timeout)
        .saturating_add(NVIDIA_MPS_STOP_BOUND)
        .saturating_add(MPS_RESTORE_BOUND)
        .saturating_add(MPS_SWEEP_BOUND)
        .saturating_add(sharing_timeout.saturating_mul(2))
        .saturating_add(RECOVERY_LOCAL_WORK)
}

/// Runs `tasks`, at most `parallelism` at a time, until all have ended or `bound` has passed. Returns
/// each task's outcome in the order given; `None` for one that had not ended in time (it is dropped
/// where it was: callers treat that as a failure of that task alone).
pub(super) async fn bounded<T, F: Future<Output = T>>(
    tasks: impl IntoIterator<Item = F>,
    parallelism: usize,
    bound: Duration,
) -> Vec<Option<T>> {
    let numbered: Vec<_> = tasks
        .into_iter()
        .enumerate()
        .map(|(index, task)| async move { (index, task.await) })
        .collect();
    let mut outcomes: Vec<Option<T>> = numbered.iter().map(|_| None).collect();
    let deadline = tokio::time::Instant::now() + bound;
    let mut running = futures::stream::iter(numbered).buffer_unordered(parallelism.max(1));
    while let Ok(Some((index, outcome))) = tokio::time::timeout_at(deadline, running.next()).await {
        outcomes[index] = Some(outcome);
    }
    outcomes
}

impl Preparer {
    /// Loads the checkpoint (or sets it aside and rebuilds it), checks claims in states this build
    /// does not know against the API server, then converges the node with the result.
    pub(super) async fn recover_at_start(self: &Arc<Self>) -> Result<Recovery, ClaimError> {
        let file = self.checkpoint.clone();
        let loaded = tokio::task::spawn_blocking(move || file.load())
            .await
            .map_err(|e| internal("(startup)", e))?;
        let (mut stored, set_aside, missing) = match loaded {
            Ok(Some(stored)) => (stored, None, false),
            Ok(None) => (CheckpointData::default(), None, true),
            Err(error) => (
                CheckpointData::default(),
                Some(self.set_aside(&error)),
                false,
            ),
        };
        let this_boot = checkpoint::current_boot_id();
        let dropped = self
            .check_records_of_an_earlier_boot(&mut stored, &this_boot)
            .await;
        let nvidia = self.adopt_nvidia_claims(&mut stored).await;
        // What only the API server can settle: after a set-aside (or without a checkpoint, where
        // specs exist) every spec on disk; otherwise the claims a newer release recorded in a state
        // this one does not know.
        let mut rebuild = set_aside.is_some();
        let mut specs = Vec::new();
        if set_aside.is_some() || missing {
            let cdi = self.cdi.clone();
            match tokio::task::spawn_blocking(move || cdi.claim_specs()).await {
                Ok(Ok(uids)) => specs = uids,
                Ok(Err(error)) => {
                    warn!(%error, "listing CDI specs to rebuild the checkpoint failed; they are left as they are");
                    rebuild = true;
                }
                Err(error) => return Err(internal("(startup)", error)),
            }
        }
        let rebuilt_without_checkpoint = missing && (rebuild || !specs.is_empty());
        if rebuilt_without_checkpoint {
            rebuild = true;
            warn!(
                path = %self.checkpoint.path().display(),
                specs = specs.len(),
                "no checkpoint, but CDI specs of this driver are on disk (a checkpoint deleted, or --kubelet-plugins-dir changed): rebuilding the prepared claims from them and the API server; no CDI spec or MIG device is removed"
            );
        }
        let to_verify: Vec<String> = if rebuild {
            specs
        } else {
            stored
                .claims
                .iter()
                .filter(|(_, record)| record.state == ClaimState::Unknown)
                .map(|(uid, _)| uid.clone())
                .collect()
        };
        stored
            .claims
            .retain(|_, record| record.state != ClaimState::Unknown);
        if !to_verify.is_empty() {
            let verified = self.verify_claims(&to_verify).await;
            for (uid, record) in verified.kept {
                info!(claim = %describe(&uid, &record), "prepared claim rebuilt from its CDI spec and the API server");
                stored.claims.insert(uid, record);
            }
            for (uid, reason) in verified.left {
                warn!(claim_uid = %uid, %reason, "CDI spec left in place: it cannot be matched to a claim prepared here");
                stored.left_in_place.insert(uid);
            }
        }
        let worker = self.clone();
        let degraded = rebuild;
        let mut recovery =
            tokio::task::spawn_blocking(move || worker.recover(stored, degraded, this_boot))
                .await
                .map_err(|e| internal("(startup)", e))??;
        recovery.checkpoint_set_aside = set_aside;
        recovery.checkpoint_missing =
            rebuilt_without_checkpoint.then(|| self.checkpoint.path().to_path_buf());
        recovery.dropped_after_reboot = dropped;
        recovery.nvidia = nvidia;
        Ok(recovery)
    }

    /// After a reboot, keeps only the completed records the API server confirms (`reboot.rs`) and
    /// returns the UIDs of the others, which are dropped: their specs then go as orphans, and their
    /// devices are free for the kubelet's prepares.
    async fn check_records_of_an_earlier_boot(
        &self,
        stored: &mut CheckpointData,
        this_boot: &str,
    ) -> Vec<String> {
        if !written_in_an_earlier_boot(stored, this_boot) {
            return Vec::new();
        }
        let (completed, others) = std::mem::take(&mut stored.claims)
            .into_iter()
            .partition(|(_, record)| record.state == ClaimState::Completed);
        stored.claims = others;
        let checked = self.check_earlier_boot(completed).await;
        stored.claims.extend(checked.kept);
        checked
            .dropped
            .into_iter()
            .map(|(uid, reason)| {
                info!(claim_uid = %uid, %reason, "record of an earlier boot dropped; the kubelet prepares the claim again if a pod still needs it");
                uid
            })
            .collect()
    }

    /// Moves an unusable checkpoint out of the way (never deleting it) and says so.
    fn set_aside(&self, error: &CheckpointError) -> CheckpointSetAside {
        let moved_to = match crate::fsutil::set_aside(self.checkpoint.path(), "corrupt") {
            Ok(path) => Some(path),
            Err(move_error) => {
                warn!(path = %self.checkpoint.path().display(), error = %move_error, "the unusable checkpoint cannot be moved aside; it is overwritten at the next write");
                None
            }
        };
        self.metrics
            .state_file_set_aside("checkpoint", error.kind());
        warn!(
            %error,
            moved_to = %moved_to.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            "checkpoint cannot be used; set aside. Rebuilding the prepared claims from the CDI specs and the API server; no CDI spec or MIG device is removed"
        );
        CheckpointSetAside {
            kind: error.kind(),
            reason: error.to_string(),
            moved_to,
        }
    }

    /// Converges with `stored`: started claims rolled back, completed ones kept (specs written again
    /// where lost), orphan specs removed and, in dynamic MIG mode, MIG devices the plugin made that
    /// no claim owns destroyed (others are reported and left alone). `degraded` (the checkpoint was
    /// set aside, or missing with specs on disk) removes and destroys nothing: what the rebuild could
    /// not match stays. Specs left in place by an earlier rebuild stay too, as do, while there are
    /// any, all MIG devices.
    pub(super) fn recover(
        &self,
        mut stored: CheckpointData,
        degraded: bool,
        boot_id: String,
    ) -> Result<Recovery, ClaimError> {
        let mut recovery = Recovery {
            rebooted: written_in_an_earlier_boot(&stored, &boot_id),
            ..Default::default()
        };
        let inventory = self.inventory.borrow().clone();
        // MIG configuration does not survive a reboot: no device made in an earlier boot is left.
        let made_before = std::mem::take(&mut stored.mig_devices_made);
        let made_before = if recovery.rebooted {
            Vec::new()
        } else {
            made_before
        };
        // What is on file while MIG devices are made again: the records as loaded, of this boot now.
        let mut journal = CheckpointData {
            boot_id: boot_id.clone(),
            claims: stored.claims.clone(),
            left_in_place: stored.left_in_place.clone(),
            gpu_modes: stored.gpu_modes.clone(),
            mig_devices_made: made_before.clone(),
            nvidia_claims: stored.nvidia_claims.clone(),
            nvidia_claims_done: stored.nvidia_claims_done.clone(),
        };
        let mut data = CheckpointData {
            boot_id,
            nvidia_claims: stored.nvidia_claims.clone(),
            nvidia_claims_done: stored.nvidia_claims_done.clone(),
            ..Default::default()
        };
        // Completed claims whose MIG devices are back, with whether their spec must be written again.
        let mut kept: Vec<(String, ClaimRecord, bool)> = Vec::new();
        // The domains that claims kept here hold: a claim rolled back does not leave them.
        let held_domains: BTreeSet<String> = stored
            .claims
            .values()
            .filter(|record| is_finished(record))
            .filter_map(|record| record.domain.as_ref())
            .map(|member| member.domain_uid.clone())
            .collect();
        for (uid, mut record) in stored.claims {
            if record.state == ClaimState::Completed && record.phase == Phase::Reserved {
                // Written by a release before phases.
                record.phase = Phase::Completed;
            }
            if !is_finished(&record) {
                // Unknown states were settled by `recover_at_start`; what is left was being
                // prepared or unprepared when the plugin stopped. Its MPS daemon, MIG devices and
                // GPU modes go with the sweeps below, which keep only what completed claims own;
                // its domain is left here, from the record.
                self.leave_recorded_domain(&uid, &record, &held_domains);
                if let Err(reason) = self.give_back_at_start(&record) {
                    warn!(claim = %describe(&uid, &record), %reason, "a passthrough GPU cannot be given back to its driver yet; the claim stays recorded for the kubelet's unprepare");
                    data.claims.insert(uid, record);
                    continue;
                }
                self.roll_back_at_start(uid, &record, &mut recovery)?;
                continue;
            }
            let mut rewrite = false;
            if let Err(reason) =
                self.restore_mig_devices(&uid, &inventory, &mut record, &mut rewrite, &mut journal)
            {
                warn!(claim = %describe(&uid, &record), %reason, "MIG device of a prepared claim is gone and cannot be made again; rolling the claim back");
                self.roll_back_at_start(uid, &record, &mut recovery)?;
                continue;
            }
            if let Err(reason) = self.rebind_at_start(&record) {
                warn!(claim = %describe(&uid, &record), %reason, "a passthrough claim's GPU is not bound to vfio-pci and cannot be bound again; its VM will not start until it is");
            }
            kept.push((uid, record, rewrite));
        }
        // The MPS daemons of all kept claims side by side, within a bound: one after another, a
        // node with many MPS claims would take minutes to start after a reboot.
        self.restore_mps(
            kept.iter_mut()
                .map(|(uid, record, _)| (uid.as_str(), record)),
            &inventory,
            &mut recovery,
        );
        for (uid, record, rewrite) in kept {
            // /var/run/cdi is tmpfs: after a reboot the spec is gone and is written again;
            // one that a power cut left unreadable is replaced the same way.
            if rewrite || !matches!(self.cdi.read_claim_spec(&uid), Ok(Some(_))) {
                let mps = match record.mps.as_ref().map(|d| self.mps.container_edits(d)) {
                    Some(Ok(edits)) => Some(edits),
                    Some(Err(error)) => {
                        warn!(claim = %describe(&uid, &record), %error, "the MPS daemon's CDI edits cannot be made; the spec is written without them");
                        None
                    }
                    None => None,
                };
                let mps = super::vfio::with_common_edits(mps, &inventory, &record);
                write_spec_with(
                    &self.cdi,
                    &uid,
                    &record.devices,
                    &inventory,
                    &self.driver_edits,
                    mps.as_ref(),
                )
                .map_err(|source| ClaimError::Cdi {
                    claim: describe(&uid, &record),
                    source,
                })?;
            }
            recovery.kept.push(uid.clone());
            data.claims.insert(uid, record);
        }
        let on_disk = self.cdi.claim_specs().map_err(|source| ClaimError::Cdi {
            claim: "(startup)".to_string(),
            source,
        })?;
        // Left in place while its spec exists and no kept claim took it over.
        data.left_in_place = stored
            .left_in_place
            .into_iter()
            .filter(|uid| on_disk.contains(uid) && !data.claims.contains_key(uid))
            .collect();
        recovery.left_in_place = data.left_in_place.iter().cloned().collect();
        for uid in on_disk {
            if data.claims.contains_key(&uid) || data.left_in_place.contains(&uid) {
                continue;
            }
            if degraded {
                // Every spec went through the rebuild; one that appeared since is not ours to judge.
                continue;
            }
            self.cdi
                .remove_claim_spec(&uid)
                .map_err(|source| ClaimError::Cdi {
                    claim: uid.clone(),
                    source,
                })?;
            recovery.orphan_specs_removed.push(uid);
        }
        if !degraded {
            recovery.mps_daemons_cleaned_up = self.sweep_mps(&data);
        }
        data.gpu_modes = self.converge_gpu_modes(&data, stored.gpu_modes, degraded, &inventory);
        let mut made = mig_records::made_for_claims(data.claims.iter(), &inventory);
        // Re-creates of this start whose claim was rolled back (one that did not return in time) keep
        // their record: a create that returns late leaves a device the next start's sweep destroys.
        let unfinished = mig_records::not_among(
            mig_records::not_among(journal.mig_devices_made.clone(), &made_before),
            &made,
        );
        made.extend(unfinished);
        if *self.mig_mode.borrow() == MigMode::Dynamic {
            if degraded || !data.left_in_place.is_empty() {
                warn!(
                    left_in_place = data.left_in_place.len(),
                    "dynamic MIG: MIG devices no known claim owns are kept, because CDI specs of unknown claims are left in place and may use them"
                );
                made.extend(mig_records::not_among(made_before, &made));
            } else {
                let owned: BTreeSet<(String, u32)> = data
                    .claims
                    .values()
                    .flat_map(|record| &record.devices)
                    .chain(data.nvidia_claims.values().flat_map(|c| &c.devices))
                    .filter_map(|device| device.mig.as_ref())
                    .map(|mig| (mig.parent_uuid.clone(), mig.gpu_instance_id))
                    .collect();
                let current = self.backend.inventory().map_err(|e| ClaimError::Internal {
                    claim: "(startup)".to_string(),
                    reason: format!("reading the GPUs: {e}"),
                })?;
                let sweep = self.sweep_mig(&current, &owned, &made_before);
                recovery.mig_devices_destroyed = sweep.destroyed;
                recovery.mig_devices_left_alone = sweep.left_alone;
                made.extend(sweep.still_made);
            }
        } else {
            // Kept for a later start in dynamic MIG mode, which destroys them if no claim owns them.
            made.extend(mig_records::not_among(made_before, &made));
        }
        data.mig_devices_made = made;
        // Without a checkpoint on disk prepares fail per claim until it can be written; refusing to
        // start would only add a crash loop, and the node would publish nothing.
        if let Err(error) = self.checkpoint.store(&data) {
            warn!(%error, "writing the recovered checkpoint failed; prepares fail until it can be written");
        }
        let mut state = lock(&self.state);
        state.data = data;
        info!(
            kept = recovery.kept.len(),
            rolled_back = recovery.rolled_back.len(),
            orphans_removed = recovery.orphan_specs_removed.len(),
            left_in_place = recovery.left_in_place.len(),
            mig_devices_destroyed = recovery.mig_devices_destroyed.len(),
            mig_devices_left_alone = recovery.mig_devices_left_alone.len(),
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
        uid: &str,
        inventory: &Inventory,
        record: &mut ClaimRecord,
        rewrite: &mut bool,
        journal: &mut CheckpointData,
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
            // A share of a dynamic MIG device that another kept claim's restore made again just now.
            if let (Some(existing), Some(_), true) =
                (&target.existing, &device.share_id, prepared.created)
            {
                prepared.uuid = existing.uuid.clone();
                prepared.gpu_instance_id = existing.gpu_instance_id;
                prepared.compute_instance_id = existing.compute_instance_id;
                prepared.device_files = existing.device_files.clone();
                *rewrite = true;
                continue;
            }
            if !prepared.created {
                return Err(format!(
                    "static MIG device {} ({}) no longer exists",
                    device.device, prepared.uuid
                ));
            }
            let instance = self.recreate_recorded(uid, &target, journal)?;
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

impl Preparer {
    /// Leaves the domain a claim rolled back at start had joined, or was joining, unless a kept
    /// claim holds it. Runs on recovery's blocking thread; a failure is logged (the entry then
    /// stays until the domain is deleted, and the daemon goes with the first domain sweep).
    fn leave_recorded_domain(&self, uid: &str, record: &ClaimRecord, held: &BTreeSet<String>) {
        let (Some(member), Some(membership)) = (&record.domain, &self.domains) else {
            return;
        };
        if held.contains(&member.domain_uid) {
            return;
        }
        let handle = tokio::runtime::Handle::current();
        match handle.block_on(membership.leave(member)) {
            Ok(()) => {
                info!(claim = %describe(uid, record), domain = %member.domain, "left the ComputeDomain a claim rolled back at start was joining")
            }
            Err(error) => {
                warn!(claim = %describe(uid, record), domain = %member.domain, %error, "leaving the ComputeDomain of a claim rolled back at start failed")
            }
        }
    }
}

impl Preparer {
    /// A claim rolled back at start: its spec removed (what else it made goes with the sweeps).
    fn roll_back_at_start(
        &self,
        uid: String,
        record: &ClaimRecord,
        recovery: &mut Recovery,
    ) -> Result<(), ClaimError> {
        self.cdi
            .remove_claim_spec(&uid)
            .map_err(|source| ClaimError::Cdi {
                claim: describe(&uid, record),
                source,
            })?;
        recovery.rolled_back.push(uid);
        Ok(())
    }
}

/// Whether a record says its claim was fully prepared and not being unprepared: kept at start.
/// (`reserved` with `completed` state is a record of a release before phases.)
fn is_finished(record: &ClaimRecord) -> bool {
    record.state == ClaimState::Completed
        && !matches!(record.phase, Phase::Unpreparing | Phase::Unknown)
}

/// Whether the checkpoint names a boot other than this one (a checkpoint written where the boot id
/// could not be read names none, and counts as this boot's).
fn written_in_an_earlier_boot(stored: &CheckpointData, this_boot: &str) -> bool {
    !stored.boot_id.is_empty() && stored.boot_id != this_boot
}

#[cfg(test)]
mod tests {
    use super::bounded;
    use std::time::{Duration, Instant};

    #[tokio::test]
    async fn bounded_runs_side_by_side_and_gives_up_at_the_bound() {
        let started = Instant::now();
        let naps = (0..16).map(|i| async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            i
        });
        let outcomes = bounded(naps, 8, Duration::from_secs(10)).await;
        assert_eq!(outcomes, (0..16).map(Some).collect::<Vec<_>>());
        // Two rounds of eight, not sixteen naps one after another.
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1000), "{took:?}");

        let started = Instant::now();
        let some_hang = (0..4u64).map(|i| async move {
            let nap = if i % 2 == 0 { 10 } else { 3_600_000 };
            tokio::time::sleep(Duration::from_millis(nap)).await;
            i
        });
        let outcomes = bounded(some_hang, 8, Duration::from_millis(300)).await;
        assert_eq!(outcomes, [Some(0), None, Some(2), None]);
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
