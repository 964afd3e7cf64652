//! A node's membership of a ComputeDomain under load, against the API server double: the 18 trays of one
//! NVLink clique join one domain at the same moment (every one writes its entry of `status.nodes`, and
//! all but one of each round conflict), and all are in within the kubelet's deadline, each with its own
//! index; a node that leaves while a sync of its health runs is not added back; and a node that leaves
//! and joins again is reported Ready, never as a failure.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use gpu_dra::domains::api::{ComputeDomainStatus, DomainGroup, DomainObject, READY};
use gpu_dra::domains::membership::{ChannelMembership, DaemonSpec, DomainDaemons, Membership};
use gpu_dra::support::apiserver::ApiServer;
use kube::api::{Api, DynamicObject, PostParams};

const NAMESPACE: &str = "team";
const CLIQUE: &str = "00000000-0000-0000-0000-000000000001.0";
/// How long the kubelet waits for NodePrepareResources.
const KUBELET_DEADLINE: Duration = Duration::from_secs(45);

/// A node's daemons that are ready at once and remember the peers they were given.
#[derive(Default)]
struct ReadyDaemons {
    peers: Mutex<Vec<String>>,
    running: Mutex<BTreeSet<String>>,
}

impl DomainDaemons for ReadyDaemons {
    fn ensure<'a>(&'a self, spec: &'a DaemonSpec) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            *self.peers.lock().unwrap() = spec.peers.iter().map(|p| format!("{p:?}")).collect();
            self.running.lock().unwrap().insert(spec.domain_uid.clone());
            Ok(())
        })
    }
    fn set_peers(
        &self,
        _domain_uid: &str,
        peers: &[gpu_dra::domains::membership::Peer],
    ) -> Result<bool, String> {
        let peers: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
        let mut current = self.peers.lock().unwrap();
        let changed = *current != peers;
        *current = peers;
        Ok(changed)
    }
    fn state<'a>(&'a self, _domain_uid: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn stop<'a>(&'a self, domain_uid: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.running.lock().unwrap().remove(domain_uid);
            Ok(())
        })
    }
    fn running(&self) -> BoxFuture<'_, Vec<String>> {
        Box::pin(async { self.running.lock().unwrap().iter().cloned().collect() })
    }
}

async fn create_domain(client: &kube::Client, nodes: u32) -> DomainObject {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), NAMESPACE, &DomainGroup::Ours.api_resource());
    let object: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "ComputeDomain",
        "metadata": {"name": "job", "namespace": NAMESPACE},
        "spec": {"numNodes": nodes, "channel": {"resourceClaimTemplate": {"name": "job-channel"}}},
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &object).await.unwrap();
    DomainObject::from_dynamic(DomainGroup::Ours, &created).unwrap()
}

async fn status(client: &kube::Client) -> ComputeDomainStatus {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), NAMESPACE, &DomainGroup::Ours.api_resource());
    let object = api.get("job").await.unwrap();
    DomainObject::from_dynamic(DomainGroup::Ours, &object)
        .unwrap()
        .status
}

fn member(domain: &DomainObject) -> ChannelMembership {
    ChannelMembership {
        domain_uid: domain.uid.clone(),
        namespace: NAMESPACE.into(),
        domain: domain.name.clone(),
        nvidia_group: false,
        channel: 0,
        clique: CLIQUE.into(),
    }
}

