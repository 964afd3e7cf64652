//! Watch responses: a newline-delimited stream of `{"type", "object"}` events that replays the history after
//! the requested resourceVersion, then follows live changes until `timeoutSeconds`, with bookmarks and
//! `410 Gone` for a resourceVersion older than the history, as the real server streams them.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use serde_json::{json, Value};
use tokio::sync::broadcast::error::RecvError;

use super::errors::ApiError;
use super::rest::Request;
use super::selectors::Selection;
use super::{EventType, ResourceDef, Shared, StoreEvent};

/// How often a watch that allows bookmarks gets one; the real server sends about one a minute, tests
/// want them sooner.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(5);
/// The watch length when the client gives no `timeoutSeconds` (the real server picks 30 to 60 minutes).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// What the request asked for, read from its query.
struct WatchOptions {
    /// `None` for "current state first" (no resourceVersion, or "0").
    from: Option<u64>,
    bookmarks: bool,
    send_initial_events: bool,
    timeout: Duration,
}

impl WatchOptions {
    fn parse(request: &Request) -> Result<WatchOptions, ApiError> {
        let query = &request.query;
        let from = match query.get("resourceVersion").map(String::as_str) {
            None | Some("") | Some("0") => None,
            Some(version) => Some(version.parse::<u64>().map_err(|_| {
                ApiError::BadRequest(format!(
                    "resourceVersion: Invalid value: \"{version}\": must be an integer"
                ))
            })?),
        };
        let timeout = match query.get("timeoutSeconds") {
            Some(seconds) => Duration::from_secs(seconds.parse().map_err(|_| {
                ApiError::BadRequest(format!("invalid timeoutSeconds {seconds:?}"))
            })?),
            None => DEFAULT_WATCH_TIMEOUT,
        };
        let flag = |name: &str| query.get(name).is_some_and(|v| v == "true" || v == "1");
        Ok(WatchOptions {
            from,
            bookmarks: flag("allowWatchBookmarks"),
            send_initial_events: flag("sendInitialEvents"),
            timeout,
        })
    }
}

fn line(event_type: &str, object: &Value) -> Result<Bytes, Infallible> {
    let mut text = json!({"type": event_type, "object": object}).to_string();
    text.push('\n');
    Ok(Bytes::from(text))
}

fn bookmark(
    def: &ResourceDef,
    revision: u64,
    initial_events_end: bool,
) -> Result<Bytes, Infallible> {
    let mut metadata = json!({"resourceVersion": revision.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        "BOOKMARK",
        &json!({"kind": def.kind, "apiVersion": def.api_version(), "metadata": metadata}),
    )
}

/// What woke a running watch up.
enum Next {
    End,
    /// The test froze open watches: go silent, as a half-open connection does.
    Freeze,
    Bookmark,
    Event(Result<Arc<StoreEvent>, RecvError>),
}

/// The event type a watch with `selection` sees for `event`, if any: a change that moves an object into
/// the selection is ADDED, one that moves it out is DELETED.
fn visible(event: &StoreEvent, def: &ResourceDef, selection: &Selection) -> Option<&'static str> {
    if event.resource != def.plural {
        return None;
    }
    let now = selection.matches(&event.object);
    let before = event
        .previous
        .as_ref()
        .is_some_and(|p| selection.matches(p));
    match (event.kind, before, now) {
        (EventType::Modified, true, true) => Some("MODIFIED"),
        (EventType::Modified, false, true) => Some("ADDED"),
        (EventType::Modified, true, false) => Some("DELETED"),
        (EventType::Modified, false, false) => None,
        (kind, _, now) => now.then_some(kind.as_str()),
    }
}

/// Starts a watch: everything up to now is decided under the store lock, so no change is lost or repeated
/// between the replay and the live events.
pub(super) fn respond(shared: Arc<Shared>, request: &Request) -> Result<Response, ApiError> {
    let def = request.def;
    let selection = Selection::parse(def, request.namespace.clone(), &request.query)
        .map_err(ApiError::BadRequest)?;
    let options = WatchOptions::parse(request)?;
    let mut first: Vec<Result<Bytes, Infallible>> = Vec::new();
    let mut gone = false;
    let (mut events, start) = {
        let store = shared.store();
        let events = shared.events.subscribe();
        match options.from {
            None => {
                let current = store
                    .objects
                    .iter()
                    .filter(|(key, obj)| key.resource == def.plural && selection.matches(obj));
                first.extend(current.map(|(_, obj)| line("ADDED", obj)));
                if options.send_initial_events {
                    first.push(bookmark(def, store.revision, true));
                }
            }
            Some(from) if from < store.compacted_through => {
                let error = ApiError::Gone {
                    requested: from,
                    oldest: store.compacted_through + 1,
                };
                first.push(line("ERROR", &error.status()));
                gone = true;
            }
            Some(from) => {
                let replay = store.history.iter().filter(|event| event.revision > from);
                first.extend(
                    replay.filter_map(|e| Some(line(visible(e, def, &selection)?, &e.object))),
                );
            }
        }
        (events, store.revision)
    };
    let mut shutdown = shared.shutdown.clone();
    let (mut frozen, born) = shared.hangs.freeze_signal();
    let stream = async_stream::stream! {
        for item in first {
            yield item;
        }
        if gone {
            return;
        }
        let deadline = tokio::time::Instant::now() + options.timeout;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + BOOKMARK_INTERVAL, BOOKMARK_INTERVAL);
        let mut last_seen = start;
        loop {
            let next = tokio::select! {
                // A freeze wins over anything ready at the same time: nothing may slip out after it.
                biased;
                _ = frozen.wait_for(|generation| *generation > born) => Next::Freeze,
                _ = tokio::time::sleep_until(deadline) => Next::End,
                _ = shutdown.wait_for(|stopped| *stopped) => Next::End,
                _ = ticker.tick(), if options.bookmarks => Next::Bookmark,
                received = events.recv() => Next::Event(received),
            };
            match next {
                Next::End | Next::Event(Err(RecvError::Closed)) => break,
                // Neither the timeout nor the end of the stream ever reaches the client.
                Next::Freeze => {
                    let _ = shutdown.wait_for(|stopped| *stopped).await;
                    break;
                }
                Next::Bookmark => yield bookmark(def, last_seen, false),
                // This watch fell too far behind the live events; the client must list again.
                Next::Event(Err(RecvError::Lagged(_))) => {
                    let gone = ApiError::Gone { requested: last_seen, oldest: last_seen + 1 };
                    yield line("ERROR", &gone.status());
                    break;
                }
                Next::Event(Ok(event)) => {
                    if event.revision <= last_seen {
                        continue;
                    }
                    last_seen = event.revision;
                    if let Some(event_type) = visible(&event, def, &selection) {
                        yield line(event_type, &event.object);
                    }
                }
            }
        }
    };
    let mut response = Response::new(Body::from_stream(stream));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}
