//! The ComputeDomain controller against the API server double: six fabric nodes in two NVLink cliques
//! (4 + 2) and one node without fabric. A domain of 4 nodes is placed on the 4-node clique with its
//! template; a second gets another channel; one of 5 nodes waits with the cliques' counts; status
//! follows the plugins' node entries and the Nodes; deleting a domain deletes its template; NVIDIA's
//! group is served only under NVIDIA's driver name.

use std::time::Duration;

use gpu_dra::domains::api::{CHANNEL_ANNOTATION, CLIQUE_ANNOTATION, PLACEMENT_ANNOTATION};
use gpu_dra::domains::controller::{Controller, ControllerConfig};
use gpu_dra::support::apiserver::ApiServer;
use serde_json::{json, Value};
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(10);
const BIG: &str = "cluster-1.0";
const SMALL: &str = "cluster-1.1";

/// A node's slice under `driver`: two GPUs and, with a clique, IMEX channels 0..4.
fn slice(driver: &str, node: &str, clique: Option<&str>) -> Value {
    let mut devices: Vec<Value> = (0..2)
        .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"type": {"string": "gpu"}}}))
        .collect();
    if let Some(clique) = clique {
        devices.extend((0..4).map(|n| {
            json!({"name": format!("imex-channel-{n}"), "attributes": {
                "type": {"string": "imex-channel"},
                "channel": {"int": n},
                "nvlinkDomain": {"string": clique},
            }})
        }));
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
    json!({
        "apiVersion": api_version,
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": "team"},
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

    // numNodes 4: only the 4-node clique fits; channel 0.
    api.insert("computedomains", domain("gpu.dra.dev/v1alpha1", "first", 4));
    let first = domain_when(&api, "computedomains", "first", |d| {
        !annotation(d, CHANNEL_ANNOTATION).is_empty()
    })
    .await;
    assert_eq!(annotation(&first, CLIQUE_ANNOTATION), BIG);
    assert_eq!(annotation(&first, CHANNEL_ANNOTATION), "0");
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

    // A second domain of 4 nodes: the same clique, another channel.
    api.insert(
        "computedomains",
        domain("gpu.dra.dev/v1alpha1", "second", 4),
    );
    let second = domain_when(&api, "computedomains", "second", |d| {
        !annotation(d, CHANNEL_ANNOTATION).is_empty()
    })
    .await;
    assert_eq!(annotation(&second, CLIQUE_ANNOTATION), BIG);
    assert_eq!(annotation(&second, CHANNEL_ANNOTATION), "1");
    assert!(selector(&template_named(&api, "second-channel").await).ends_with("channel == 1"));

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
    assert!(annotation(&big, CLIQUE_ANNOTATION).is_empty());
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

    // Deleting the domain deletes its template (no garbage collector here); the other stays.
    api.remove("computedomains", Some("team"), "first");
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
    let theirs = domain_when(&api, NVIDIA, "theirs", |d| {
        !annotation(d, CHANNEL_ANNOTATION).is_empty()
    })
    .await;
    assert_eq!(annotation(&theirs, CLIQUE_ANNOTATION), BIG);
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
    let theirs = api.get(NVIDIA, Some("team"), "theirs").unwrap();
    assert!(annotation(&theirs, CLIQUE_ANNOTATION).is_empty());
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.resource.starts_with(NVIDIA)),
        "requests on NVIDIA's group under gpu.dra.dev"
    );
    drop(stop);
}
