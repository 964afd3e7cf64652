//! Operations on a GPU that run on a blocking thread (NVML, `nvidia-smi`): changes of its sharing mode,
//! and the creates and destroys of its MIG devices. One lock per GPU: operations on one GPU run one at
//! a time, different GPUs in parallel. A driver stuck in the kernel may never give such a thread
//! back, so the caller waits a bounded time; an operation that did not return leaves its GPU marked
//! stuck (what it was doing, since when), later operations on that GPU fail at once saying so, and
//! once it returns its outcome is taken in. Other GPUs go on meanwhile. [`Preparer::stuck_gpus`]
//! lists the stuck GPUs, and the gauge `gpu_dra_gpu_operation_stuck{gpu}` shows them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::sync::OwnedMutexGuard;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::Preparer;
use crate::gpu::{GpuError, GpuSharingMode};
use crate::observability::Metrics;

/// How long one change of a GPU's sharing mode may take before it counts as stuck: `nvidia-smi`'s own
/// timeout (10 s) and NVML's calls, with room to spare, well inside the kubelet's 45 s for a prepare.
pub const SHARING_TIMEOUT: Duration = Duration::from_secs(15);

/// How long one MIG create or destroy may take before it counts as stuck. NVML's MIG calls (MIG mode
/// on or off, a GPU instance and its compute instance made or destroyed) return within a few seconds
/// on a healthy GPU; 15 s leaves room for a busy driver, and a prepare that first waits for the GPU's
/// lock (as long again, at most) still answers well inside the kubelet's 45 s.
pub const MIG_TIMEOUT: Duration = Duration::from_secs(15);

/// How often a caller looks whether an operation that another caller gave up waiting for returned.
const POLL: Duration = Duration::from_millis(10);

/// An operation on a GPU, as messages and [`Preparer::stuck_gpus`] name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum GpuOp {
    SetSharing(GpuSharingMode),
    /// A MIG device of `profile` (`1g.10gb`) at memory slice `start`.
    CreateMig {
        profile: String,
        start: u32,
    },
    /// The MIG device with this UUID.
    DestroyMig {
        uuid: String,
    },
}

impl GpuOp {
    /// What it does: `creating MIG device 1g.10gb at memory slice 3`.
    pub(super) fn doing(&self) -> String {
        match self {
            GpuOp::SetSharing(mode) => format!("setting {mode}"),
            GpuOp::CreateMig { profile, start } => {
                format!("creating MIG device {profile} at memory slice {start}")
            }
            GpuOp::DestroyMig { uuid } => format!("destroying MIG device {uuid}"),
        }
    }

    /// The operation as a noun, after "an earlier".
    fn earlier(&self) -> String {
        match self {
            GpuOp::SetSharing(mode) => format!("change to {mode}"),
            GpuOp::CreateMig { profile, start } => {
                format!("create of MIG device {profile} at memory slice {start}")
            }
            GpuOp::DestroyMig { uuid } => format!("destroy of MIG device {uuid}"),
        }
    }

    /// What may hold it up besides the driver.
    fn stuck_cause(&self) -> &'static str {
        match self {
            GpuOp::SetSharing(_) => "the GPU driver is stuck, or nvidia-smi cannot exit",
            _ => "the GPU driver is stuck",
        }
    }

    /// The start of the message of a failure: the GPU, the operation.
    fn failed(&self, gpu: &str) -> String {
        match self {
            GpuOp::SetSharing(mode) => format!("setting {gpu} to {mode}"),
            other => format!("{gpu}: {}", other.doing()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum GpuOpError {
    #[error(
        "{gpu}: an earlier {} has not returned for {}s ({}); no change to this GPU can be made \
         until it returns",
        op.earlier(), since.as_secs(), op.stuck_cause()
    )]
    Stuck {
        gpu: String,
        op: GpuOp,
        since: Duration,
    },
    #[error(
        "{gpu}: {} did not return within {}s; the GPU driver may be stuck (check \
         `nvidia-smi -q -i {uuid}` and the kernel log for XID errors)",
        op.doing(), timeout.as_secs_f64()
    )]
    TimedOut {
        gpu: String,
        uuid: String,
        op: GpuOp,
        timeout: Duration,
    },
    #[error(
        "{gpu}: another operation on the GPU{} is still running after {}s",
        running.as_ref().map(|op| format!(" ({})", op.doing())).unwrap_or_default(),
        waited.as_secs_f64()
    )]
    Busy {
        gpu: String,
        running: Option<GpuOp>,
        waited: Duration,
    },
    #[error("{}: {source}", op.failed(gpu))]
    Failed {
        gpu: String,
        op: GpuOp,
        source: GpuError,
    },
    #[error("{gpu}: {} ended abnormally: {reason}", op.doing())]
    Aborted {
        gpu: String,
        op: GpuOp,
        reason: String,
    },
}

