//! What a stretch of the API server double's request log cost: requests by verb and resource,
//! writes stored, and the bytes those writes sent.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use gpu_dra::support::apiserver::{ApiServer, RequestRecord, Verb};

/// No request for this long means the plugin is done reacting: longer than the publisher's
/// one-second write window plus the 50 ms it lets its own watch echoes settle.
const QUIET: Duration = Duration::from_millis(1500);

/// Waits until the server has seen no request for [`QUIET`] (30 s at most).
pub async fn settle(api: &ApiServer) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut seen = api.requests().len();
    let mut quiet_since = tokio::time::Instant::now();
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = api.requests().len();
        if now != seen {
            seen = now;
            quiet_since = tokio::time::Instant::now();
        } else if quiet_since.elapsed() >= QUIET {
            return;
        }
    }
    println!("  (requests did not stop within 30 s; counting anyway)");
}

/// Requests of one stretch of the log.
#[derive(Default)]
pub struct Tally {
    /// `VERB resource` (`(dry run)` added for dry runs, the code for answers other than 2xx) → count.
    by_kind: BTreeMap<String, usize>,
    pub requests: usize,
    /// Create, update, patch and delete requests the server stored.
    pub writes: usize,
    /// Bytes of the bodies of those writes.
    pub bytes_written: usize,
}

impl Tally {
    pub fn of(records: &[RequestRecord]) -> Tally {
        let mut tally = Tally::default();
        for r in records {
            let mut kind = label(r.verb, &r.resource);
            if r.dry_run {
                kind += " (dry run)";
            }
            if r.code >= 300 {
                kind += &format!(" ({})", r.code);
            }
            *tally.by_kind.entry(kind).or_default() += 1;
            tally.requests += 1;
            if is_write(r.verb) && !r.dry_run && r.code < 300 {
                tally.writes += 1;
                tally.bytes_written += r.body_bytes;
            }
        }
        tally
    }
}

/// `N requests, W writes (B KiB): VERB resource n, ...`
impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kinds: Vec<String> = self
            .by_kind
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect();
        write!(
            f,
            "{} requests, {} writes stored ({:.1} KiB sent): {}",
            self.requests,
            self.writes,
            self.bytes_written as f64 / 1024.0,
            kinds.join(", ")
        )
    }
}

fn is_write(verb: Verb) -> bool {
    matches!(
        verb,
        Verb::Create | Verb::Update | Verb::Patch | Verb::Delete
    )
}

/// `GET resourceclaims`: the verb as audit logs spell it.
fn label(verb: Verb, resource: &str) -> String {
    format!("{} {resource}", format!("{verb:?}").to_uppercase())
}
