//! The ComputeDomain controller against the API server double: six fabric nodes in two NVLink cliques
//! (4 + 2) and one node without fabric. A domain of 4 nodes is placed on the 4-node clique (its
//! ComputeDomainPlacement, then its template); a second goes there too, since placing holds no node;
//! one of 5 nodes waits with the cliques' counts; annotations a user presets change nothing; forty
//! empty domains keep no other namespace's job out, while workers' channel claims do take their nodes;
//! status follows the plugins' node entries and the Nodes; deleting a domain deletes its template and
//! placement; NVIDIA's group is served only under NVIDIA's driver name.

use std::time::Duration;

use gpu_dra::domains::api::PLACEMENT_ANNOTATION;
use gpu_dra::domains::controller::{Controller, ControllerConfig};
use gpu_dra::support::apiserver::ApiServer;
use serde_json::{json, Value};
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(10);
const BIG: &str = "cluster-1.0";
const SMALL: &str = "cluster-1.1";

/// A node's slice under `driver`: two GPUs and, with a clique, its IMEX channel device.
fn slice(driver: &str, node: &str, clique: Option<&str>) -> Value {
    let mut devices: Vec<Value> = (0..2)
        .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"type": {"string": "gpu"}}}))
        .collect();
    if let Some(clique) = clique {
        devices.push(json!({"name": "imex-channel-0", "attributes": {
            "type": {"string": "imex-channel"},
            "channel": {"int": 0},
            "nvlinkDomain": {"string": clique},
        }}));
    }
    json!({
        "metadata": {"name": format!("{node}-{driver}")},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices},
    })
}

fn node(name: &str, ready: bool) -> Value {
    json!({
        "metadata": {"name": name},
        "status": {"conditions": [{
            "type": "Ready",
            "status": if ready { "True" } else { "False" },
            "reason": if ready { "KubeletReady" } else { "KubeletNotReady" },
            "message": if ready { "kubelet is posting ready status" } else { "container runtime is down" },
        }]},
    })
}

/// Nodes a0..a3 (clique BIG), b0, b1 (SMALL) and `plain` (no fabric), with their slices.
fn cluster(api: &ApiServer, driver: &str) {
    let nodes = [
        ("a0", Some(BIG)),
        ("a1", Some(BIG)),
        ("a2", Some(BIG)),
        ("a3", Some(BIG)),
        ("b0", Some(SMALL)),
        ("b1", Some(SMALL)),
        ("plain", None),
    ];
    for (name, clique) in nodes {
        api.insert("nodes", node(name, true));
        api.insert("resourceslices", slice(driver, name, clique));
    }
}

fn domain(api_version: &str, name: &str, num_nodes: u32) -> Value {
    domain_in("team", api_version, name, num_nodes)
}

fn domain_in(namespace: &str, api_version: &str, name: &str, num_nodes: u32) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"numNodes": num_nodes,
                 "channel": {"resourceClaimTemplate": {"name": format!("{name}-channel")}}},
    })
}

/// Starts the controller; dropping the sender stops it.
fn start(api: &ApiServer, driver: &str) -> oneshot::Sender<()> {
    let mut config = ControllerConfig::new(driver);
    config.resync = Duration::from_millis(300);
    let controller = Controller::new(api.client(), config);
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(controller.run(async move {
        let _ = stopped.await;
    }));
    stop
}

async fn template_named(api: &ApiServer, name: &str) -> Value {
    let found = api
        .wait_for(
            "resourceclaimtemplates",
            |t| t.iter().any(|t| t["metadata"]["name"] == name),
            WAIT,
        )
        .await
        .unwrap_or_else(|| panic!("no template {name}"));
    found
        .into_iter()
        .find(|t| t["metadata"]["name"] == name)
        .unwrap()
}

fn selector(template: &Value) -> &str {
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]
        ["expression"]
        .as_str()
        .unwrap_or_default()
}

/// Waits until domain `name` (in `resource`) satisfies `pred`, and returns it.
async fn domain_when(
    api: &ApiServer,
    resource: &str,
    name: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let found = api
        .wait_for(
            resource,
            |all| all.iter().any(|d| d["metadata"]["name"] == name && pred(d)),
            WAIT,
        )
        .await;
    match found {
        Some(all) => all
            .into_iter()
            .find(|d| d["metadata"]["name"] == name)
            .unwrap(),
        None => panic!(
            "ComputeDomain {name} never got there: {:#}",
            api.get(resource, Some("team"), name).unwrap_or_default()
        ),
    }
}

