//! How the plugin talks to the API server when it is slow, hung or half-open: connect and read
//! timeouts on the client, a watch length that lets every watcher notice a silent connection on its
//! own, and the per-claim budget that keeps a prepare inside the kubelet's 45 s deadline.

use std::time::Duration;

use kube::runtime::watcher;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ApiClientError {
    #[error("the read timeout ({read:?}) must be longer than the watch timeout ({watch:?}), or idle watches on a healthy cluster would be cut off")]
    ReadShorterThanWatch { read: Duration, watch: Duration },
    #[error("API timeouts must be at least one second (watch) and above zero (others): {0}")]
    TooShort(&'static str),
    #[error("reading kubeconfig {path}: {reason}")]
    Kubeconfig { path: String, reason: String },
    #[error("no kubeconfig given and no in-cluster configuration: {0}")]
    NoConfig(String),
    #[error("creating the Kubernetes client: {0}")]
    Client(String),
}

/// Timeouts towards the API server.
///
/// One client serves both plain requests and watches, so the two timeouts are chosen together:
/// a watch asks the server to end it after `watch` (`timeoutSeconds`), and the kube watcher treats a
/// watch that stays silent a little longer than that (5 s) as dead and starts over. An idle but healthy
/// watch is therefore never silent for longer than `watch`, and `read` must be longer than that, or
/// the read timeout would cut idle watches on a quiet cluster and make every watcher list again and
/// again. A half-open watch (the connection dropped without a reset) is noticed after `watch` plus
/// 5 s by the watcher, or after `read` by the client, whichever comes first; a hung plain request
/// fails after `read`. A second client for watches would allow a shorter `read`, but each client
/// keeps its own connections, and the prepare path does not need it: it has its own budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiTimeouts {
    /// Establishing a connection (TCP and TLS).
    pub connect: Duration,
    /// The longest silence on a connection while a request waits for bytes (headers or body), counted
    /// from when the request was sent.
    pub read: Duration,
    /// How long a watch lasts before the server ends it and the watcher resumes from where it was
    /// (whole seconds; shorter than `read`).
    pub watch: Duration,
    /// The time NodePrepareResources may spend reading one ResourceClaim, retries included, before
    /// that claim gets a per-claim error: well inside the kubelet's 45 s deadline for the whole call.
    pub claim_read: Duration,
}

impl Default for ApiTimeouts {
    /// Production values. The read timeout is above the API server's own limit for a request (60 s,
    /// `--request-timeout`), so a slow but answering server is never cut off; the watch length of a
    /// minute bounds how long a half-open watch goes unnoticed (65 s), and resuming a watch from its
    /// resourceVersion once a minute is cheap for the server (served from its watch cache).
    fn default() -> Self {
        ApiTimeouts {
            connect: Duration::from_secs(10),
            read: Duration::from_secs(75),
            watch: Duration::from_secs(60),
            claim_read: Duration::from_secs(20),
        }
    }
}

impl ApiTimeouts {
    /// Checks that the values work together (see the type's documentation).
    pub fn check(&self) -> Result<(), ApiClientError> {
        if self.connect.is_zero() {
            return Err(ApiClientError::TooShort("connect"));
        }
        if self.read.is_zero() {
            return Err(ApiClientError::TooShort("read"));
        }
        if self.claim_read.is_zero() {
            return Err(ApiClientError::TooShort("claim_read"));
        }
        if self.watch_seconds() == 0 {
            return Err(ApiClientError::TooShort("watch"));
        }
        if self.read <= Duration::from_secs(u64::from(self.watch_seconds())) {
            return Err(ApiClientError::ReadShorterThanWatch {
                read: self.read,
                watch: self.watch,
            });
        }
        Ok(())
    }

    /// The server-side watch length in whole seconds, as the API takes it.
    fn watch_seconds(&self) -> u32 {
        u32::try_from(self.watch.as_secs()).unwrap_or(u32::MAX)
    }

