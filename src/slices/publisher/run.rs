//! When the publisher syncs. At rest it sends nothing but its watches: it syncs (reads the version, lists
//! the node's slices) only when the devices change, a slice of the node changes, the Node is re-created
//! (a new UID) or a sync failed. At 5,000 nodes a periodic re-list would be thousands of requests a
//! minute for nothing, and the watches already re-list after every interruption the server cannot resume.
//! Writes close together are coalesced; failed syncs are retried with exponential backoff.

use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::sync::{watch, Notify};
use tracing::{debug, info, info_span, warn, Instrument};

use super::Publisher;
use crate::apiclient::{jittered_cap, NOT_SERVED_RETRY_MAX};
use crate::devices::NodeDevices;
use crate::observability::{Readiness, SliceSync};

/// The first wait after a failed sync; it doubles with each further failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// Longest wait between retries of a failed sync.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Device changes within this long after a write wait for its end and go out together: a burst of
/// faults is written at once and then at most once more per window (at most two writes a second).
const COALESCE_WINDOW: Duration = Duration::from_secs(1);
/// How long a sync deferred for devices recomputed to what the server keeps waits before it looks again.
const RECOMPUTE_WAIT: Duration = Duration::from_secs(1);

impl Publisher {
    /// Keeps the slices published until `shutdown` turns true: syncs when the devices change, when a
    /// watch event says the stored slices changed or the Node was re-created; retries failures with
    /// exponential backoff. Nothing else wakes it: an idle node sends no request but its watches.
    pub async fn run(
        self: Arc<Self>,
        mut devices: watch::Receiver<Arc<NodeDevices>>,
        readiness: Arc<Readiness>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let changed = Arc::new(Notify::new());
        let watch_task = tokio::spawn(watch_slices(
            self.slices.clone(),
            self.watch.clone().fields(&self.field_selector()),
            changed.clone(),
        ));
        let node_task = tokio::spawn(self.clone().watch_node(changed.clone()));
        let mut backoff = Backoff::new();
        let mut said_not_served = false;
        let mut last_write: Option<tokio::time::Instant> = None;
        loop {
            // Whatever woke us (a device change, a watch event, the resync), no sync starts within
            // the window after a write: the changes of a burst go out together.
            if let Some(window_end) = last_write.map(|at| at + COALESCE_WINDOW) {
                tokio::select! {
                    _ = tokio::time::sleep_until(window_end) => {}
                    _ = shutdown.changed() => break,
                }
            }
            let snapshot = devices.borrow_and_update().clone();
            let span = info_span!("slice_sync", driver = %self.driver, node = %self.node_name, devices = snapshot.device_count());
            match self.sync(&snapshot).instrument(span).await {
                Ok(stats) if stats.deferred => {
                    self.metrics.slice_sync(SliceSync::Deferred);
                    // The monitor recomputes the devices for what the server keeps; sync those.
                    tokio::select! {
                        result = devices.changed() => if result.is_err() { break },
                        _ = tokio::time::sleep(RECOMPUTE_WAIT) => {}
                        _ = shutdown.changed() => break,
                    }
                    continue;
                }
                Ok(stats) => {
                    if stats.writes() > 0 {
                        last_write = Some(tokio::time::Instant::now());
                        self.metrics.slice_sync(SliceSync::Written);
                    } else {
                        self.metrics.slice_sync(SliceSync::Unchanged);
                    }
                    backoff.reset();
                    readiness.set_slices_published();
                }
                Err(error) => {
                    self.metrics.slice_sync(SliceSync::Failed);
                    let not_served = error.api_not_served();
                    let delay = if not_served {
                        backoff.next_delay_up_to(NOT_SERVED_RETRY_MAX)
                    } else {
                        backoff.next_delay()
                    };
                    if !not_served {
                        warn!(%error, retry_in_ms = delay.as_millis() as u64, "publishing ResourceSlices failed");
                    } else if !said_not_served {
                        warn!(%error, retry_max_s = NOT_SERVED_RETRY_MAX.as_secs(), "the API server does not serve resource.k8s.io/v1 ResourceSlices (Kubernetes 1.34 or later with DRA is needed); looking again with backoff up to 5 minutes, without saying so again");
                    }
                    said_not_served = not_served;
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.changed() => break,
                    }
                    continue;
                }
            }
            tokio::select! {
                result = devices.changed() => if result.is_err() { break },
                _ = changed.notified() => {
                    // Let a burst of watch events (our own writes echoing back) settle into one sync.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ = shutdown.changed() => break,
            }
            if *shutdown.borrow() {
                break;
            }
        }
        watch_task.abort();
        node_task.abort();
    }

