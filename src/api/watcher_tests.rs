//! The watcher against the API server double: delivery, the last good policy staying in force,
//! supersession, label selection and re-selection, status writes and retries.

use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};
use tokio::sync::watch;

use super::*;
use crate::support::apiserver::{ApiServer, FaultSpec, Verb};

const TIMEOUT: Duration = Duration::from_secs(20);
const NODE: &str = "node-a";
const POLICIES: &str = "gpunodepolicies";

/// A server with one node, and a watcher for that node running until the harness is dropped.
struct Harness {
    server: ApiServer,
    policies: watch::Receiver<Option<EffectivePolicy>>,
    _stop: watch::Sender<bool>,
}

async fn start(node_labels: Value) -> Harness {
    start_with(node_labels, |_| {}).await
}

async fn start_with(node_labels: Value, before: impl FnOnce(&ApiServer)) -> Harness {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = match ApiServer::start().await {
        Ok(server) => server,
        Err(err) => panic!("starting the API server double: {err}"),
    };
    set_node_labels(&server, node_labels);
    before(&server);
    let (out, policies) = watch::channel(None);
    let (stop, shutdown) = watch::channel(false);
    tokio::spawn(PolicyWatcher::run(
        server.client(),
        NODE.to_string(),
        out,
        shutdown,
    ));
    Harness {
        server,
        policies,
        _stop: stop,
    }
}

fn set_node_labels(server: &ApiServer, labels: Value) {
    server.insert(
        "nodes",
        json!({ "metadata": { "name": NODE, "labels": labels } }),
    );
}

fn insert_policy(server: &ApiServer, name: &str, created: &str, spec: Value) {
    server.insert(
        POLICIES,
        json!({ "metadata": { "name": name, "creationTimestamp": created }, "spec": spec }),
    );
}

impl Harness {
    /// Waits until the published policy satisfies `pred` and returns it.
    async fn published(
        &mut self,
        pred: impl FnMut(&Option<EffectivePolicy>) -> bool,
    ) -> Option<EffectivePolicy> {
        let waited = tokio::time::timeout(TIMEOUT, self.policies.wait_for(pred))
            .await
            .map(|result| result.map(|value| value.clone()));
        match waited {
            Ok(Ok(value)) => value,
            Ok(Err(_)) => panic!("the watcher stopped publishing"),
            Err(_) => panic!(
                "timed out; the published policy is {:?}",
                *self.policies.borrow()
            ),
        }
    }

    async fn published_name(&mut self, name: Option<&str>) -> Option<EffectivePolicy> {
        self.published(|p| p.as_ref().map(|p| p.name.as_str()) == name)
            .await
    }

    /// Waits until policy `name` has an Accepted condition with `status`, `reason` and
    /// `generation`, and returns the condition.
    async fn accepted(&self, name: &str, status: &str, reason: &str, generation: i64) -> Value {
        let found = self
            .server
            .wait_for(
                POLICIES,
                |objects| {
                    objects.iter().any(|o| {
                        o["metadata"]["name"] == name && {
                            let c = accepted_condition(o);
                            c["status"] == status
                                && c["reason"] == reason
                                && c["observedGeneration"] == generation
                        }
                    })
                },
                TIMEOUT,
            )
            .await;
        if found.is_none() {
            panic!(
                "policy {name} never got Accepted={status}/{reason} for generation {generation}; it is {:?}",
                self.server.get(POLICIES, None, name)
            );
        }
        let object = self.server.get(POLICIES, None, name).unwrap_or_default();
        accepted_condition(&object)
    }
}

fn accepted_condition(object: &Value) -> Value {
    object["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Accepted"))
        .cloned()
        .unwrap_or(Value::Null)
}

const T0: &str = "2025-01-01T00:00:00Z";
const T1: &str = "2025-06-01T00:00:00Z";

