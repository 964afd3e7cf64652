//! The plugin against an API server that hangs, refuses or keeps erroring, and against half-open
//! watches: a prepare answers per claim within its budget (never the kubelet's whole-call deadline),
//! the publisher and the watchers find their way back on their own once the server answers, and
//! `/healthz` fails when a task the plugin cannot work without has stopped.
//!
//! The timeouts are the production ones scaled down (claim budget 2 s instead of 20 s), so that the
//! tests stay fast; the kubelet double keeps its real 45 s deadline.

use std::time::{Duration, Instant};

use gpu_dra::apiclient::ApiTimeouts;
use gpu_dra::support::apiserver::{FaultSpec, HangSpec, Verb};
use gpu_dra::support::harness::{Harness, DRIVER, NODE};
use gpu_dra::support::kubelet::ClaimRef;
use serde_json::{json, Value};

/// Production's timeouts, scaled down.
fn short_timeouts() -> ApiTimeouts {
    ApiTimeouts {
        connect: Duration::from_secs(1),
        read: Duration::from_secs(4),
        watch: Duration::from_secs(2),
        claim_read: Duration::from_secs(2),
    }
}

/// Far below the kubelet's 45 s deadline and above the 2 s budget with room for a loaded machine.
const PER_CLAIM_ANSWER_BOUND: Duration = Duration::from_secs(12);

type Answer = std::collections::HashMap<
    String,
    Result<Vec<gpu_dra::support::kubelet::PreparedDevice>, String>,
>;

fn error_of<'a>(answer: &'a Answer, claim: &ClaimRef) -> &'a str {
    match answer.get(&claim.uid) {
        Some(Err(error)) => error,
        other => panic!("claim {} should have failed: {other:?}", claim.name),
    }
}

