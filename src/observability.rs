//! What operators watch: Prometheus metrics, the `/healthz`, `/readyz` and `/metrics` endpoints
//! (`probes.rs`), and logging set-up (text or JSON).

mod probes;

pub use probes::{serve_http, Liveness, Readiness};

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tracing_subscriber::filter::Targets;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SliceSyncLabels {
    outcome: &'static str,
}

/// How one sync of the node's ResourceSlices ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SliceSync {
    /// The server's slices already matched the devices: nothing written.
    Unchanged,
    /// Writes made the server's slices match.
    Written,
    /// Nothing written: the devices use fields the server drops and are being recomputed.
    Deferred,
    /// A request failed; the sync is retried with backoff.
    Failed,
}

impl SliceSync {
    fn label(self) -> &'static str {
        match self {
            SliceSync::Unchanged => "unchanged",
            SliceSync::Written => "written",
            SliceSync::Deferred => "deferred",
            SliceSync::Failed => "error",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SetAsideLabels {
    file: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FeatureGateLabels {
    feature_gate: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassProblemLabels {
    class: String,
    problem: &'static str,
}

/// The plugin's metrics; cheap to update from any task.
pub struct Metrics {
    registry: Registry,
    prepared: Family<OutcomeLabels, Counter>,
    unprepared: Family<OutcomeLabels, Counter>,
    prepare_seconds: Histogram,
    unprepare_seconds: Histogram,
    published_devices: Gauge,
    slice_syncs: Family<SliceSyncLabels, Counter>,
    slices_confirmed: Gauge<f64, AtomicU64>,
    api_errors: Family<OperationLabels, Counter>,
    api_timeouts: Family<OperationLabels, Counter>,
    device_healthy: Family<DeviceLabels, Gauge>,
    faults: Family<FaultLabels, Counter>,
    device_class_problems: Family<ClassProblemLabels, Gauge>,
    state_files_set_aside: Family<SetAsideLabels, Counter>,
    feature_gate_disabled: Family<FeatureGateLabels, Gauge>,
    unreadable_gpus: Gauge,
    gpu_operation_stuck: Family<GpuLabels, Gauge>,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("gpu_dra");
        let prepared = Family::<OutcomeLabels, Counter>::default();
        let unprepared = Family::<OutcomeLabels, Counter>::default();
        // 0.5 ms .. ~16 s: a prepare is milliseconds normally and up to the kubelet's 45 s deadline when stuck.
        let prepare_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let unprepare_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let published_devices = Gauge::default();
        let slice_syncs = Family::<SliceSyncLabels, Counter>::default();
        let slices_confirmed = Gauge::<f64, AtomicU64>::default();
        let api_errors = Family::<OperationLabels, Counter>::default();
        let api_timeouts = Family::<OperationLabels, Counter>::default();
        let device_healthy = Family::<DeviceLabels, Gauge>::default();
        let faults = Family::<FaultLabels, Counter>::default();
        let device_class_problems = Family::<ClassProblemLabels, Gauge>::default();
        let state_files_set_aside = Family::<SetAsideLabels, Counter>::default();
        registry.register(
            "state_files_set_aside",
            "State files of the plugin that could not be used and were set aside as <file>.corrupt-<time>, \
             by file (checkpoint, faults) and reason (corrupt, unreadable, too_new)",
            state_files_set_aside.clone(),
        );
        let feature_gate_disabled = Family::<FeatureGateLabels, Gauge>::default();
        registry.register(
            "feature_gate_disabled",
            "1 while the API server drops the ResourceSlice fields of this feature gate \
             (DRAPartitionableDevices, DRADeviceTaints) and the node publishes without them, else 0",
            feature_gate_disabled.clone(),
        );
        let unreadable_gpus = Gauge::default();
        registry.register(
            "unreadable_gpus",
            "GPUs the backend sees but cannot read (lost, in a MIG mode change, any per-GPU error); left out of the ResourceSlices",
            unreadable_gpus.clone(),
        );
        let gpu_operation_stuck = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_operation_stuck",
            "1 while an operation on the GPU (a sharing-mode change, a MIG create or destroy) has not returned \
             within its bound, so the GPU takes no other; 0 once it returned",
            gpu_operation_stuck.clone(),
        );
        registry.register(
            "device_class_problems",
            "1 for each DeviceClass whose selectors error on this node's devices (DeviceClassSelectorError) or \
             that names this driver and matches none of them (DeviceClassMatchesNothing)",
            device_class_problems.clone(),
        );
        registry.register(
            "device_healthy",
            "1 for a published device that is healthy, 0 for one with a fault that takes it out of use",
            device_healthy.clone(),
        );
        registry.register(
            "faults",
            "GPU faults seen, by kind (xid_<n>, double_bit_ecc, retirement_pending, row_remap_failure, gpu_lost)",
            faults.clone(),
        );
        registry.register(
            "claims_prepared",
            "Claims handled by NodePrepareResources, by outcome (ok or error)",
            prepared.clone(),
        );
        registry.register(
            "claims_unprepared",
            "Claims handled by NodeUnprepareResources, by outcome (ok or error)",
            unprepared.clone(),
        );
        registry.register(
            "prepare_duration_seconds",
            "Time to prepare one claim",
            prepare_seconds.clone(),
        );
        registry.register(
            "unprepare_duration_seconds",
            "Time to unprepare one claim",
            unprepare_seconds.clone(),
        );
        registry.register(
            "published_devices",
            "Devices in the ResourceSlices of this node",
            published_devices.clone(),
        );
        registry.register(
            "slice_syncs",
            "Syncs of this node's ResourceSlices with the API server, by outcome (unchanged: they already \
             matched; written: writes made them match; deferred: devices being recomputed; error)",
            slice_syncs.clone(),
        );
        registry.register(
            "slices_confirmed_timestamp_seconds",
            "Unix time of the last sync that found the API server's ResourceSlices of this node matching its \
             devices or made them match; 0 before the first. An idle node does not sync, so an old value \
             alone is no fault; while syncs fail (slice_syncs_total{outcome=\"error\"}) it says since when \
             the slices have gone unconfirmed",
            slices_confirmed.clone(),
        );
        registry.register(
            "api_errors",
            "Failed requests to the Kubernetes API server, by operation",
            api_errors.clone(),
        );
        registry.register(
            "api_timeouts",
            "Requests to the Kubernetes API server that got no answer in time (hung or unreachable server), \
             by operation; each is also counted in api_errors",
            api_timeouts.clone(),
        );
        Arc::new(Metrics {
            registry,
            prepared,
            unprepared,
            prepare_seconds,
            unprepare_seconds,
            published_devices,
            slice_syncs,
            slices_confirmed,
            api_errors,
            api_timeouts,
            device_healthy,
            faults,
            device_class_problems,
            state_files_set_aside,
            feature_gate_disabled,
            unreadable_gpus,
            gpu_operation_stuck,
        })
    }

    /// Sets the health of every published device (devices no longer published are dropped).
    pub fn set_device_health(&self, devices: &[(String, bool)]) {
        self.device_healthy.clear();
        for (device, healthy) in devices {
            self.device_healthy
                .get_or_create(&DeviceLabels {
                    device: device.clone(),
                })
                .set(i64::from(*healthy));
        }
    }

    /// Sets the classes with a problem on this node (classes no longer listed are dropped).
    pub fn set_device_class_problems(&self, problems: &[(String, &'static str)]) {
        self.device_class_problems.clear();
        for (class, problem) in problems {
            self.device_class_problems
                .get_or_create(&ClassProblemLabels {
                    class: class.clone(),
                    problem,
                })
                .set(1);
        }
    }

    /// Whether the API server drops the fields of `feature_gate` (it is off there).
    pub fn set_feature_gate_disabled(&self, feature_gate: &'static str, disabled: bool) {
        self.feature_gate_disabled
            .get_or_create(&FeatureGateLabels { feature_gate })
            .set(i64::from(disabled));
    }

    /// Whether an operation on GPU `gpu` (`gpu-<minor>`) has not returned within its bound.
    pub fn set_gpu_operation_stuck(&self, gpu: &str, stuck: bool) {
        self.gpu_operation_stuck
            .get_or_create(&GpuLabels {
                gpu: gpu.to_string(),
            })
            .set(i64::from(stuck));
    }

    pub fn set_unreadable_gpus(&self, count: usize) {
        self.unreadable_gpus.set(count as i64);
    }

    pub fn fault_seen(&self, kind: &str) {
        self.faults
            .get_or_create(&FaultLabels {
                kind: kind.to_string(),
            })
            .inc();
    }

    /// A state file (`checkpoint`, `faults`) was set aside for `reason`.
    pub fn state_file_set_aside(&self, file: &'static str, reason: &'static str) {
        self.state_files_set_aside
            .get_or_create(&SetAsideLabels { file, reason })
            .inc();
    }

    pub fn claim_prepared(&self, ok: bool, elapsed: Duration) {
        self.prepared.get_or_create(&outcome(ok)).inc();
        self.prepare_seconds.observe(elapsed.as_secs_f64());
    }

    pub fn claim_unprepared(&self, ok: bool, elapsed: Duration) {
        self.unprepared.get_or_create(&outcome(ok)).inc();
        self.unprepare_seconds.observe(elapsed.as_secs_f64());
    }

    pub fn set_published_devices(&self, count: usize) {
        self.published_devices.set(count as i64);
    }

    /// A sync of the node's slices ended with `outcome`; one that leaves the server's slices matching the
    /// devices (unchanged or written) also sets the confirmation time to now.
    pub fn slice_sync(&self, outcome: SliceSync) {
        self.slice_syncs
            .get_or_create(&SliceSyncLabels {
                outcome: outcome.label(),
            })
            .inc();
        if matches!(outcome, SliceSync::Unchanged | SliceSync::Written) {
            // A clock before 1970 leaves the gauge as it was rather than going back to 0.
            if let Ok(now) = SystemTime::now().duration_since(UNIX_EPOCH) {
                self.slices_confirmed.set(now.as_secs_f64());
            }
        }
    }

    pub fn api_error(&self, operation: &'static str) {
        self.api_errors
            .get_or_create(&OperationLabels { operation })
            .inc();
    }

    /// A request that got no answer in time; counted as an API error too.
    pub fn api_timeout(&self, operation: &'static str) {
        self.api_error(operation);
        self.api_timeouts
            .get_or_create(&OperationLabels { operation })
            .inc();
    }

    /// The Prometheus text exposition of all metrics.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

fn outcome(ok: bool) -> OutcomeLabels {
    OutcomeLabels {
        outcome: if ok { "ok" } else { "error" },
    }
}

/// Log format of `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global tracing subscriber; `RUST_LOG` filters (else `default_level`). Safe to call twice.
pub fn init_logging(format: LogFormat, default_level: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = log_filter(std::env::var("RUST_LOG").ok().as_deref(), default_level);
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .log_internal_errors(true);
    let registry = tracing_subscriber::registry().with(filter);
    let _ = match format {
        LogFormat::Text => registry.with(layer).try_init(),
        LogFormat::Json => registry
            .with(layer.json().with_current_span(true))
            .try_init(),
    };
}

/// What `RUST_LOG` lets through: a comma-separated list of `target=level` and bare levels (`warn`,
/// `gpu_dra=debug,kube=info`). Unset, empty or unreadable, `default_level` applies.
fn log_filter(rust_log: Option<&str>, default_level: &str) -> Targets {
    rust_log
        .filter(|directives| !directives.trim().is_empty())
        .and_then(|directives| directives.parse().ok())
        .unwrap_or_else(|| default_level.parse().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::{log_filter, Metrics, SliceSync};
    use tracing::Level;

    fn sample(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn slice_syncs_are_counted_by_outcome_and_only_a_match_confirms() {
        let metrics = Metrics::new();
        let confirmed = "gpu_dra_slices_confirmed_timestamp_seconds";
        assert_eq!(sample(&metrics.encode(), confirmed), Some(0.0));

        metrics.slice_sync(SliceSync::Failed);
        metrics.slice_sync(SliceSync::Deferred);
        let text = metrics.encode();
        assert_eq!(sample(&text, confirmed), Some(0.0), "{text}");
        assert_eq!(
            sample(&text, r#"gpu_dra_slice_syncs_total{outcome="error"}"#),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, r#"gpu_dra_slice_syncs_total{outcome="deferred"}"#),
            Some(1.0)
        );

        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        metrics.slice_sync(SliceSync::Written);
        metrics.slice_sync(SliceSync::Unchanged);
        metrics.slice_sync(SliceSync::Unchanged);
        let text = metrics.encode();
        let at = sample(&text, confirmed).unwrap();
        assert!(at >= before && at < before + 60.0, "{at} vs {before}");
        assert_eq!(
            sample(&text, r#"gpu_dra_slice_syncs_total{outcome="written"}"#),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, r#"gpu_dra_slice_syncs_total{outcome="unchanged"}"#),
            Some(2.0)
        );
    }

    #[test]
    fn rust_log_is_a_list_of_targets_and_levels() {
        let filter = log_filter(Some("gpu_dra=debug,kube=warn"), "info");
        assert!(filter.would_enable("gpu_dra::plugin", &Level::DEBUG));
        assert!(!filter.would_enable("gpu_dra::plugin", &Level::TRACE));
        assert!(filter.would_enable("kube::client", &Level::WARN));
        assert!(!filter.would_enable("kube::client", &Level::INFO));
        // Targets it does not name are off, as with no bare level.
        assert!(!filter.would_enable("hyper", &Level::ERROR));

        let filter = log_filter(Some("warn,gpu_dra=trace"), "info");
        assert!(filter.would_enable("rustls", &Level::WARN));
        assert!(!filter.would_enable("rustls", &Level::INFO));
        assert!(filter.would_enable("gpu_dra", &Level::TRACE));
    }

    #[test]
    fn without_a_readable_rust_log_the_default_level_applies() {
        for rust_log in [
            None,
            Some(""),
            Some("  "),
            Some("gpu_dra=loud"),
            Some("a=b=c"),
        ] {
            let filter = log_filter(rust_log, "info");
            assert!(filter.would_enable("gpu_dra", &Level::INFO), "{rust_log:?}");
            assert!(
                !filter.would_enable("gpu_dra", &Level::DEBUG),
                "{rust_log:?}"
            );
        }
        let filter = log_filter(None, "error");
        assert!(filter.would_enable("gpu_dra", &Level::ERROR));
        assert!(!filter.would_enable("gpu_dra", &Level::WARN));
    }
}