fn node(client: &kube::Client, i: usize) -> (Membership, Arc<ReadyDaemons>) {
    let daemons = Arc::new(ReadyDaemons::default());
    let membership = Membership::new(
        client.clone(),
        "gpu.dra.dev",
        &format!("tray-{i:02}"),
        Some(&format!("10.0.1.{}", i + 1)),
        daemons.clone(),
    );
    (membership, daemons)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eighteen_trays_join_one_domain_at_once_within_the_kubelets_deadline() {
    let api = ApiServer::start().await.expect("API server double");
    let client = api.client();
    let domain = create_domain(&client, 18).await;
    let member = member(&domain);
    let nodes: Vec<_> = (0..18).map(|i| node(&client, i)).collect();
    let started = Instant::now();
    let joins = nodes.iter().map(|(membership, _)| {
        let member = member.clone();
        async move {
            let at = Instant::now();
            let result = membership.join(&member).await;
            (result, at.elapsed())
        }
    });
    let results = futures::future::join_all(joins).await;
    let elapsed = started.elapsed();
    for (i, (result, took)) in results.iter().enumerate() {
        assert!(result.is_ok(), "tray-{i:02}: {result:?}");
        assert!(*took < KUBELET_DEADLINE, "tray-{i:02} took {took:?}");
    }
    let status = status(&client).await;
    assert_eq!(status.nodes.len(), 18, "{status:?}");
    assert!(status.nodes.iter().all(|n| n.status == READY), "{status:?}");
    let indices: BTreeSet<u32> = status.nodes.iter().map(|n| n.index).collect();
    assert_eq!(indices, (0..18).collect(), "each tray its own index");
    let conflicts = api
        .requests()
        .iter()
        .filter(|r| r.resource == "computedomains/status" && r.code == 409)
        .count();
    assert!(
        conflicts > 0,
        "the joins never met: the test proves nothing"
    );
    println!("18 joins in {elapsed:?}, {conflicts} conflicts retried");

    // Every tray's daemon ends up with all 18 peers once it syncs.
    let clique = Ok(CLIQUE.to_string());
    for (membership, _) in &nodes {
        membership
            .sync(std::slice::from_ref(&member), &clique)
            .await;
    }
    for (i, (_, daemons)) in nodes.iter().enumerate() {
        assert_eq!(daemons.peers.lock().unwrap().len(), 18, "tray-{i:02}");
    }
}

#[tokio::test]
async fn a_node_that_left_is_not_added_back_and_a_rejoin_is_no_failure() {
    let api = ApiServer::start().await.expect("API server double");
    let client = api.client();
    let domain = create_domain(&client, 2).await;
    let member = member(&domain);
    let (one, _) = node(&client, 1);
    let (two, _) = node(&client, 2);
    one.join(&member).await.unwrap();
    two.join(&member).await.unwrap();
    let clique = Ok(CLIQUE.to_string());

    // tray-01 leaves; a sync that still had it as a member (it ran while the leave did) reports its
    // health: its entry must stay gone.
    one.leave(&member).await.unwrap();
    one.sync(std::slice::from_ref(&member), &clique).await;
    let names: Vec<String> = status(&client)
        .await
        .nodes
        .into_iter()
        .map(|n| n.name)
        .collect();
    assert_eq!(names, ["tray-02"]);

    // It joins again: Ready, with the lowest free index, and no Warning Event anywhere.
    one.join(&member).await.unwrap();
    one.sync(std::slice::from_ref(&member), &clique).await;
    let status = status(&client).await;
    let entry = status.nodes.iter().find(|n| n.name == "tray-01").unwrap();
    assert_eq!(entry.status, READY);
    assert_eq!(entry.index, 0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let warnings: Vec<_> = api
        .list("events")
        .into_iter()
        .filter(|e| e["type"] == "Warning")
        .collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
}

/// `--imex-mode host`: the node joins with the host daemon's state and starts nothing.
#[tokio::test]
async fn with_the_hosts_imex_daemon_the_node_reports_its_state_and_starts_nothing() {
    use gpu_dra::domains::imex::host_managed::{HostImex, DEFAULT_SOCKET};
    use std::os::unix::fs::PermissionsExt;
    let api = ApiServer::start().await.expect("API server double");
    let client = api.client();
    let domain = create_domain(&client, 1).await;
    let member = member(&domain);
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("nvidia-imex-ctl");
    let answer = dir.path().join("answer");
    std::fs::write(&ctl, format!("#!/bin/sh\ncat {}\n", answer.display())).unwrap();
    std::fs::set_permissions(&ctl, std::fs::Permissions::from_mode(0o755)).unwrap();
    let host = Membership::new(
        client.clone(),
        "gpu.dra.dev",
        "tray-01",
        Some("10.0.1.2"),
        Arc::new(HostImex::with_program(
            ctl,
            std::path::Path::new(DEFAULT_SOCKET),
        )),
    )
    .with_ready_timeout(Duration::from_millis(600));

    // The host's daemon waits for its quorum: the claim fails with its answer, the entry says it.
    std::fs::write(&answer, "UNAVAILABLE\n").unwrap();
    let error = host.join(&member).await.unwrap_err();
    assert!(
        error.contains("the host's nvidia-imex daemon is not ready"),
        "{error}"
    );
    let entry = status(&client).await.nodes.pop().unwrap();
    assert_eq!(entry.status, "NotReady");
    assert!(entry.reason.unwrap_or_default().contains("UNAVAILABLE"));

    // It is ready: the node joins, Ready; no daemon Pod was made.
    std::fs::write(&answer, "READY\n").unwrap();
    host.join(&member).await.unwrap();
    let entry = status(&client).await.nodes.pop().unwrap();
    assert_eq!(
        (entry.name.as_str(), entry.status.as_str()),
        ("tray-01", READY)
    );
    assert!(api.list("pods").is_empty());
    host.leave(&member).await.unwrap();
    assert!(status(&client).await.nodes.is_empty());
}

/// Before a channel is prepared the plugin checks the claim against the controller's placement: the
/// domain must be in the claim's namespace, placed by a ComputeDomainPlacement made for it, on this
/// node's clique. Annotations a user preset, a placement of another domain and a claim of another
/// namespace naming the domain's UID change nothing.
#[tokio::test]
async fn a_channel_is_prepared_only_as_the_controllers_placement_says() {
    use gpu_dra::domains::api::ComputeDomainPlacement;
    let api = ApiServer::start().await.expect("API server double");
    let client = api.client();
    let mut domain = create_domain(&client, 1).await;
    let (node, _) = node(&client, 1);
    let groups = [DomainGroup::Ours];
    let resolve = |namespace: &'static str, clique: &'static str, uid: String| {
        let node = &node;
        async move { node.resolve(&groups, namespace, &uid, 0, clique).await }
    };

    // A user presets the old placement annotations: not placed.
    let domains: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), NAMESPACE, &DomainGroup::Ours.api_resource());
    let mut object = domains.get("job").await.unwrap();
    object.metadata.annotations = Some(
        [
            ("gpu.dra.dev/nvlink-domain".to_string(), CLIQUE.to_string()),
            ("gpu.dra.dev/imex-channel".to_string(), "0".to_string()),
        ]
        .into(),
    );
    domains
        .replace("job", &PostParams::default(), &object)
        .await
        .unwrap();
    let error = resolve(NAMESPACE, CLIQUE, domain.uid.clone())
        .await
        .unwrap_err();
    assert!(
        error.contains("is not placed on an NVLink clique yet"),
        "{error}"
    );

    // A placement under the domain's UID that was made for another domain is not its placement.
    let placements: Api<ComputeDomainPlacement> = Api::all(client.clone());
    let mut other = domain.clone();
    other.namespace = "elsewhere".into();
    let forged = ComputeDomainPlacement::of(&other, CLIQUE);
    placements
        .create(&PostParams::default(), &forged)
        .await
        .unwrap();
    let error = resolve(NAMESPACE, CLIQUE, domain.uid.clone())
        .await
        .unwrap_err();
    assert!(
        error.contains("is not placed on an NVLink clique yet"),
        "{error}"
    );
    placements
        .delete(&domain.uid, &Default::default())
        .await
        .unwrap();

    // Placed on another clique: this node's channel is refused, naming both.
    domain.namespace = NAMESPACE.into();
    let placed = ComputeDomainPlacement::of(&domain, "00000000-0000-0000-0000-000000000001.1");
    placements
        .create(&PostParams::default(), &placed)
        .await
        .unwrap();
    let error = resolve(NAMESPACE, CLIQUE, domain.uid.clone())
        .await
        .unwrap_err();
    assert!(
        error.contains("is placed on NVLink clique 00000000-0000-0000-0000-000000000001.1")
            && error.contains(&format!("this node's channel is in clique {CLIQUE}")),
        "{error}"
    );
    placements
        .delete(&domain.uid, &Default::default())
        .await
        .unwrap();

    // Placed here: the claim of the domain's namespace joins; one of another namespace that names
    // the domain's UID finds no such domain.
    placements
        .create(
            &PostParams::default(),
            &ComputeDomainPlacement::of(&domain, CLIQUE),
        )
        .await
        .unwrap();
    let member = resolve(NAMESPACE, CLIQUE, domain.uid.clone())
        .await
        .unwrap();
    assert_eq!(
        (member.namespace.as_str(), member.domain.as_str()),
        (NAMESPACE, "job")
    );
    let error = resolve("intruder", CLIQUE, domain.uid.clone())
        .await
        .unwrap_err();
    assert!(
        error.contains(&format!(
            "no ComputeDomain with UID {} in namespace intruder",
            domain.uid
        )),
        "{error}"
    );
}
