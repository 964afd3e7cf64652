//! The DRA resource-health service (`DRAResourceHealth`, v1alpha1 and v1) on the DRA socket: streams the
//! complete list of the driver's devices to the kubelet at once, on every change of the plugin's health reports,
//! and at least every third of the health timeout, so no device ever times out to Unknown while we are up.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::debug;

use crate::proto::{health_v1 as v1, health_v1alpha1 as v1alpha1};

/// The longest `DeviceHealth.message` the kubelet accepts, in characters.
pub const MAX_MESSAGE_LEN: usize = 1024;
/// The kubelet's default per-device health timeout (`DefaultHealthTimeout`).
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(30);
/// A floor on the resend period, so a tiny timeout cannot turn the stream into a busy loop.
const MIN_RESEND_INTERVAL: Duration = Duration::from_millis(10);
/// Responses the stream may hold for a slow reader; each is a full list, so a deeper queue only adds staleness.
const STREAM_BUFFER: usize = 1;

/// One device's health as the plugin computed it; the service sends the whole list in every response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealthReport {
    pub pool: String,
    pub device: String,
    pub healthy: bool,
    /// Why the device is unhealthy; not sent for healthy devices, and cut to [`MAX_MESSAGE_LEN`].
    pub message: String,
}

/// Serves `NodeWatchResources` for both API versions from the plugin's health reports. Dropping the reports'
/// `watch::Sender` (plugin shutdown) ends every open stream.
#[derive(Clone)]
pub struct HealthService {
    reports: watch::Receiver<Arc<Vec<DeviceHealthReport>>>,
    timeout: Duration,
}

/// A version-independent device entry; each API version's message is built from it.
struct Entry {
    pool: String,
    device: String,
    healthy: bool,
    message: String,
}

impl HealthService {
    /// `timeout` is sent as each device's `health_check_timeout_seconds` (rounded up to whole seconds, at least
    /// 1, since 0 would mean the kubelet's default) and the list is resent at least every `timeout / 3`.
    pub fn new(reports: watch::Receiver<Arc<Vec<DeviceHealthReport>>>, timeout: Duration) -> Self {
        HealthService { reports, timeout }
    }

    fn timeout_seconds(&self) -> i64 {
        let whole = self.timeout.as_secs() + u64::from(self.timeout.subsec_nanos() > 0);
        i64::try_from(whole.max(1)).unwrap_or(i64::MAX)
    }

    fn resend_interval(&self) -> Duration {
        (self.timeout / 3).max(MIN_RESEND_INTERVAL)
    }

    /// Starts the task that feeds one client's stream; `build` turns the current list into that version's
    /// response. The task ends when the client goes away or the reports' sender is dropped.
    fn watch<T: Send + 'static>(
        &self,
        build: fn(Vec<Entry>, i64, i64) -> T,
    ) -> Result<ReceiverStream<Result<T, Status>>, Status> {
        let mut reports = self.reports.clone();
        if reports.has_changed().is_err() {
            // Nothing will ever update the list; the kubelet retries the stream after 5 s.
            return Err(Status::unavailable("device health reporting has stopped"));
        }
        let timeout_seconds = self.timeout_seconds();
        let interval = self.resend_interval();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(async move {
            debug!("health stream opened");
            loop {
                let current = Arc::clone(&reports.borrow_and_update());
                let entries = current.iter().map(entry).collect();
                // Fails only when the client is gone, even while waiting for room in the queue.
                if tx
                    .send(Ok(build(entries, unix_now(), timeout_seconds)))
                    .await
                    .is_err()
                {
                    debug!("health stream closed by the client");
                    return;
                }
                tokio::select! {
                    changed = reports.changed() => {
                        if changed.is_err() {
                            debug!("health reports ended; closing the health stream");
                            return;
                        }
                    }
                    () = tokio::time::sleep(interval) => {}
                    () = tx.closed() => {
                        debug!("health stream closed by the client");
                        return;
                    }
                }
            }
        });
        Ok(ReceiverStream::new(rx))
    }
}

