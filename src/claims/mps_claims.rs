//! A claim's MPS control daemon, the claim side of `mps/`: what daemon a claim's MPS devices need
//! (`mps_spec`: its devices, limits and whether it serves several users), starting it with the daemon
//! in the claim's record first and stopping it from the record, and at start taking over, starting
//! again or sweeping the daemons of kept and gone claims.

use std::collections::BTreeSet;

use tracing::{info, warn};

use super::checkpoint::CheckpointData;
use super::mps::{MpsDaemonRecord, MpsDaemonSpec, MpsDevice, TakeOver};
use super::{ClaimError, ClaimRecord, ClaimRef, PreparedDevice, Preparer, Recovery};
use crate::api::config::SharingSettings;
use crate::gpu::Inventory;

impl Preparer {
    /// Starts the claim's MPS control daemon when any of its devices uses MPS. The daemon is in the
    /// claim's record, and the record on file, before its tmpfs or Pod are made, so that a roll-back,
    /// an unprepare or a restart stops it whatever point the start reached.
    pub(super) async fn start_mps(
        &self,
        claim: &ClaimRef,
        devices: &[PreparedDevice],
        inventory: &Inventory,
    ) -> Result<Option<MpsDaemonRecord>, ClaimError> {
        let spec = match mps_spec(&claim.uid, devices, inventory) {
            Ok(Some(spec)) => spec,
            Ok(None) => return Ok(None),
            Err(reason) => {
                return Err(ClaimError::Config {
                    claim: claim.to_string(),
                    reason,
                })
            }
        };
        let failed = |error: super::mps::MpsError| ClaimError::Sharing {
            claim: claim.to_string(),
            reason: format!("starting the MPS control daemon: {error}"),
        };
        let planned = self.mps.planned(&spec).map_err(failed)?;
        self.update_record(claim, |record| {
            record.mps = Some(planned);
            record.phase = super::lifecycle::Phase::MpsDaemon;
        });
        self.persist(claim).await?;
        let record = self.mps.start(&spec).await.map_err(failed)?;
        self.update_record(claim, |held| held.mps = Some(record.clone()));
        info!(pod = %record.pod, "MPS control daemon started");
        Ok(Some(record))
    }

    /// Stops the claim's MPS control daemon, if it has one.
    pub(super) async fn stop_mps(&self, record: &ClaimRecord) -> Result<(), String> {
        let Some(daemon) = record.mps.clone() else {
            return Ok(());
        };
        self.mps
            .stop(&daemon)
            .await
            .map_err(|e| format!("stopping the MPS control daemon: {e}"))
    }