/// The clique of the domain's ComputeDomainPlacement, once the controller wrote it.
async fn placed(api: &ApiServer, resource: &str, namespace: &str, name: &str) -> String {
    let domain = api
        .wait_for(
            resource,
            |all| {
                all.iter().any(|d| {
                    d["metadata"]["name"] == name && d["metadata"]["namespace"] == namespace
                })
            },
            WAIT,
        )
        .await
        .and_then(|all| {
            all.into_iter()
                .find(|d| d["metadata"]["name"] == name && d["metadata"]["namespace"] == namespace)
        })
        .unwrap_or_else(|| panic!("no ComputeDomain {namespace}/{name}"));
    let uid = domain["metadata"]["uid"].as_str().unwrap().to_string();
    let placements = api
        .wait_for(
            "computedomainplacements",
            |all| all.iter().any(|p| p["metadata"]["name"] == uid.as_str()),
            WAIT,
        )
        .await
        .unwrap_or_else(|| panic!("ComputeDomain {namespace}/{name} was never placed"));
    let placement = placements
        .into_iter()
        .find(|p| p["metadata"]["name"] == uid.as_str())
        .unwrap();
    assert_eq!(placement["spec"]["domain"]["namespace"], namespace);
    assert_eq!(placement["spec"]["domain"]["name"], name);
    assert_eq!(placement["spec"]["domain"]["uid"], uid.as_str());
    placement["spec"]["clique"].as_str().unwrap().to_string()
}

fn annotation<'a>(domain: &'a Value, key: &str) -> &'a str {
    domain["metadata"]["annotations"][key]
        .as_str()
        .unwrap_or_default()
}

