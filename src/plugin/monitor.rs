//! The health monitor: reads the backend's events on a thread of its own, keeps the fault state, and
//! turns inventory + faults + the admin's policy into what the node publishes (devices with taints)
//! and what the kubelet hears (device health). Every input change recomputes both outputs; a burst of
//! events becomes one recomputation per wake-up, and the publisher coalesces further.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{Device, DeviceTaint};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::api::{self, EffectivePolicy};
use crate::devices::{node_devices, share_devices, MigMode, NodeDevices, Shares};
use crate::domains::channels::channel_devices;
use crate::gpu::{GpuBackend, GpuEvent, Inventory};
use crate::health::{Fault, HealthPolicy, HealthState, TaintEffect};
use crate::kubelet::DeviceHealthReport;
use crate::observability::Metrics;
use crate::slices::kept_fields::{
    effective_mig_mode, effective_shares, withhold_faulty, KeptFields,
};

use super::startup::FaultStore;

/// How long one wait for a backend event lasts, so the reader notices shutdown promptly.
const EVENT_WAIT: Duration = Duration::from_millis(100);
/// Pause after a failed wait, so a broken event source does not spin.
const EVENT_ERROR_PAUSE: Duration = Duration::from_secs(1);

/// What the admin's policy sets for this node (a GpuNodePolicy), or the defaults.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodePolicy {
    pub health: HealthPolicy,
    /// `None` keeps the plugin's `--mig-mode`.
    pub mig_mode: Option<MigMode>,
    /// Devices published for sharing (`spec.sharing`); `None` leaves it to `--consumable-shares`.
    pub shares: Option<Shares>,
    /// Write GPU feature discovery's labels on this node (`node_labels`).
    pub classic_node_labels: bool,
    /// GPUs published for VFIO passthrough only (`devices::passthrough`).
    pub passthrough: Option<api::policy::PassthroughSpec>,
}

impl NodePolicy {
    /// The policy a GpuNodePolicy sets (valid: the watcher passes only accepted specs); fields it
    /// leaves out keep their defaults.
    pub fn from_effective(policy: &EffectivePolicy) -> NodePolicy {
        let defaults = HealthPolicy::default();
        let effect = |spec: &Option<api::TaintEffect>, default: TaintEffect| match spec {
            Some(api::TaintEffect::None) => TaintEffect::None,
            Some(api::TaintEffect::NoSchedule) => TaintEffect::NoSchedule,
            Some(api::TaintEffect::NoExecute) => TaintEffect::NoExecute,
            _ => default,
        };
        let xids = |list: &[i64]| list.iter().filter_map(|x| u64::try_from(*x).ok()).collect();
        let health = match &policy.health {
            Some(spec) => HealthPolicy {
                extra_ignored_xids: xids(&spec.ignored_xids),
                extra_fatal_xids: xids(&spec.fatal_xids),
                informational_effect: effect(
                    &spec.informational_effect,
                    defaults.informational_effect,
                ),
                reset_required_effect: effect(
                    &spec.reset_required_effect,
                    defaults.reset_required_effect,
                ),
                fatal_effect: effect(&spec.fatal_effect, defaults.fatal_effect),
                clear_on_recovery: spec.clear_on_recovery.unwrap_or(defaults.clear_on_recovery),
            },
            None => defaults,
        };
        let mig_mode = match &policy.mig_mode {
            Some(api::MigModeSpec::None) => Some(MigMode::None),
            Some(api::MigModeSpec::Static) => Some(MigMode::Static),
            Some(api::MigModeSpec::Dynamic) => Some(MigMode::Dynamic),
            _ => None,
        };
        let shares = policy.sharing.as_ref().and_then(|s| s.resolved());
        NodePolicy {
            health,
            mig_mode,
            shares,
            classic_node_labels: policy.classic_node_labels,
            passthrough: policy.passthrough.clone(),
        }
    }
}

/// Passes the policy the GpuNodePolicy watcher selects for this node on to the monitor; no policy
/// (none selects the node, or it was deleted) means the defaults.
pub async fn follow_policies(
    mut selected: watch::Receiver<Option<EffectivePolicy>>,
    policy: watch::Sender<NodePolicy>,
) {
    while selected.changed().await.is_ok() {
        // Not held across an await: the watcher's next send would wait on it.
        let next = selected
            .borrow_and_update()
            .as_ref()
            .map(NodePolicy::from_effective)
            .unwrap_or_default();
        info!(policy = ?selected.borrow().as_ref().map(|p| p.name.clone()), "node policy in force");
        policy.send_replace(next);
    }
}

