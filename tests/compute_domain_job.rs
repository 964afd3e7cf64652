//! A ComputeDomain job end to end on the doubles: seven fake nodes (four GB200 trays in NVLink clique 0,
//! two in clique 1 and one L40S node without a fabric, the last three first in name order), each with its own plugin, kubelet double and pod
//! runner, the controller, and a job of four pods that each want a node's four GPUs and the domain's
//! IMEX channel. The pods must land on the four nodes of clique 0 (the scheduler's filter, played by
//! the rack, can only use what the controller's template allows), every container must get the
//! channel's device node, every node's IMEX daemon must run with all four peers, and the domain must
//! turn Ready. Then a daemon dies and a node leaves the clique mid-job: each shows as a taint on the
//! node's channel, an Event on the domain and the node's entry in its status. Finishing the job stops
//! the daemons and empties the status.

use std::time::Duration;

use gpu_dra::domains::api::{ComputeDomainStatus, DomainObject};
use gpu_dra::support::apiserver::ApiServer;
use gpu_dra::support::harness::install_device_classes;
use gpu_dra::support::rack::{self, wait_for, Fabric, Rack};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate, ResourceSlice};
use kube::api::{Api, DynamicObject, ListParams};
use serde_json::Value;

const NAMESPACE: &str = "team";
const CLIQUE_0: &str = "00000000-0000-0000-0000-000000000001.0";

async fn domain(client: &kube::Client, name: &str) -> DomainObject {
    rack::domain(client, NAMESPACE, name).await
}

async fn create_domain(client: &kube::Client, name: &str, nodes: u32) {
    rack::create_domain(client, NAMESPACE, name, nodes).await
}

async fn create_worker(client: &kube::Client, name: &str, channel_template: &str) {
    rack::create_worker(client, NAMESPACE, name, "four-gpus", channel_template).await
}

/// The slices of one node's pool, once all of them are there.
async fn whole_pool(client: &kube::Client, node: &str) -> Vec<ResourceSlice> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    wait_for(
        &format!("{node}'s slices"),
        Duration::from_secs(30),
        async || {
            let slices: Vec<ResourceSlice> = api
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .into_iter()
                .filter(|s| s.spec.node_name.as_deref() == Some(node))
                .collect();
            let complete = !slices.is_empty()
                && slices
                    .iter()
                    .all(|s| s.spec.pool.resource_slice_count as usize == slices.len());
            complete.then_some(slices)
        },
    )
    .await
}

fn channel_taint(slices: &[ResourceSlice], channel: &str) -> Option<(String, String)> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == channel)?
        .taints
        .as_ref()?
        .first()
        .map(|t| (t.key.clone(), t.value.clone().unwrap_or_default()))
}

async fn events_about(client: &kube::Client, name: &str) -> Vec<(String, String)> {
    let events: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &kube::api::ApiResource::erase::<k8s_openapi::api::events::v1::Event>(&()),
    );
    events
        .list(&ListParams::default())
        .await
        .map(|list| list.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.data.pointer("/regarding/name").and_then(Value::as_str) == Some(name))
        .map(|e| {
            let text = |p: &str| {
                e.data
                    .pointer(p)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            (text("/reason"), text("/note"))
        })
        .collect()
}

