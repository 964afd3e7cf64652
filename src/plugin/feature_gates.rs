//! Tells the operator when the API server drops ResourceSlice fields because a feature gate is off
//! there (and when it keeps them again): a Warning Event on the Node, a log line and a metric, each
//! naming the gate, once per change. The publisher learns it; the health monitor acts on it.

use std::sync::Arc;

use tokio::sync::watch;
use tracing::{info, warn};

use super::node_events::NodeEvents;
use crate::devices::MigMode;
use crate::observability::Metrics;
use crate::slices::{GatedField, KeptFields};

/// Event reason while a gate's fields are dropped.
pub const REASON_DISABLED: &str = "FeatureGateDisabled";
/// Event reason when the server keeps them again.
pub const REASON_ENABLED: &str = "FeatureGateEnabled";

/// The Event's note for a dropped field: the gate, what the node does instead, what the admin can do.
/// `mig_mode` and `mps_shares` (a GpuNodePolicy sets `spec.sharing`, or `--consumable-shares` is set) say whether the
/// node uses the field now.
pub fn disabled_note(field: GatedField, mig_mode: MigMode, mps_shares: bool) -> String {
    let relevance = match (field, mig_mode) {
        (GatedField::Counters, MigMode::Dynamic) => "",
        (GatedField::Counters, _) => " (it matters only with --mig-mode dynamic)",
        (GatedField::Taints, _) => "",
        (GatedField::ConsumableCapacity, _) if mps_shares => "",
        (GatedField::ConsumableCapacity, _) => {
            " (it matters only where a GpuNodePolicy sets spec.sharing or --consumable-shares is set)"
        }
    };
    format!(
        "feature gate {} is off on the API server{relevance}: {}",
        field.feature_gate(),
        field.consequence()
    )
}

/// Reports every change of `kept` until `shutdown` turns true or the publisher is gone.
pub async fn report(
    mut kept: watch::Receiver<KeptFields>,
    mig_mode: MigMode,
    mps_shares: bool,
    events: Arc<NodeEvents>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut reported = KeptFields::default();
    for field in GatedField::ALL {
        metrics.set_feature_gate_disabled(field.feature_gate(), false);
    }
    loop {
        let now = *kept.borrow_and_update();
        for field in GatedField::ALL {
            if now.keeps(field) == reported.keeps(field) {
                continue;
            }
            let gate = field.feature_gate();
            metrics.set_feature_gate_disabled(gate, !now.keeps(field));
            if now.keeps(field) {
                let note = format!(
                    "the API server keeps the fields of feature gate {gate} again; this node publishes them"
                );
                info!(feature_gate = gate, "{note}");
                events.forget(REASON_DISABLED);
                events.normal_once(REASON_ENABLED, "Publish", &note).await;
            } else {
                let note = disabled_note(field, mig_mode, mps_shares);
                warn!(feature_gate = gate, "{note}");
                events.forget(REASON_ENABLED);
                events.warn_once(REASON_DISABLED, "Publish", &note).await;
            }
        }
        reported = now;
        tokio::select! {
            result = kept.changed() => if result.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_name_the_gate_and_what_to_do() {
        let counters = disabled_note(GatedField::Counters, MigMode::Dynamic, false);
        assert!(counters.contains("DRAPartitionableDevices"), "{counters}");
        assert!(counters.contains("--mig-mode static"), "{counters}");
        assert!(counters.contains("whole GPUs only"), "{counters}");
        assert!(disabled_note(GatedField::Counters, MigMode::Static, false).contains("only with"));
        let taints = disabled_note(GatedField::Taints, MigMode::Dynamic, false);
        assert!(taints.contains("DRADeviceTaints"), "{taints}");
        assert!(taints.contains("faulty devices out"), "{taints}");
        let sharing = disabled_note(GatedField::ConsumableCapacity, MigMode::Static, true);
        assert!(sharing.contains("DRAConsumableCapacity"), "{sharing}");
        assert!(sharing.contains("exclusive use"), "{sharing}");
        assert!(!sharing.contains("matters only"), "{sharing}");
        let unused = disabled_note(GatedField::ConsumableCapacity, MigMode::Static, false);
        assert!(
            unused.contains("matters only where a GpuNodePolicy"),
            "{unused}"
        );
        for note in [taints, counters, sharing, unused] {
            assert!(note.len() <= 1024, "an Event note holds 1 KiB: {note}");
        }
    }
}
