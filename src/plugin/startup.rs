//! What the plugin must know before recovery and its first publish: the MIG mode in force (the
//! GpuNodePolicy, read once with a short timeout, else `--mig-mode`), the faults a previous run saw
//! (`faults.json`), the Event that tells the operator a checkpoint was set aside, and the one that names
//! the claims NVIDIA's plugin left prepared when this plugin runs under NVIDIA's driver name.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::node_events::NodeEvents;
use super::PluginConfig;
use crate::api::{EffectivePolicy, PolicyWatcher};
use crate::claims::checkpoint::current_boot_id;
use crate::claims::Recovery;
use crate::gpu::Inventory;
use crate::health::{Fault, FaultFile, FaultTarget, HealthState};
use crate::observability::Metrics;

/// How long the plugin waits at start for the API server (the GpuNodePolicy read, the claim list of
/// a checkpoint rebuild) before it goes on without the answer.
pub const DEFAULT_STARTUP_API_TIMEOUT: Duration = Duration::from_secs(5);

/// The Event reason when the checkpoint could not be used.
pub const REASON_CHECKPOINT_SET_ASIDE: &str = "CheckpointSetAside";

/// The Event reason when there was no checkpoint although CDI specs of this driver were on disk.
pub const REASON_CHECKPOINT_MISSING: &str = "CheckpointMissing";
/// NVIDIA's plugin left claims prepared on this node (a plugin started as `gpu.nvidia.com`).
pub const REASON_NVIDIA_CLAIMS: &str = "NvidiaPreparedClaims";

/// The Event reason when dynamic MIG left MIG devices alone that the plugin did not make.
pub const REASON_MIG_DEVICES_LEFT_ALONE: &str = "MigDevicesLeftAlone";

/// Where the MIG mode (and health policy) the plugin started with came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyAtStart {
    /// The GpuNodePolicy of this name selects the node.
    Policy(String),
    /// No GpuNodePolicy selects the node: the flags apply.
    NoPolicy,
    /// The API server did not answer within the start-up timeout: the flags apply until the
    /// watcher reads the policy.
    TimedOut,
    /// Reading the policy failed (the error): the flags apply until the watcher reads it.
    Failed(String),
}

/// Reads the policy in force on this node, bounded by `config.startup_api_timeout`; says in the log
/// which MIG mode the plugin starts with and why.
pub(super) async fn initial_policy(
    client: &kube::Client,
    config: &PluginConfig,
) -> (Option<EffectivePolicy>, PolicyAtStart) {
    let timeout = config.startup_api_timeout;
    let read = PolicyWatcher::policy_in_force(client.clone(), &config.node_name);
    let (policy, source) = match tokio::time::timeout(timeout, read).await {
        Ok(Ok(Some(policy))) => {
            let name = policy.name.clone();
            (Some(policy), PolicyAtStart::Policy(name))
        }
        Ok(Ok(None)) => (None, PolicyAtStart::NoPolicy),
        Ok(Err(error)) => (None, PolicyAtStart::Failed(error.to_string())),
        Err(_) => (None, PolicyAtStart::TimedOut),
    };
    let flag = config.mig_mode;
    match &source {
        PolicyAtStart::Policy(name) => {
            let mode = policy.as_ref().and_then(|p| p.mig_mode.as_ref());
            info!(policy = %name, mig_mode = ?mode.map(|m| m.as_str()).unwrap_or("(--mig-mode)"), flag = ?flag, "starting with the GpuNodePolicy in force on this node")
        }
        PolicyAtStart::NoPolicy => {
            info!(mig_mode = ?flag, "no GpuNodePolicy selects this node; starting with --mig-mode")
        }
        PolicyAtStart::TimedOut => warn!(
            mig_mode = ?flag,
            timeout_ms = timeout.as_millis() as u64,
            "reading the GpuNodePolicy at start timed out; starting with --mig-mode until the policy watcher reads it"
        ),
        PolicyAtStart::Failed(error) => warn!(
            mig_mode = ?flag,
            %error,
            "reading the GpuNodePolicy at start failed; starting with --mig-mode until the policy watcher reads it"
        ),
    }
    (policy, source)
}