fn status_of(domain: &DomainObject, node: &str) -> Option<(String, Option<String>)> {
    domain
        .status
        .nodes
        .iter()
        .find(|n| n.name == node)
        .map(|n| (n.status.clone(), n.reason.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_four_node_job_gets_one_clique_a_channel_everywhere_and_its_faults_reported() {
    let api = ApiServer::start().await.expect("API server double");
    install_device_classes(&api);
    let client = api.client();
    let mut rack = Rack::start(
        &api,
        &[
            // First in name order, so a first-fit that ignored the clique would pick them.
            ("a0", Fabric::None),
            ("a1", Fabric::Clique(1)),
            ("a2", Fabric::Clique(1)),
            ("n1", Fabric::Clique(0)),
            ("n2", Fabric::Clique(0)),
            ("n3", Fabric::Clique(0)),
            ("n4", Fabric::Clique(0)),
        ],
        "gpu-dra:test",
    )
    .await;
    for node in &rack.nodes {
        let slices = whole_pool(&client, &node.name).await;
        let channels = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.name.starts_with("imex-channel-"))
            .count();
        let expected = if node.name == "a0" { 0 } else { 1 };
        assert_eq!(
            channels, expected,
            "IMEX channel devices published by {}",
            node.name
        );
    }
    let controller = rack::RunningController::start(&client, Duration::from_millis(500));

    // Every pod of the job wants a whole tray: four GPUs.
    rack::create_gpus_template(&client, NAMESPACE, "four-gpus", 4).await;
    create_domain(&client, "job", 4).await;
    let placed = wait_for(
        "the domain's placement",
        Duration::from_secs(20),
        async || rack::placement(&client, NAMESPACE, "job").await,
    )
    .await;
    assert_eq!(placed, CLIQUE_0, "clique 0 is the only one with 4 nodes");
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NAMESPACE);
    wait_for(
        "the channel template",
        Duration::from_secs(20),
        async || templates.get_opt("job-channel").await.ok().flatten(),
    )
    .await;

    // The job: four workers, each placed where its GPUs and the domain's channel fit.
    let mut placed_on = Vec::new();
    for i in 0..4 {
        let name = format!("worker-{i}");
        create_worker(&client, &name, "job-channel").await;
        let node = rack
            .schedule(&client, NAMESPACE, &name)
            .await
            .unwrap_or_else(|why| panic!("{name} fits no node: {why}"));
        placed_on.push(node);
    }
    placed_on.sort();
    assert_eq!(
        placed_on,
        ["n1", "n2", "n3", "n4"],
        "the job stays in clique 0"
    );
    // A fifth worker finds no node: clique 0's channels are taken, and clique 1 is not the domain's.
    create_worker(&client, "worker-4", "job-channel").await;
    let why = rack
        .schedule(&client, NAMESPACE, "worker-4")
        .await
        .unwrap_err();
    assert!(
        ["a0:", "a1:", "a2:", "n1:", "n4:"]
            .iter()
            .all(|node| why.contains(node)),
        "{why}"
    );

    // The kubelets start the workers: every container gets the channel, every daemon runs.
    for i in 0..4 {
        let name = format!("worker-{i}");
        let node = Api::<ResourceClaim>::namespaced(client.clone(), NAMESPACE)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|c| {
                c.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with(&format!("{name}-gpus")))
            })
            .and_then(|c| {
                c.status?
                    .allocation?
                    .devices?
                    .results?
                    .first()
                    .map(|r| r.pool.clone())
            })
            .expect("the worker's GPUs are allocated");
        let prepared = rack
            .start_pod(&client, NAMESPACE, &name, &node)
            .await
            .unwrap_or_else(|e| panic!("{name} on {node}: {e}"));
        let devices = &prepared.cdi_devices["worker"];
        assert!(
            devices.iter().any(|id| id.ends_with("-imex-channel-0")),
            "{name}'s container gets the channel: {devices:?}"
        );
        let specs = std::fs::read_dir(&rack.node(&node).config.cdi_root).unwrap();
        let channel_spec = specs
            .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
            .find(|text| text.contains("imex-channel-0"))
            .expect("a CDI spec for the channel claim");
        let spec: Value = serde_json::from_str(&channel_spec).unwrap();
        let node_entry = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
        assert_eq!(
            node_entry["path"],
            "/dev/nvidia-caps-imex-channels/channel0"
        );
        assert_eq!(node_entry["type"], "c", "with numbers: {node_entry}");
    }
    let ready = wait_for(
        "the domain to be Ready",
        Duration::from_secs(30),
        async || {
            let domain = domain(&client, "job").await;
            (domain.status.status == "Ready").then_some(domain.status)
        },
    )
    .await;
    let mut joined: Vec<&str> = ready.nodes.iter().map(|n| n.name.as_str()).collect();
    joined.sort();
    assert_eq!(joined, ["n1", "n2", "n3", "n4"]);
    assert!(ready.nodes.iter().all(|n| n.clique_id == CLIQUE_0));
    // Each node's daemon ends up with all four nodes as peers.
    for node in ["n1", "n2", "n3", "n4"] {
        let dir = rack.node(node).imex_dir(&domain(&client, "job").await.uid);
        wait_for(
            &format!("{node}'s daemon with 4 peers"),
            Duration::from_secs(30),
            async || {
                let state: Value =
                    serde_json::from_str(&std::fs::read_to_string(dir.join("stand-in.json")).ok()?)
                        .ok()?;
                let peers = state["peers"].as_array()?.len();
                (peers == 4).then_some(())
            },
        )
        .await;
    }

    // The plugin of n1 and the controller restart (an upgrade): the daemon Pod keeps running, the
    // domain keeps its placement and stays Ready.
    let daemon_pods: Api<Pod> = Api::namespaced(client.clone(), "gpu-dra");
    let n1_daemon = |pods: Vec<Pod>| {
        pods.into_iter()
            .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("n1"))
            .and_then(|p| p.metadata.uid)
    };
    let before = n1_daemon(
        daemon_pods
            .list(&ListParams::default())
            .await
            .unwrap()
            .items,
    );
    assert!(before.is_some(), "n1 runs an IMEX daemon Pod");
    controller.stop().await;
    rack.restart_plugin("n1").await;
    let controller = rack::RunningController::start(&client, Duration::from_millis(500));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = n1_daemon(
        daemon_pods
            .list(&ListParams::default())
            .await
            .unwrap()
            .items,
    );
    assert_eq!(after, before, "the restarted plugin keeps n1's daemon Pod");
    let kept = domain(&client, "job").await;
    assert_eq!(
        rack::placement(&client, NAMESPACE, "job").await.as_deref(),
        Some(CLIQUE_0)
    );
    assert_eq!(kept.status.status, "Ready", "{:?}", kept.status);
    assert_eq!(
        status_of(&kept, "n1").map(|s| s.0),
        Some("Ready".to_string())
    );

    // Mid-job, n2's IMEX daemon dies.
    let uid = domain(&client, "job").await.uid;
    std::fs::write(
        rack.node("n2").imex_dir(&uid).join("fail"),
        "fabric error (test)",
    )
    .unwrap();
    let status: ComputeDomainStatus =
        wait_for("n2 reported", Duration::from_secs(30), async || {
            let domain = domain(&client, "job").await;
            let (state, _) = status_of(&domain, "n2")?;
            (state == "NotReady" && domain.status.status == "NotReady").then_some(domain.status)
        })
        .await;
    let reason = status
        .nodes
        .iter()
        .find(|n| n.name == "n2")
        .unwrap()
        .reason
        .clone();
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("IMEX daemon not ready")),
        "{reason:?}"
    );
    let taint = wait_for(
        "n2's channel tainted",
        Duration::from_secs(20),
        async || channel_taint(&whole_pool(&client, "n2").await, "imex-channel-0"),
    )
    .await;
    assert_eq!(
        taint,
        (
            "gpu.dra.dev/imex-daemon".to_string(),
            "NotReady".to_string()
        )
    );
    let events = events_about(&client, "job").await;
    assert!(
        events
            .iter()
            .any(|(reason, note)| reason == "IMEXDaemonNotReady" && note.contains("n2")),
        "{events:?}"
    );
    // The daemon comes back: the taint goes, n2 is Ready again.
    std::fs::remove_file(rack.node("n2").imex_dir(&uid).join("fail")).unwrap();
    wait_for("n2 Ready again", Duration::from_secs(40), async || {
        let domain = domain(&client, "job").await;
        (status_of(&domain, "n2")?.0 == "Ready").then_some(())
    })
    .await;
    wait_for("n2's taint gone", Duration::from_secs(20), async || {
        channel_taint(&whole_pool(&client, "n2").await, "imex-channel-0")
            .is_none()
            .then_some(())
    })
    .await;

    // n3 leaves the clique (its GPUs now report clique 1).
    rack.node("n3").set_fabric(Fabric::Clique(1));
    let reason = wait_for("n3 reported", Duration::from_secs(30), async || {
        let domain = domain(&client, "job").await;
        let (state, reason) = status_of(&domain, "n3")?;
        (state == "NotReady").then_some(reason)
    })
    .await;
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("left NVLink clique") && r.contains(CLIQUE_0)),
        "{reason:?}"
    );
    let events = events_about(&client, "job").await;
    assert!(
        events
            .iter()
            .any(|(_, note)| note.contains("n3") && note.contains("left NVLink clique")),
        "{events:?}"
    );

    // A domain of five nodes fits no clique: no template, and the reason names the cliques.
    create_domain(&client, "too-big", 5).await;
    let reason = wait_for("too-big's reason", Duration::from_secs(20), async || {
        domain(&client, "too-big")
            .await
            .annotations
            .get(gpu_dra::domains::api::PLACEMENT_ANNOTATION)
            .cloned()
    })
    .await;
    assert!(
        reason.contains("no NVLink clique has 5 free nodes"),
        "{reason}"
    );
    assert_eq!(rack::placement(&client, NAMESPACE, "too-big").await, None);
    assert!(templates
        .get_opt("too-big-channel")
        .await
        .unwrap()
        .is_none());

    // The job ends: the kubelets unprepare its claims; the daemons stop and the status empties.
    for node in ["n1", "n2", "n3", "n4"] {
        let rack_node = rack.node(node);
        let results = rack_node.unprepare_all().await.expect("unprepare call");
        assert!(results.values().all(|r| r.is_ok()), "{node}: {results:?}");
        assert!(
            !rack_node.imex_dir(&uid).exists(),
            "{node}'s daemon directory is gone"
        );
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "gpu-dra");
    let daemons = pods.list(&ListParams::default()).await.unwrap().items;
    assert!(
        daemons.is_empty(),
        "no IMEX daemon Pod is left: {daemons:?}"
    );
    wait_for("the status to empty", Duration::from_secs(20), async || {
        domain(&client, "job")
            .await
            .status
            .nodes
            .is_empty()
            .then_some(())
    })
    .await;
    controller.stop().await;
    rack.shutdown().await;
}