#[tokio::test]
async fn an_invalid_edit_keeps_the_last_good_generation_in_force() {
    let mut h = start(json!({ "gpu": "h100" })).await;
    insert_policy(
        &h.server,
        "h100",
        T0,
        json!({
            "nodeSelector": { "matchLabels": { "gpu": "h100" } },
            "health": { "fatalXids": [79], "fatalEffect": "NoExecute" },
            "migMode": "static",
            "classicNodeLabels": true,
        }),
    );
    let first = h.published_name(Some("h100")).await;
    assert_eq!(
        first,
        Some(EffectivePolicy {
            name: "h100".into(),
            generation: 1,
            health: Some(HealthSpec {
                fatal_xids: vec![79],
                fatal_effect: Some(super::super::policy::TaintEffect::NoExecute),
                ..HealthSpec::default()
            }),
            mig_mode: Some(MigModeSpec::Static),
            sharing: None,
            classic_node_labels: true,
            passthrough: None,
        })
    );
    h.accepted("h100", "True", "Valid", 1).await;

    // The admin breaks the policy through the API, which bumps the generation to 2.
    let api: Api<GpuNodePolicy> = Api::all(h.server.client());
    let broken = json!({ "spec": { "health": { "ignoredXids": [79], "fatalEffect": "Explode" } } });
    if let Err(err) = api
        .patch("h100", &PatchParams::default(), &Patch::Merge(&broken))
        .await
    {
        panic!("editing the policy: {err}");
    }
    let condition = h.accepted("h100", "False", "Invalid", 2).await;
    let message = condition["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("spec.health.fatalXids[0]: XID 79 is also in ignoredXids")
            && message.contains("spec.health.fatalEffect: unknown effect \"Explode\""),
        "message: {message}"
    );
    // The watcher has seen generation 2 (it wrote its status) and still applies generation 1.
    assert_eq!(*h.policies.borrow(), first);

    // Fixing it puts the new generation in force.
    let fixed = json!({ "spec": { "health": { "ignoredXids": [], "fatalEffect": "NoSchedule" }, "migMode": "dynamic" } });
    if let Err(err) = api
        .patch("h100", &PatchParams::default(), &Patch::Merge(&fixed))
        .await
    {
        panic!("editing the policy: {err}");
    }
    let third = h
        .published(|p| p.as_ref().is_some_and(|p| p.generation == 3))
        .await;
    assert_eq!(third.and_then(|p| p.mig_mode), Some(MigModeSpec::Dynamic));
    h.accepted("h100", "True", "Valid", 3).await;

    // One status write per verdict: the events caused by its own writes do not make it write again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.server.writes("gpunodepolicies/status"), 3);
}

#[tokio::test]
async fn a_higher_priority_policy_supersedes_and_its_removal_restores() {
    let mut h = start(json!({ "gpu": "h100" })).await;
    insert_policy(&h.server, "everywhere", T0, json!({ "priority": 1 }));
    h.published_name(Some("everywhere")).await;
    h.accepted("everywhere", "True", "Valid", 1).await;

    insert_policy(
        &h.server,
        "h100",
        T1,
        json!({ "priority": 5, "nodeSelector": { "matchExpressions": [{ "key": "gpu", "operator": "In", "values": ["h100"] }] } }),
    );
    h.published_name(Some("h100")).await;
    h.accepted("h100", "True", "Valid", 1).await;
    let loser = h.accepted("everywhere", "False", "Superseded", 1).await;
    assert_eq!(
        loser["message"],
        "superseded by GpuNodePolicy \"h100\", which has priority 5 (this policy has 1)"
    );

    h.server.remove(POLICIES, None, "h100");
    h.published_name(Some("everywhere")).await;
    h.accepted("everywhere", "True", "Valid", 1).await;
}

#[tokio::test]
async fn a_tie_goes_to_the_older_policy_and_the_loser_is_told() {
    let mut h = start(json!({})).await;
    insert_policy(&h.server, "newer", T1, json!({ "priority": 3 }));
    insert_policy(&h.server, "older", T0, json!({ "priority": 3 }));
    h.published_name(Some("older")).await;
    let loser = h.accepted("newer", "False", "Superseded", 1).await;
    assert_eq!(
        loser["message"],
        "superseded by GpuNodePolicy \"older\": both have priority 3, and \"older\" wins because it is older"
    );
}

#[tokio::test]
async fn policies_for_other_labels_do_not_apply_until_the_labels_change() {
    let mut h = start(json!({ "gpu": "a100" })).await;
    insert_policy(
        &h.server,
        "h100-only",
        T0,
        json!({ "nodeSelector": { "matchLabels": { "gpu": "h100" } }, "migMode": "dynamic" }),
    );
    // An invalid policy inserted afterwards: once its status is written, the first has been evaluated.
    insert_policy(&h.server, "broken", T0, json!({ "migMode": "sometimes" }));
    h.accepted("broken", "False", "Invalid", 1).await;
    assert_eq!(*h.policies.borrow(), None);
    let untouched = h
        .server
        .get(POLICIES, None, "h100-only")
        .unwrap_or_default();
    assert_eq!(accepted_condition(&untouched), Value::Null);

    set_node_labels(&h.server, json!({ "gpu": "h100" }));
    let applied = h.published_name(Some("h100-only")).await;
    assert_eq!(applied.and_then(|p| p.mig_mode), Some(MigModeSpec::Dynamic));
    h.accepted("h100-only", "True", "Valid", 1).await;

    set_node_labels(&h.server, json!({ "gpu": "a100" }));
    h.published_name(None).await;
}