impl GpuOpError {
    /// Whether the operation was started and may still take effect: it did not return in time.
    pub(super) fn may_still_take_effect(&self) -> bool {
        matches!(self, GpuOpError::TimedOut { .. })
    }

    /// Whether the operation never started: the GPU was stuck or busy with another.
    pub(super) fn not_started(&self) -> bool {
        matches!(self, GpuOpError::Stuck { .. } | GpuOpError::Busy { .. })
    }
}

/// Per-GPU state, by GPU UUID; created on first use and kept (a node has a handful of GPUs).
pub(super) struct GpuOps {
    gpus: Mutex<HashMap<String, Arc<GpuEntry>>>,
    sharing_timeout: Duration,
    mig_timeout: Duration,
    metrics: Arc<Metrics>,
}

#[derive(Default)]
struct GpuEntry {
    /// Held by whoever runs an operation on the GPU.
    lock: Arc<tokio::sync::Mutex<GpuMode>>,
    /// The operation started last that has not been taken in: running, stuck, or returned since.
    /// Readable without the lock, so that stuck GPUs can be listed at any time.
    running: Mutex<Option<Running>>,
}

#[derive(Debug, Default)]
pub(super) struct GpuMode {
    /// The mode last set; `None` when not known (not set by this plugin yet, or the last change
    /// failed or has not returned).
    applied: Option<GpuSharingMode>,
}

struct Running {
    op: GpuOp,
    /// The GPU's name, `gpu-<minor>`.
    gpu: String,
    started: Instant,
    timeout: Duration,
    /// Ends when the operation returns: `Err` with why it failed.
    task: JoinHandle<Result<(), String>>,
    gauge: Arc<Mutex<Gauge>>,
}

impl Running {
    fn stuck(&self) -> bool {
        !self.task.is_finished() && self.started.elapsed() >= self.timeout
    }
}

/// Whether the operation returned, and whether it was reported stuck: set under one lock by the
/// waiter (stuck) and by the blocking thread (returned), so the gauge never stays at 1 for an
/// operation that has returned.
#[derive(Default)]
struct Gauge {
    returned: bool,
    reported: bool,
}

/// One GPU's state, locked.
pub(super) struct HeldGpu {
    gpu: String,
    uuid: String,
    entry: Arc<GpuEntry>,
    state: OwnedMutexGuard<GpuMode>,
    sharing_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl GpuOps {
    /// `sharing_timeout` bounds each change of a sharing mode, `mig_timeout` each MIG create and
    /// destroy; each wait for a GPU's lock is bounded by the timeout of the operation that waits.
    pub(super) fn new(
        sharing_timeout: Duration,
        mig_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            gpus: Mutex::new(HashMap::new()),
            sharing_timeout,
            mig_timeout,
            metrics,
        }
    }

    fn entry(&self, uuid: &str) -> Arc<GpuEntry> {
        super::lock(&self.gpus)
            .entry(uuid.to_string())
            .or_default()
            .clone()
    }

    /// Takes the lock of GPU `uuid` (`gpu` names it in messages) for a change of its sharing mode,
    /// waiting at most the sharing timeout. Fails at once while an earlier operation on the GPU has
    /// not returned; one that returned since is taken in first.
    pub(super) async fn hold(&self, uuid: &str, gpu: &str) -> Result<HeldGpu, GpuOpError> {
        self.hold_within(uuid, gpu, self.sharing_timeout).await
    }

    async fn hold_within(
        &self,
        uuid: &str,
        gpu: &str,
        wait: Duration,
    ) -> Result<HeldGpu, GpuOpError> {
        let deadline = Instant::now() + wait;
        let entry = self.entry(uuid);
        let busy = |entry: &GpuEntry| GpuOpError::Busy {
            gpu: gpu.to_string(),
            running: super::lock(&entry.running).as_ref().map(|r| r.op.clone()),
            waited: wait,
        };
        let state = tokio::time::timeout(wait, entry.lock.clone().lock_owned())
            .await
            .map_err(|_| busy(&entry))?;
        let mut held = HeldGpu {
            gpu: gpu.to_string(),
            uuid: uuid.to_string(),
            entry,
            state,
            sharing_timeout: self.sharing_timeout,
            metrics: self.metrics.clone(),
        };
        held.settle(deadline).await?;
        Ok(held)
    }

