//! The probes' answers: what `/readyz` waits for ([`Readiness`]), what `/healthz` checks
//! ([`Liveness`]: the start, part by part, then the vital tasks), and the HTTP server that serves
//! both beside `/metrics`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;

use super::Metrics;

/// What `/readyz` waits for: the claims recovered, the DRA socket serving, the kubelet's registration,
/// the first publish.
#[derive(Default)]
pub struct Readiness {
    claims_recovered: AtomicBool,
    serving: AtomicBool,
    registered: AtomicBool,
    slices_published: AtomicBool,
    registration_error: Mutex<Option<String>>,
    /// Woken at every change, for [`Readiness::wait_ready`].
    changed: tokio::sync::Notify,
}

impl Readiness {
    /// The claims prepared before the start are recovered (their CDI specs, MIG devices, MPS daemons).
    pub fn set_claims_recovered(&self) {
        self.claims_recovered.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    pub fn set_serving(&self) {
        self.serving.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    pub fn set_registration(&self, registered: bool, error: Option<String>) {
        self.registered.store(registered, Ordering::SeqCst);
        if let Ok(mut slot) = self.registration_error.lock() {
            *slot = error;
        }
        self.changed.notify_waiters();
    }

    pub fn set_slices_published(&self) {
        self.slices_published.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Returns once everything `/readyz` waits for is there.
    pub async fn wait_ready(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check, so a change between the two is not missed.
            changed.as_mut().enable();
            if self.check().is_ok() {
                return;
            }
            changed.await;
        }
    }

    pub fn is_registered(&self) -> bool {
        self.registered.load(Ordering::SeqCst)
    }

    /// `Ok` when ready, else the list of what is missing, in words.
    pub fn check(&self) -> Result<(), Vec<String>> {
        let mut missing = Vec::new();
        if !self.claims_recovered.load(Ordering::SeqCst) {
            missing.push("prepared claims not recovered yet".to_string());
        }
        if !self.serving.load(Ordering::SeqCst) {
            missing.push("DRA gRPC server not serving yet".to_string());
        }
        if !self.registered.load(Ordering::SeqCst) {
            let why = self
                .registration_error
                .lock()
                .ok()
                .and_then(|e| e.clone())
                .map(|e| format!(": {e}"))
                .unwrap_or_default();
            missing.push(format!("not registered with the kubelet{why}"));
        }
        if !self.slices_published.load(Ordering::SeqCst) {
            missing.push("ResourceSlices not published yet".to_string());
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(missing)
        }
    }
}

/// What `/healthz` checks: the start-up, part by part, and then the tasks the plugin cannot work
/// without (the DRA and registration gRPC servers, the publisher, the health monitor).
///
/// `/healthz` is served before anything else starts, and says alive while the part of the start-up
/// now running is within its bound; a part past its bound (a wedged recovery, a hung NVML) fails it,
/// naming the part and how long it has run, so that the kubelet's probes restart a start that no
/// longer progresses. A vital task that stops outside shutdown (it ended, panicked or was cancelled)
/// is recorded here and `/healthz` fails from then on, so that the kubelet restarts the pod instead of
/// keeping a plugin that looks alive but no longer serves or publishes.
#[derive(Default)]
pub struct Liveness {
    stopped: Mutex<Vec<String>>,
    starting: Mutex<Option<StartingPart>>,
}

/// The part of the start-up now running.
struct StartingPart {
    name: &'static str,
    since: Instant,
    bound: Duration,
}

impl Liveness {
    /// Records that `task` stopped, and why (`ended`, `panicked: ...`, `was cancelled`).
    pub fn task_stopped(&self, task: &str, why: &str) {
        if let Ok(mut stopped) = self.stopped.lock() {
            stopped.push(format!("{task} stopped ({why})"));
        }
    }

    /// The start-up part `name` begins now and should be done within `bound`.
    pub fn part_starting(&self, name: &'static str, bound: Duration) {
        *lock_or_recover(&self.starting) = Some(StartingPart {
            name,
            since: Instant::now(),
            bound,
        });
    }

    /// The start-up is over (every part started, or the start failed).
    pub fn start_over(&self) {
        *lock_or_recover(&self.starting) = None;
    }

    /// The part of the start-up now running, in words (`recovery for 12.0s of its 395.0s`); `None` once
    /// the plugin has started.
    pub fn starting(&self) -> Option<String> {
        lock_or_recover(&self.starting).as_ref().map(|part| {
            format!(
                "{} for {} of its {}",
                part.name,
                seconds(part.since.elapsed()),
                seconds(part.bound)
            )
        })
    }

    /// `Ok` while the start-up is within its bound and every vital task runs, else what is wrong, in
    /// words.
    pub fn check(&self) -> Result<(), Vec<String>> {
        let mut wrong = lock_or_recover(&self.stopped).clone();
        if let Some(part) = lock_or_recover(&self.starting).as_ref() {
            let elapsed = part.since.elapsed();
            if elapsed > part.bound {
                wrong.push(format!(
                    "start-up part {} has run for {}, past its bound of {}",
                    part.name,
                    seconds(elapsed),
                    seconds(part.bound)
                ));
            }
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong)
        }
    }
}

/// `12.3s`.
fn seconds(duration: Duration) -> String {
    format!("{:.1}s", duration.as_secs_f64())
}

/// A poisoned lock still holds the last value written, which is all these records need.
fn lock_or_recover<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[derive(Clone)]
struct HttpState {
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    liveness: Arc<Liveness>,
}

/// Serves `/healthz` (liveness), `/readyz` and `/metrics` on `addr` until `shutdown` fires; returns the
/// bound address and the server's task.
pub async fn serve_http(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    liveness: Arc<Liveness>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let router = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(HttpState {
            metrics,
            readiness,
            liveness,
        });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let server = axum::serve(listener, router).with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        });
        if let Err(error) = server.await {
            tracing::error!(%error, "HTTP server failed");
        }
    });
    Ok((bound, task))
}

