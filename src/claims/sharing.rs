//! Sharing at prepare and unprepare. Which sharing each device of a claim gets comes from the claim's
//! opaque configs (`configs.rs`, upstream's precedence). What that asks of a whole GPU (a time-slice
//! interval, or the exclusive-process compute mode that MPS needs on a GPU only one claim has) is set
//! through the backend, from what every recorded claim needs, so the last claim to go resets it. A claim
//! with MPS devices gets its own MPS control daemon (`mps/`), recorded with the claim.

use std::collections::{BTreeMap, BTreeSet};

use tracing::{info, warn};

use super::allocation::FetchedClaim;
use super::checkpoint::{CheckpointData, RecordedGpuMode};
use super::configs;
use super::mps::{MpsDaemonRecord, MpsDaemonSpec, MpsDevice, TakeOver};
use super::{lock, ClaimError, ClaimRecord, ClaimRef, PreparedDevice, Preparer, Recovery};
use crate::api::config::{MpsSettings, SharingSettings};
use crate::devices::DeviceName;
use crate::gpu::{GpuSharingMode, Inventory};

impl Preparer {
    /// Sets each device's `sharing` from the claim's configs. A device several requests of the claim
    /// share must get the same sharing from all of them. Devices with admin access are left as they
    /// are (they watch, they do not run work). A device published for MPS sharing by memory
    /// (`allowMultipleAllocations`, so the scheduler gave the claim a `shareID`) is shared with other
    /// claims: it defaults to MPS, with the claim's memory share as its pinned-memory limit, and a
    /// config asking for it exclusively is refused.
    pub(super) fn resolve_sharing(
        &self,
        claim: &ClaimRef,
        fetched: &FetchedClaim,
        inventory: &Inventory,
        devices: &mut [PreparedDevice],
    ) -> Result<(), ClaimError> {
        let results: Vec<_> = super::allocation_results(&fetched.claim)
            .iter()
            .filter(|r| r.driver == self.driver && r.pool == self.pool)
            .collect();
        let to_configure: Vec<(&str, &str, bool)> = results
            .iter()
            .map(|r| {
                let is_mig = matches!(DeviceName::parse(&r.device), Some(DeviceName::Mig { .. }));
                (r.request.as_str(), r.device.as_str(), is_mig)
            })
            .collect();
        let entries = configs::allocation_config_entries(&fetched.claim, &fetched.raw_configs);
        // NVIDIA's per-device MPS limits name devices by UUID: a whole GPU's from the inventory, a
        // MIG device's once it is known (a MIG device still to be created has none yet).
        let uuids: Vec<Option<&str>> = results
            .iter()
            .map(|r| match devices.iter().find(|d| d.device == r.device) {
                Some(PreparedDevice { mig: Some(mig), .. }) if !mig.uuid.is_empty() => {
                    Some(mig.uuid.as_str())
                }
                _ if whole_gpu_minor(&r.device).is_some() => {
                    super::edits::find_gpu(inventory, &r.device).map(|gpu| gpu.uuid.as_str())
                }
                _ => None,
            })
            .collect();
        let resolved = configs::resolve_with_uuids(&self.driver, &entries, &to_configure, &uuids)
            .map_err(|error| ClaimError::Config {
            claim: claim.to_string(),
            reason: error.to_string(),
        })?;
        let mut chosen: BTreeMap<&str, (SharingSettings, &str)> = BTreeMap::new();
        for (result, resolved) in results.iter().zip(resolved) {
            let shared = result.share_id.is_some();
            let settings = match (&resolved.settings, resolved.source, shared) {
                (SharingSettings::Exclusive, None, true) => {
                    SharingSettings::Mps(MpsSettings::default())
                }
                (SharingSettings::Exclusive, Some(index), true) => {
                    return Err(ClaimError::Config {
                        claim: claim.to_string(),
                        reason: format!(
                            "config[{index}]: device {} is shared with other claims (published for MPS sharing by memory); it cannot be Exclusive",
                            result.device
                        ),
                    })
                }
                (settings, _, _) => settings.clone(),
            };
            let settings = match (settings, memory_share(result)) {
                (SharingSettings::Mps(mut mps), Some(share)) if shared => {
                    let limit = mps
                        .per_device_pinned_memory_limit_bytes
                        .get(&result.device)
                        .copied()
                        .or(mps.pinned_memory_limit_bytes)
                        .map_or(share, |asked| asked.min(share));
                    mps.per_device_pinned_memory_limit_bytes
                        .insert(result.device.clone(), limit);
                    SharingSettings::Mps(mps)
                }
                (settings, _) => settings,
            };
            match chosen.get(result.device.as_str()) {
                Some((earlier, request)) if *earlier != settings => {
                    return Err(ClaimError::Config {
                        claim: claim.to_string(),
                        reason: format!(
                            "device {} is allocated to requests {request} and {} with different sharing ({} and {})",
                            result.device,
                            result.request,
                            earlier.env_value(),
                            settings.env_value()
                        ),
                    })
                }
                Some(_) => {}
                None => {
                    chosen.insert(&result.device, (settings, &result.request));
                }
            }
        }
        for device in devices.iter_mut().filter(|d| !d.admin_access) {
            if let Some((settings, _)) = chosen.get(device.device.as_str()) {
                device.sharing = settings.clone();
            }
        }
        Ok(())
    }

