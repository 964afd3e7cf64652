//! The plugin as an assembly of named parts. Each part starts within a bound that `/healthz` watches
//! (a part past it fails `/healthz`, naming the part), logs how long it took, owns the tasks it
//! spawned and what to undo when it stops, and stops on its own: the parts stop in the reverse order
//! of their start, on shutdown and when a later part fails to start.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use super::supervise::Vital;
use super::{claims_setup, startup, PluginConfig, PluginError};
use crate::claims;
use crate::observability::Liveness;

/// How long each part of the start may take before `/healthz` fails naming it, so that the kubelet
/// restarts a start that no longer progresses. Each bound is the worst case of what the part waits
/// for, where that is bounded (the API server's start-up timeout, the sharing timeout, recovery's
/// bounds), with room for the work around it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartBounds {
    /// `/healthz`, `/readyz` and `/metrics` bound.
    pub http: Duration,
    /// The backend opened (NVML's init), the GPUs read, the driver's files for containers found.
    pub backend: Duration,
    /// The GpuNodePolicy in force read.
    pub policy: Duration,
    /// The claims prepared before the start recovered.
    pub recovery: Duration,
    /// The faults of the previous run loaded, the GPU event reader and the monitor started.
    pub health_monitor: Duration,
    pub dra_socket: Duration,
    pub registration_socket: Duration,
    pub publisher: Duration,
    pub readiness: Duration,
}

/// A part that binds a socket or spawns tasks, and waits on nothing outside the process.
const QUICK: Duration = Duration::from_secs(10);

/// NVML's init and a read of every GPU, and a search of the driver root for the files containers need:
/// seconds, or tens where persistence mode is off and the driver brings up each GPU as it is opened.
const BACKEND: Duration = Duration::from_secs(60);

impl PartBounds {
    /// The bounds for a plugin with these timeouts (`--startup-api-timeout-seconds`, the sharing
    /// timeout).
    pub const fn for_timeouts(startup_api_timeout: Duration, sharing_timeout: Duration) -> Self {
        PartBounds {
            http: QUICK,
            backend: BACKEND,
            policy: startup_api_timeout.saturating_add(QUICK),
            // The daemons' image read from the plugin's own Pod, then the claims.
            recovery: claims_setup::OWN_IMAGE_TIMEOUT
                .saturating_add(claims::recovery_bound(startup_api_timeout, sharing_timeout))
                .saturating_add(QUICK),
            health_monitor: QUICK,
            dra_socket: QUICK,
            registration_socket: QUICK,
            publisher: QUICK,
            readiness: QUICK,
        }
    }

    /// The bounds `config` sets, else those of its timeouts.
    pub fn for_config(config: &PluginConfig) -> Self {
        config.start_bounds.unwrap_or(Self::for_timeouts(
            config.startup_api_timeout,
            config.sharing_timeout,
        ))
    }

    /// The longest the whole start takes before one of its parts is past its bound.
    pub const fn total(&self) -> Duration {
        self.http
            .saturating_add(self.backend)
            .saturating_add(self.policy)
            .saturating_add(self.recovery)
            .saturating_add(self.health_monitor)
            .saturating_add(self.dra_socket)
            .saturating_add(self.registration_socket)
            .saturating_add(self.publisher)
            .saturating_add(self.readiness)
    }
}

/// The bounds of a plugin started with the default timeouts, as the DaemonSet starts it.
pub const DEFAULT_PART_BOUNDS: PartBounds = PartBounds::for_timeouts(
    startup::DEFAULT_STARTUP_API_TIMEOUT,
    claims::SHARING_TIMEOUT,
);

/// The worst-case start of a plugin with the default timeouts: the DaemonSet's startup probe allows
/// at least this long (a test compares them).
pub const STARTUP_BOUND: Duration = DEFAULT_PART_BOUNDS.total();

/// One part while it runs: its stop signal, the tasks it spawned and what to undo when it stops.
/// Clones are the same part.
#[derive(Clone)]
pub(super) struct Part {
    inner: Arc<PartInner>,
}

struct PartInner {
    name: &'static str,
    stop: watch::Sender<bool>,
    vital: Vital,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    undo: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

impl Part {
    fn new(name: &'static str, vital: Vital) -> Self {
        Part {
            inner: Arc::new(PartInner {
                name,
                stop: watch::channel(false).0,
                vital,
                tasks: Mutex::default(),
                undo: Mutex::default(),
            }),
        }
    }