    /// Runs `work`, a MIG create or destroy (`op`) on GPU `uuid` (`gpu` names it in messages), on a
    /// blocking thread under the GPU's lock: waits for the lock and for `work` at most the MIG
    /// timeout each. Work that does not return in time keeps running, and the GPU counts as stuck
    /// until it returns.
    pub(super) async fn mig<T: Send + 'static>(
        &self,
        uuid: &str,
        gpu: &str,
        op: GpuOp,
        work: impl FnOnce() -> Result<T, GpuError> + Send + 'static,
    ) -> Result<T, GpuOpError> {
        let mut held = self.hold_within(uuid, gpu, self.mig_timeout).await?;
        held.run(op, self.mig_timeout, work).await
    }

    /// How long one MIG create or destroy may take.
    pub(super) fn mig_timeout(&self) -> Duration {
        self.mig_timeout
    }

    /// Forgets the mode last set on GPU `uuid` (something else changed it), so the next sync sets
    /// it whatever it is. Waits for the GPU's lock as [`hold`](Self::hold) does.
    pub(super) async fn forget(&self, uuid: &str) {
        let entry = self.entry(uuid);
        if let Ok(mut state) =
            tokio::time::timeout(self.sharing_timeout, entry.lock.clone().lock_owned()).await
        {
            state.applied = None;
        }
    }

    /// The GPUs with an operation that has not returned in time: GPU UUID, and what is stuck.
    pub(super) fn stuck(&self) -> Vec<(String, String)> {
        let mut stuck: Vec<(String, String)> = super::lock(&self.gpus)
            .iter()
            .filter_map(|(uuid, entry)| {
                let running = super::lock(&entry.running);
                let running = running.as_ref().filter(|r| r.stuck())?;
                Some((
                    uuid.clone(),
                    format!(
                        "{}: {} has not returned for {}s",
                        running.gpu,
                        running.op.doing(),
                        running.started.elapsed().as_secs()
                    ),
                ))
            })
            .collect();
        stuck.sort();
        stuck
    }
}

impl HeldGpu {
    /// The mode last set on the GPU, if known.
    pub(super) fn applied(&self) -> Option<GpuSharingMode> {
        self.state.applied
    }

    /// Runs `change` (which leaves the GPU in `mode` when it succeeds) on a blocking thread, waiting
    /// at most the sharing timeout; returns whether it changed anything. A change that does not
    /// return in time keeps running, and the GPU counts as stuck until it returns.
    pub(super) async fn change(
        &mut self,
        mode: GpuSharingMode,
        change: impl FnOnce() -> Result<bool, GpuError> + Send + 'static,
    ) -> Result<bool, GpuOpError> {
        self.state.applied = None;
        let changed = self
            .run(GpuOp::SetSharing(mode), self.sharing_timeout, change)
            .await?;
        self.state.applied = Some(mode);
        Ok(changed)
    }

