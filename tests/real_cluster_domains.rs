//! The ComputeDomain job on a real control plane (`../shared/realk8s/up.sh`: kube-apiserver, the real
//! scheduler, the resourceclaim and garbage-collector controllers), with seven Nodes made Ready
//! without a kubelet; the plugins, kubelet doubles, IMEX daemons' pod runners and the controller run in
//! this process. What only the real components can say: the API server accepts the CRD, the slices with
//! channel devices and their taints, and the status writes; the resourceclaim controller makes the
//! workers' claims from the controller's template; the real scheduler, given that template's selector,
//! puts the four workers on the four nodes of clique 0 and nothing of the job elsewhere, and leaves a
//! fifth worker Pending; deleting the domain lets the garbage collector take its template.
//!
//! Ignored unless asked for: `e2e/real-cluster-compute-domain.sh` sets the cluster up and runs it.

use std::time::Duration;

use gpu_dra::support::rack::{self, wait_for, Fabric, Rack};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaimTemplate, ResourceSlice};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use serde_json::Value;

const NAMESPACE: &str = "team";
const CLIQUE_0: &str = "00000000-0000-0000-0000-000000000001.0";

const NODES: [(&str, Fabric); 7] = [
    ("cd-a0", Fabric::None),
    ("cd-a1", Fabric::Clique(1)),
    ("cd-a2", Fabric::Clique(1)),
    ("cd-n1", Fabric::Clique(0)),
    ("cd-n2", Fabric::Clique(0)),
    ("cd-n3", Fabric::Clique(0)),
    ("cd-n4", Fabric::Clique(0)),
];

/// Removes the slices the rack's nodes published in an earlier run (no kubelet wipes them here), so the
/// real scheduler sees only what this run's plugins publish.
async fn forget_rack_slices(client: &kube::Client) {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    for slice in slices.list(&ListParams::default()).await.unwrap().items {
        if slice
            .spec
            .node_name
            .as_deref()
            .is_some_and(|n| n.starts_with("cd-"))
        {
            let name = slice.metadata.name.unwrap_or_default();
            let _ = slices.delete(&name, &DeleteParams::default()).await;
        }
    }
}