    /// At start, for the kept claims with an MPS daemon: takes each daemon's Pod over if it still runs
    /// for the claim's devices as they are now, starts it again in the same directories otherwise (it
    /// died, or a MIG device was made again after a reboot and has a new UUID), so that the claim's
    /// new containers work again. The daemons are restored side by side, [`MPS_RESTORE_PARALLELISM`]
    /// at a time, all within [`MPS_RESTORE_BOUND`]. A daemon that cannot be started again, or is not
    /// back in time, is reported and forgotten; its claim stays prepared. Runs on a blocking thread of
    /// the runtime (recovery's).
    ///
    /// [`MPS_RESTORE_PARALLELISM`]: super::MPS_RESTORE_PARALLELISM
    /// [`MPS_RESTORE_BOUND`]: super::MPS_RESTORE_BOUND
    pub(super) fn restore_mps<'a>(
        &self,
        kept: impl IntoIterator<Item = (&'a str, &'a mut ClaimRecord)>,
        inventory: &Inventory,
        recovery: &mut Recovery,
    ) {
        let mut daemons = Vec::new();
        for (uid, record) in kept {
            let Some(daemon) = record.mps.clone() else {
                continue;
            };
            match mps_spec(uid, &record.devices, inventory) {
                Ok(Some(spec)) => daemons.push((uid, record, daemon, spec)),
                Ok(None) => {
                    warn!(claim = %super::describe(uid, record), "MPS daemon recorded for a claim without MPS devices; forgotten");
                    record.mps = None;
                }
                Err(reason) => {
                    warn!(claim = %super::describe(uid, record), %reason, "the claim's MPS daemon cannot be started again");
                    record.mps = None;
                }
            }
        }
        if daemons.is_empty() {
            return;
        }
        let started = std::time::Instant::now();
        let bound = super::MPS_RESTORE_BOUND;
        let take_overs = daemons
            .iter()
            .map(|(_, _, daemon, spec)| self.mps.take_over(daemon, spec));
        let outcomes = tokio::runtime::Handle::current().block_on(super::recovery::bounded(
            take_overs,
            super::MPS_RESTORE_PARALLELISM,
            bound,
        ));
        for ((uid, record, daemon, _), outcome) in daemons.into_iter().zip(outcomes) {
            match outcome {
                Some(Ok(TakeOver::TakenOver)) => {
                    info!(claim = %super::describe(uid, record), pod = %daemon.pod, "MPS control daemon taken over");
                    recovery.mps_daemons_taken_over.push(uid.to_string());
                }
                Some(Ok(TakeOver::Restarted(restarted))) => {
                    warn!(claim = %super::describe(uid, record), pod = %restarted.pod, "MPS control daemon was gone, not Ready or named other devices; started again");
                    record.mps = Some(restarted);
                    recovery.mps_daemons_restarted.push(uid.to_string());
                }
                Some(Err(error)) => {
                    warn!(claim = %super::describe(uid, record), %error, "MPS control daemon had stopped and cannot be started again; the claim's containers cannot use MPS");
                    record.mps = None;
                }
                None => {
                    warn!(claim = %super::describe(uid, record), pod = %daemon.pod, bound_s = bound.as_secs(), "MPS control daemon not taken over or started again within recovery's bound for all MPS daemons; the claim stays prepared, and its containers cannot use MPS");
                    record.mps = None;
                }
            }
        }
        info!(
            daemons = recovery.mps_daemons_taken_over.len() + recovery.mps_daemons_restarted.len(),
            took_ms = started.elapsed().as_millis() as u64,
            "MPS control daemons of kept claims restored"
        );
    }

    /// Stops the MPS daemons of claims that are no longer prepared and removes their directories,
    /// within [`MPS_SWEEP_BOUND`]: what is left then is stopped at the next start (each daemon's Pod
    /// goes before its directory, so one cut off is left whole). Every kept claim's directory stays,
    /// also one without a daemon record (rebuilt after the checkpoint was set aside), as do those of
    /// claims whose CDI spec is left in place.
    ///
    /// [`MPS_SWEEP_BOUND`]: super::MPS_SWEEP_BOUND
    pub(super) fn sweep_mps(&self, data: &CheckpointData) -> Vec<String> {
        let keep: BTreeSet<String> = data
            .claims
            .keys()
            .chain(&data.left_in_place)
            .cloned()
            .collect();
        // Daemon Pods without a directory are looked for in the background: a list that waits on an
        // unreachable API server must not hold up the start.
        let handle = tokio::runtime::Handle::current();
        let bound = super::MPS_SWEEP_BOUND;
        let cleaned = match handle.block_on(tokio::time::timeout(bound, self.mps.sweep_dirs(&keep)))
        {
            Ok(cleaned) => cleaned,
            Err(_) => {
                warn!(bound_s = bound.as_secs(), "stopping the MPS daemons of claims no longer prepared did not finish within its bound; the others are stopped at the next start");
                Vec::new()
            }
        };
        let mps = self.mps.clone();
        handle.spawn(async move { mps.sweep_pods(&keep).await });
        for uid in &cleaned {
            info!(claim_uid = %uid, "MPS control daemon of a claim no longer prepared stopped");
        }
        cleaned
    }
}

