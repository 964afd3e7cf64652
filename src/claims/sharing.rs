//! Sharing at prepare and unprepare. Which sharing each device of a claim gets comes from the claim's
//! opaque configs (`configs.rs`, upstream's precedence). What that asks of a whole GPU (a time-slice
//! interval, or the exclusive-process compute mode that MPS needs on a GPU only one claim has) is set
//! through the backend, from what every recorded claim needs, so the last claim to go resets it. A claim
//! with MPS devices gets its own MPS control daemon (`mps_claims.rs`), recorded with the claim.

use std::collections::{BTreeMap, BTreeSet};

use tracing::{info, warn};

use super::allocation::FetchedClaim;
use super::checkpoint::{CheckpointData, RecordedGpuMode};
use super::configs;
use super::{lock, ClaimError, ClaimRecord, ClaimRef, PreparedDevice, Preparer};
use crate::api::config::{MpsSettings, SharingSettings};
use crate::devices::{DeviceName, Enforcement};
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
        // What keeps shares apart on this node now; a share allocated under a policy since removed
        // keeps MPS, the enforcement of the first form of shares.
        let (enforcement, nvidia) = match *self.shares.borrow() {
            Some(shares) => (shares.enforcement, shares.nvidia),
            None => (Enforcement::Mps, false),
        };
        let mut chosen: BTreeMap<&str, (SharingSettings, &str)> = BTreeMap::new();
        for (result, resolved) in results.iter().zip(resolved) {
            let shared = result.share_id.is_some();
            let settings = if shared {
                share_settings(&resolved.settings, resolved.source, enforcement, nvidia).map_err(
                    |why| ClaimError::Config {
                        claim: claim.to_string(),
                        reason: format!(
                            "device {} is shared with other claims: {why}",
                            result.device
                        ),
                    },
                )?
            } else {
                resolved.settings.clone()
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
}

impl Preparer {
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

/// What a share of a device gets, from the claim's own settings (`source`: the index of the config
/// they come from, `None` when no config set them) and the node's enforcement, which is what a share
/// gets when no config says otherwise, or why the config does not fit: a share is never Exclusive
/// (except under NVIDIA's `--consumable-shares`, where that means no sharing setting); a GPU has one
/// time-slice interval, so under time-slicing enforcement a config may not ask another one; NVIDIA's
/// `--consumable-shares` refuses MPS, as NVIDIA's plugin does.
pub(super) fn share_settings(
    settings: &SharingSettings,
    source: Option<usize>,
    enforcement: Enforcement,
    nvidia: bool,
) -> Result<SharingSettings, String> {
    let config = |index: Option<usize>| match index {
        Some(index) => format!("config[{index}]"),
        None => "its config".to_string(),
    };
    match (settings, source, enforcement) {
        (SharingSettings::Exclusive, None, Enforcement::Mps) => {
            Ok(SharingSettings::Mps(MpsSettings::default()))
        }
        (SharingSettings::Exclusive, None, Enforcement::TimeSlicing(interval)) => {
            Ok(SharingSettings::TimeSlicing { interval })
        }
        (SharingSettings::Exclusive, None, Enforcement::None) => Ok(SharingSettings::Exclusive),
        // NVIDIA's configs leave a GPU Exclusive unless they say otherwise: nothing to enforce.
        (SharingSettings::Exclusive, Some(_), Enforcement::None) if nvidia => {
            Ok(SharingSettings::Exclusive)
        }
        (SharingSettings::Exclusive, index, _) => Err(format!(
            "{} asks for it Exclusive, which a share cannot be",
            config(index)
        )),
        (SharingSettings::Mps(_), _, Enforcement::None) if nvidia => Err(
            "MPS sharing is not supported when consumable shares is enabled (--consumable-shares); \
             use TimeSlicing or no sharing config"
                .into(),
        ),
        (SharingSettings::TimeSlicing { interval: asked }, index, Enforcement::TimeSlicing(set))
            if *asked != set =>
        {
            Err(format!(
                "{} asks for time-slice interval {asked}, but this node time-slices shared GPUs \
                 with interval {set} (its GpuNodePolicy's spec.sharing.shares.interval)",
                config(index)
            ))
        }
        (settings, _, _) => Ok(settings.clone()),
    }
}

/// Why a share of `device` cannot join the shares `held` by another claim under NVIDIA's
/// `--consumable-shares`: NVIDIA's rule that the claims on one device have the same configuration
/// (MPS shares, which NVIDIA refuses anyway, only need each other to be MPS). `None` when it fits.
pub(super) fn share_conflict(held: &SharingSettings, device: &SharingSettings) -> Option<String> {
    match (held, device) {
        (SharingSettings::Mps(_), SharingSettings::Mps(_)) => None,
        (a, b) if a == b => None,
        (a, b) => Some(format!(
            "it is shared with sharing {}, and this claim asks for {}: the claims on one device \
             must have the same configuration",
            a.env_value(),
            b.env_value()
        )),
    }
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

/// The memory a shared device's allocation result consumes (its `consumedCapacity`), in bytes.
fn memory_share(
    result: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult,
) -> Option<u64> {
    let quantity = result.consumed_capacity.as_ref()?.get("memory")?;
    // A share of no memory (Count and Unlimited shares by default) sets no limit.
    if crate::quantity::parse_nanos(&quantity.0) == Some(0) {
        return None;
    }
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
#[path = "sharing_tests.rs"]
mod tests;