#[tokio::test]
async fn domains_are_placed_on_a_clique_with_room_and_followed_until_deleted() {
    let api = ApiServer::start().await.expect("API server double");
    cluster(&api, "gpu.dra.dev");
    let stop = start(&api, "gpu.dra.dev");

    // numNodes 4: only the 4-node clique fits. An annotation the user preset is not a placement.
    let mut first = domain("gpu.dra.dev/v1alpha1", "first", 4);
    first["metadata"]["annotations"] =
        json!({"gpu.dra.dev/nvlink-domain": SMALL, "gpu.dra.dev/imex-channel": "5"});
    api.insert("computedomains", first);
    assert_eq!(placed(&api, "computedomains", "team", "first").await, BIG);
    let first = api.get("computedomains", Some("team"), "first").unwrap();
    let uid = first["metadata"]["uid"].as_str().unwrap().to_string();
    let template = template_named(&api, "first-channel").await;
    assert_eq!(
        selector(&template),
        "device.attributes[\"gpu.dra.dev\"].nvlinkDomain == \"cluster-1.0\" && \
         device.attributes[\"gpu.dra.dev\"].channel == 0"
    );
    assert_eq!(template["metadata"]["namespace"], "team");
    assert_eq!(
        template["metadata"]["labels"]["gpu.dra.dev/compute-domain"],
        uid.as_str()
    );
    assert_eq!(
        template["metadata"]["ownerReferences"][0]["uid"],
        uid.as_str()
    );
    let request = &template["spec"]["spec"]["devices"]["requests"][0];
    assert_eq!(request["name"], "channel");
    assert_eq!(
        request["exactly"]["deviceClassName"],
        "imex-channel.gpu.dra.dev"
    );
    let parameters = &template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"];
    assert_eq!(
        parameters,
        &json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "ComputeDomainChannelConfig", "domainID": uid})
    );

    // A second domain of 4 nodes: the same clique (placing one takes no node; its workers' channel
    // claims do), and the same channel: a node serves one domain at a time.
    api.insert(
        "computedomains",
        domain("gpu.dra.dev/v1alpha1", "second", 4),
    );
    assert_eq!(placed(&api, "computedomains", "team", "second").await, BIG);
    assert!(selector(&template_named(&api, "second-channel").await).ends_with("channel == 0"));

    // numNodes 5 fits no clique: no template, the reason names the cliques and their counts.
    api.insert("computedomains", domain("gpu.dra.dev/v1alpha1", "big", 5));
    let big = domain_when(&api, "computedomains", "big", |d| {
        d["status"]["conditions"][0]["status"] == "False"
    })
    .await;
    assert_eq!(
        annotation(&big, PLACEMENT_ANNOTATION),
        "no NVLink clique has 5 free nodes: cluster-1.0 has 4 (of 4), cluster-1.1 has 2 (of 2); \
         nodes without an NVLink fabric are never used"
    );
    assert_eq!(big["status"]["conditions"][0]["reason"], "NoCliqueFits");
    assert_eq!(big["status"]["status"], "NotReady");
    let big_uid = big["metadata"]["uid"].as_str().unwrap();
    assert!(api.get("computedomainplacements", None, big_uid).is_none());
    assert!(api
        .get("resourceclaimtemplates", Some("team"), "big-channel")
        .is_none());

    // The plugins of a0..a3 report their IMEX daemons Ready: the domain is Ready.
    let mut with_nodes = api.get("computedomains", Some("team"), "first").unwrap();
    with_nodes["status"]["nodes"] = json!((0..4)
        .map(
            |i| json!({"name": format!("a{i}"), "ipAddress": format!("10.0.0.{i}"),
                        "cliqueID": BIG, "index": i, "status": "Ready"})
        )
        .collect::<Vec<_>>());
    api.insert("computedomains", with_nodes);
    let ready = domain_when(&api, "computedomains", "first", |d| {
        d["status"]["status"] == "Ready"
    })
    .await;
    assert_eq!(
        ready["status"]["conditions"][1]["message"],
        "4 of 4 node(s) Ready"
    );

    // Node a1 goes NotReady: its entry turns NotReady with the reason, the domain NotReady, and a
    // Warning Event on the domain names the node.
    api.insert("nodes", node("a1", false));
    let degraded = domain_when(&api, "computedomains", "first", |d| {
        d["status"]["status"] == "NotReady"
    })
    .await;
    let a1 = degraded["status"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "a1")
        .unwrap();
    assert_eq!(a1["status"], "NotReady");
    let reason = a1["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("node a1 is NotReady") && reason.contains("container runtime is down"),
        "{reason}"
    );
    let events = api
        .wait_for(
            "events",
            |e| {
                e.iter().any(|e| {
                    e["reason"] == "NodeNotReady"
                        && e["type"] == "Warning"
                        && e["regarding"]["name"] == "first"
                        && e["regarding"]["kind"] == "ComputeDomain"
                        && e["related"]["name"] == "a1"
                })
            },
            WAIT,
        )
        .await;
    assert!(
        events.is_some(),
        "no NodeNotReady Event: {:#?}",
        api.list("events")
    );

    // Deleting the domain deletes its template (no garbage collector here) and its placement; the
    // other's stay.
    api.remove("computedomains", Some("team"), "first");
    api.wait_for(
        "computedomainplacements",
        |p| !p.iter().any(|p| p["metadata"]["name"] == uid.as_str()),
        WAIT,
    )
    .await
    .expect("the placement of the deleted domain is deleted");
    let gone = api
        .wait_for(
            "resourceclaimtemplates",
            |t| !t.iter().any(|t| t["metadata"]["name"] == "first-channel"),
            WAIT,
        )
        .await
        .expect("the template of the deleted domain is deleted");
    assert!(gone
        .iter()
        .any(|t| t["metadata"]["name"] == "second-channel"));
    drop(stop);
}

