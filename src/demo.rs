//! `gpu-dra demo`: the whole driver on one machine without a cluster or GPUs. It starts the in-process
//! API server double, the plugin with the fake backend, and the kubelet double, then walks one claim
//! through publish → allocate → prepare → CDI spec → unprepare, saying what happens at each step.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, PostParams};

use crate::plugin::PluginConfig;
use crate::support::apiserver::ApiServer;
use crate::support::kubelet::{ClaimRef, KubeletDouble};
use crate::support::scheduler;

const NODE: &str = "demo-node";
const DRIVER: &str = "gpu.dra.dev";
const NAMESPACE: &str = "default";
const CLAIM: &str = "one-gpu";

pub async fn run(out: &mut impl Write) -> Result<()> {
    let workdir = tempfile::Builder::new().prefix("gpu-dra-demo-").tempdir()?;
    let root = workdir.path();

    let api = ApiServer::start()
        .await
        .context("starting the API server double")?;
    step(
        out,
        1,
        &format!("Started a Kubernetes API server double at {}", api.url()),
    )?;
    api.insert(
        "nodes",
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}),
    );
    say(out, &format!("created Node {NODE}"))?;
    crate::support::harness::install_device_classes(&api);
    say(
        out,
        "created DeviceClasses gpu.dra.dev (whole GPUs) and mig.gpu.dra.dev (MIG devices)",
    )?;

    let config = PluginConfig {
        http_addr: Some(([127, 0, 0, 1], 0).into()),
        ..PluginConfig::fake_node_under(root, DRIVER, NODE, "dgx-h100")
    };
    let plugin = crate::plugin::start(config.clone(), api.client()).await?;
    step(
        out,
        2,
        "Started the plugin with the fake backend (profile dgx-h100: 8x H100 80GB)",
    )?;
    say(
        out,
        &format!(
            "registration socket {}",
            config.registration_socket().display()
        ),
    )?;
    say(
        out,
        &format!("DRA socket          {}", config.dra_socket().display()),
    )?;

    let kubelet =
        KubeletDouble::register(&config.registry_dir, DRIVER, Duration::from_secs(10)).await?;
    step(
        out,
        3,
        "The kubelet double found the registration socket and registered the plugin",
    )?;
    let info = kubelet.plugin_info();
    say(
        out,
        &format!(
            "GetInfo: type={} name={} endpoint={} versions={:?}; kubelet chose {:?}",
            info.r#type,
            info.name,
            info.endpoint,
            info.supported_versions,
            kubelet.service()
        ),
    )?;

    let slices = wait_for_slices(&api.client()).await?;
    let devices: Vec<_> = slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect();
    step(
        out,
        4,
        &format!(
            "The plugin published {} ResourceSlice(s) with {} devices for pool {NODE}:",
            slices.len(),
            devices.len()
        ),
    )?;
    for line in crate::devices::table(&devices).lines() {
        say(out, line)?;
    }

    let claims: Api<ResourceClaim> = Api::namespaced(api.client(), NAMESPACE);
    let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": CLAIM, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}
    }))?;
    let created = claims.create(&PostParams::default(), &claim).await?;
    let uid = created.metadata.uid.clone().unwrap_or_default();
    let allocated = scheduler::allocate(
        &api.client(),
        NAMESPACE,
        CLAIM,
        NODE,
        ("demo-pod", "demo-pod-uid"),
    )
    .await?;
    let result = crate::claims::allocation_results(&allocated)
        .first()
        .context("the claim has no allocation result")?;
    step(
        out,
        5,
        &format!(
            "Created ResourceClaim {NAMESPACE}/{CLAIM} (uid {uid}); first-fit allocation gave request {:?} device {}/{}",
            result.request, result.pool, result.device
        ),
    )?;

    let claim_ref = ClaimRef::new(NAMESPACE, CLAIM, uid.clone());
    let prepared = kubelet.prepare(std::slice::from_ref(&claim_ref)).await?;
    let devices = match prepared.get(&uid) {
        Some(Ok(devices)) => devices.clone(),
        Some(Err(error)) => bail!("prepare failed: {error}"),
        None => bail!("the plugin did not answer for the claim"),
    };
    step(out, 6, "NodePrepareResources answered:")?;
    for device in &devices {
        say(
            out,
            &format!(
                "request {:?} → {}/{}; CDI ids {:?}",
                device.request_names, device.pool_name, device.device_name, device.cdi_device_ids
            ),
        )?;
    }

    let spec_path = plugin.preparer.cdi_spec_path(&uid);
    let spec = std::fs::read_to_string(&spec_path)
        .with_context(|| format!("reading {}", spec_path.display()))?;
    step(
        out,
        7,
        &format!(
            "The CDI spec the container runtime will read, {}:",
            spec_path.display()
        ),
    )?;
    let pretty = serde_json::to_string_pretty(&serde_json::from_str::<serde_json::Value>(&spec)?)?;
    for line in pretty.lines() {
        say(out, line)?;
    }

    if let Some(addr) = plugin.http_addr {
        let ready = http_get(addr, "/readyz")
            .await
            .unwrap_or_else(|e| format!("unreachable: {e}"));
        let metrics = http_get(addr, "/metrics").await.unwrap_or_default();
        step(
            out,
            8,
            &format!("http://{addr}/readyz says: {}", ready.trim()),
        )?;
        for line in metrics.lines().filter(|l| {
            l.starts_with("gpu_dra_claims_prepared_total")
                || l.starts_with("gpu_dra_published_devices")
        }) {
            say(out, line)?;
        }
    }

    let unprepared = kubelet.unprepare(std::slice::from_ref(&claim_ref)).await?;
    if let Some(Err(error)) = unprepared.get(&uid) {
        bail!("unprepare failed: {error}");
    }
    step(
        out,
        9,
        &format!(
            "NodeUnprepareResources succeeded; CDI spec removed: {}",
            !spec_path.exists()
        ),
    )?;

    let sockets = [config.registration_socket(), config.dra_socket()];
    plugin.shutdown().await;
    step(
        out,
        10,
        &format!(
            "Plugin stopped; sockets removed: {}",
            sockets.iter().all(|s| !s.exists())
        ),
    )?;
    writeln!(out, "\nDemo complete.")?;
    Ok(())
}

async fn wait_for_slices(client: &kube::Client) -> Result<Vec<ResourceSlice>> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let slices = api
            .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
            .await?
            .items;
        if !slices.is_empty() {
            return Ok(slices);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no ResourceSlices published within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A minimal HTTP/1.0 GET, enough to show what /readyz and /metrics serve.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default())
}

fn step(out: &mut impl Write, number: u32, text: &str) -> std::io::Result<()> {
    writeln!(out, "\n[{number}] {text}")
}

fn say(out: &mut impl Write, text: &str) -> std::io::Result<()> {
    writeln!(out, "    {text}")
}
