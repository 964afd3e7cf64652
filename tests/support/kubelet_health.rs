//! The kubelet double's side of `DRAResourceHealth.NodeWatchResources`: opening the stream in the API version a
//! kubelet picks, checking each entry as the kubelet reads it, and the kubelet's loop that keeps a health cache.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::{KubeletDouble, KubeletError};
use crate::proto::{health_v1, health_v1alpha1, HEALTH_V1ALPHA1_SERVICE, HEALTH_V1_SERVICE};

/// The health API version of a stream. Kubernetes 1.34 – 1.36 always open v1alpha1 (whatever the plugin
/// advertises) and only log `Unimplemented`; 1.37 opens only an advertised one, preferring v1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthApi {
    V1alpha1,
    V1,
}

/// A device's health as the kubelet records it; the same in both API versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthStatus {
    Unknown,
    Healthy,
    Unhealthy,
}

/// One device of a `NodeWatchResources` response, after the double's checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealth {
    pub pool: String,
    pub device: String,
    pub health: HealthStatus,
    pub message: String,
    /// Unix seconds (`last_updated_time`).
    pub last_updated: i64,
    /// `health_check_timeout_seconds`; 0 means the kubelet's 30 s default.
    pub timeout_seconds: i64,
}

/// The longest `DeviceHealth.message` the kubelet keeps, in characters.
pub const MAX_HEALTH_MESSAGE_CHARS: usize = 1024;

enum HealthStream {
    V1alpha1(tonic::Streaming<health_v1alpha1::NodeWatchResourcesResponse>),
    V1(tonic::Streaming<health_v1::NodeWatchResourcesResponse>),
}

/// An open `NodeWatchResources` stream. Dropping it closes the stream, as a kubelet that deregisters the plugin does.
pub struct HealthWatch {
    stream: HealthStream,
}

impl KubeletDouble {
    /// Opens `NodeWatchResources` on the plugin's DRA socket as a 1.37 kubelet does (`pickHealthService`): v1 when
    /// the plugin advertised `v1.DRAResourceHealth`, else v1alpha1 when it advertised
    /// `v1alpha1.DRAResourceHealth`, else no stream at all.
    pub async fn watch_health(&self) -> Result<HealthWatch, KubeletError> {
        let advertised = |service: &str| self.info.supported_versions.iter().any(|v| v == service);
        let api = if advertised(HEALTH_V1_SERVICE) {
            HealthApi::V1
        } else if advertised(HEALTH_V1ALPHA1_SERVICE) {
            HealthApi::V1alpha1
        } else {
            return Err(KubeletError::NoHealthService(
                self.info.supported_versions.clone(),
            ));
        };
        self.watch_health_with(api).await
    }

    /// Opens `NodeWatchResources` in `api` regardless of what the plugin advertised; `HealthApi::V1alpha1` is what
    /// a 1.34 – 1.36 kubelet does with every DRA plugin.
    pub async fn watch_health_with(&self, api: HealthApi) -> Result<HealthWatch, KubeletError> {
        let stream = match api {
            HealthApi::V1alpha1 => {
                let mut client =
                    health_v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(
                        self.channel.clone(),
                    );
                let request = health_v1alpha1::NodeWatchResourcesRequest {};
                HealthStream::V1alpha1(
                    client
                        .node_watch_resources(request)
                        .await
                        .map_err(KubeletError::HealthStream)?
                        .into_inner(),
                )
            }
            HealthApi::V1 => {
                let mut client =
                    health_v1::dra_resource_health_client::DraResourceHealthClient::new(
                        self.channel.clone(),
                    );
                let request = health_v1::NodeWatchResourcesRequest {};
                HealthStream::V1(
                    client
                        .node_watch_resources(request)
                        .await
                        .map_err(KubeletError::HealthStream)?
                        .into_inner(),
                )
            }
        };
        Ok(HealthWatch { stream })
    }
}

impl HealthWatch {
    pub fn api(&self) -> HealthApi {
        match self.stream {
            HealthStream::V1alpha1(_) => HealthApi::V1alpha1,
            HealthStream::V1(_) => HealthApi::V1,
        }
    }

