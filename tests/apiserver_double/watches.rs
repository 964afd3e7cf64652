//! Watches as `kube::runtime::watcher` uses them: deletions by the kubelet seen, streaming lists, and
//! `410 Gone` for a compacted resourceVersion, with the watch ending at its timeout.

use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use gpu_dra::support::apiserver::Verb;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{DeleteParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::watcher;

use super::{slice, slice_value, start, DRIVER};

async fn next_event(
    events: &mut futures::stream::BoxStream<
        'static,
        watcher::Result<watcher::Event<ResourceSlice>>,
    >,
) -> watcher::Event<ResourceSlice> {
    let event = tokio::time::timeout(Duration::from_secs(10), events.try_next()).await;
    event
        .expect("an event in time")
        .expect("no watch error")
        .expect("stream goes on")
}

#[tokio::test]
async fn watcher_sees_slices_wiped_by_the_kubelet() {
    let (server, api) = start().await;
    api.create(&PostParams::default(), &slice("mine", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let config = watcher::Config::default().fields("spec.nodeName=node-a");
    let mut events = watcher(api.clone(), config).boxed();
    let mut seen = Vec::new();
    loop {
        match next_event(&mut events).await {
            watcher::Event::InitApply(s) => seen.push(s.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(seen, ["mine"]);
    server.insert(
        "resourceslices",
        serde_json::to_value(slice("other-node", "node-b", DRIVER, 1)).unwrap(),
    );
    server.insert(
        "resourceslices",
        serde_json::to_value(slice("second", "node-a", DRIVER, 1)).unwrap(),
    );
    match next_event(&mut events).await {
        watcher::Event::Apply(s) => assert_eq!(s.metadata.name.as_deref(), Some("second")),
        other => panic!("expected the inserted slice, got {other:?}"),
    }
    let wiped = server.remove_where("resourceslices", |s| s["spec"]["nodeName"] == "node-a");
    assert_eq!(wiped.len(), 2);
    let mut deleted = Vec::new();
    while deleted.len() < 2 {
        if let watcher::Event::Delete(s) = next_event(&mut events).await {
            deleted.push(s.metadata.name.unwrap());
        }
    }
    deleted.sort();
    assert_eq!(deleted, ["mine", "second"]);
    assert!(server
        .requests()
        .iter()
        .any(|r| r.verb == Verb::Watch && r.code == 200));
}

#[tokio::test]
async fn watcher_with_streaming_lists() {
    let (_server, api) = start().await;
    api.create(&PostParams::default(), &slice("mine", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let config = watcher::Config::default().streaming_lists();
    let mut events = watcher(api.clone(), config).boxed();
    let mut seen = Vec::new();
    loop {
        match next_event(&mut events).await {
            watcher::Event::InitApply(s) => seen.push(s.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(seen, ["mine"]);
    api.delete("mine", &DeleteParams::default()).await.unwrap();
    assert!(matches!(
        next_event(&mut events).await,
        watcher::Event::Delete(_)
    ));
}

#[tokio::test]
async fn watch_from_a_compacted_version_is_gone_and_ends_at_timeout() {
    let (server, api) = start().await;
    api.create(&PostParams::default(), &slice("s", "node-a", DRIVER, 1))
        .await
        .unwrap();
    let mut stream = api
        .watch(&WatchParams::default().timeout(1), "0")
        .await
        .unwrap()
        .boxed();
    assert!(matches!(
        stream.try_next().await.unwrap(),
        Some(WatchEvent::Added(_))
    ));
    let started = Instant::now();
    assert!(
        stream.try_next().await.unwrap().is_none(),
        "the stream ends at timeoutSeconds"
    );
    assert!(started.elapsed() < Duration::from_secs(3));

    server.insert("resourceslices", slice_value("t"));
    server.compact();
    let mut expired = api
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    match expired.try_next().await.unwrap() {
        Some(WatchEvent::Error(status)) => assert_eq!(status.code, 410),
        other => panic!("expected 410 Gone, got {other:?}"),
    }
}