    /// Sets the sharing mode of each whole GPU under `devices` to what the recorded claims, other than
    /// `without`, need of it, where that differs from what was set last. Changes to one GPU run one
    /// at a time and are bounded in time; a GPU whose earlier change is stuck fails at once (see
    /// `gpu_modes.rs`), and other GPUs are not held up by it. A mode other than the default is
    /// recorded in the checkpoint before it is set, and dropped once the GPU is reset.
    pub(super) async fn sync_gpu_modes(
        &self,
        claim: &ClaimRef,
        inventory: &Inventory,
        devices: &[PreparedDevice],
        without: Option<&str>,
    ) -> Result<(), String> {
        let gpus: BTreeSet<u32> = devices
            .iter()
            .filter_map(|d| whole_gpu_minor(&d.device))
            .collect();
        for minor in gpus {
            let Some(gpu) = inventory.gpus.iter().find(|g| g.minor == minor) else {
                continue;
            };
            let name = format!("gpu-{minor}");
            let mut held = self
                .gpu_modes
                .hold(&gpu.uuid, &name)
                .await
                .map_err(|e| e.to_string())?;
            let wanted = {
                let state = lock(&self.state);
                desired_mode(&state.data.claims, minor, without)
            };
            if held.applied() == Some(wanted) {
                continue;
            }
            self.record_gpu_mode(claim, &gpu.uuid, &name, wanted)
                .await?;
            let (backend, uuid) = (self.backend.clone(), gpu.uuid.clone());
            held.change(wanted, move || {
                backend.set_sharing(&uuid, &wanted).map(|_| true)
            })
            .await
            .map_err(|e| e.to_string())?;
            if wanted == GpuSharingMode::Default {
                self.forget_gpu_mode(&gpu.uuid);
            }
            info!(gpu = %name, mode = %describe_mode(&wanted), "GPU sharing mode set");
        }
        Ok(())
    }

    /// Writes `mode` for GPU `uuid` into the checkpoint before it is set, unless it is the default
    /// (the record of what the GPU held stays until the reset succeeds): NVML cannot read the
    /// time-slice interval back, so a crash between setting and recording would leave the GPU
    /// time-sliced with nothing saying so.
    async fn record_gpu_mode(
        &self,
        claim: &ClaimRef,
        uuid: &str,
        name: &str,
        mode: GpuSharingMode,
    ) -> Result<(), String> {
        if mode == GpuSharingMode::Default {
            return Ok(());
        }
        {
            let mut state = lock(&self.state);
            let recorded = RecordedGpuMode::Known(mode);
            if state.data.gpu_modes.get(uuid) == Some(&recorded) {
                return Ok(());
            }
            state.data.gpu_modes.insert(uuid.to_string(), recorded);
            state.revision += 1;
        }
        self.persist(claim).await.map_err(|error| {
            let cause = match error {
                ClaimError::Checkpoint { source, .. } => source.to_string(),
                other => other.to_string(),
            };
            format!("{name}: recording {mode} in the checkpoint before setting it failed, so it was not set: {cause}")
        })
    }