    /// The watcher configuration every watch of the plugin starts from.
    pub fn watcher_config(&self) -> watcher::Config {
        watcher::Config::default().timeout(self.watch_seconds().max(1))
    }

    /// Sets the client-side timeouts on a kube configuration.
    pub fn apply(&self, config: &mut kube::Config) {
        config.connect_timeout = Some(self.connect);
        config.read_timeout = Some(self.read);
        config.write_timeout = Some(self.read);
        // Count the read timeout from when a request is sent, not from when its pooled connection
        // went idle; otherwise a connection that sat in the pool would time out the next request early.
        config.reset_reader_on_write = true;
    }
}

/// A client for `kubeconfig`, or the in-cluster / `KUBECONFIG` configuration when none is given, with
/// `timeouts` applied.
pub async fn kube_client(
    kubeconfig: Option<&std::path::Path>,
    timeouts: &ApiTimeouts,
) -> Result<kube::Client, ApiClientError> {
    timeouts.check()?;
    // rustls needs one process-wide crypto provider; choose it explicitly so that a build in which
    // several are compiled in (the tests pull in aws-lc-rs) does not leave the choice ambiguous.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut config = match kubeconfig {
        Some(path) => {
            let kubeconfig_error = |reason: String| ApiClientError::Kubeconfig {
                path: path.display().to_string(),
                reason,
            };
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| kubeconfig_error(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| kubeconfig_error(e.to_string()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| ApiClientError::NoConfig(e.to_string()))?,
    };
    timeouts.apply(&mut config);
    kube::Client::try_from(config).map_err(|e| ApiClientError::Client(e.to_string()))
}

/// Whether a request failed because the server did not answer in time (a connect or read timeout),
/// as opposed to answering with an error.
pub fn is_timeout(error: &kube::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(io) = current.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return true;
            }
        }
        source = current.source();
    }
    false
}

/// First and longest wait before retrying a resource the server does not serve (404 on the list or
/// the watch: a CRD not applied, an API group the server lacks). Every node asks, so at 5,000 nodes a
/// retry every few seconds would be thousands of requests a minute for nothing.
pub const NOT_SERVED_RETRY_MIN: Duration = Duration::from_secs(1);
pub const NOT_SERVED_RETRY_MAX: Duration = Duration::from_secs(300);

/// `stream` (a watcher, or a reflector over one) retried after errors, with delays that grow across
/// consecutive failures: kube's default (0.8 s doubling to 30 s, with jitter), or, while the server
/// answers 404 (the resource is not served), 1 s doubling to 5 minutes.
///
/// kube's own `default_backoff` starts over on every event, and a watcher emits `Init` before each
/// list, so a list that keeps failing was retried about once a second forever, from every node. Here
/// `Init` is dropped before the backoff sees it: only a real answer (an object, the end of a list)
/// resets it. Nobody downstream needs `Init`: a reflector has already applied it to its store.
pub fn retried<K, S>(
    stream: S,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: Send,
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
{
    use futures::StreamExt;
    use kube::runtime::WatchStreamExt;
    let backoff = WatchBackoff::default();
    let not_served = backoff.not_served.clone();
    stream
        .filter(|event| std::future::ready(!matches!(event, Ok(watcher::Event::Init))))
        .inspect(move |event| {
            if let Err(error) = event {
                not_served.store(is_not_served(error), std::sync::atomic::Ordering::Relaxed);
            }
        })
        .backoff(backoff)
}

/// A 404 from a watcher's list or watch: the server does not serve the resource. A collection cannot
/// be "not found" otherwise. The code decides, not the reason: for a whole API group it does not serve
/// (a CRD alone in its group, as GpuNodePolicy is), a real kube-apiserver answers with the plain text
/// `404 page not found`, which kube reads as a Status without the `NotFound` reason.
pub fn is_not_served(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 404,
        watcher::Error::WatchError(status) => status.code == 404,
        _ => false,
    }
}