    /// The next response: `Ok(None)` when the plugin ended the stream (the kubelet then clears the driver's health
    /// cache and reopens it after 5 s). Entries the kubelet could not use are errors here, where the kubelet would
    /// log and skip them (or, for long messages, truncate), so a test sees the plugin's mistake.
    pub async fn next(&mut self) -> Result<Option<Vec<DeviceHealth>>, KubeletError> {
        // v1alpha1 and v1 have the same messages in different packages; one body serves both.
        macro_rules! receive {
            ($stream:expr) => {
                match $stream.message().await {
                    Ok(Some(response)) => response
                        .devices
                        .into_iter()
                        .map(|d| {
                            let id = d.device.unwrap_or_default();
                            check_device_health(
                                id.pool_name,
                                id.device_name,
                                health_status(d.health),
                                d.health,
                                d.message,
                                d.last_updated_time,
                                d.health_check_timeout_seconds,
                            )
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                    Ok(None) => return Ok(None),
                    Err(status) => return Err(KubeletError::HealthStream(status)),
                }
            };
        }
        let devices = match &mut self.stream {
            HealthStream::V1alpha1(stream) => receive!(stream),
            HealthStream::V1(stream) => receive!(stream),
        };
        Ok(Some(devices))
    }
}

/// The health enum off the wire. v1alpha1 and v1 number `HealthStatus` the same (0 unknown, 1 healthy,
/// 2 unhealthy), so one decoder serves both; `None` for a value neither defines.
fn health_status(raw: i32) -> Option<HealthStatus> {
    match health_v1alpha1::HealthStatus::try_from(raw).ok()? {
        health_v1alpha1::HealthStatus::Unknown => Some(HealthStatus::Unknown),
        health_v1alpha1::HealthStatus::Healthy => Some(HealthStatus::Healthy),
        health_v1alpha1::HealthStatus::Unhealthy => Some(HealthStatus::Unhealthy),
    }
}

/// The kubelet's view of one entry: it keys its cache by pool/device, keeps at most 1024 message characters and
/// takes `last_updated_time` as the time of the report, so a future time would keep a device alive too long.
fn check_device_health(
    pool: String,
    device: String,
    health: Option<HealthStatus>,
    raw_health: i32,
    message: String,
    last_updated: i64,
    timeout_seconds: i64,
) -> Result<DeviceHealth, KubeletError> {
    let bad = |reason: String| KubeletError::BadHealth {
        pool: pool.clone(),
        device: device.clone(),
        reason,
    };
    if pool.is_empty() || device.is_empty() {
        return Err(bad("empty pool or device name".to_string()));
    }
    let Some(health) = health else {
        return Err(bad(format!("unknown health value {raw_health}")));
    };
    let chars = message.chars().count();
    if chars > MAX_HEALTH_MESSAGE_CHARS {
        return Err(bad(format!(
            "message has {chars} characters, more than {MAX_HEALTH_MESSAGE_CHARS}"
        )));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|since| i64::try_from(since.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    if last_updated > now {
        return Err(bad(format!(
            "last_updated_time {last_updated} is in the future (now {now})"
        )));
    }
    if timeout_seconds < 0 {
        return Err(bad(format!(
            "negative health_check_timeout_seconds {timeout_seconds}"
        )));
    }
    Ok(DeviceHealth {
        pool,
        device,
        health,
        message,
        last_updated,
        timeout_seconds,
    })
}

/// The kubelet's `DefaultHealthTimeout`, used when a device reports no `health_check_timeout_seconds`.
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(30);

/// The kubelet's health cache for one plugin, as `HandleWatchResourcesStream` keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HealthCache {
    /// By `(pool, device)`. The kubelet stamps each entry with the time it received it.
    pub devices: std::collections::BTreeMap<(String, String), HealthStatus>,
    /// How many streams were opened so far.
    pub streams_opened: u32,
}

/// A background loop that keeps a health stream open the way the kubelet does: it opens the stream, applies
/// each response to the cache, clears the driver's entries when the stream ends or fails, and opens a new one
/// `reopen_after` later. Dropping it stops the loop.
pub struct HealthMonitor {
    cache: tokio::sync::watch::Receiver<HealthCache>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HealthMonitor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HealthMonitor {
    pub fn snapshot(&self) -> HealthCache {
        self.cache.borrow().clone()
    }

    /// Waits up to `timeout` for a cache state that satisfies `condition`.
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        condition: impl Fn(&HealthCache) -> bool,
    ) -> Result<HealthCache, HealthCache> {
        let met = match tokio::time::timeout(timeout, self.cache.wait_for(|c| condition(c))).await {
            Ok(Ok(cache)) => Some(cache.clone()),
            _ => None,
        };
        met.ok_or_else(|| self.snapshot())
    }
}

impl KubeletDouble {
    /// Starts the kubelet's health-stream loop over `api` (1.34 – 1.36 use v1alpha1 for every plugin). The
    /// kubelet waits 5 s (`wait.UntilWithContext`, from the end of the previous attempt) where this waits
    /// `reopen_after`, so tests need not.
    pub fn monitor_health(&self, api: HealthApi, reopen_after: Duration) -> HealthMonitor {
        let (cache_tx, cache_rx) = tokio::sync::watch::channel(HealthCache::default());
        let kubelet = self.clone();
        let task = tokio::spawn(async move {
            let mut received: HashMap<
                (String, String),
                (HealthStatus, Duration, tokio::time::Instant),
            > = HashMap::new();
            loop {
                if let Ok(mut watch) = kubelet.watch_health_with(api).await {
                    cache_tx.send_modify(|cache| cache.streams_opened += 1);
                    // Any error ends the stream, as a receive error does in the kubelet.
                    while let Ok(Some(devices)) = watch.next().await {
                        let now = tokio::time::Instant::now();
                        let reported: HashSet<(String, String)> = devices
                            .iter()
                            .map(|d| (d.pool.clone(), d.device.clone()))
                            .collect();
                        for device in devices {
                            let timeout = match device.timeout_seconds {
                                seconds if seconds > 0 => Duration::from_secs(seconds as u64),
                                _ => DEFAULT_HEALTH_TIMEOUT,
                            };
                            received.insert(
                                (device.pool, device.device),
                                (device.health, timeout, now),
                            );
                        }
                        // Devices missing from a report go Unknown once their timeout has passed.
                        for (key, (health, timeout, at)) in received.iter_mut() {
                            if !reported.contains(key) && now.duration_since(*at) > *timeout {
                                *health = HealthStatus::Unknown;
                                *at = now;
                            }
                        }
                        let devices = received
                            .iter()
                            .map(|(key, (health, _, _))| (key.clone(), *health))
                            .collect();
                        cache_tx.send_modify(|cache| cache.devices = devices);
                    }
                    received.clear();
                    cache_tx.send_modify(|cache| cache.devices.clear());
                }
                tokio::time::sleep(reopen_after).await;
            }
        });
        HealthMonitor {
            cache: cache_rx,
            task,
        }
    }
}
