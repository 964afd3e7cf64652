//! Supervision of the tasks the plugin cannot work without: each runs under a guard that records in
//! [`Liveness`] when it stops outside shutdown (it returned, panicked or was cancelled), so `/healthz`
//! fails and the kubelet restarts the pod rather than keeping a plugin that no longer serves.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinHandle};
use tracing::error;

use crate::observability::Liveness;

/// Spawns vital tasks and remembers them by name; clones share the names.
#[derive(Clone)]
pub(super) struct Vital {
    liveness: Arc<Liveness>,
    /// True once the plugin is being stopped: a task that ends then is not a fault.
    stopping: watch::Receiver<bool>,
    tasks: Arc<Mutex<Vec<(&'static str, AbortHandle)>>>,
}

impl Vital {
    pub(super) fn new(liveness: Arc<Liveness>, stopping: watch::Receiver<bool>) -> Self {
        Vital {
            liveness,
            stopping,
            tasks: Arc::default(),
        }
    }

    /// Spawns `task` as `name`; its end outside shutdown makes the plugin unhealthy.
    pub(super) fn spawn(
        &self,
        name: &'static str,
        task: impl Future<Output = ()> + Send + 'static,
    ) -> JoinHandle<()> {
        self.spawn_explained(name, async move {
            task.await;
            "ended".to_string()
        })
    }

    /// Like `spawn`, for a task that says why it ended (shown by `/healthz`).
    pub(super) fn spawn_explained(
        &self,
        name: &'static str,
        task: impl Future<Output = String> + Send + 'static,
    ) -> JoinHandle<()> {
        let mut guard = StopGuard {
            task: name,
            why: None,
            liveness: self.liveness.clone(),
            stopping: self.stopping.clone(),
        };
        let handle = tokio::spawn(async move {
            // A panic is caught here rather than by tokio, so that its message reaches /healthz.
            let outcome = AssertUnwindSafe(task).catch_unwind().await;
            guard.stopped_because(match outcome {
                Ok(why) => why,
                Err(panic) => format!("panicked: {}", panic_message(panic.as_ref())),
            });
        });
        self.tasks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push((name, handle.abort_handle()));
        handle
    }

    /// Cancels the task spawned as `name`, as if it had died; false when there is none.
    pub(super) fn abort(&self, name: &str) -> bool {
        let tasks = self
            .tasks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut found = false;
        for (_, handle) in tasks.iter().filter(|(n, _)| *n == name) {
            handle.abort();
            found = true;
        }
        found
    }
}

/// Lives inside a vital task; dropped when the task ends, panics or is cancelled.
struct StopGuard {
    task: &'static str,
    why: Option<String>,
    liveness: Arc<Liveness>,
    stopping: watch::Receiver<bool>,
}

impl StopGuard {
    fn stopped_because(&mut self, why: String) {
        self.why = Some(why);
    }
}

impl Drop for StopGuard {
    fn drop(&mut self) {
        if *self.stopping.borrow() {
            return;
        }
        let why = self.why.as_deref().unwrap_or("was cancelled");
        error!(task = self.task, why, "a vital plugin task stopped; /healthz fails from now on so that the kubelet restarts the pod");
        self.liveness.task_stopped(self.task, why);
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "no message".to_string()
    }
}
