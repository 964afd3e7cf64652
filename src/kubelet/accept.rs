//! Accepting the kubelet's connections without spinning on errors. tonic polls its incoming stream
//! again at once after an error, and an accept that fails for want of file descriptors (EMFILE,
//! ENFILE) fails again at once while the connection waits in the backlog: a core spins until a
//! descriptor frees up. So accept errors pause the stream as Go's `net/http` server does: 5 ms,
//! doubling to 1 s, back to 5 ms after an accept that works; logged once per burst, never passed on.
//! Only an error that says the listening socket itself is unusable ends the stream (and so the
//! server, which makes the plugin unhealthy and restarted).

use std::io;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tracing::{error, info, warn};

/// The pause after the first accept error of a burst.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(5);
/// The longest pause between retries.
pub const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The connections of `incoming`, with its errors retried after growing pauses instead of passed on.
pub fn with_backoff<S>(incoming: impl Stream<Item = io::Result<S>>) -> impl Stream<Item = S> {
    async_stream::stream! {
        let mut incoming = std::pin::pin!(incoming);
        let mut delay = FIRST_BACKOFF;
        // Errors in the current burst, and when it began.
        let mut burst: Option<(u64, tokio::time::Instant)> = None;
        while let Some(next) = incoming.next().await {
            match next {
                Ok(connection) => {
                    if let Some((errors, since)) = burst.take() {
                        info!(errors, lasted_ms = since.elapsed().as_millis() as u64, "accepting connections on the kubelet socket again");
                    }
                    delay = FIRST_BACKOFF;
                    yield connection;
                }
                Err(error) if listener_unusable(&error) => {
                    error!(%error, "the kubelet socket cannot accept connections any more; its server stops");
                    break;
                }
                Err(error) => {
                    match &mut burst {
                        Some((errors, _)) => *errors += 1,
                        None => {
                            warn!(%error, first_retry_ms = delay.as_millis() as u64, max_retry_ms = MAX_BACKOFF.as_millis() as u64, "accepting a connection on the kubelet socket failed; retrying with growing pauses (logged once until it works again)");
                            burst = Some((1, tokio::time::Instant::now()));
                        }
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}

/// Errors of `accept(2)` that no wait can cure: the descriptor is not (or no longer) a listening
/// socket. Everything else (EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED, ...) is transient.
fn listener_unusable(error: &io::Error) -> bool {
    use nix::libc;
    matches!(
        error.raw_os_error(),
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EOPNOTSUPP | libc::EFAULT)
    )
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use super::*;

    /// The log lines written while it is the thread's default subscriber.
    #[derive(Clone, Default)]
    struct Logs(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Logs {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn emfile() -> io::Error {
        io::Error::from_raw_os_error(nix::libc::EMFILE)
    }

    /// An accept source that answers `script` in order, noting when it was asked.
    fn scripted(
        script: Vec<io::Result<u32>>,
        asked: Arc<Mutex<Vec<Instant>>>,
    ) -> impl Stream<Item = io::Result<u32>> {
        futures::stream::iter(script).map(move |answer| {
            asked.lock().unwrap().push(Instant::now());
            answer
        })
    }

    #[tokio::test(flavor = "current_thread")]
    async fn accept_errors_are_retried_after_doubling_pauses_reset_by_a_connection() {
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _logging = tracing::subscriber::set_default(subscriber);
        let mut script: Vec<io::Result<u32>> = (0..8).map(|_| Err(emfile())).collect();
        script.push(Ok(1));
        script.extend((0..2).map(|_| Err(emfile())));
        script.push(Ok(2));
        let asked = Arc::new(Mutex::new(Vec::new()));

        let served: Vec<u32> = with_backoff(scripted(script, asked.clone()))
            .collect()
            .await;

        assert_eq!(
            served,
            vec![1, 2],
            "both connections are served, no error ends the stream"
        );
        let asked = asked.lock().unwrap().clone();
        let gaps: Vec<Duration> = asked.windows(2).map(|w| w[1] - w[0]).collect();
        // 5 ms doubling: 5, 10, ..., 640 ms after the eight errors of the first burst.
        for (retry, gap) in gaps[..8].iter().enumerate() {
            let least = FIRST_BACKOFF * 2u32.pow(retry as u32);
            assert!(
                *gap >= least,
                "retry {retry} came after {gap:?}, before {least:?}"
            );
        }
        // The connection reset the pause: the next burst starts at 5 ms again, not at 1 s.
        assert!(gaps[8] < Duration::from_millis(50), "{:?}", gaps[8]);
        assert!(
            gaps[9] >= FIRST_BACKOFF && gaps[9] < Duration::from_millis(500),
            "{:?}",
            gaps[9]
        );
        let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            text.matches("accepting a connection on the kubelet socket failed")
                .count(),
            2,
            "{text}"
        );
        assert!(text.contains("Too many open files"), "{text}");
        assert_eq!(
            text.matches("accepting connections on the kubelet socket again")
                .count(),
            2,
            "{text}"
        );
        assert!(
            text.contains("errors=8") && text.contains("errors=2"),
            "{text}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_listener_that_is_no_socket_ends_the_stream() {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let script = vec![
            Err(emfile()),
            Err(io::Error::from_raw_os_error(nix::libc::EBADF)),
            Ok(1),
        ];
        let served: Vec<u32> = with_backoff(scripted(script, asked.clone()))
            .collect()
            .await;
        assert!(served.is_empty());
        assert_eq!(
            asked.lock().unwrap().len(),
            2,
            "nothing is accepted after EBADF"
        );
    }
}
