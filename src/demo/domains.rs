//! The demo's ComputeDomain step: a small rack beside the demo's node (a node without an NVLink
//! fabric, a GB200 tray in clique 1, two in clique 0), the controller, a domain of two nodes and a job
//! of two workers: where they land, what their containers get, the domain's status, and what a dead
//! IMEX daemon looks like.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams};

use super::{say, step};
use crate::support::apiserver::ApiServer;
use crate::support::rack::{self, wait_for, Fabric, Rack};

const NAMESPACE: &str = "team";

pub async fn demo_compute_domain(out: &mut impl Write, api: &ApiServer, number: u32) -> Result<()> {
    let client = api.client();
    let rack = Rack::start(
        api,
        &[
            ("rack-a0", Fabric::None),
            ("rack-a1", Fabric::Clique(1)),
            ("rack-b1", Fabric::Clique(0)),
            ("rack-b2", Fabric::Clique(0)),
        ],
        "gpu-dra:demo",
    )
    .await;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let channels = |node: &str, slices: &[ResourceSlice]| {
        slices
            .iter()
            .filter(|s| s.spec.node_name.as_deref() == Some(node))
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.name.starts_with("imex-channel-"))
            .count()
    };
    let published = wait_for("the rack's slices", Duration::from_secs(20), async || {
        let all = slices.list(&ListParams::default()).await.ok()?.items;
        rack.nodes
            .iter()
            .skip(1)
            .all(|n| channels(&n.name, &all) > 0)
            .then_some(all)
    })
    .await;
    step(
        out,
        number,
        "ComputeDomains: a rack of four more nodes, each with its own plugin: rack-a0 (4x L40S, no NVLink \
         fabric), rack-a1 (a GB200 NVL72 tray in NVLink clique 1), rack-b1 and rack-b2 (trays in clique 0)",
    )?;
    for node in &rack.nodes {
        say(
            out,
            &format!(
                "{} ({}) publishes {} IMEX channel device(s)",
                node.name,
                node.ip,
                channels(&node.name, &published)
            ),
        )?;
    }

    let controller = rack::RunningController::start(&client, Duration::from_millis(500));
    rack::create_gpus_template(&client, NAMESPACE, "four-gpus", 4).await;
    rack::create_domain(&client, NAMESPACE, "job", 2).await;
    let clique = wait_for("the placement", Duration::from_secs(20), async || {
        rack::placement(&client, NAMESPACE, "job").await
    })
    .await;
    step(
        out,
        number + 1,
        &format!(
            "Created ComputeDomain {NAMESPACE}/job (numNodes: 2); `gpu-dra controller` placed it on clique \
             {clique} and wrote ResourceClaimTemplate job-channel, whose selector admits only that clique's \
             channel devices (one per node: a node serves one domain at a time)"
        ),
    )?;

    let mut placed = Vec::new();
    for worker in ["worker-0", "worker-1"] {
        rack::create_worker(&client, NAMESPACE, worker, "four-gpus", "job-channel").await;
        let node = rack
            .schedule(&client, NAMESPACE, worker)
            .await
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("{worker} fits no node"))?;
        placed.push((worker, node));
    }
    step(
        out,
        number + 2,
        "Two workers, each asking for a tray's 4 GPUs and the domain's channel, placed on the first node that fits:",
    )?;
    for (worker, node) in &placed {
        say(out, &format!("{worker} → {node}"))?;
    }
    say(
        out,
        "rack-a0 (no fabric) and rack-a1 (the other clique) come first by name and are passed over",
    )?;
    for (worker, node) in &placed {
        rack.start_pod(&client, NAMESPACE, worker, node)
            .await
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("preparing {worker} on {node}"))?;
        let spec = std::fs::read_dir(&rack.node(node).config.cdi_root)?
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
            .find(|text| text.contains("imex-channel-"))
            .context("no CDI spec for the channel")?;
        let spec: serde_json::Value = serde_json::from_str(&spec)?;
        let device = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
        say(
            out,
            &format!(
                "{worker} prepared on {node}: its container gets {} (type {}, major {}, minor {}: /dev/null's, as every fake device file; a real node's nvidia-caps-imex-channels major, minor = channel)",
                device["path"].as_str().unwrap_or_default(),
                device["type"].as_str().unwrap_or_default(),
                device["major"],
                device["minor"],
            ),
        )?;
    }
    let status = wait_for("the domain Ready", Duration::from_secs(30), async || {
        let domain = rack::domain(&client, NAMESPACE, "job").await;
        (domain.status.status == "Ready").then_some(domain.status)
    })
    .await;
    step(
        out,
        number + 3,
        &format!(
            "Each node started the domain's IMEX daemon (a Pod of the plugin's image) before answering; the domain is {}:",
            status.status
        ),
    )?;
    for node in &status.nodes {
        say(
            out,
            &format!(
                "{} {} (index {}, clique {}): {}",
                node.name, node.ip_address, node.index, node.clique_id, node.status
            ),
        )?;
    }

    // The IMEX stand-in exits with the reason in its `fail` file, as a crashed daemon would.
    let uid = rack::domain(&client, NAMESPACE, "job").await.uid;
    let failing = &placed[1].1;
    std::fs::write(
        rack.node(failing).imex_dir(&uid).join("fail"),
        "lost connection to peer (demo)",
    )?;
    let reason = wait_for(
        "the failure reported",
        Duration::from_secs(30),
        async || {
            let domain = rack::domain(&client, NAMESPACE, "job").await;
            let entry = domain.status.nodes.iter().find(|n| &n.name == failing)?;
            (entry.status == "NotReady" && domain.status.status == "NotReady")
                .then(|| entry.reason.clone().unwrap_or_default())
        },
    )
    .await;
    let taint = wait_for("the channel's taint", Duration::from_secs(20), async || {
        slices
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .iter()
            .filter(|s| s.spec.node_name.as_deref() == Some(failing))
            .flat_map(|s| s.spec.devices.iter().flatten())
            .find(|d| d.name == "imex-channel-0")?
            .taints
            .as_ref()?
            .first()
            .map(|t| {
                format!(
                    "{}={}:{}",
                    t.key,
                    t.value.clone().unwrap_or_default(),
                    t.effect
                )
            })
    })
    .await;
    step(
        out,
        number + 4,
        &format!("Killed the IMEX daemon on {failing}: the domain is NotReady"),
    )?;
    say(out, &format!("{failing}'s entry: {reason}"))?;
    say(
        out,
        &format!(
            "{failing}'s imex-channel-0 is tainted {taint}: nothing new of the domain lands there"
        ),
    )?;
    say(
        out,
        "and a Warning Event IMEXDaemonNotReady is recorded on the ComputeDomain",
    )?;

    // The job ends: its claims are unprepared, the daemons stop.
    for (_, node) in &placed {
        rack.node(node).unprepare_all().await?;
    }
    let left = Api::<ResourceClaim>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await?
        .items
        .len();
    step(
        out,
        number + 5,
        &format!(
            "The job ended: its {left} claims unprepared, both IMEX daemons stopped (their directories: {})",
            if placed
                .iter()
                .all(|(_, node)| !rack.node(node).imex_dir(&uid).exists())
            {
                "removed"
            } else {
                "still there"
            }
        ),
    )?;
    controller.stop().await;
    rack.shutdown().await;
    Ok(())
}