async fn bound_node(pods: &Api<Pod>, name: &str) -> Option<String> {
    pods.get(name).await.ok()?.spec?.node_name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs the real control plane: e2e/real-cluster-compute-domain.sh"]
async fn a_job_on_the_real_scheduler_stays_in_its_clique() {
    let client = gpu_dra::explain::cluster::client(None, None)
        .await
        .expect("a client from KUBECONFIG");
    forget_rack_slices(&client).await;
    let rack = Rack::start_live(client.clone(), &NODES, "gpu-dra:test").await;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    wait_for(
        "every rack node's pool",
        Duration::from_secs(60),
        async || {
            let all = slices.list(&ListParams::default()).await.ok()?.items;
            NODES
                .iter()
                .all(|(node, _)| {
                    all.iter()
                        .any(|s| s.spec.node_name.as_deref() == Some(*node))
                })
                .then_some(())
        },
    )
    .await;
    let controller = rack::RunningController::start(&client, Duration::from_secs(1));

    rack::create_gpus_template(&client, NAMESPACE, "four-gpus", 4).await;
    rack::create_domain(&client, NAMESPACE, "job", 4).await;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NAMESPACE);
    wait_for(
        "the channel template",
        Duration::from_secs(30),
        async || templates.get_opt("job-channel").await.ok().flatten(),
    )
    .await;
    let placed = rack::placement(&client, NAMESPACE, "job").await;
    assert_eq!(placed.as_deref(), Some(CLIQUE_0));
    println!("ok    the controller placed the domain on {CLIQUE_0} (its ComputeDomainPlacement)");

    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    for i in 0..5 {
        rack::create_worker(
            &client,
            NAMESPACE,
            &format!("worker-{i}"),
            "four-gpus",
            "job-channel",
        )
        .await;
    }
    // The real scheduler binds four of them; which four is its choice, the nodes are not.
    let bound = wait_for("four workers bound", Duration::from_secs(60), async || {
        let mut bound = Vec::new();
        for i in 0..5 {
            let name = format!("worker-{i}");
            if let Some(node) = bound_node(&pods, &name).await {
                bound.push((name, node));
            }
        }
        (bound.len() == 4).then_some(bound)
    })
    .await;
    let mut nodes: Vec<&str> = bound.iter().map(|(_, n)| n.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["cd-n1", "cd-n2", "cd-n3", "cd-n4"], "{bound:?}");
    println!("ok    the real scheduler bound four workers to clique 0's nodes: {bound:?}");
    tokio::time::sleep(Duration::from_secs(5)).await;
    let pending: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_none()))
        .filter_map(|p| p.metadata.name)
        .collect();
    assert_eq!(
        pending.len(),
        1,
        "the fifth worker stays Pending: {pending:?}"
    );
    println!("ok    the fifth worker stays Pending: {pending:?}");
    // `gpu-dra explain` against the real API server says why.
    let source = gpu_dra::explain::Source::Live {
        kubeconfig: None,
        context: None,
    };
    let target = gpu_dra::explain::Target::Pod {
        namespace: NAMESPACE.to_string(),
        name: pending[0].clone(),
    };
    let report = gpu_dra::explain::run(&source, &target)
        .await
        .expect("explain runs");
    assert!(!report.fits);
    let notes = report.notes.join("\n");
    assert!(
        notes.contains(&format!(
            "nodes of NVLink clique {CLIQUE_0} are free for the ComputeDomain's pods"
        )),
        "{notes}"
    );
    println!("ok    gpu-dra explain: {notes}");

    for (worker, node) in &bound {
        let prepared = rack
            .start_pod(&client, NAMESPACE, worker, node)
            .await
            .unwrap_or_else(|e| panic!("{worker} on {node}: {e}"));
        let devices = &prepared.cdi_devices["worker"];
        assert!(
            devices.iter().any(|id| id.ends_with("-imex-channel-0")),
            "{devices:?}"
        );
    }
    println!("ok    every worker's container gets imex-channel-0 (prepared by its node's plugin)");
    let status = wait_for("the domain Ready", Duration::from_secs(60), async || {
        let domain = rack::domain(&client, NAMESPACE, "job").await;
        (domain.status.status == "Ready").then_some(domain.status)
    })
    .await;
    assert_eq!(status.nodes.len(), 4);
    println!("ok    the domain is Ready with 4 nodes");

    // A daemon dies: the real API server takes the channel's taint.
    let uid = rack::domain(&client, NAMESPACE, "job").await.uid;
    let (_, failing) = &bound[1];
    std::fs::write(
        rack.node(failing).imex_dir(&uid).join("fail"),
        "fabric error (test)",
    )
    .unwrap();
    wait_for(
        "the taint in the real slice",
        Duration::from_secs(60),
        async || {
            let tainted = slices
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .iter()
                .filter(|s| s.spec.node_name.as_deref() == Some(failing.as_str()))
                .flat_map(|s| s.spec.devices.iter().flatten())
                .any(|d| {
                    d.name == "imex-channel-0" && d.taints.as_ref().is_some_and(|t| !t.is_empty())
                });
            tainted.then_some(())
        },
    )
    .await;
    wait_for("the domain NotReady", Duration::from_secs(30), async || {
        let domain = rack::domain(&client, NAMESPACE, "job").await;
        (domain.status.status == "NotReady").then_some(())
    })
    .await;
    let events: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &kube::api::ApiResource::erase::<k8s_openapi::api::events::v1::Event>(&()),
    );
    let events = events.list(&ListParams::default()).await.unwrap().items;
    assert!(events
        .iter()
        .any(|e| e.data.pointer("/reason").and_then(Value::as_str) == Some("IMEXDaemonNotReady")));
    println!(
        "ok    {failing}'s dead daemon: channel tainted, domain NotReady, Event IMEXDaemonNotReady"
    );
    std::fs::remove_file(rack.node(failing).imex_dir(&uid).join("fail")).unwrap();

    // The job ends.
    for (_, node) in &bound {
        let results = rack.node(node).unprepare_all().await.unwrap();
        assert!(results.values().all(|r| r.is_ok()), "{results:?}");
    }
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    for i in 0..5 {
        let _ = pods.delete(&format!("worker-{i}"), &now).await;
    }
    let domains: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &gpu_dra::domains::api::DomainGroup::Ours.api_resource(),
    );
    domains
        .delete("job", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the template gone", Duration::from_secs(60), async || {
        templates
            .get_opt("job-channel")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    println!("ok    the job's daemons stopped; deleting the domain took its template");
    controller.stop().await;
    rack.shutdown().await;
    forget_rack_slices(&client).await;
}

