//! The sharing mode of each GPU as this plugin last set it, with one lock per GPU: changes to one GPU
//! run one at a time, different GPUs change in parallel. A change runs on a blocking thread (NVML,
//! `nvidia-smi`) that a driver stuck in the kernel may never give back, so the caller waits a bounded
//! time; a change that did not return leaves its GPU marked stuck, and later changes to that GPU fail
//! at once, saying what is stuck, until it returns. Other GPUs go on meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::sync::OwnedMutexGuard;
use tokio::task::JoinHandle;

use crate::gpu::{GpuError, GpuSharingMode};

/// How long one change of a GPU's sharing mode may take before it counts as stuck: `nvidia-smi`'s own
/// timeout (10 s) and NVML's calls, with room to spare, well inside the kubelet's 45 s for a prepare.
pub const SHARING_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum GpuModeError {
    #[error(
        "{gpu}: an earlier change to {mode} has not returned for {}s (the GPU driver is stuck, or \
         nvidia-smi cannot exit); no change to this GPU can be made until it returns",
        since.as_secs()
    )]
    Stuck {
        gpu: String,
        mode: GpuSharingMode,
        since: Duration,
    },
    #[error(
        "{gpu}: setting {mode} did not return within {}s; the GPU driver may be stuck (check \
         `nvidia-smi -q -i {uuid}` and the kernel log for XID errors)",
        timeout.as_secs_f64()
    )]
    TimedOut {
        gpu: String,
        uuid: String,
        mode: GpuSharingMode,
        timeout: Duration,
    },
    #[error(
        "{gpu}: another change to its sharing mode is still running after {}s",
        waited.as_secs_f64()
    )]
    Busy { gpu: String, waited: Duration },
    #[error("setting {gpu} to {mode}: {source}")]
    Failed {
        gpu: String,
        mode: GpuSharingMode,
        source: GpuError,
    },
    #[error("{gpu}: the change to {mode} ended abnormally: {reason}")]
    Aborted {
        gpu: String,
        mode: GpuSharingMode,
        reason: String,
    },
}

/// What a change on the blocking thread returns: whether it changed anything.
type Change = JoinHandle<Result<bool, GpuError>>;

/// Per-GPU sharing state, by GPU UUID; created on first use and kept (a node has a handful of GPUs).
#[derive(Debug)]
pub(super) struct GpuModes {
    gpus: Mutex<HashMap<String, Arc<tokio::sync::Mutex<GpuMode>>>>,
    timeout: Duration,
}

#[derive(Debug, Default)]
pub(super) struct GpuMode {
    /// The mode last set; `None` when not known (not set by this plugin yet, or the last change
    /// failed or has not returned).
    applied: Option<GpuSharingMode>,
    stuck: Option<StuckChange>,
}

#[derive(Debug)]
struct StuckChange {
    mode: GpuSharingMode,
    since: Instant,
    change: Change,
}

/// One GPU's state, locked.
pub(super) struct HeldGpu {
    gpu: String,
    uuid: String,
    state: OwnedMutexGuard<GpuMode>,
    timeout: Duration,
}

impl GpuModes {
    /// `timeout` bounds each change, and each wait for a GPU's lock.
    pub(super) fn new(timeout: Duration) -> Self {
        Self {
            gpus: Mutex::new(HashMap::new()),
            timeout,
        }
    }

    /// Takes the lock of GPU `uuid` (`gpu` names it in messages), waiting at most the timeout. Fails
    /// at once while an earlier change to the GPU has not returned; one that returned since is
    /// settled first.
    pub(super) async fn hold(&self, uuid: &str, gpu: &str) -> Result<HeldGpu, GpuModeError> {
        let lock = super::lock(&self.gpus)
            .entry(uuid.to_string())
            .or_default()
            .clone();
        let state = tokio::time::timeout(self.timeout, lock.lock_owned())
            .await
            .map_err(|_| GpuModeError::Busy {
                gpu: gpu.to_string(),
                waited: self.timeout,
            })?;
        let mut held = HeldGpu {
            gpu: gpu.to_string(),
            uuid: uuid.to_string(),
            state,
            timeout: self.timeout,
        };
        held.settle()?;
        Ok(held)
    }
}

impl GpuModes {
    /// Forgets the mode last set on GPU `uuid` (something else changed it), so the next sync sets
    /// it whatever it is. Waits for the GPU's lock as [`hold`](Self::hold) does.
    pub(super) async fn forget(&self, uuid: &str) {
        let lock = super::lock(&self.gpus)
            .entry(uuid.to_string())
            .or_default()
            .clone();
        if let Ok(mut state) = tokio::time::timeout(self.timeout, lock.lock_owned()).await {
            state.applied = None;
        }
    }
}

impl HeldGpu {
    /// The mode last set on the GPU, if known.
    pub(super) fn applied(&self) -> Option<GpuSharingMode> {
        self.state.applied
    }

