//! One lock per GPU for MIG operations. NVML lets a create and a destroy on one GPU interleave, and
//! the steps of each (MIG mode on, GPU instance, compute instance; or destroy, then MIG mode off when
//! the GPU is empty) then race: a destroy may switch MIG mode off under a create. Both backends run
//! every MIG operation of a GPU under its lock; different GPUs proceed in parallel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Per-GPU locks, by GPU UUID; created on first use and kept (a node has a handful of GPUs).
#[derive(Debug, Default)]
pub struct GpuLocks {
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl GpuLocks {
    /// Runs `operation` while holding the lock of GPU `uuid`.
    pub fn with<T>(&self, uuid: &str, operation: impl FnOnce() -> T) -> T {
        let gpu = {
            let mut locks = self
                .locks
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            locks.entry(uuid.to_string()).or_default().clone()
        };
        // A panic in an earlier operation leaves nothing half-written in the lock itself.
        let _held = gpu.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        operation()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn one_gpu_runs_one_operation_at_a_time_and_gpus_run_in_parallel() {
        let locks = Arc::new(GpuLocks::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (locks, inside, most) = (locks.clone(), inside.clone(), most.clone());
                std::thread::spawn(move || {
                    locks.with("GPU-a", || {
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(20));
                        inside.fetch_sub(1, Ordering::SeqCst);
                    })
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1);
        // Another GPU's lock is free while GPU-a's is held.
        locks.with("GPU-a", || locks.with("GPU-b", || ()));
    }
}
