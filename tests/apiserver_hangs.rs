//! The API server double when it hangs: a hung request is accepted and read but gets not one byte back
//! until released; a frozen watch stays open and silent (no events, no bookmarks, no end) while new
//! requests and watches are served.

use std::time::Duration;

use futures::StreamExt;
use gpu_dra::support::apiserver::{ApiServer, HangSpec, Verb};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, WatchEvent, WatchParams};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn node(name: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

/// Sends one raw HTTP/1.1 GET for `path` on a fresh connection.
async fn raw_get(server: &ApiServer, path: &str) -> tokio::net::TcpStream {
    let addr = server.url().trim_start_matches("http://").to_string();
    let mut stream = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("the server accepts the connection");
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("the request is written");
    stream
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_hung_request_is_accepted_and_gets_no_bytes_until_released() {
    let server = ApiServer::start().await.expect("server starts");
    server.insert("nodes", node("node-a"));
    server.hang_next(HangSpec {
        verb: Some(Verb::Get),
        resource: Some("nodes".into()),
        name: Some("node-a".into()),
        count: Some(1),
    });
    let mut hung = raw_get(&server, "/api/v1/nodes/node-a").await;
    wait_until("the request is held", || server.hanging() == 1).await;
    let mut buffer = [0u8; 4096];
    let silent = tokio::time::timeout(Duration::from_millis(700), hung.read(&mut buffer)).await;
    assert!(
        silent.is_err(),
        "a hung request must get nothing, not even a status line or a close: {silent:?}"
    );

    // The count is spent: the same request on another connection is answered at once.
    let nodes: Api<Node> = Api::all(server.client_without_retries());
    let answered = tokio::time::timeout(Duration::from_secs(2), nodes.get("node-a")).await;
    assert!(matches!(answered, Ok(Ok(_))), "{answered:?}");
    assert_eq!(server.hanging(), 1);

    server.release_hangs();
    let read = tokio::time::timeout(Duration::from_secs(2), hung.read(&mut buffer))
        .await
        .expect("a released request is answered")
        .expect("reading the answer");
    let text = String::from_utf8_lossy(&buffer[..read]);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    wait_until("the held request is let go", || server.hanging() == 0).await;
}

#[tokio::test]
async fn a_hang_matches_verb_resource_and_name_until_released() {
    let server = ApiServer::start().await.expect("server starts");
    server.insert("nodes", node("node-a"));
    server.insert("nodes", node("node-b"));
    server.hang_next(HangSpec {
        verb: Some(Verb::Get),
        resource: Some("nodes".into()),
        name: Some("node-a".into()),
        count: None,
    });
    let nodes: Api<Node> = Api::all(server.client_without_retries());
    for _ in 0..2 {
        let hung = tokio::time::timeout(Duration::from_millis(300), nodes.get("node-a")).await;
        assert!(hung.is_err(), "GET node-a must hang every time: {hung:?}");
    }
    // Another name, and a list of the same resource, are served.
    assert!(nodes.get("node-b").await.is_ok());
    assert_eq!(
        nodes
            .list(&Default::default())
            .await
            .expect("list is served")
            .items
            .len(),
        2
    );
    server.release_hangs();
    assert!(nodes.get("node-a").await.is_ok(), "released: served again");
}

#[tokio::test]
async fn a_frozen_watch_stays_open_and_sends_nothing_while_new_watches_work() {
    let server = ApiServer::start().await.expect("server starts");
    server.insert("nodes", node("node-a"));
    let nodes: Api<Node> = Api::all(server.client_without_retries());
    // A one-second watch: unfrozen, the server would end it after a second.
    let params = WatchParams::default().timeout(1);
    let mut frozen = nodes
        .watch(&params, "0")
        .await
        .expect("watch starts")
        .boxed();
    let first = frozen.next().await;
    assert!(matches!(first, Some(Ok(WatchEvent::Added(_)))), "{first:?}");

    server.freeze_watches();
    server.insert("nodes", node("node-b"));
    let silent = tokio::time::timeout(Duration::from_millis(2500), frozen.next()).await;
    assert!(
        silent.is_err(),
        "a frozen watch must neither send (events, bookmarks) nor end: {silent:?}"
    );

    // A watch opened after the freeze sees the current state and the changes that follow.
    let mut fresh = nodes
        .watch(&params, "0")
        .await
        .expect("a new watch starts")
        .boxed();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match tokio::time::timeout(Duration::from_secs(2), fresh.next()).await {
            Ok(Some(Ok(WatchEvent::Added(node)))) => {
                seen.push(node.metadata.name.unwrap_or_default())
            }
            Ok(Some(Ok(WatchEvent::Bookmark(_)))) => {}
            other => panic!("the new watch must replay both nodes: {other:?}"),
        }
    }
    seen.sort();
    assert_eq!(seen, ["node-a", "node-b"]);
}

#[tokio::test]
async fn a_hung_watch_request_gets_no_response_at_all() {
    let server = ApiServer::start().await.expect("server starts");
    server.hang_next(HangSpec::all(Verb::Watch, "nodes"));
    let mut hung = raw_get(&server, "/api/v1/nodes?watch=true&timeoutSeconds=1").await;
    wait_until("the watch is held", || server.hanging() == 1).await;
    let mut buffer = [0u8; 1024];
    let silent = tokio::time::timeout(Duration::from_millis(1500), hung.read(&mut buffer)).await;
    assert!(silent.is_err(), "no headers for a hung watch: {silent:?}");
    // Lists are another verb: still served.
    let nodes: Api<Node> = Api::all(server.client_without_retries());
    assert!(nodes.list(&Default::default()).await.is_ok());
}