/// The claim's MPS daemon: every device that uses MPS, with its pinned-memory limit (its own entry of
/// the per-device map, else the default). The active-thread percentage is the daemon's, so the
/// claim's MPS configs must agree on it.
fn mps_spec(
    claim_uid: &str,
    devices: &[PreparedDevice],
    inventory: &Inventory,
) -> Result<Option<MpsDaemonSpec>, String> {
    let mut spec = MpsDaemonSpec {
        claim_uid: claim_uid.to_string(),
        devices: Vec::new(),
        active_thread_percentage: None,
        multi_user: false,
        shm_size_bytes: None,
    };
    let mut percentage_from: Option<&str> = None;
    let mut before_volta = None;
    for device in devices {
        let SharingSettings::Mps(mps) = &device.sharing else {
            continue;
        };
        // One daemon serves the claim: multi-user if any of its MPS configs asks for it.
        spec.multi_user |= mps.multi_user;
        // One tmpfs serves the claim: the largest `shmSize` its MPS configs ask for.
        spec.shm_size_bytes = spec.shm_size_bytes.max(mps.shm_size_bytes);
        if let Some(percentage) = mps.active_thread_percentage {
            match (spec.active_thread_percentage, percentage_from) {
                (Some(earlier), Some(from)) if earlier != percentage => {
                    return Err(format!(
                        "the claim's MPS devices ask for different active-thread percentages ({from}: {earlier}, {}: {percentage}); one MPS daemon serves the claim, so they must agree",
                        device.device
                    ))
                }
                _ => {
                    spec.active_thread_percentage = Some(percentage);
                    percentage_from = Some(&device.device);
                }
            }
        }
        let gpu = match &device.mig {
            Some(mig) => inventory.gpus.iter().find(|g| g.uuid == mig.parent_uuid),
            None => super::edits::find_gpu(inventory, &device.device),
        };
        let uuid = match (&device.mig, gpu) {
            (Some(mig), _) => mig.uuid.clone(),
            (None, Some(gpu)) => gpu.uuid.clone(),
            (None, None) => return Err(format!("device {} is not on this node", device.device)),
        };
        if let Some(gpu) = gpu.filter(|g| !is_volta_or_newer(&g.cuda_compute_capability)) {
            before_volta.get_or_insert((device.device.clone(), gpu));
        }
        spec.devices.push(MpsDevice {
            device: device.device.clone(),
            uuid,
            pinned_memory_limit_bytes: mps
                .per_device_pinned_memory_limit_bytes
                .get(&device.device)
                .copied()
                .or(mps.pinned_memory_limit_bytes),
        });
    }
    if let (true, Some((device, gpu))) = (spec.multi_user, before_volta) {
        // As NVIDIA's plugin: the multi-user daemon needs Volta (compute capability 7.0) or newer.
        return Err(format!(
            "multiuser mode was requested but is not supported: device {device} ({}) has compute capability {}, below Volta's 7.0",
            gpu.uuid, gpu.cuda_compute_capability
        ));
    }
    Ok((!spec.devices.is_empty()).then_some(spec))
}

/// Whether a compute capability (`9.0`) is Volta's 7.0 or newer; an unreadable one counts as new
/// (the daemon itself refuses where it cannot).
fn is_volta_or_newer(capability: &str) -> bool {
    capability
        .split('.')
        .next()
        .and_then(|major| major.trim().parse::<u32>().ok())
        .is_none_or(|major| major >= 7)
}

#[cfg(test)]
mod multi_user_tests {
    use super::*;
    use crate::api::config::MpsSettings;
    use crate::gpu::{FakeBackend, GpuBackend};

    fn mps_device(device: &str, multi_user: bool) -> PreparedDevice {
        PreparedDevice {
            request_names: vec!["gpu".into()],
            pool: "node-a".into(),
            device: device.into(),
            cdi_device_ids: Vec::new(),
            share_id: None,
            admin_access: false,
            mig: None,
            sharing: SharingSettings::Mps(MpsSettings {
                multi_user,
                ..MpsSettings::default()
            }),
            imex_channels: None,
        }
    }

    #[test]
    fn one_multi_user_config_makes_the_claims_daemon_multi_user() {
        let inventory = FakeBackend::new("node-a", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        let devices = [mps_device("gpu-0", false), mps_device("gpu-1", true)];
        let spec = mps_spec("uid", &devices, &inventory).unwrap().unwrap();
        assert!(spec.multi_user);
        assert_eq!(spec.devices.len(), 2);
        let single = mps_spec("uid", &devices[..1], &inventory).unwrap().unwrap();
        assert!(!single.multi_user);
    }

    #[test]
    fn multi_user_needs_volta_or_newer_as_nvidias_plugin_checks() {
        let mut inventory = FakeBackend::new("node-a", "l40s-4")
            .unwrap()
            .inventory()
            .unwrap();
        // A Pascal GPU (6.0) beside the L40S: the daemon would serve it too.
        inventory.gpus[0].cuda_compute_capability = "6.0".into();
        let devices = [mps_device("gpu-0", false), mps_device("gpu-1", true)];
        let error = mps_spec("uid", &devices, &inventory).unwrap_err();
        assert!(
            error.starts_with("multiuser mode was requested but is not supported: device gpu-0")
                && error.contains("compute capability 6.0"),
            "{error}"
        );
        // Single-user MPS on it is fine.
        assert!(mps_spec("uid", &devices[..1], &inventory).is_ok());
        assert!(is_volta_or_newer("7.0") && is_volta_or_newer("10.0") && is_volta_or_newer(""));
        assert!(!is_volta_or_newer("6.1"));
    }
}