/// A whole GB200 NVL72 rack: 18 trays of one clique, a domain of 18 nodes, and its 18 workers started by
/// their kubelets at the same moment. Every prepare (status entry written against 17 other writers, the
/// node's IMEX daemon started and ready) ends within the kubelet's 45 s, every tray gets its own index,
/// every daemon ends with all 18 peers, and the domain turns Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eighteen_trays_of_one_clique_prepare_their_workers_at_once() {
    const TRAYS: usize = 18;
    const KUBELET_DEADLINE: Duration = Duration::from_secs(45);
    let api = ApiServer::start().await.expect("API server double");
    install_device_classes(&api);
    let client = api.client();
    let names: Vec<String> = (0..TRAYS).map(|i| format!("t{i:02}")).collect();
    let nodes: Vec<(&str, Fabric)> = names
        .iter()
        .map(|n| (n.as_str(), Fabric::Clique(0)))
        .collect();
    let rack = Rack::start(&api, &nodes, "gpu-dra:test").await;
    for name in &names {
        whole_pool(&client, name).await;
    }
    let controller = rack::RunningController::start(&client, Duration::from_millis(500));
    rack::create_gpus_template(&client, NAMESPACE, "four-gpus", 4).await;
    create_domain(&client, "rack", TRAYS as u32).await;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NAMESPACE);
    wait_for(
        "the channel template",
        Duration::from_secs(20),
        async || templates.get_opt("rack-channel").await.ok().flatten(),
    )
    .await;
    let mut placed_on = Vec::new();
    for i in 0..TRAYS {
        let name = format!("worker-{i}");
        create_worker(&client, &name, "rack-channel").await;
        let node = rack
            .schedule(&client, NAMESPACE, &name)
            .await
            .unwrap_or_else(|why| panic!("{name} fits no node: {why}"));
        placed_on.push((name, node));
    }

    let starts = placed_on.iter().map(|(name, node)| {
        let (rack, client) = (&rack, &client);
        async move {
            let began = std::time::Instant::now();
            let prepared = rack.start_pod(client, NAMESPACE, name, node).await;
            (name, node, prepared, began.elapsed())
        }
    });
    for (name, node, prepared, took) in futures::future::join_all(starts).await {
        let prepared = prepared.unwrap_or_else(|e| panic!("{name} on {node}: {e}"));
        assert!(
            prepared.cdi_devices["worker"]
                .iter()
                .any(|id| id.ends_with("-imex-channel-0")),
            "{name} gets the channel"
        );
        assert!(took < KUBELET_DEADLINE, "{name} on {node} took {took:?}");
    }

    let ready = wait_for(
        "the domain to be Ready",
        Duration::from_secs(30),
        async || {
            let domain = domain(&client, "rack").await;
            (domain.status.status == "Ready").then_some(domain)
        },
    )
    .await;
    assert_eq!(ready.status.nodes.len(), TRAYS);
    let indices: std::collections::BTreeSet<u32> =
        ready.status.nodes.iter().map(|n| n.index).collect();
    assert_eq!(indices.len(), TRAYS, "each tray its own index");
    assert!(indices.iter().all(|i| *i < TRAYS as u32));
    for name in &names {
        let dir = rack.node(name).imex_dir(&ready.uid);
        wait_for(
            &format!("{name}'s daemon with {TRAYS} peers"),
            Duration::from_secs(30),
            async || {
                let state: Value =
                    serde_json::from_str(&std::fs::read_to_string(dir.join("stand-in.json")).ok()?)
                        .ok()?;
                (state["peers"].as_array()?.len() == TRAYS).then_some(())
            },
        )
        .await;
    }
    let warnings: Vec<Value> = api
        .list("events")
        .into_iter()
        .filter(|e| e["type"] == "Warning")
        .collect();
    assert!(warnings.is_empty(), "no failure reported: {warnings:#?}");
    controller.stop().await;
    rack.shutdown().await;
}
