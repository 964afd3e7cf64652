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

/// A wait drawn at random from `[longest / 2, longest]`, for a retry whose delay has grown to its cap (or
/// never had jitter). Nodes that failed at the same moment (an API server that went away, a CRD deleted:
/// the server ends every watch at once and kube's watcher re-watches at once, without a delay) would,
/// with equal waits, keep retrying in the same second for as long as the failure lasts, and all come back
/// in that second when it ends. A random wait spreads them a little further on each retry; the cap stays
/// the longest wait there is.
pub fn jittered_cap(longest: Duration) -> Duration {
    longest.mul_f64(1.0 - fastrand::f64() / 2.0)
}

/// The shortest and longest window over which a watch spreads its re-list when the server that answers
/// 410 Gone has just come back (see [`retried`]): about as long as the watch failed, within these. The
/// slices stay published meanwhile; only what the watch would notice (slices deleted by others, a new
/// policy) waits, and 10 s at least keeps 5,000 nodes to about 500 a second re-listing.
pub const RELIST_SPREAD_MIN: Duration = Duration::from_secs(10);
pub const RELIST_SPREAD_MAX: Duration = Duration::from_secs(30);

/// `stream` (a watcher, or a reflector over one) retried after errors, with delays that grow across
/// consecutive failures: kube's default (0.8 s doubling to 30 s, each delay `d` drawn from `[d, 2d)`, so
/// 30 to 60 s at the cap), or, while the server answers 404 (the resource is not served), 1 s doubling to
/// 5 minutes, each drawn from `[d/2, d]` ([`jittered_cap`]).
///
/// A 410 Gone after failures is the API server coming back: it asks the watcher to list again, which then
/// waits a random time within about as long as the watch had been failing ([`RELIST_SPREAD_MIN`] to
/// [`RELIST_SPREAD_MAX`]) rather than the next delay. What happens on a restart of kube-apiserver
/// (`benches/realk8s/herd.py` measures it): the old server ends every watch at the same moment, as it
/// exits, and kube's watcher resumes an ended watch immediately, without a delay; later attempts wait
/// for jittered delays, but a server that has bound its port and is still starting holds every
/// connection made meanwhile until it serves, then answers all the resumed watches with 410 in the same
/// instant (its watch cache starts at the current revision). Every node has failed for as long, so
/// the next delays lie within one narrow window of `[d, 2d)`: with them, 30 and 32 of 50 nodes
/// confirmed their slices in the same second (two runs). Spread over the failure's length instead (at
/// least 10 s), at most 8 to 14 of 50 did, over about 10 s; a bigger outage (more nodes waiting, more to
/// list) is spread wider, and a 410 on a healthy watch (no failure before it) is retried as before.
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
    let last_error = backoff.last_error.clone();
    stream
        .filter(|event| std::future::ready(!matches!(event, Ok(watcher::Event::Init))))
        .inspect(move |event| {
            if let Err(error) = event {
                last_error.store(
                    LastError::of(error) as u8,
                    std::sync::atomic::Ordering::Relaxed,
                );
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

/// A 410 Gone from a watch: the server cannot resume it from where it was and asks for a new list.
pub fn is_gone(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 410,
        watcher::Error::WatchError(status) => status.code == 410,
        _ => false,
    }
}

/// What the last error of a [`retried`] stream said, as far as its next delay depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum LastError {
    Other = 0,
    NotServed = 1,
    Gone = 2,
}

impl LastError {
    fn of(error: &watcher::Error) -> LastError {
        if is_not_served(error) {
            LastError::NotServed
        } else if is_gone(error) {
            LastError::Gone
        } else {
            LastError::Other
        }
    }
}

/// The delays of [`retried`]: which sequence the next one comes from depends on the last error.
#[derive(Default)]
struct WatchBackoff {
    usual: watcher::DefaultBackoff,
    long: Doubling,
    /// A [`LastError`], set by the stream before it asks for the delay.
    last_error: std::sync::Arc<std::sync::atomic::AtomicU8>,
    /// When the first error since the last answer came.
    failing_since: Option<tokio::time::Instant>,
}

impl WatchBackoff {
    fn last_error(&self) -> LastError {
        match self.last_error.load(std::sync::atomic::Ordering::Relaxed) {
            1 => LastError::NotServed,
            2 => LastError::Gone,
            _ => LastError::Other,
        }
    }

    fn next_at(&mut self, now: tokio::time::Instant) -> Option<Duration> {
        let failed_for = self.failing_since.map(|since| now - since);
        self.failing_since.get_or_insert(now);
        match (self.last_error(), failed_for) {
            (LastError::NotServed, _) => self.long.next(),
            // The server is back after failures: list again at a random time within about as long as
            // the watch was failing (why: see `retried`).
            (LastError::Gone, Some(failed_for)) => {
                let window = failed_for.clamp(RELIST_SPREAD_MIN, RELIST_SPREAD_MAX);
                Some(window.mul_f64(fastrand::f64()))
            }
            _ => self.usual.next(),
        }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.next_at(tokio::time::Instant::now())
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.usual.reset();
        self.long.reset();
        self.failing_since = None;
    }
}

/// Delays that double from [`NOT_SERVED_RETRY_MIN`] to [`NOT_SERVED_RETRY_MAX`], each drawn from between
/// half of that and all of it ([`jittered_cap`]): a 404 often starts for every node at once (a CRD
/// deleted ends all its watches together), and fixed delays would keep them all asking in one second.
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
        Some(jittered_cap(delay))
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

    /// Whether each delay lies between half of `caps`' and all of it.
    fn within_half_of(delays: &[Duration], caps: &[u64]) -> bool {
        delays.len() == caps.len()
            && delays.iter().zip(caps).all(|(delay, cap)| {
                let cap = Duration::from_secs(*cap);
                *delay >= cap / 2 && *delay <= cap
            })
    }

    const NOT_SERVED_CAPS: [u64; 11] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300];

    #[test]
    fn retries_of_a_resource_not_served_double_up_to_five_minutes_and_start_over_after_a_success() {
        use kube::runtime::utils::Backoff;
        let mut delays = Doubling::default();
        let first: Vec<Duration> = delays.by_ref().take(11).collect();
        assert!(within_half_of(&first, &NOT_SERVED_CAPS), "{first:?}");
        delays.reset();
        let again = delays.next().unwrap();
        assert!(again <= NOT_SERVED_RETRY_MIN, "{again:?}");
    }

    #[test]
    fn nodes_that_fail_together_do_not_retry_together() {
        // 50 nodes get their first 404 in the same instant; with fixed delays all 50 would ask again in
        // the same second, every time. Drawn delays put them apart, more so with each retry.
        let mut nodes: Vec<Doubling> = (0..50).map(|_| Doubling::default()).collect();
        let mut elapsed = vec![Duration::ZERO; nodes.len()];
        for _ in 0..NOT_SERVED_CAPS.len() {
            for (node, at) in nodes.iter_mut().zip(&mut elapsed) {
                *at += node.next().unwrap();
            }
        }
        let mut seconds: Vec<u64> = elapsed.iter().map(Duration::as_secs).collect();
        seconds.sort_unstable();
        let most_in_one_second = seconds
            .chunk_by(|a, b| a == b)
            .map(<[u64]>::len)
            .max()
            .unwrap();
        // Their 11th retries spread over minutes (a standard deviation of about 75 s): at most 2 or 3
        // share a second (9 or more: a chance of about one in a billion). Fixed delays: all 50.
        assert!(most_in_one_second <= 8, "{seconds:?}");
        // At the cap, each wait is between half the cap and the cap.
        for _ in 0..100 {
            let wait = jittered_cap(NOT_SERVED_RETRY_MAX);
            assert!(wait >= NOT_SERVED_RETRY_MAX / 2 && wait <= NOT_SERVED_RETRY_MAX);
        }
    }

    fn set_last_error(backoff: &WatchBackoff, error: LastError) {
        backoff
            .last_error
            .store(error as u8, std::sync::atomic::Ordering::Relaxed);
    }

    #[test]
    fn a_410_after_failures_lists_again_within_the_failures_length() {
        use kube::runtime::utils::Backoff;
        let gone =
            kube::core::Status::failure("too old resource version", "Expired").with_code(410);
        let gone = watcher::Error::WatchError(Box::new(gone));
        assert!(is_gone(&gone) && !is_not_served(&gone));
        assert_eq!(LastError::of(&gone), LastError::Gone);
        let start = tokio::time::Instant::now();

        // A healthy watch that gets a 410 (nothing failed before it) retries with the usual delay.
        let mut backoff = WatchBackoff::default();
        set_last_error(&backoff, LastError::Gone);
        let first = backoff.next_at(start).unwrap();
        assert!(first >= Duration::from_millis(800) && first < Duration::from_millis(1600));

        // The server went away for 20 s (refused connections), then answers 410 to every node at once:
        // each lists again within the next 20 s, at a time it draws for itself.
        let relists: Vec<Duration> = (0..50)
            .map(|_| {
                let mut node = WatchBackoff::default();
                set_last_error(&node, LastError::Other);
                node.next_at(start);
                set_last_error(&node, LastError::Gone);
                node.next_at(start + Duration::from_secs(20)).unwrap()
            })
            .collect();
        assert!(
            relists.iter().all(|d| *d < Duration::from_secs(20)),
            "{relists:?}"
        );
        let mut seconds: Vec<u64> = relists.iter().map(Duration::as_secs).collect();
        seconds.sort_unstable();
        seconds.dedup();
        assert!(seconds.len() >= 10, "50 nodes over 20 s: {seconds:?}");

        // Within RELIST_SPREAD_MAX after a long failure, within RELIST_SPREAD_MIN after a short one; an
        // answer in between starts the count over.
        let mut backoff = WatchBackoff::default();
        backoff.next_at(start);
        set_last_error(&backoff, LastError::Gone);
        let after_long = backoff.next_at(start + Duration::from_secs(600)).unwrap();
        assert!(after_long < RELIST_SPREAD_MAX, "{after_long:?}");
        backoff.reset();
        set_last_error(&backoff, LastError::Other);
        backoff.next_at(start + Duration::from_secs(600));
        set_last_error(&backoff, LastError::Gone);
        let after_short = backoff
            .next_at(start + Duration::from_millis(600_100))
            .unwrap();
        assert!(after_short < RELIST_SPREAD_MIN, "{after_short:?}");
    }

    #[test]
    fn a_404_switches_to_the_long_delays_and_other_errors_back() {
        let mut backoff = WatchBackoff::default();
        set_last_error(&backoff, LastError::NotServed);
        let long: Vec<Duration> = backoff.by_ref().take(10).collect();
        assert!(within_half_of(&long, &NOT_SERVED_CAPS[..10]), "{long:?}");
        set_last_error(&backoff, LastError::Other);
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