    /// Drops GPU `uuid`'s record after a reset (in memory; the caller's next write takes it along).
    fn forget_gpu_mode(&self, uuid: &str) {
        let mut state = lock(&self.state);
        if state.data.gpu_modes.remove(uuid).is_some() {
            state.revision += 1;
        }
    }

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
}

impl Preparer {
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

    /// At start, sets every GPU to the sharing mode its recorded claims need (the default when none)
    /// where it may hold another: the compute mode reads otherwise, the checkpoint recorded another
    /// mode (set, or about to be set, when the plugin stopped), or `unknown` says the records were
    /// lost. A time-slice interval cannot be read back, so one that a kept claim needs is set again.
    /// Returns the records to keep. The GPUs change side by side, each within the sharing timeout (a
    /// hung GPU holds up no other, and the whole takes one GPU's time); failures are logged, and the
    /// next prepare or unprepare on the GPU retries. Runs on a blocking thread of the runtime.
    pub(super) fn converge_gpu_modes(
        &self,
        data: &CheckpointData,
        recorded: BTreeMap<String, RecordedGpuMode>,
        unknown: bool,
        inventory: &Inventory,
    ) -> BTreeMap<String, RecordedGpuMode> {
        let wanted: Vec<(String, GpuSharingMode, Option<RecordedGpuMode>)> = inventory
            .gpus
            .iter()
            .map(|gpu| {
                let wanted = desired_mode(&data.claims, gpu.minor, None);
                (
                    format!("gpu-{}", gpu.minor),
                    wanted,
                    recorded.get(&gpu.uuid).cloned(),
                )
            })
            .collect();
        let changes = inventory
            .gpus
            .iter()
            .zip(&wanted)
            .map(|(gpu, (name, wanted, earlier))| {
                let wanted = *wanted;
                let record_other = earlier
                    .as_ref()
                    .is_some_and(|r| *r != RecordedGpuMode::Known(wanted));
                let (backend, uuid) = (self.backend.clone(), gpu.uuid.clone());
                let converge = move || {
                    let current = backend.sharing(&uuid)?;
                    let set = match wanted {
                        GpuSharingMode::TimeSlice(_) => true,
                        _ => unknown || record_other || current != wanted,
                    };
                    if set {
                        backend.set_sharing(&uuid, &wanted)?;
                    }
                    Ok(set)
                };
                async move {
                    let mut held = self.gpu_modes.hold(&gpu.uuid, name).await?;
                    held.change(wanted, converge).await
                }
            });
        let outcomes =
            tokio::runtime::Handle::current().block_on(futures::future::join_all(changes));
        let mut kept = BTreeMap::new();
        for ((gpu, (name, wanted, earlier)), outcome) in
            inventory.gpus.iter().zip(wanted).zip(outcomes)
        {
            match outcome {
                Ok(set) => {
                    if set {
                        info!(gpu = %name, mode = %describe_mode(&wanted), recorded = ?earlier, "GPU sharing mode restored");
                    }
                    if wanted != GpuSharingMode::Default {
                        kept.insert(gpu.uuid.clone(), RecordedGpuMode::Known(wanted));
                    }
                }
                Err(error) => {
                    warn!(gpu = %name, %error, "setting the GPU's sharing mode at start failed");
                    let keep = earlier.or_else(|| {
                        (wanted != GpuSharingMode::Default)
                            .then_some(RecordedGpuMode::Known(wanted))
                    });
                    if let Some(keep) = keep {
                        kept.insert(gpu.uuid.clone(), keep);
                    }
                }
            }
        }
        // GPUs not in the inventory now (unreadable, lost) keep their records for a later start.
        for (uuid, mode) in recorded {
            if !inventory.gpus.iter().any(|g| g.uuid == uuid) {
                kept.insert(uuid, mode);
            }
        }
        kept
    }
}