/// The fault state file and the boot it belongs to.
pub struct FaultStore {
    file: FaultFile,
    boot_id: String,
    /// What the file holds, as far as this run knows.
    saved: Option<Vec<(FaultTarget, Fault)>>,
}

impl FaultStore {
    pub(super) fn in_dir(plugin_dir: &Path) -> FaultStore {
        FaultStore {
            file: FaultFile::in_dir(plugin_dir),
            boot_id: current_boot_id(),
            saved: None,
        }
    }

    /// The faults of the previous run that still hold: of this boot, on GPUs that are still here (read,
    /// or seen but unreadable for now: their faults taint them once they read again), and no `lost` for
    /// a GPU that the inventory just read. A file that cannot be used is set aside.
    pub(super) fn load(&mut self, inventory: &Inventory, metrics: &Metrics) -> HealthState {
        let loaded = match self.file.load(&self.boot_id) {
            Ok(loaded) => loaded,
            Err(error) => {
                let moved = crate::fsutil::set_aside(self.file.path(), "corrupt");
                metrics.state_file_set_aside("faults", error.kind());
                warn!(%error, moved_to = ?moved.as_ref().ok(), move_error = ?moved.as_ref().err().map(|e| e.to_string()), "fault state cannot be used; set aside, starting without the faults of the previous run");
                return HealthState::new();
            }
        };
        let (kept, dropped): (Vec<_>, Vec<_>) =
            loaded.faults.into_iter().partition(|(target, fault)| {
                let present = inventory.gpus.iter().any(|g| g.uuid == target.gpu_uuid)
                    || inventory
                        .unreadable
                        .iter()
                        .any(|g| g.uuid.as_deref() == Some(target.gpu_uuid.as_str()));
                let answers_again = *fault == Fault::Lost && target.gpu_instance_id.is_none();
                present && !answers_again
            });
        let mut state = HealthState::with_faults(kept);
        state.forget_vanished_mig_devices(inventory);
        let kept = state.unrecovered();
        if !kept.is_empty() || !dropped.is_empty() || loaded.skipped > 0 {
            info!(
                kept = kept.len(),
                dropped = dropped.len() + loaded.skipped,
                faults = ?kept.iter().map(|(t, f)| format!("{} {}", t.gpu_uuid, f.describe())).collect::<Vec<_>>(),
                "faults of the previous run restored (dropped: of an earlier boot, of GPUs gone or answering again)"
            );
        }
        state
    }

    /// Writes the faults not yet recovered, when they changed since the last write.
    pub(super) fn save(&mut self, state: &HealthState) {
        let now = state.unrecovered();
        if self.saved.as_ref() == Some(&now) {
            return;
        }
        // A small file, written rarely (on fault changes): blocking the monitor for it is fine.
        match self.file.store(&self.boot_id, &now) {
            Ok(()) => self.saved = Some(now),
            Err(error) => {
                warn!(%error, "saving the fault state failed; after a restart these faults would be forgotten")
            }
        }
    }
}