/// The monitor's inputs and outputs.
pub struct MonitorChannels {
    pub inventory: watch::Receiver<Arc<Inventory>>,
    pub policy: watch::Receiver<NodePolicy>,
    pub events: mpsc::Receiver<GpuEvent>,
    pub devices: watch::Sender<Arc<NodeDevices>>,
    pub health: watch::Sender<Arc<Vec<DeviceHealthReport>>>,
    pub mig_mode: watch::Sender<MigMode>,
    /// The sharing in force (published, so allocated): what prepares enforce.
    pub shares: watch::Sender<Option<Shares>>,
    /// What the API server keeps of counters, taints and shared devices (from the publisher): dynamic
    /// MIG falls back to whole GPUs without counters, faulty devices are withheld without taints, GPUs
    /// are published exclusive without the fields of shared devices.
    pub kept_fields: watch::Receiver<KeptFields>,
    /// IMEX channel devices to taint (ComputeDomains whose daemon here is not ready), and why.
    pub channel_taints: watch::Receiver<BTreeMap<String, &'static str>>,
    /// The GPUs prepared claims hold as GPUs and as passthrough devices.
    pub held_ways: watch::Receiver<crate::devices::passthrough::HeldWays>,
}

pub struct Monitor {
    pub driver: String,
    pub pool: String,
    pub default_mig_mode: MigMode,
    /// `--consumable-shares`, where the policy sets no sharing.
    pub default_shares: Option<Shares>,
    pub metrics: Arc<Metrics>,
    /// IMEX channels published where the node is in an NVLink clique.
    pub imex_channels: u32,
}

/// Reads backend events until `stop` is set, forwarding them to `events`. Backends block in
/// `wait_event` (NVML's event set does), hence a thread rather than a task.
pub fn spawn_event_reader(
    backend: Arc<dyn GpuBackend>,
    events: mpsc::Sender<GpuEvent>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("gpu-events".into())
        // It only waits and forwards; NVML's calls need little stack.
        .stack_size(512 * 1024)
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match backend.wait_event(EVENT_WAIT) {
                    Ok(Some(event)) => {
                        if events.blocking_send(event).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(error) => {
                        warn!(%error, "reading GPU events failed");
                        std::thread::sleep(EVENT_ERROR_PAUSE);
                    }
                }
            }
        })
}

impl Monitor {
    /// Runs until `shutdown` turns true or the event reader ends, starting from the faults the
    /// previous run left (`state`) and saving them to `faults` whenever they change.
    pub async fn run(
        self,
        mut state: HealthState,
        mut faults: FaultStore,
        mut ch: MonitorChannels,
        mut shutdown: watch::Receiver<bool>,
    ) {
        self.recompute(&state, &ch);
        faults.save(&state);
        // A publisher that is gone leaves what it last learned in force; it does not stop the monitor.
        let mut kept_open = true;
        let mut taints_open = true;
        let mut held_open = true;
        loop {
            tokio::select! {
                event = ch.events.recv() => {
                    let Some(event) = event else { return };
                    let mut changed = self.record(&mut state, &event);
                    // Take whatever else arrived in the same burst before recomputing.
                    while let Ok(more) = ch.events.try_recv() {
                        changed |= self.record(&mut state, &more);
                    }
                    if !changed {
                        continue;
                    }
                }
                result = ch.inventory.changed() => {
                    if result.is_err() { return }
                    let inventory = ch.inventory.borrow_and_update().clone();
                    state.forget_vanished_mig_devices(&inventory);
                }
                result = ch.policy.changed() => {
                    if result.is_err() { return }
                    ch.policy.borrow_and_update();
                }
                result = ch.channel_taints.changed(), if taints_open => {
                    // Without ComputeDomains on this node nothing sends; the last taints stay.
                    if result.is_err() {
                        taints_open = false;
                        continue;
                    }
                    ch.channel_taints.borrow_and_update();
                }
                result = ch.held_ways.changed(), if held_open => {
                    if result.is_err() {
                        held_open = false;
                        continue;
                    }
                    ch.held_ways.borrow_and_update();
                }
                result = ch.kept_fields.changed(), if kept_open => {
                    if result.is_err() {
                        kept_open = false;
                        continue;
                    }
                    ch.kept_fields.borrow_and_update();
                }
                _ = shutdown.changed() => return,
            }
            self.recompute(&state, &ch);
            faults.save(&state);
        }
    }