#[tokio::test]
async fn a_malformed_domain_is_reported_and_does_not_stop_the_others() {
    let api = ApiServer::start().await.expect("API server double");
    cluster(&api, "gpu.dra.dev");
    let stop = start(&api, "gpu.dra.dev");
    let mut broken = domain("gpu.dra.dev/v1alpha1", "broken", 2);
    broken["spec"]["numNodes"] = json!("two");
    api.insert("computedomains", broken);
    let mut no_channel = domain("gpu.dra.dev/v1alpha1", "no-channel", 2);
    no_channel["spec"]["channel"] = Value::Null;
    api.insert("computedomains", no_channel);
    api.insert("computedomains", domain("gpu.dra.dev/v1alpha1", "fine", 2));

    template_named(&api, "fine-channel").await;
    let broken = domain_when(&api, "computedomains", "broken", |d| {
        d["status"]["conditions"][0]["reason"] == "InvalidSpec"
    })
    .await;
    let message = broken["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap();
    assert!(
        message.contains("ComputeDomain team/broken: spec"),
        "{message}"
    );
    let refused = domain_when(&api, "computedomains", "no-channel", |d| {
        d["status"]["conditions"][0]["reason"] == "SpecNotSupported"
    })
    .await;
    assert!(annotation(&refused, PLACEMENT_ANNOTATION).starts_with("spec.channel is not set"));
    assert!(api
        .wait_for(
            "events",
            |e| e.iter().any(|e| e["reason"] == "InvalidSpec"),
            WAIT
        )
        .await
        .is_some());
    drop(stop);
}

#[tokio::test]
async fn nvidias_group_is_served_in_compatibility_mode_only() {
    const NVIDIA: &str = "computedomains.resource.nvidia.com";
    let api = ApiServer::start().await.expect("API server double");
    cluster(&api, "gpu.nvidia.com");
    let stop = start(&api, "gpu.nvidia.com");
    api.insert(NVIDIA, domain("resource.nvidia.com/v1beta1", "theirs", 2));
    assert_eq!(placed(&api, NVIDIA, "team", "theirs").await, BIG);
    let template = template_named(&api, "theirs-channel").await;
    assert!(selector(&template).starts_with("device.attributes[\"gpu.nvidia.com\"].nvlinkDomain"));
    let opaque = &template["spec"]["spec"]["devices"]["config"][0]["opaque"];
    assert_eq!(opaque["driver"], "gpu.nvidia.com");
    assert_eq!(
        opaque["parameters"]["apiVersion"],
        "resource.nvidia.com/v1beta1"
    );
    assert_eq!(
        template["metadata"]["ownerReferences"][0]["apiVersion"],
        "resource.nvidia.com/v1beta1"
    );
    drop(stop);

    // Under our own driver name, NVIDIA's group is never asked about.
    let api = ApiServer::start().await.expect("API server double");
    cluster(&api, "gpu.dra.dev");
    let controller = Controller::new(api.client(), ControllerConfig::new("gpu.dra.dev"));
    assert_eq!(controller.groups().len(), 1);
    let stop = start(&api, "gpu.dra.dev");
    api.insert(NVIDIA, domain("resource.nvidia.com/v1beta1", "theirs", 2));
    api.insert("computedomains", domain("gpu.dra.dev/v1alpha1", "ours", 2));
    template_named(&api, "ours-channel").await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(api.list("computedomainplacements").len(), 1, "ours only");
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.resource.starts_with(NVIDIA)),
        "requests on NVIDIA's group under gpu.dra.dev"
    );
    drop(stop);
}

/// A claim of `namespace` allocated the channel device of each of `nodes` (a job's workers).
fn channel_claim(namespace: &str, name: &str, node: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "channel", "exactly": {"deviceClassName": "imex-channel.gpu.dra.dev"}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "channel", "driver": "gpu.dra.dev", "pool": node, "device": "imex-channel-0"}
        ]}}},
    })
}

#[tokio::test]
async fn empty_domains_hold_no_node_and_workers_do() {
    let api = ApiServer::start().await.expect("API server double");
    cluster(&api, "gpu.dra.dev");
    let stop = start(&api, "gpu.dra.dev");
    // Forty domains of four nodes in one namespace, none with a worker yet.
    for i in 0..40 {
        api.insert(
            "computedomains",
            domain_in("crowd", "gpu.dra.dev/v1alpha1", &format!("empty-{i}"), 4),
        );
    }
    api.wait_for("computedomainplacements", |p| p.len() == 40, WAIT)
        .await
        .expect("the forty are placed");
    // Another namespace's job of four nodes is placed all the same, and gets its template.
    api.insert("computedomains", domain("gpu.dra.dev/v1alpha1", "job", 4));
    assert_eq!(placed(&api, "computedomains", "team", "job").await, BIG);
    template_named(&api, "job-channel").await;

    // Its four workers are allocated the channels of a0..a3: now the big clique is full, and the next
    // domain (two nodes) goes to the small one.
    for i in 0..4 {
        api.insert(
            "resourceclaims",
            channel_claim("team", &format!("worker-{i}-channel"), &format!("a{i}")),
        );
    }
    api.insert(
        "computedomains",
        domain_in("other", "gpu.dra.dev/v1alpha1", "next", 2),
    );
    assert_eq!(placed(&api, "computedomains", "other", "next").await, SMALL);
    drop(stop);
}