/// With the real node of `../shared/realk8s/node` in the domain's clique (its plugin started with
/// `--fake-profile gb200-nvl72`, clique 0): the real kubelet prepares the worker placed there, the
/// plugin's IMEX daemon runs in a Pod the real kubelet starts from the plugin's image, and containerd
/// makes the channel's device node in the worker's container from the CDI spec. The other worker goes to
/// a node of the rack (kubelet double); a clique-1 node beside them is never used.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs the real control plane and node: REAL_NODE=1 e2e/real-cluster-compute-domain.sh"]
async fn a_worker_on_the_real_node_runs_with_the_channel_in_its_container() {
    let client = gpu_dra::explain::cluster::client(None, None)
        .await
        .expect("a client from KUBECONFIG");
    forget_rack_slices(&client).await;
    let rack = Rack::start_live(
        client.clone(),
        &[("cd-a1", Fabric::Clique(1)), ("cd-n1", Fabric::Clique(0))],
        "gpu-dra:dev",
    )
    .await;
    // With the controller installed from deploy/ (IN_CLUSTER_CONTROLLER=1) none runs here: two would
    // contend for the same domains.
    let controller = std::env::var_os("IN_CLUSTER_CONTROLLER")
        .is_none()
        .then(|| rack::RunningController::start(&client, Duration::from_secs(1)));
    rack::create_gpus_template(&client, NAMESPACE, "four-gpus-rn", 4).await;
    rack::create_domain(&client, NAMESPACE, "real", 2).await;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NAMESPACE);
    wait_for(
        "the channel template",
        Duration::from_secs(30),
        async || templates.get_opt("real-channel").await.ok().flatten(),
    )
    .await;
    let placed = rack::placement(&client, NAMESPACE, "real").await;
    assert_eq!(placed.as_deref(), Some(CLIQUE_0));
    println!("ok    the domain is placed on {CLIQUE_0} (node-1 and cd-n1)");

    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    for i in 0..2 {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("real-worker-{i}"), "namespace": NAMESPACE},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "worker", "image": "localhost/busybox:local", "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "ls -l /dev/nvidia-caps-imex-channels/ && env | grep IMEX && sleep 3600"],
                    "resources": {"claims": [{"name": "gpus"}, {"name": "channel"}]}}],
                "resourceClaims": [
                    {"name": "gpus", "resourceClaimTemplateName": "four-gpus-rn"},
                    {"name": "channel", "resourceClaimTemplateName": "real-channel"},
                ],
            },
        }))
        .unwrap();
        pods.create(&Default::default(), &pod)
            .await
            .expect("worker created");
    }
    let bound = wait_for("both workers bound", Duration::from_secs(60), async || {
        let mut bound = Vec::new();
        for i in 0..2 {
            let name = format!("real-worker-{i}");
            bound.push((name.clone(), bound_node(&pods, &name).await?));
        }
        Some(bound)
    })
    .await;
    let mut nodes: Vec<&str> = bound.iter().map(|(_, n)| n.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["cd-n1", "node-1"], "{bound:?}");
    println!(
        "ok    the real scheduler bound the workers to node-1 and cd-n1 (not cd-a1 of clique 1)"
    );
    let (on_rack, _) = bound.iter().find(|(_, n)| n == "cd-n1").unwrap();
    let (on_real, _) = bound.iter().find(|(_, n)| n == "node-1").unwrap();
    rack.start_pod(&client, NAMESPACE, on_rack, "cd-n1")
        .await
        .unwrap_or_else(|e| panic!("{on_rack} on cd-n1: {e}"));
    wait_for(
        "the real node's worker Running",
        Duration::from_secs(90),
        async || {
            let pod = pods.get(on_real).await.ok()?;
            (pod.status?.phase.as_deref() == Some("Running")).then_some(())
        },
    )
    .await;
    let logs = pods.logs(on_real, &Default::default()).await.expect("logs");
    println!(
        "      {on_real}'s container: {}",
        logs.trim().replace('\n', " | ")
    );
    let channel = logs
        .lines()
        .find(|line| line.ends_with(" channel0"))
        .unwrap_or_else(|| panic!("no channel0 in the container: {logs}"));
    assert!(channel.starts_with("crw"), "a character device: {channel}");
    println!(
        "ok    containerd made /dev/nvidia-caps-imex-channels/channel0 in the container on node-1"
    );
    let status = wait_for("the domain Ready", Duration::from_secs(60), async || {
        let domain = rack::domain(&client, NAMESPACE, "real").await;
        (domain.status.status == "Ready").then_some(domain.status)
    })
    .await;
    let joined: Vec<String> = status
        .nodes
        .iter()
        .map(|n| format!("{} {} {}", n.name, n.ip_address, n.status))
        .collect();
    println!("ok    the domain is Ready: {joined:?}");
    let daemons: Api<Pod> = Api::namespaced(client.clone(), "gpu-dra");
    let on_node_1 = daemons
        .list(
            &ListParams::default()
                .fields("spec.nodeName=node-1")
                .labels("app.kubernetes.io/component=imex-daemon"),
        )
        .await
        .unwrap()
        .items;
    assert!(
        on_node_1
            .iter()
            .any(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")),
        "node-1's IMEX daemon Pod runs under the real kubelet"
    );
    println!("ok    node-1's IMEX daemon Pod runs under the real kubelet, from image gpu-dra:dev");

    // The end: the rack node's claims are unprepared by its kubelet double; the real kubelet unprepares
    // node-1's when its worker is deleted.
    rack.node("cd-n1").unprepare_all().await.unwrap();
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let _ = pods.delete(on_rack, &now).await;
    let _ = pods.delete(on_real, &DeleteParams::default()).await;
    wait_for(
        "node-1's daemon gone",
        Duration::from_secs(90),
        async || {
            let left = daemons
                .list(
                    &ListParams::default()
                        .fields("spec.nodeName=node-1")
                        .labels("app.kubernetes.io/component=imex-daemon"),
                )
                .await
                .ok()?
                .items;
            left.is_empty().then_some(())
        },
    )
    .await;
    println!("ok    deleting node-1's worker unprepared its channel and stopped node-1's daemon");
    let domains: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &gpu_dra::domains::api::DomainGroup::Ours.api_resource(),
    );
    domains
        .delete("real", &DeleteParams::default())
        .await
        .unwrap();
    if let Some(controller) = controller {
        controller.stop().await;
    }
    rack.shutdown().await;
    forget_rack_slices(&client).await;
}