    fn record(&self, state: &mut HealthState, event: &GpuEvent) -> bool {
        let changed = state.apply(event);
        if changed {
            if let Some(fault) = Fault::from_event(&event.kind) {
                self.metrics.fault_seen(&fault_kind(&fault));
                warn!(gpu = %event.gpu_uuid, gpu_instance = ?event.gpu_instance_id, fault = %fault.describe(), "GPU fault");
            } else {
                info!(gpu = %event.gpu_uuid, gpu_instance = ?event.gpu_instance_id, kind = ?event.kind, "GPU health event");
            }
        }
        changed
    }

    /// Devices with taints and health reports from the current inventory, faults and policy.
    pub(super) fn recompute(&self, state: &HealthState, ch: &MonitorChannels) {
        let inventory = ch.inventory.borrow().clone();
        let policy = ch.policy.borrow().clone();
        let kept = *ch.kept_fields.borrow();
        let mode = effective_mig_mode(policy.mig_mode.unwrap_or(self.default_mig_mode), kept);
        let mut node = node_devices(&inventory, mode);
        let held = ch.held_ways.borrow().clone();
        crate::devices::passthrough::publish(&mut node, &inventory, |minor, address| {
            let chosen = policy
                .passthrough
                .as_ref()
                .is_some_and(|p| p.selects(minor, address));
            held.passthrough(chosen, address)
        });
        node.channels = channel_devices(&inventory, self.imex_channels);
        taint_channels(
            &mut node.channels,
            &ch.channel_taints.borrow(),
            &self.driver,
        );
        let shares = effective_shares(policy.shares.or(self.default_shares), kept);
        if let Some(shares) = &shares {
            let too_small = share_devices(&mut node, shares);
            if !too_small.is_empty() {
                debug!(devices = ?too_small, ?shares, "GPUs published exclusive: their memory has no room for the minimum share plus one step");
            }
        }
        // Taints are made for the newest API; the planner fits them to the server's version.
        state.taint(
            &mut node,
            &inventory,
            &self.driver,
            &policy.health,
            u32::MAX,
        );
        let statuses = state.device_health(&node, &inventory, &policy.health);
        // After the health reports: a withheld device still shows as unhealthy to the kubelet.
        let withheld = withhold_faulty(&mut node, kept);
        if !withheld.is_empty() {
            debug!(devices = ?withheld, "faulty devices left out of the ResourceSlices: the API server drops taints");
        }
        self.metrics.set_device_health(
            &statuses
                .iter()
                .map(|s| (s.device.clone(), s.healthy))
                .collect::<Vec<_>>(),
        );
        let mut reports: Vec<DeviceHealthReport> = statuses
            .into_iter()
            .map(|s| DeviceHealthReport {
                pool: self.pool.clone(),
                device: s.device,
                healthy: s.healthy,
                message: s.message,
            })
            .collect();
        // GPUs the backend cannot read are not published, but pods may use them: UNHEALTHY.
        reports.extend(super::gpu_reports::unreadable_health(
            &inventory, &self.pool,
        ));
        send_if_changed(&ch.devices, node);
        send_if_changed(&ch.health, reports);
        ch.shares.send_if_modified(|current| {
            let changed = *current != shares;
            *current = shares;
            changed
        });
        ch.mig_mode.send_if_modified(|current| {
            let changed = *current != mode;
            *current = mode;
            changed
        });
    }
}

fn send_if_changed<T: PartialEq>(tx: &watch::Sender<Arc<T>>, value: T) {
    tx.send_if_modified(|current| {
        let changed = **current != value;
        if changed {
            *current = Arc::new(value);
        }
        changed
    });
}

/// The `kind` label of the fault counter.
fn fault_kind(fault: &Fault) -> String {
    match fault {
        Fault::Xid(xid) => format!("xid_{xid}"),
        Fault::DoubleBitEcc => "double_bit_ecc".into(),
        Fault::RetirementPending => "retirement_pending".into(),
        Fault::RowRemapFailure => "row_remap_failure".into(),
        Fault::Lost => "gpu_lost".into(),
    }
}

/// The taint key of an IMEX channel whose ComputeDomain is not ready on this node.
pub const CHANNEL_TAINT_KEY: &str = "imex-daemon";

/// Taints the channels of domains that are not ready here (NoSchedule: the domain's running pod
/// stays, nothing new of it lands here); the reason is in the domain's status.
fn taint_channels(channels: &mut [Device], taints: &BTreeMap<String, &'static str>, driver: &str) {
    for device in channels {
        if let Some(value) = taints.get(&device.name) {
            device.taints = Some(vec![DeviceTaint {
                key: format!("{driver}/{CHANNEL_TAINT_KEY}"),
                value: Some(value.to_string()),
                effect: "NoSchedule".to_string(),
                time_added: None,
            }]);
        }
    }
}