    /// Turns true when this part stops (and ends, as a closed channel, if the plugin is dropped).
    pub(super) fn stop_signal(&self) -> watch::Receiver<bool> {
        self.inner.stop.subscribe()
    }

    /// Runs `task` until the part stops; the plugin goes on without it if it ends.
    pub(super) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        self.keep(tokio::spawn(task));
    }

    /// Runs `task` as the vital task `name`: its end outside shutdown fails `/healthz`.
    pub(super) fn spawn_vital(
        &self,
        name: &'static str,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        self.keep(self.inner.vital.spawn(name, task));
    }

    /// Like `spawn_vital`, for a task that says why it ended (shown by `/healthz`).
    pub(super) fn spawn_vital_explained(
        &self,
        name: &'static str,
        task: impl Future<Output = String> + Send + 'static,
    ) {
        self.keep(self.inner.vital.spawn_explained(name, task));
    }

    /// A task spawned elsewhere that ends when this part's stop signal turns true.
    pub(super) fn keep(&self, task: JoinHandle<()>) {
        lock(&self.inner.tasks).push(task);
    }

    /// Runs `undo` when the part stops, once its tasks have ended (a socket file removed).
    pub(super) fn on_stop(&self, undo: impl FnOnce() + Send + 'static) {
        lock(&self.inner.undo).push(Box::new(undo));
    }

    /// Signals the part's tasks, waits for each (5 s at most), then undoes what it made.
    async fn stop(&self) {
        let began = Instant::now();
        let _ = self.inner.stop.send(true);
        let tasks = std::mem::take(&mut *lock(&self.inner.tasks));
        for task in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        let undo = std::mem::take(&mut *lock(&self.inner.undo));
        for undo in undo.into_iter().rev() {
            undo();
        }
        debug!(
            part = self.inner.name,
            took_ms = began.elapsed().as_millis() as u64,
            "plugin part stopped"
        );
    }
}

/// The parts started so far, in order.
pub(super) struct Assembly {
    liveness: Arc<Liveness>,
    stopping: watch::Sender<bool>,
    vital: Vital,
    started: Vec<Part>,
    began: Instant,
}

impl Assembly {
    pub(super) fn new(liveness: Arc<Liveness>) -> Self {
        let (stopping, stopping_rx) = watch::channel(false);
        Assembly {
            vital: Vital::new(liveness.clone(), stopping_rx),
            liveness,
            stopping,
            started: Vec::new(),
            began: Instant::now(),
        }
    }

    /// Starts the part `name` with `start`, which gets the part to spawn its tasks into; `/healthz`
    /// fails while it runs past `bound`. A part that fails stops the parts started before it, and
    /// its error is the start's.
    pub(super) async fn start<T, Started>(
        &mut self,
        name: &'static str,
        bound: Duration,
        start: impl FnOnce(Part) -> Started,
    ) -> Result<T, PluginError>
    where
        Started: Future<Output = Result<T, PluginError>>,
    {
        let part = Part::new(name, self.vital.clone());
        self.started.push(part.clone());
        self.liveness.part_starting(name, bound);
        let began = Instant::now();
        let outcome = start(part).await;
        let took = began.elapsed();
        let took_ms = took.as_millis() as u64;
        match &outcome {
            Ok(_) if took > bound => {
                warn!(
                    part = name,
                    took_ms,
                    bound_ms = bound.as_millis() as u64,
                    "plugin part started, past its bound (/healthz failed meanwhile)"
                )
            }
            Ok(_) => info!(part = name, took_ms, "plugin part started"),
            Err(error) => {
                error!(part = name, took_ms, %error, "plugin part failed to start; stopping the parts started before it");
                self.liveness.start_over();
                self.stop_parts().await;
            }
        }
        outcome
    }

    /// Every part has started: `/healthz` now watches the vital tasks alone. Returns how long the
    /// start took.
    pub(super) fn all_started(&self) -> Duration {
        self.liveness.start_over();
        self.began.elapsed()
    }

    /// Cancels the vital task `name` as if it had died; false when there is none.
    pub(super) fn abort_vital(&self, name: &str) -> bool {
        self.vital.abort(name)
    }

    /// Stops the parts, the last started first.
    pub(super) async fn stop(mut self) {
        self.stop_parts().await;
    }

    async fn stop_parts(&mut self) {
        let _ = self.stopping.send(true);
        while let Some(part) = self.started.pop() {
            part.stop().await;
        }
    }
}

/// A poisoned lock still holds the list as last written, which is all a stop needs.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
