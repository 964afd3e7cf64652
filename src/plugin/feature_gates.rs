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
pub fn disabled_note(field: GatedField, mig_mode: MigMode) -> String {
    let relevance = match (field, mig_mode) {
        (GatedField::Counters, MigMode::Dynamic) => "",
        (GatedField::Counters, _) => " (it matters only with --mig-mode dynamic)",
        (GatedField::Taints, _) => "",
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
                let note = disabled_note(field, mig_mode);
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
        let counters = disabled_note(GatedField::Counters, MigMode::Dynamic);
        assert!(counters.contains("DRAPartitionableDevices"), "{counters}");
        assert!(counters.contains("--mig-mode static"), "{counters}");
        assert!(counters.contains("whole GPUs only"), "{counters}");
        assert!(disabled_note(GatedField::Counters, MigMode::Static).contains("only with"));
        let taints = disabled_note(GatedField::Taints, MigMode::Dynamic);
        assert!(taints.contains("DRADeviceTaints"), "{taints}");
        assert!(taints.contains("faulty devices out"), "{taints}");
        assert!(taints.len() <= 1024 && counters.len() <= 1024);
    }
}