fn assert_prepared(answer: &Answer, claim: &ClaimRef) {
    match answer.get(&claim.uid) {
        Some(Ok(devices)) if !devices.is_empty() => {}
        other => panic!("claim {} should be prepared: {other:?}", claim.name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_claim_read_fails_that_claim_only_well_before_the_kubelet_deadline() {
    let mut node = Harness::new("dgx-h100").await;
    node.config.api = short_timeouts();
    // The test double's own client has no read timeout at all: the budget alone must hold.
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let hung = node.allocated_claim("hung", 1).await;
    let fine = node.allocated_claim("fine", 1).await;

    node.api.hang_next(HangSpec {
        verb: Some(Verb::Get),
        resource: Some("resourceclaims".into()),
        name: Some("hung".into()),
        count: None,
    });
    let started = Instant::now();
    let answer = kubelet
        .prepare(&[hung.clone(), fine.clone()])
        .await
        .expect("the call as a whole succeeds; only the hung claim fails");
    let took = started.elapsed();
    assert!(
        took < PER_CLAIM_ANSWER_BOUND,
        "the per-claim error took {took:?}; the kubelet gives up after 45 s"
    );
    let error = error_of(&answer, &hung);
    assert!(error.contains("default/hung"), "{error}");
    assert!(error.contains("did not answer in time"), "{error}");
    assert_prepared(&answer, &fine);
    assert!(
        plugin
            .metrics
            .encode()
            .contains("gpu_dra_api_timeouts_total{operation=\"get_claim\"} 1"),
        "{}",
        plugin.metrics.encode()
    );

    // The kubelet retries; once the server answers, the claim is prepared.
    node.api.release_hangs();
    let retried = kubelet
        .prepare(std::slice::from_ref(&hung))
        .await
        .expect("retry");
    assert_prepared(&retried, &hung);
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_read_timeout_on_a_hung_claim_read_is_reported_as_no_answer() {
    let mut node = Harness::new("l40s-4").await;
    // The client's read timeout (2 s) runs out long before the claim budget (30 s).
    node.config.api = ApiTimeouts {
        read: Duration::from_secs(2),
        watch: Duration::from_secs(1),
        claim_read: Duration::from_secs(30),
        ..short_timeouts()
    };
    let kubeconfig = node.dir.path().join("kubeconfig");
    node.api.write_kubeconfig(&kubeconfig).expect("kubeconfig");
    let client = gpu_dra::plugin::kube_client(Some(&kubeconfig), &node.config.api)
        .await
        .expect("client");
    let plugin = gpu_dra::plugin::start(node.config.clone(), client)
        .await
        .expect("plugin starts");
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let hung = node.allocated_claim("hung", 1).await;
    node.api.hang_next(HangSpec {
        verb: Some(Verb::Get),
        resource: Some("resourceclaims".into()),
        name: Some("hung".into()),
        count: None,
    });
    let started = Instant::now();
    let answer = kubelet
        .prepare(std::slice::from_ref(&hung))
        .await
        .expect("the call as a whole succeeds");
    let took = started.elapsed();
    let error = error_of(&answer, &hung);
    assert!(error.contains("default/hung"), "{error}");
    assert!(error.contains("did not answer in time"), "{error}");
    // One read timeout, not retried into the budget.
    assert!(took < Duration::from_secs(6), "took {took:?}");
    node.api.release_hangs();
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_or_erroring_server_fails_the_claim_within_the_budget() {
    let mut node = Harness::new("dgx-h100").await;
    node.config.api = short_timeouts();
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let fine = node.allocated_claim("fine", 1).await;
    let unlucky = node.allocated_claim("unlucky", 1).await;
    let answer = kubelet
        .prepare(std::slice::from_ref(&fine))
        .await
        .expect("prepare");
    assert_prepared(&answer, &fine);

    // 503 on every GET: kube's client retries those on its own, with backoff, for minutes.
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::Get),
        resource: Some("resourceclaims".into()),
        code: 503,
        count: 100_000,
    });
    let started = Instant::now();
    let answer = kubelet
        .prepare(&[unlucky.clone(), fine.clone()])
        .await
        .expect("the call as a whole succeeds");
    let took = started.elapsed();
    assert!(took < PER_CLAIM_ANSWER_BOUND, "503s: took {took:?}");
    let error = error_of(&answer, &unlucky);
    assert!(error.contains("default/unlucky"), "{error}");
    assert!(error.contains("did not answer in time"), "{error}");
    // Already prepared: answered from the checkpoint without the API server.
    assert_prepared(&answer, &fine);

    // A refusal is final at once: no retry can change it within the call.
    node.api.clear_faults();
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::Get),
        resource: Some("resourceclaims".into()),
        code: 403,
        count: 1,
    });
    let started = Instant::now();
    let answer = kubelet
        .prepare(std::slice::from_ref(&unlucky))
        .await
        .expect("the call");
    assert!(started.elapsed() < PER_CLAIM_ANSWER_BOUND);
    let error = error_of(&answer, &unlucky);
    assert!(error.contains("default/unlucky"), "{error}");
    assert!(
        error.contains("403") || error.contains("Forbidden"),
        "{error}"
    );

    // And a 500 that persists: retried a few times, then a per-claim error.
    node.api.fail_next(FaultSpec {
        verb: Some(Verb::Get),
        resource: Some("resourceclaims".into()),
        code: 500,
        count: 100,
    });
    let started = Instant::now();
    let answer = kubelet
        .prepare(std::slice::from_ref(&unlucky))
        .await
        .expect("the call");
    assert!(started.elapsed() < PER_CLAIM_ANSWER_BOUND);
    assert!(error_of(&answer, &unlucky).contains("default/unlucky"));
    node.api.clear_faults();
    plugin.shutdown().await;
}

fn is_event_for(event: &Value, reason: &str, class: &str) -> bool {
    event["reason"] == reason && event["related"]["name"] == class
}