    /// Runs `change` (which leaves the GPU in `mode` when it succeeds) on a blocking thread, waiting
    /// at most the timeout; returns whether it changed anything. A change that does not return in
    /// time keeps running, and the GPU counts as stuck until it returns.
    pub(super) async fn change(
        &mut self,
        mode: GpuSharingMode,
        change: impl FnOnce() -> Result<bool, GpuError> + Send + 'static,
    ) -> Result<bool, GpuModeError> {
        self.state.applied = None;
        let mut task = tokio::task::spawn_blocking(change);
        match tokio::time::timeout(self.timeout, &mut task).await {
            Ok(finished) => self.finished(mode, finished),
            Err(_) => {
                self.state.stuck = Some(StuckChange {
                    mode,
                    since: Instant::now()
                        .checked_sub(self.timeout)
                        .unwrap_or_else(Instant::now),
                    change: task,
                });
                Err(GpuModeError::TimedOut {
                    gpu: self.gpu.clone(),
                    uuid: self.uuid.clone(),
                    mode,
                    timeout: self.timeout,
                })
            }
        }
    }

    fn finished(
        &mut self,
        mode: GpuSharingMode,
        finished: Result<Result<bool, GpuError>, tokio::task::JoinError>,
    ) -> Result<bool, GpuModeError> {
        match finished {
            Ok(Ok(changed)) => {
                self.state.applied = Some(mode);
                Ok(changed)
            }
            Ok(Err(source)) => Err(GpuModeError::Failed {
                gpu: self.gpu.clone(),
                mode,
                source,
            }),
            Err(join) => Err(GpuModeError::Aborted {
                gpu: self.gpu.clone(),
                mode,
                reason: join.to_string(),
            }),
        }
    }

    /// Fails while an earlier change has not returned; takes in the outcome of one that has.
    fn settle(&mut self) -> Result<(), GpuModeError> {
        let Some(stuck) = self.state.stuck.as_mut() else {
            return Ok(());
        };
        let Some(finished) = (&mut stuck.change).now_or_never() else {
            return Err(GpuModeError::Stuck {
                gpu: self.gpu.clone(),
                mode: stuck.mode,
                since: stuck.since.elapsed(),
            });
        };
        let mode = stuck.mode;
        self.state.stuck = None;
        // Its outcome only tells what the GPU holds now; the caller goes on from there.
        let _ = self.finished(mode, finished);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::TimeSliceInterval;
    use std::sync::mpsc;

    const LONG: GpuSharingMode = GpuSharingMode::TimeSlice(TimeSliceInterval::Long);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_that_does_not_return_fails_in_time_and_blocks_only_its_gpu() {
        let modes = GpuModes::new(Duration::from_millis(200));
        let (release, released) = mpsc::channel::<()>();
        let mut held = modes.hold("GPU-a", "gpu-0").await.unwrap();
        let started = Instant::now();
        let err = held
            .change(LONG, move || {
                let _ = released.recv();
                Ok(true)
            })
            .await
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(
            err.to_string(),
            "gpu-0: setting compute mode DEFAULT with time-slice interval Long did not return \
             within 0.2s; the GPU driver may be stuck (check `nvidia-smi -q -i GPU-a` and the \
             kernel log for XID errors)"
        );
        drop(held);

        // The next change to that GPU fails at once, naming what is stuck; another GPU changes.
        let started = Instant::now();
        let err = modes.hold("GPU-a", "gpu-0").await.err().unwrap();
        assert!(started.elapsed() < Duration::from_millis(100));
        assert!(matches!(err, GpuModeError::Stuck { .. }), "{err}");
        assert!(
            err.to_string().starts_with(
                "gpu-0: an earlier change to compute mode DEFAULT with time-slice interval Long has not returned for"
            ),
            "{err}"
        );
        let mut other = modes.hold("GPU-b", "gpu-1").await.unwrap();
        assert!(other.change(LONG, || Ok(true)).await.unwrap());
        assert_eq!(other.applied(), Some(LONG));

        // Once it returns, the GPU takes changes again, starting from what that change set.
        release.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let held = loop {
            match modes.hold("GPU-a", "gpu-0").await {
                Ok(held) => break held,
                Err(GpuModeError::Stuck { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                Err(other) => panic!("{other}"),
            }
        };
        assert_eq!(held.applied(), Some(LONG));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_change_leaves_the_mode_unknown() {
        let modes = GpuModes::new(Duration::from_secs(5));
        let mut held = modes.hold("GPU-a", "gpu-0").await.unwrap();
        held.change(LONG, || Ok(true)).await.unwrap();
        let err = held
            .change(GpuSharingMode::ExclusiveProcess, || {
                Err(GpuError::Sharing {
                    gpu: "GPU-a".into(),
                    reason: "Insufficient Permissions".into(),
                })
            })
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "setting gpu-0 to compute mode EXCLUSIVE_PROCESS: GPU GPU-a: Insufficient Permissions"
        );
        assert_eq!(held.applied(), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_for_a_gpus_lock_is_bounded() {
        let modes = GpuModes::new(Duration::from_millis(100));
        let _first = modes.hold("GPU-a", "gpu-0").await.unwrap();
        let err = modes.hold("GPU-a", "gpu-0").await.err().unwrap();
        assert_eq!(
            err.to_string(),
            "gpu-0: another change to its sharing mode is still running after 0.1s"
        );
        modes.hold("GPU-b", "gpu-1").await.unwrap();
    }
}