/// Tells the operator, as a Warning Event on the Node, that the checkpoint was set aside (or missing
/// while CDI specs of this driver were on disk) and what the rebuild kept and left; in the
/// background, so a slow API server does not hold up the start.
/// Under NVIDIA's driver name, says which claims NVIDIA's plugin prepared on this node were taken
/// over (their pods are unprepared by this plugin when they go) and which were not, and why
/// (docs/nvidia-compatibility.md). NVIDIA's checkpoint is only read.
pub(super) fn report_nvidia_claims(events: &Arc<NodeEvents>, adoption: &crate::claims::Adoption) {
    let mut notes = Vec::new();
    if !adoption.adopted.is_empty() {
        notes.push(format!(
            "Took over {} claim(s) that NVIDIA's DRA plugin prepared on this node (its checkpoint.json is left as it is): {}. \
             When their pods go, gpu-dra unprepares them as NVIDIA's plugin would (its MPS daemons, MIG devices, sharing modes and CDI specs).",
            adoption.adopted.len(),
            adoption.adopted.join("; ")
        ));
    }
    if !adoption.not_adopted.is_empty() {
        notes.push(format!(
            "Claims of NVIDIA's checkpoint not taken over: {}.",
            adoption.not_adopted.join("; ")
        ));
    }
    if !adoption.unprepared_since.is_empty() {
        let path = adoption
            .checkpoint
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let live = if adoption.adopted.is_empty() && adoption.not_adopted.is_empty() {
            "No claim it lists is in force any more: move it aside (mv"
        } else {
            "Once the claims above are gone too, move it aside (mv"
        };
        notes.push(format!(
            "NVIDIA's checkpoint still lists {} claim(s) that gpu-dra has unprepared since ({}); gpu-dra never writes that file. \
             NVIDIA's DRA plugin, swapped back, would refuse their devices to new claims. {live} {path} {path}.old) before NVIDIA's plugin runs on this node again.",
            adoption.unprepared_since.len(),
            adoption.unprepared_since.join("; ")
        ));
    }
    if let Some(error) = &adoption.error {
        notes.push(format!(
            "NVIDIA's checkpoint could not be read (left as it is), so no claim NVIDIA's plugin prepared was taken over: {error}. \
             Drain the pods that use gpu.nvidia.com devices on this node, or swap NVIDIA's plugin back until they are gone."
        ));
    }
    if notes.is_empty() {
        return;
    }
    let note = notes.join(" ");
    warn!("{note}");
    let events = events.clone();
    tokio::spawn(async move { events.warn(REASON_NVIDIA_CLAIMS, "Start", &note).await });
}

pub(super) fn report_recovery(events: &Arc<NodeEvents>, recovery: &Recovery) {
    report_mig_devices_left_alone(events, recovery);
    let (reason, mut note) = match (&recovery.checkpoint_set_aside, &recovery.checkpoint_missing) {
        (Some(aside), _) => {
            let moved = match &aside.moved_to {
                Some(path) => format!("set aside as {}", path.display()),
                None => "could not be moved aside".to_string(),
            };
            (
                REASON_CHECKPOINT_SET_ASIDE,
                format!(
                    "The checkpoint could not be used ({}: {}) and was {moved}. ",
                    aside.kind, aside.reason
                ),
            )
        }
        (None, Some(path)) => (
            REASON_CHECKPOINT_MISSING,
            format!(
                "There was no checkpoint at {} although CDI specs of this driver were on disk (a checkpoint deleted, or --kubelet-plugins-dir changed). ",
                path.display()
            ),
        ),
        (None, None) => return,
    };
    note.push_str(&format!(
        "Rebuilt {} prepared claim(s) from the CDI specs on disk and the ResourceClaims in the API server. ",
        recovery.kept.len(),
    ));
    if recovery.left_in_place.is_empty() {
        note.push_str("No CDI spec or MIG device was removed.");
    } else {
        note.push_str(&format!(
            "Left in place, not deleted: CDI specs of {} claim(s) that could not be matched to an allocation on this node ({}), and, in dynamic MIG mode, the MIG devices no known claim owns; the specs go when the kubelet unprepares those claims.",
            recovery.left_in_place.len(),
            recovery.left_in_place.join(", ")
        ));
    }
    let events = events.clone();
    tokio::spawn(async move { events.warn(reason, "Recover", &note).await });
}

/// Tells the operator which MIG devices the dynamic-MIG sweep left alone because the plugin did not
/// make them: they hold memory slices that the published placements count as free.
fn report_mig_devices_left_alone(events: &Arc<NodeEvents>, recovery: &Recovery) {
    if recovery.mig_devices_left_alone.is_empty() {
        return;
    }
    let note = format!(
        "Dynamic MIG mode: {} MIG device(s) that no prepared claim owns and this plugin did not make were left alone ({}). Prepares of placements they overlap fail until an admin destroys them (nvidia-smi mig -dci / -dgi) or switches the node to static MIG mode.",
        recovery.mig_devices_left_alone.len(),
        recovery.mig_devices_left_alone.join(", ")
    );
    let events = events.clone();
    tokio::spawn(async move {
        events
            .warn(REASON_MIG_DEVICES_LEFT_ALONE, "Recover", &note)
            .await
    });
}