fn accepted(policy: &Value) -> bool {
    policy["status"]["conditions"]
        .as_array()
        .is_some_and(|conditions| conditions.iter().any(|c| c["type"] == "Accepted"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publisher_and_the_watchers_recover_from_a_half_open_api_server() {
    let mut node = Harness::new("dgx-h100").await;
    node.config.api = short_timeouts();
    // The plugin's own client, as the binary builds it, with the (short) timeouts.
    let kubeconfig = node.dir.path().join("kubeconfig");
    node.api.write_kubeconfig(&kubeconfig).expect("kubeconfig");
    let client = gpu_dra::plugin::kube_client(Some(&kubeconfig), &node.config.api)
        .await
        .expect("client");
    let plugin = gpu_dra::plugin::start(node.config.clone(), client)
        .await
        .expect("plugin starts");
    let wait = Duration::from_secs(10);
    node.api
        .wait_for("resourceslices", |s| !s.is_empty(), wait)
        .await
        .expect("slices published");
    // The DeviceClass self-test has listed once it reports deploy/'s MIG class (static mode, no MIG).
    node.api
        .wait_for(
            "events",
            |events| {
                events
                    .iter()
                    .any(|e| is_event_for(e, "DeviceClassMatchesNothing", "mig.gpu.dra.dev"))
            },
            wait,
        )
        .await
        .expect("the DeviceClass watcher runs");
    // Let every watch settle into its stream.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The connections go half-open: open watches fall silent and every new request hangs.
    node.api.freeze_watches();
    node.api.hang_next(HangSpec::default());
    // Meanwhile, behind the plugin's back: its slices are deleted, an admin adds a policy and a
    // DeviceClass.
    let removed = node.api.remove_where("resourceslices", |_| true);
    assert!(!removed.is_empty());
    node.api.insert(
        "gpunodepolicies",
        json!({"metadata": {"name": "all-nodes"}, "spec": {"migMode": "static"}}),
    );
    node.api.insert(
        "deviceclasses",
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "only-mig"},
            "spec": {"selectors": [{"cel": {"expression":
                format!("device.driver == \"{DRIVER}\" && device.attributes[\"{DRIVER}\"].type == \"mig\"")}}]},
        }),
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        node.api.list("resourceslices").is_empty(),
        "nothing got through while hung"
    );

    // The server answers again; the frozen watches stay frozen, so the plugin must notice them itself.
    node.api.release_hangs();
    let recover = Duration::from_secs(20);
    node.api
        .wait_for(
            "resourceslices",
            |slices| {
                slices
                    .iter()
                    .any(|s| s["spec"]["nodeName"] == NODE && s["spec"]["driver"] == DRIVER)
            },
            recover,
        )
        .await
        .expect("the publisher re-creates the slices deleted while its watch was half-open");
    node.api
        .wait_for(
            "gpunodepolicies",
            |policies| policies.iter().any(accepted),
            recover,
        )
        .await
        .expect("the policy watcher sees the new policy and reports on it");
    node.api
        .wait_for(
            "events",
            |events| {
                events
                    .iter()
                    .any(|e| is_event_for(e, "DeviceClassMatchesNothing", "only-mig"))
            },
            recover,
        )
        .await
        .expect("the DeviceClass self-test sees the new class");
    plugin.shutdown().await;
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the HTTP endpoint");
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut text = String::new();
    stream.read_to_string(&mut text).await.expect("read");
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_when_a_vital_task_has_stopped() {
    for task in [
        "publisher",
        "health-monitor",
        "dra-server",
        "registration-server",
    ] {
        let mut node = Harness::new("l40s-4").await;
        node.config.http_addr = Some(([127, 0, 0, 1], 0).into());
        let plugin = node.start_plugin().await;
        let addr = plugin.http_addr.expect("HTTP is on");
        let (code, body) = http_get(addr, "/healthz").await;
        assert_eq!(
            (code, body.as_str()),
            (200, "ok\n"),
            "{task}: healthy at first"
        );

        assert!(plugin.abort_vital_task(task), "{task} is a vital task");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let (code, body) = loop {
            let (code, body) = http_get(addr, "/healthz").await;
            if code != 200 || tokio::time::Instant::now() > deadline {
                break (code, body);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(code, 503, "{task}: {body}");
        assert!(body.contains(&format!("{task} stopped")), "{task}: {body}");
        plugin.shutdown().await;
    }
    let node = Harness::new("l40s-4").await;
    let plugin = node.start_plugin().await;
    assert!(!plugin.abort_vital_task("no-such-task"));
    plugin.shutdown().await;
}

/// A socket file removed under the plugin (a wiped plugin directory) or replaced leaves a server the
/// kubelet cannot reach although it runs on: the plugin ends that server so that `/healthz` fails, and
/// says which socket, so that the kubelet's liveness probe restarts it and it binds the socket again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_when_a_kubelet_socket_file_is_removed_or_replaced() {
    for (task, replace) in [("registration-server", false), ("dra-server", true)] {
        let mut node = Harness::new("l40s-4").await;
        node.config.http_addr = Some(([127, 0, 0, 1], 0).into());
        let plugin = node.start_plugin().await;
        let addr = plugin.http_addr.expect("HTTP is on");
        assert_eq!(http_get(addr, "/healthz").await.0, 200, "{task}: healthy");
        let socket = if task == "dra-server" {
            node.config.dra_socket()
        } else {
            node.config.registration_socket()
        };
        std::fs::remove_file(&socket).unwrap();
        if replace {
            let _other = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let (code, body) = loop {
            let (code, body) = http_get(addr, "/healthz").await;
            if code != 200 || tokio::time::Instant::now() > deadline {
                break (code, body);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(code, 503, "{task}: {body}");
        let what = if replace { "replaced" } else { "removed" };
        assert!(
            body.contains(&format!(
                "{task} stopped (socket {} was {what}",
                socket.display()
            )),
            "{task}: {body}"
        );
        plugin.shutdown().await;
    }
}