    /// Runs `work` on a blocking thread, waiting at most `timeout` for it. It is recorded as the
    /// GPU's running operation before the wait, so that if this caller is cancelled (the kubelet's
    /// deadline) the next caller still knows what runs.
    async fn run<T: Send + 'static>(
        &mut self,
        op: GpuOp,
        timeout: Duration,
        work: impl FnOnce() -> Result<T, GpuError> + Send + 'static,
    ) -> Result<T, GpuOpError> {
        if let Some(earlier) = super::lock(&self.entry.running).as_ref() {
            // Only after one that did not return: a caller does nothing more under that hold.
            return Err(GpuOpError::Stuck {
                gpu: self.gpu.clone(),
                op: earlier.op.clone(),
                since: earlier.started.elapsed(),
            });
        }
        let (sender, receiver) = tokio::sync::oneshot::channel();
        let gauge = Arc::new(Mutex::new(Gauge::default()));
        let (metrics, gpu, returned) = (self.metrics.clone(), self.gpu.clone(), gauge.clone());
        let task = tokio::task::spawn_blocking(move || {
            let result = work();
            let summary = result.as_ref().map(|_| ()).map_err(|e| e.to_string());
            {
                let mut gauge = super::lock(&returned);
                gauge.returned = true;
                if gauge.reported {
                    metrics.set_gpu_operation_stuck(&gpu, false);
                }
            }
            // The waiter may have given up; the outcome is then taken in from `summary`.
            let _ = sender.send(result);
            summary
        });
        *super::lock(&self.entry.running) = Some(Running {
            op: op.clone(),
            gpu: self.gpu.clone(),
            started: Instant::now(),
            timeout,
            task,
            gauge: gauge.clone(),
        });
        match tokio::time::timeout(timeout, receiver).await {
            Ok(Ok(result)) => {
                super::lock(&self.entry.running).take();
                result.map_err(|source| GpuOpError::Failed {
                    gpu: self.gpu.clone(),
                    op,
                    source,
                })
            }
            Ok(Err(_)) => {
                // The work panicked: the thread ended without sending its result.
                let running = super::lock(&self.entry.running).take();
                let reason = match running {
                    Some(running) => match running.task.await {
                        Err(join) => join.to_string(),
                        Ok(_) => "it returned no result".to_string(),
                    },
                    None => "it returned no result".to_string(),
                };
                Err(GpuOpError::Aborted {
                    gpu: self.gpu.clone(),
                    op,
                    reason,
                })
            }
            Err(_) => {
                {
                    let mut gauge = super::lock(&gauge);
                    if !gauge.returned {
                        gauge.reported = true;
                        self.metrics.set_gpu_operation_stuck(&self.gpu, true);
                    }
                }
                warn!(gpu = %self.gpu, uuid = %self.uuid, operation = %op.doing(), timeout_s = timeout.as_secs_f64(), "a GPU operation did not return in time; the GPU counts as stuck until it does");
                Err(GpuOpError::TimedOut {
                    gpu: self.gpu.clone(),
                    uuid: self.uuid.clone(),
                    op,
                    timeout,
                })
            }
        }
    }

    /// Takes in an earlier operation that has returned. One that has not fails at once once it is
    /// past its timeout; one still within it (its caller was cancelled) is waited for until
    /// `deadline`.
    async fn settle(&mut self, deadline: Instant) -> Result<(), GpuOpError> {
        loop {
            let returned = {
                let mut running = super::lock(&self.entry.running);
                let Some(earlier) = running.as_ref() else {
                    return Ok(());
                };
                if earlier.task.is_finished() {
                    running.take()
                } else if earlier.stuck() {
                    return Err(GpuOpError::Stuck {
                        gpu: self.gpu.clone(),
                        op: earlier.op.clone(),
                        since: earlier.started.elapsed(),
                    });
                } else if Instant::now() >= deadline {
                    return Err(GpuOpError::Busy {
                        gpu: self.gpu.clone(),
                        running: Some(earlier.op.clone()),
                        waited: earlier.started.elapsed(),
                    });
                } else {
                    None
                }
            };
            match returned {
                Some(earlier) => {
                    self.take_in(earlier);
                    return Ok(());
                }
                None => tokio::time::sleep(POLL).await,
            }
        }
    }

    /// What an operation that returned after its caller stopped waiting left: a sharing mode set
    /// or not; a MIG device made or destroyed (the checkpoint's record of a MIG device being made
    /// stays until the device is destroyed, so the kubelet's retry adopts it, or the next start's
    /// sweep destroys it).
    fn take_in(&mut self, earlier: Running) {
        let outcome = match earlier.task.now_or_never() {
            Some(Ok(summary)) => summary,
            Some(Err(join)) => Err(join.to_string()),
            // Finished, checked under the same lock.
            None => Err("its outcome cannot be read".to_string()),
        };
        let late = super::lock(&earlier.gauge).reported;
        if let GpuOp::SetSharing(mode) = &earlier.op {
            self.state.applied = outcome.is_ok().then_some(*mode);
        }
        if late {
            match &outcome {
                Ok(()) => {
                    info!(gpu = %self.gpu, operation = %earlier.op.doing(), "a GPU operation that had not returned in time returned; the GPU takes operations again")
                }
                Err(error) => {
                    warn!(gpu = %self.gpu, operation = %earlier.op.doing(), %error, "a GPU operation that had not returned in time returned with an error; the GPU takes operations again")
                }
            }
        }
    }
}

impl Preparer {
    /// The GPUs an operation is stuck on (a sharing-mode change, a MIG create or destroy that has
    /// not returned within its bound): GPU UUID, and what is stuck (`gpu-0: creating MIG device
    /// 1g.10gb at memory slice 3 has not returned for 20s`). Every other operation on such a GPU fails
    /// at once until it returns.
    pub fn stuck_gpus(&self) -> Vec<(String, String)> {
        self.gpu_modes.stuck()
    }
}

#[cfg(test)]
#[path = "gpu_modes_tests.rs"]
mod tests;