async fn healthz(State(state): State<HttpState>) -> (StatusCode, String) {
    match state.liveness.check() {
        Ok(()) => match state.liveness.starting() {
            None => (StatusCode::OK, "ok\n".to_string()),
            Some(part) => (StatusCode::OK, format!("ok (starting: {part})\n")),
        },
        Err(stopped) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("unhealthy: {}\n", stopped.join("; ")),
        ),
    }
}

async fn readyz(State(state): State<HttpState>) -> (StatusCode, String) {
    match state.readiness.check() {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(missing) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", missing.join("; ")),
        ),
    }
}

async fn metrics_text(
    State(state): State<HttpState>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

#[cfg(test)]
mod tests {
    use super::{Liveness, Readiness};
    use std::time::Duration;

    #[test]
    fn a_start_up_part_past_its_bound_fails_liveness_until_the_start_is_over() {
        let liveness = Liveness::default();
        assert_eq!(liveness.check(), Ok(()));
        assert_eq!(liveness.starting(), None);
        liveness.part_starting("recovery", Duration::from_secs(60));
        assert_eq!(liveness.check(), Ok(()));
        let starting = liveness.starting().unwrap();
        assert!(
            starting.starts_with("recovery for 0.0s of its 60.0s"),
            "{starting}"
        );

        liveness.part_starting("policy", Duration::from_millis(10));
        std::thread::sleep(Duration::from_millis(30));
        let wrong = liveness.check().unwrap_err();
        assert_eq!(wrong.len(), 1, "{wrong:?}");
        assert!(
            wrong[0].starts_with("start-up part policy has run for 0.")
                && wrong[0].ends_with(", past its bound of 0.0s"),
            "{wrong:?}"
        );

        liveness.start_over();
        assert_eq!(liveness.check(), Ok(()));
        liveness.task_stopped("publisher", "ended");
        assert_eq!(
            liveness.check(),
            Err(vec!["publisher stopped (ended)".to_string()])
        );
    }

    #[test]
    fn readiness_waits_for_recovered_claims_too() {
        let readiness = Readiness::default();
        let missing = readiness.check().unwrap_err();
        assert_eq!(missing[0], "prepared claims not recovered yet");
        readiness.set_serving();
        readiness.set_registration(true, None);
        readiness.set_slices_published();
        assert_eq!(
            readiness.check(),
            Err(vec!["prepared claims not recovered yet".to_string()])
        );
        readiness.set_claims_recovered();
        assert_eq!(readiness.check(), Ok(()));
    }

    #[tokio::test]
    async fn wait_ready_returns_once_the_last_item_is_there() {
        let readiness = std::sync::Arc::new(Readiness::default());
        readiness.set_claims_recovered();
        readiness.set_serving();
        readiness.set_registration(true, None);
        let waiter = tokio::spawn({
            let readiness = readiness.clone();
            async move { readiness.wait_ready().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        readiness.set_slices_published();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("ready in time")
            .unwrap();
    }
}