/// The delays of [`retried`]: which sequence the next one comes from depends on the last error.
#[derive(Default)]
struct WatchBackoff {
    usual: watcher::DefaultBackoff,
    long: Doubling,
    not_served: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        if self.not_served.load(std::sync::atomic::Ordering::Relaxed) {
            self.long.next()
        } else {
            self.usual.next()
        }
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.usual.reset();
        self.long.reset();
    }
}

/// Delays that double from [`NOT_SERVED_RETRY_MIN`] to [`NOT_SERVED_RETRY_MAX`].
struct Doubling {
    next: Duration,
}

impl Default for Doubling {
    fn default() -> Doubling {
        Doubling {
            next: NOT_SERVED_RETRY_MIN,
        }
    }
}

impl Iterator for Doubling {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (self.next * 2).min(NOT_SERVED_RETRY_MAX);
        Some(delay)
    }
}

impl kube::runtime::utils::Backoff for Doubling {
    fn reset(&mut self) {
        self.next = NOT_SERVED_RETRY_MIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn production_timeouts_fit_together() {
        let timeouts = ApiTimeouts::default();
        assert!(timeouts.check().is_ok());
        // A prepare must answer per claim well before the kubelet's 45 s deadline.
        assert!(timeouts.claim_read < Duration::from_secs(45) / 2);
    }

    #[test]
    fn a_read_timeout_within_the_watch_length_is_refused() {
        let timeouts = ApiTimeouts {
            read: Duration::from_secs(30),
            watch: Duration::from_secs(30),
            ..ApiTimeouts::default()
        };
        assert!(matches!(
            timeouts.check(),
            Err(ApiClientError::ReadShorterThanWatch { .. })
        ));
    }

    #[test]
    fn watches_ask_the_server_to_end_them_after_the_watch_timeout() {
        let timeouts = ApiTimeouts {
            watch: Duration::from_secs(2),
            ..ApiTimeouts::default()
        };
        assert_eq!(timeouts.watcher_config().timeout, Some(2));
    }

    #[test]
    fn the_client_gets_the_timeouts() {
        let mut config = kube::Config::new(http::Uri::from_static("http://127.0.0.1:1"));
        ApiTimeouts::default().apply(&mut config);
        assert_eq!(config.connect_timeout, Some(Duration::from_secs(10)));
        assert_eq!(config.read_timeout, Some(Duration::from_secs(75)));
        assert!(config.reset_reader_on_write);
    }

    #[test]
    fn retries_of_a_resource_not_served_double_up_to_five_minutes_and_start_over_after_a_success() {
        use kube::runtime::utils::Backoff;
        let mut delays = Doubling::default();
        let seconds: Vec<u64> = delays.by_ref().take(11).map(|d| d.as_secs()).collect();
        assert_eq!(seconds, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        delays.reset();
        assert_eq!(delays.next(), Some(Duration::from_secs(1)));
    }

    #[test]
    fn a_404_switches_to_the_long_delays_and_other_errors_back() {
        let mut backoff = WatchBackoff::default();
        backoff
            .not_served
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let long: Vec<u64> = backoff.by_ref().take(10).map(|d| d.as_secs()).collect();
        assert_eq!(long, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]);
        backoff
            .not_served
            .store(false, std::sync::atomic::Ordering::Relaxed);
        // kube's default: 30 s at most, plus up to as much again of jitter.
        let usual = backoff.by_ref().take(10).max().unwrap();
        assert!(usual <= Duration::from_secs(60), "{usual:?}");
        let not_found = kube::core::Status::failure("gone", "NotFound").with_code(404);
        let server_error = kube::core::Status::failure("down", "InternalError").with_code(500);
        assert!(is_not_served(&watcher::Error::InitialListFailed(
            kube::Error::Api(Box::new(not_found))
        )));
        assert!(!is_not_served(&watcher::Error::InitialListFailed(
            kube::Error::Api(Box::new(server_error))
        )));
    }
}
