//! The demo's steps with claims of their own beyond the first whole GPU: a MIG device made on demand
//! (step 8), two claims that share their GPU (step 9) and a pod that fits nowhere, as `gpu-dra explain`
//! tells it (step 14). Every claim is allocated by the scheduler double (`create_and_allocate`).

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, PostParams};

use super::{say, step, DRIVER, MIG_CLAIM, MPS_CLAIM, NAMESPACE, NODE, SLICED_CLAIM};
use crate::support::apiserver::ApiServer;
use crate::support::kubelet::{ClaimRef, KubeletDouble};
use crate::support::scheduler;

/// Step 8: a claim for a 1g.10gb MIG device, allocated, prepared (the MIG device is created), with its
/// CDI edits and the UUID the plugin reports in the claim's status. Returns the claim's UID.
pub(super) async fn demo_mig_claim(
    out: &mut impl Write,
    api: &ApiServer,
    kubelet: &KubeletDouble,
    plugin: &crate::plugin::RunningPlugin,
) -> Result<String> {
    let (uid, allocated) = create_and_allocate(
        api,
        MIG_CLAIM,
        serde_json::json!({"requests": [{"name": "mig", "exactly": {
            "deviceClassName": "mig.gpu.dra.dev",
            "selectors": [{"cel": {"expression": "device.attributes[\"gpu.dra.dev\"].profile == \"1g.10gb\""}}]
        }}]}),
    )
    .await?;
    let claims: Api<ResourceClaim> = Api::namespaced(api.client(), NAMESPACE);
    let device = crate::claims::allocation_results(&allocated)
        .first()
        .context("the MIG claim has no allocation result")?
        .device
        .clone();
    let claim_ref = ClaimRef::new(NAMESPACE, MIG_CLAIM, uid.clone());
    let prepared = kubelet.prepare(std::slice::from_ref(&claim_ref)).await?;
    if let Some(Err(error)) = prepared.get(&uid) {
        bail!("prepare of the MIG claim failed: {error}");
    }
    step(
        out,
        8,
        &format!(
            "ResourceClaim {NAMESPACE}/{MIG_CLAIM} asked for a 1g.10gb MIG device: the scheduler picked {device}\n    (the top memory slice keeps the 4g placement free); prepare created it:"
        ),
    )?;
    let spec = crate::cdi::CdiRegistry::new(&plugin.config.cdi_root, DRIVER)
        .read_claim_spec(&uid)?
        .context("the MIG claim has no CDI spec")?;
    for edits in spec.devices.iter().map(|d| &d.container_edits) {
        for node in &edits.device_nodes {
            // The numbers the runtime makes the node with: the file exists on no host.
            let numbers = match (&node.device_type, node.major, node.minor) {
                (Some(t), Some(major), Some(minor)) => format!(" ({t} {major}:{minor})"),
                _ => String::new(),
            };
            say(out, &format!("device node {}{numbers}", node.path))?;
        }
        for env in &edits.env {
            say(out, &format!("env {env}"))?;
        }
    }
    // The plugin reports the created device's UUID in the claim status right after answering.
    for _ in 0..100 {
        let claim = claims.get(MIG_CLAIM).await?;
        if let Some(status) = claim
            .status
            .and_then(|s| s.devices)
            .and_then(|d| d.into_iter().next())
        {
            let data = status.data.map(|d| d.0.to_string()).unwrap_or_default();
            say(
                out,
                &format!("claim status.devices: {} {data}", status.device),
            )?;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(uid)
}

/// Step 9: two claims that share their GPU, set by an opaque `GpuConfig` in the claim: one time-sliced
/// (interval Long), one with its own MPS daemon. Returns both claims for the unprepare step.
pub(super) async fn demo_sharing(
    out: &mut impl Write,
    api: &ApiServer,
    kubelet: &KubeletDouble,
    plugin: &crate::plugin::RunningPlugin,
    profile: &str,
    root: &std::path::Path,
) -> Result<Vec<ClaimRef>> {
    let with_config = |sharing: serde_json::Value| {
        serde_json::json!({
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
            "config": [{"opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing}}}]
        })
    };
    let (sliced_uid, _) = create_and_allocate(
        api,
        SLICED_CLAIM,
        with_config(serde_json::json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})),
    )
    .await?;
    let (mps_uid, _) = create_and_allocate(
        api,
        MPS_CLAIM,
        with_config(serde_json::json!({"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "20Gi"}})),
    )
    .await?;
    let claims = vec![
        ClaimRef::new(NAMESPACE, SLICED_CLAIM, sliced_uid.clone()),
        ClaimRef::new(NAMESPACE, MPS_CLAIM, mps_uid.clone()),
    ];
    let prepared = kubelet.prepare(&claims).await?;
    for claim in &claims {
        if let Some(Err(error)) = prepared.get(&claim.uid) {
            bail!("prepare of {} failed: {error}", claim.name);
        }
    }
    step(
        out,
        9,
        "Two claims share their GPU as their opaque GpuConfig asks (any pod or container of the claim gets it):",
    )?;
    let cdi = crate::cdi::CdiRegistry::new(&plugin.config.cdi_root, DRIVER);
    for (name, uid) in [(SLICED_CLAIM, &sliced_uid), (MPS_CLAIM, &mps_uid)] {
        let spec = cdi
            .read_claim_spec(uid)?
            .context("a sharing claim has no CDI spec")?;
        let env = spec
            .container_edits
            .env
            .iter()
            .chain(spec.devices.iter().flat_map(|d| &d.container_edits.env))
            .filter(|e| e.starts_with("GPU_DRA_SHARING") || e.starts_with("CUDA_MPS"))
            .cloned()
            .collect::<Vec<_>>()
            .join(" ");
        say(out, &format!("{NAMESPACE}/{name}: container env {env}"))?;
    }
    let modes = crate::gpu::FakeBackend::with_state_file(
        NODE,
        profile,
        Some(root.join("fake-gpu-state.json")),
    )?
    .sharing_modes();
    for (uuid, mode) in &modes {
        say(out, &format!("fake GPU {uuid}: {mode}"))?;
    }
    if let Some(daemon) = plugin
        .preparer
        .prepared_claims()
        .get(&mps_uid)
        .and_then(|record| record.mps.clone())
    {
        say(
            out,
            &format!(
                "MPS control daemon for {NAMESPACE}/{MPS_CLAIM}: Pod gpu-dra/{} (the fake backend's stand-in), pipe {}",
                daemon.pod,
                daemon.dir.join("pipe").display()
            ),
        )?;
        let log = std::fs::read_to_string(daemon.dir.join("log/control.log")).unwrap_or_default();
        for line in log.lines().filter(|l| l.contains("set_default")) {
            say(out, &format!("daemon log: {line}"))?;
        }
    }
    Ok(claims)
}

/// Step 14: a pod that wants all 8 GPUs on one NVLink domain while the claims above still hold some,
/// and a node without GPUs beside the demo node: `gpu-dra explain` says why it fits nowhere.
pub(super) async fn demo_explain(out: &mut impl Write, api: &ApiServer) -> Result<()> {
    use crate::support::cluster as fixture;
    api.insert("nodes", fixture::node("cpu-node", &[], &[], false));
    let devices = serde_json::json!({
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER, "count": 8}}],
        "constraints": [{"matchAttribute": "gpu.dra.dev/nvlinkDomain"}]
    });
    api.insert(
        "resourceclaimtemplates",
        fixture::claim(NAMESPACE, "eight-gpus", devices, true),
    );
    api.insert(
        "pods",
        fixture::pod(
            NAMESPACE,
            "big-job",
            serde_json::json!([{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}]),
            serde_json::json!({}),
        ),
    );
    let target = crate::explain::Target::Pod {
        namespace: NAMESPACE.into(),
        name: "big-job".into(),
    };
    let cluster = crate::explain::Cluster::fetch(&api.client(), &target).await?;
    let report = crate::explain::explain(&cluster, &target)?;
    step(
        out,
        14,
        &format!(
            "Pod {NAMESPACE}/big-job wants 8 GPUs on one NVLink domain and stays Pending; \
             `kubectl gpu-dra explain pod {NAMESPACE}/big-job` (exit code {}) says why:",
            report.exit_code()
        ),
    )?;
    for line in report.to_table().lines() {
        if line.is_empty() {
            writeln!(out)?;
        } else {
            say(out, line)?;
        }
    }
    Ok(())
}

/// Creates the claim with `devices` as its `spec.devices` and lets the scheduler double allocate it to a
/// pod named after it; returns the claim's UID and the allocated claim.
pub(super) async fn create_and_allocate(
    api: &ApiServer,
    name: &str,
    devices: serde_json::Value,
) -> Result<(String, ResourceClaim)> {
    let claims: Api<ResourceClaim> = Api::namespaced(api.client(), NAMESPACE);
    let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": devices}
    }))?;
    let created = claims.create(&PostParams::default(), &claim).await?;
    let uid = created.metadata.uid.clone().unwrap_or_default();
    let pod = format!("{name}-pod");
    let pod_uid = format!("{name}-pod-uid");
    let allocated =
        scheduler::allocate(&api.client(), NAMESPACE, name, NODE, (&pod, &pod_uid)).await?;
    Ok((uid, allocated))
}
