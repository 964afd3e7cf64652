//! Requests that hang, as on a server (or a path to it) that stopped answering: the connection is
//! accepted and the request read, but not one byte of response comes back. Watches can also go
//! half-open: the stream stays open and sends nothing more (no events, no bookmarks) and never ends,
//! which is what a client sees when a middlebox drops the connection without a reset.
//!
//! A hung request waits until [`ApiServer::release_hangs`] (then it is answered as usual, late), the
//! client gives up and closes the connection, or the server stops. A frozen watch stays frozen until
//! the client closes it or the server stops.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::{lock, resource_matches, ApiServer, Verb};

/// Makes matching requests hang. `None` fields match anything; `resource` matches as in
/// [`super::FaultSpec`]; `name` is the object name in the path (a list or watch has none, so a spec
/// with a name never matches them). `count: None` hangs every matching request until
/// [`ApiServer::release_hangs`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HangSpec {
    pub verb: Option<Verb>,
    pub resource: Option<String>,
    pub name: Option<String>,
    pub count: Option<usize>,
}

impl HangSpec {
    /// Every request on `resource` with `verb`, until released.
    pub fn all(verb: Verb, resource: &str) -> Self {
        HangSpec {
            verb: Some(verb),
            resource: Some(resource.to_string()),
            ..HangSpec::default()
        }
    }

    fn matches(&self, verb: Verb, resource: &str, name: Option<&str>) -> bool {
        self.count != Some(0)
            && self.verb.is_none_or(|v| v == verb)
            && self
                .resource
                .as_deref()
                .is_none_or(|r| resource_matches(r, resource))
            && self.name.as_deref().is_none_or(|n| Some(n) == name)
    }
}

/// The hang state the handlers share.
pub(super) struct Hangs {
    pending: Mutex<Vec<HangSpec>>,
    /// Bumped by each release; a hung request waits for a generation newer than its own.
    released: watch::Sender<u64>,
    /// Bumped by each freeze; a watch opened before the bump goes silent.
    frozen: watch::Sender<u64>,
    /// Requests held right now.
    held: Arc<AtomicUsize>,
}

impl Default for Hangs {
    fn default() -> Self {
        Hangs {
            pending: Mutex::new(Vec::new()),
            released: watch::channel(0).0,
            frozen: watch::channel(0).0,
            held: Arc::new(AtomicUsize::new(0)),
        }
    }
}

/// Counts a held request for as long as it is held, whether it is released, abandoned by the client
/// (the handler's future is dropped) or ended by shutdown.
struct Held(Arc<AtomicUsize>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Hangs {
    /// Holds the request if a hang spec matches it: returns when the hang is released or the server
    /// stops. Returns at once otherwise.
    pub(super) async fn hold_if_hung(
        &self,
        verb: Verb,
        resource: &str,
        name: Option<&str>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut released = self.released.subscribe();
        let generation = *released.borrow_and_update();
        {
            let mut pending = lock(&self.pending);
            let Some(spec) = pending
                .iter_mut()
                .find(|spec| spec.matches(verb, resource, name))
            else {
                return;
            };
            if let Some(count) = &mut spec.count {
                *count -= 1;
            }
            pending.retain(|spec| spec.count != Some(0));
        }
        self.held.fetch_add(1, Ordering::SeqCst);
        let _held = Held(self.held.clone());
        tokio::select! {
            _ = released.wait_for(|g| *g > generation) => {}
            _ = shutdown.wait_for(|stopped| *stopped) => {}
        }
    }

    /// A receiver that a watch opened now keeps: it fires once the watch must go silent.
    pub(super) fn freeze_signal(&self) -> (watch::Receiver<u64>, u64) {
        let receiver = self.frozen.subscribe();
        let born = *receiver.borrow();
        (receiver, born)
    }
}

impl ApiServer {
    /// Makes the matching requests hang; see [`HangSpec`].
    pub fn hang_next(&self, spec: HangSpec) {
        lock(&self.shared.hangs.pending).push(spec);
    }

    /// Stops hanging new requests and lets every held request through (it is then answered as usual).
    pub fn release_hangs(&self) {
        lock(&self.shared.hangs.pending).clear();
        self.shared.hangs.released.send_modify(|g| *g += 1);
    }

    /// Every watch open now goes half-open: it sends nothing more and never ends (until the client
    /// closes it or the server stops). Watches opened later are served as usual.
    pub fn freeze_watches(&self) {
        self.shared.hangs.frozen.send_modify(|g| *g += 1);
    }

    /// How many requests are held right now.
    pub fn hanging(&self) -> usize {
        self.shared.hangs.held.load(Ordering::SeqCst)
    }
}