#[tokio::test]
async fn api_errors_are_retried() {
    let mut h = start_with(json!({}), |server| {
        for (verb, resource) in [
            (Verb::List, POLICIES),
            (Verb::Patch, "gpunodepolicies/status"),
        ] {
            server.fail_next(FaultSpec {
                verb: Some(verb),
                resource: Some(resource.to_string()),
                code: 500,
                count: 2,
            });
        }
    })
    .await;
    insert_policy(&h.server, "everywhere", T0, json!({}));
    h.published_name(Some("everywhere")).await;
    h.accepted("everywhere", "True", "Valid", 1).await;
    let failed = |verb| {
        h.server
            .requests()
            .iter()
            .filter(|r| r.verb == verb && r.code == 500)
            .count()
    };
    assert_eq!((failed(Verb::List), failed(Verb::Patch)), (2, 2));
}

#[tokio::test]
async fn shutdown_stops_the_watcher() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = match ApiServer::start().await {
        Ok(server) => server,
        Err(err) => panic!("starting the API server double: {err}"),
    };
    set_node_labels(&server, json!({}));
    let (out, _policies) = watch::channel(None);
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(PolicyWatcher::run(
        server.client(),
        NODE.into(),
        out,
        shutdown,
    ));
    let _ = stop.send(true);
    assert!(tokio::time::timeout(TIMEOUT, task).await.is_ok());
}

#[tokio::test]
async fn nodes_write_a_status_only_when_their_own_verdict_changes() {
    let mut h = start(json!({ "gpu": "h100" })).await;
    insert_policy(&h.server, "everywhere", T0, json!({ "priority": 1 }));
    insert_policy(
        &h.server,
        "h100",
        T0,
        json!({ "priority": 5, "nodeSelector": { "matchLabels": { "gpu": "h100" } } }),
    );
    h.published_name(Some("h100")).await;
    h.accepted("everywhere", "False", "Superseded", 1).await;
    h.accepted("h100", "True", "Valid", 1).await;
    let settled = h.server.writes("gpunodepolicies/status");

    // A node that agrees with the status writes nothing.
    h.server.insert(
        "nodes",
        json!({ "metadata": { "name": "node-b", "labels": { "gpu": "h100" } } }),
    );
    let (out_b, mut seen_b) = watch::channel(None);
    let (_stop_b, shutdown_b) = watch::channel(false);
    tokio::spawn(PolicyWatcher::run(
        h.server.client(),
        "node-b".into(),
        out_b,
        shutdown_b,
    ));
    // The guard wait_for returns blocks the sender; drop it at once.
    let chose = tokio::time::timeout(TIMEOUT, seen_b.wait_for(|p| p.is_some()))
        .await
        .map(|seen| seen.is_ok());
    assert_eq!(chose, Ok(true), "node-b never chose a policy");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.server.writes("gpunodepolicies/status"), settled);

    // A node where "everywhere" wins disagrees with node-a: it reports once, and neither node
    // answers the other's write.
    h.server.insert(
        "nodes",
        json!({ "metadata": { "name": "node-c", "labels": { "gpu": "a100" } } }),
    );
    let (out_c, mut seen_c) = watch::channel(None);
    let (_stop_c, shutdown_c) = watch::channel(false);
    tokio::spawn(PolicyWatcher::run(
        h.server.client(),
        "node-c".into(),
        out_c,
        shutdown_c,
    ));
    // The guard wait_for returns blocks the sender; drop it at once.
    let chose = tokio::time::timeout(TIMEOUT, seen_c.wait_for(|p| p.is_some()))
        .await
        .map(|seen| seen.is_ok());
    assert_eq!(chose, Ok(true), "node-c never chose a policy");
    h.accepted("everywhere", "True", "Valid", 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.server.writes("gpunodepolicies/status"), settled + 1);
}

#[tokio::test]
async fn a_missing_crd_is_retried_with_backoff_and_a_policy_applies_once_it_is_served() {
    let mut h = start_with(json!({}), |server| server.stop_serving(POLICIES)).await;
    insert_policy(&h.server, "everywhere", T0, json!({}));
    let not_found = |server: &ApiServer| {
        server
            .requests()
            .iter()
            .filter(|r| r.resource == POLICIES && r.code == 404)
            .count()
    };
    // Tries at 0 s, 1 s and 3 s: three in the first 3.5 s, where a fixed one-second retry makes four.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let tries = not_found(&h.server);
    assert!(
        (2..=3).contains(&tries),
        "{tries} tries in 3.5 s: {:?}",
        h.server.requests()
    );
    assert_eq!(*h.policies.borrow(), None);
    h.server.serve(POLICIES);
    h.published_name(Some("everywhere")).await;
    h.accepted("everywhere", "True", "Valid", 1).await;
}