fn entry(report: &DeviceHealthReport) -> Entry {
    Entry {
        pool: report.pool.clone(),
        device: report.device.clone(),
        healthy: report.healthy,
        message: if report.healthy {
            String::new()
        } else {
            truncate_message(&report.message)
        },
    }
}

/// Cuts `message` to at most [`MAX_MESSAGE_LEN`] bytes (so also characters) on a char boundary, ending a cut
/// message with "..." as the kubelet does when it truncates.
pub fn truncate_message(message: &str) -> String {
    if message.len() <= MAX_MESSAGE_LEN {
        return message.to_string();
    }
    let mut end = MAX_MESSAGE_LEN - 3;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &message[..end])
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| i64::try_from(since.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn v1alpha1_response(
    entries: Vec<Entry>,
    now: i64,
    timeout_seconds: i64,
) -> v1alpha1::NodeWatchResourcesResponse {
    let devices = entries
        .into_iter()
        .map(|e| v1alpha1::DeviceHealth {
            device: Some(v1alpha1::DeviceIdentifier {
                pool_name: e.pool,
                device_name: e.device,
            }),
            health: if e.healthy {
                v1alpha1::HealthStatus::Healthy
            } else {
                v1alpha1::HealthStatus::Unhealthy
            } as i32,
            last_updated_time: now,
            health_check_timeout_seconds: timeout_seconds,
            message: e.message,
        })
        .collect();
    v1alpha1::NodeWatchResourcesResponse { devices }
}

fn v1_response(
    entries: Vec<Entry>,
    now: i64,
    timeout_seconds: i64,
) -> v1::NodeWatchResourcesResponse {
    let devices = entries
        .into_iter()
        .map(|e| v1::DeviceHealth {
            device: Some(v1::DeviceIdentifier {
                pool_name: e.pool,
                device_name: e.device,
            }),
            health: if e.healthy {
                v1::HealthStatus::Healthy
            } else {
                v1::HealthStatus::Unhealthy
            } as i32,
            last_updated_time: now,
            health_check_timeout_seconds: timeout_seconds,
            message: e.message,
        })
        .collect();
    v1::NodeWatchResourcesResponse { devices }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream =
        ReceiverStream<Result<v1alpha1::NodeWatchResourcesResponse, Status>>;

    async fn node_watch_resources(
        &self,
        _request: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        self.watch(v1alpha1_response).map(Response::new)
    }
}

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = ReceiverStream<Result<v1::NodeWatchResourcesResponse, Status>>;

    async fn node_watch_resources(
        &self,
        _request: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        self.watch(v1_response).map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_messages_are_kept() {
        assert_eq!(truncate_message("ECC errors"), "ECC errors");
        let exact = "x".repeat(MAX_MESSAGE_LEN);
        assert_eq!(truncate_message(&exact), exact);
    }

    #[test]
    fn long_multibyte_messages_are_cut_on_a_char_boundary() {
        // 3-byte characters: 1021 is not a multiple of 3, so a byte cut would split one.
        let message = "€".repeat(600);
        let cut = truncate_message(&message);
        assert!(cut.len() <= MAX_MESSAGE_LEN);
        assert!(cut.ends_with("..."));
        assert!(cut.trim_end_matches("...").chars().all(|c| c == '€'));
        assert_eq!(cut.trim_end_matches("...").len(), 1020);
    }

    #[test]
    fn timeout_is_rounded_up_to_whole_seconds() {
        let (_tx, rx) = watch::channel(Arc::new(Vec::new()));
        assert_eq!(
            HealthService::new(rx.clone(), Duration::from_millis(300)).timeout_seconds(),
            1
        );
        assert_eq!(
            HealthService::new(rx.clone(), Duration::from_millis(30_500)).timeout_seconds(),
            31
        );
        assert_eq!(
            HealthService::new(rx, DEFAULT_HEALTH_TIMEOUT).timeout_seconds(),
            30
        );
    }
}