/// The sharing mode a GPU needs for the claims recorded on it, leaving out `without`: a time-slice
/// interval if a claim time-slices it, the exclusive-process compute mode if a claim that has the GPU
/// to itself runs MPS on it, the default otherwise. (Claims sharing a GPU by memory each run their own
/// MPS daemon, which needs the default compute mode.)
pub(super) fn desired_mode(
    claims: &BTreeMap<String, ClaimRecord>,
    minor: u32,
    without: Option<&str>,
) -> GpuSharingMode {
    let mut mode = GpuSharingMode::Default;
    for device in claims
        .iter()
        .filter(|(uid, _)| Some(uid.as_str()) != without)
        .flat_map(|(_, record)| &record.devices)
        .filter(|d| !d.admin_access && is_whole_gpu(&d.device, minor))
    {
        match &device.sharing {
            SharingSettings::TimeSlicing { interval } => {
                return GpuSharingMode::TimeSlice(*interval)
            }
            SharingSettings::Mps(_) if device.share_id.is_none() => {
                mode = GpuSharingMode::ExclusiveProcess
            }
            _ => {}
        }
    }
    mode
}

/// Why `device` cannot be time-sliced as it asks: another claim on the same GPU asked for another
/// interval. `None` when it fits.
pub(super) fn interval_conflict(
    claims: &BTreeMap<String, ClaimRecord>,
    claim_uid: &str,
    device: &PreparedDevice,
) -> Option<String> {
    let SharingSettings::TimeSlicing { interval } = &device.sharing else {
        return None;
    };
    let minor = whole_gpu_minor(&device.device)?;
    claims
        .iter()
        .filter(|(uid, _)| uid.as_str() != claim_uid)
        .find_map(|(uid, record)| {
            record
                .devices
                .iter()
                .filter(|d| !d.admin_access && is_whole_gpu(&d.device, minor))
                .find_map(|held| match &held.sharing {
                    SharingSettings::TimeSlicing { interval: theirs } if theirs != interval => {
                        Some(format!(
                            "gpu-{minor} is time-sliced with interval {theirs} for claim {}/{} ({uid}); this claim asks for {interval}, and a GPU has one interval",
                            record.namespace, record.name
                        ))
                    }
                    _ => None,
                })
        })
}

fn is_whole_gpu(device: &str, minor: u32) -> bool {
    whole_gpu_minor(device) == Some(minor)
}

/// The minor of a whole GPU's device name; `None` for MIG devices and names that are not ours.
fn whole_gpu_minor(device: &str) -> Option<u32> {
    match DeviceName::parse(device)? {
        DeviceName::Gpu { minor } => Some(minor),
        DeviceName::Mig { .. } => None,
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

/// The memory a shared device's allocation result consumes (its `consumedCapacity`), in bytes.
fn memory_share(
    result: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult,
) -> Option<u64> {
    let quantity = result.consumed_capacity.as_ref()?.get("memory")?;
    let bytes = crate::api::config::ByteQuantity::parse(&quantity.0).map(|q| q.bytes());
    if bytes.is_none() {
        warn!(device = %result.device, quantity = %quantity.0, "unreadable consumed memory in an allocation result");
    }
    bytes
}

fn describe_mode(mode: &GpuSharingMode) -> String {
    match mode {
        GpuSharingMode::Default => {
            "the default (no time-slice setting, compute mode Default)".into()
        }
        GpuSharingMode::TimeSlice(interval) => format!("time-slice interval {interval}"),
        GpuSharingMode::ExclusiveProcess => "compute mode ExclusiveProcess (for MPS)".into(),
    }
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