    /// Follows this node's Node object for its UID; notifies `changed` when a re-created Node brings a
    /// new one. Status updates (the kubelet's heartbeats) change nothing here and wake nobody.
    async fn watch_node(self: Arc<Self>, changed: Arc<Notify>) {
        let config = self
            .watch
            .clone()
            .fields(&format!("metadata.name={}", self.node_name));
        // Typed here, so that tests/manifests/rbac.rs sees which kind this watch needs a grant for.
        let nodes: Api<Node> = self.nodes.clone();
        let mut events = crate::apiclient::retried(watcher(nodes, config)).boxed();
        while let Some(event) = events.next().await {
            let uid = match event {
                Ok(watcher::Event::Apply(node)) | Ok(watcher::Event::InitApply(node)) => {
                    node.metadata.uid
                }
                Ok(watcher::Event::Delete(_)) => None,
                Ok(_) => continue,
                Err(error) => {
                    debug!(%error, "Node watch interrupted");
                    continue;
                }
            };
            if self.saw_node_uid(uid.clone()) && uid.is_some() {
                info!(node = %self.node_name, "the Node was re-created; its slices follow its new UID");
                changed.notify_one();
            }
        }
    }
}

/// Notifies `changed` on every change to the watched slices.
async fn watch_slices(api: Api<ResourceSlice>, config: watcher::Config, changed: Arc<Notify>) {
    let mut events = crate::apiclient::retried(watcher(api, config)).boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Delete(_))
            | Ok(watcher::Event::Apply(_))
            | Ok(watcher::Event::InitDone) => changed.notify_one(),
            Ok(_) => {}
            Err(error) => debug!(%error, "ResourceSlice watch interrupted"),
        }
    }
}

/// Exponential backoff from [`FIRST_BACKOFF`] up to [`MAX_BACKOFF`], with jitter so that many nodes
/// retrying after an API server outage do not all come back at once.
///
/// One backon sequence serves both caps, so that every failure counts towards the next delay whichever
/// cap applies to it: the sequence grows to the largest cap a caller asks for ([`NOT_SERVED_RETRY_MAX`])
/// and each delay is cut to the caller's cap. backon's jitter adds a random part of up to the delay
/// itself (a delay `d` becomes one in `[d, 2d)`). A delay that reaches the cap is drawn again from between
/// half the cap and the cap ([`jittered_cap`]), so a cap stays the longest wait there is and nodes that
/// failed together (an API server gone for all) do not keep retrying in the same second: a fixed wait at
/// the cap would keep whatever spread the growing delays left, and no more.
struct Backoff {
    delays: <ExponentialBuilder as BackoffBuilder>::Backoff,
}

impl Backoff {
    fn new() -> Self {
        let delays = ExponentialBuilder::new()
            .with_min_delay(FIRST_BACKOFF)
            .with_factor(2.0)
            .with_max_delay(NOT_SERVED_RETRY_MAX)
            .without_max_times()
            .with_jitter()
            .build();
        Backoff { delays }
    }

    fn reset(&mut self) {
        *self = Backoff::new();
    }

    fn next_delay(&mut self) -> Duration {
        self.next_delay_up_to(MAX_BACKOFF)
    }

    /// The next delay, capped at `max` instead of [`MAX_BACKOFF`] (minutes for an API not served); a
    /// `max` above [`NOT_SERVED_RETRY_MAX`] is never reached.
    fn next_delay_up_to(&mut self, max: Duration) -> Duration {
        // Without a maximum number of attempts the sequence never ends; `max` would stand in if it did.
        let delay = self.delays.next().unwrap_or(max);
        if delay >= max {
            jittered_cap(max)
        } else {
            delay
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps() {
        let mut backoff = Backoff::new();
        let first = backoff.next_delay();
        // backon's jitter adds up to the delay itself: the first wait is 0.5 s to 1 s.
        assert!(first >= Duration::from_millis(500) && first < Duration::from_millis(1000));
        let mut at_cap = Vec::new();
        for attempt in 0..40 {
            let delay = backoff.next_delay();
            // The cap holds after the jitter.
            assert!(delay <= MAX_BACKOFF, "{delay:?}");
            if attempt >= 10 {
                at_cap.push(delay);
            }
        }
        // Grown to the cap, where each wait is drawn from between half the cap and the cap: nodes that
        // failed together do not go on retrying in the same second.
        assert!(at_cap.iter().all(|d| *d >= MAX_BACKOFF / 2), "{at_cap:?}");
        let (shortest, longest) = (at_cap.iter().min().unwrap(), at_cap.iter().max().unwrap());
        assert!(*longest - *shortest > Duration::from_secs(1), "{at_cap:?}");
        backoff.reset();
        assert!(backoff.next_delay() < Duration::from_millis(1000));
    }

    #[test]
    fn an_api_not_served_is_retried_up_to_minutes() {
        let mut backoff = Backoff::new();
        let longest = (0..20)
            .map(|_| backoff.next_delay_up_to(NOT_SERVED_RETRY_MAX))
            .max()
            .unwrap();
        assert!(longest > MAX_BACKOFF.mul_f64(1.1), "{longest:?}");
        // Cut to the cap after the jitter, as above.
        assert!(longest <= NOT_SERVED_RETRY_MAX, "{longest:?}");
    }
}
