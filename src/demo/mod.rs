//! `gpu-dra demo`: the whole driver on one machine without a cluster or GPUs. It starts the in-process
//! API server double, the plugin with the fake backend and dynamic MIG, and the kubelet double, then
//! walks a whole-GPU claim and a MIG claim through publish → allocate → prepare (the MIG device is
//! created) → CDI spec → unprepare (it is destroyed), shows a time-sliced and an MPS claim, injects a GPU fault (taints, health stream) and
//! clears it, shows a pod that cannot fit and what `gpu-dra explain` says about it, and ends with a
//! ComputeDomain job on a small rack of GB200 trays in two NVLink cliques (`domains.rs`), saying what
//! happens at each step.

mod claims;
mod domains;

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams};

use crate::devices::MigMode;
use crate::gpu::GpuBackend;
use crate::plugin::PluginConfig;
use crate::support::apiserver::ApiServer;
use crate::support::kubelet::{ClaimRef, KubeletDouble};

use claims::{create_and_allocate, demo_explain, demo_mig_claim, demo_sharing};

const NODE: &str = "demo-node";
const DRIVER: &str = "gpu.dra.dev";
const NAMESPACE: &str = "default";
const CLAIM: &str = "one-gpu";
const MIG_CLAIM: &str = "small-mig";
const SLICED_CLAIM: &str = "time-sliced";
const MPS_CLAIM: &str = "mps";

pub async fn run(out: &mut impl Write) -> Result<()> {
    // Short: MPS daemons' socket paths under it must fit the 107 bytes a unix socket allows.
    let workdir = tempfile::Builder::new().prefix("gd-").tempdir()?;
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

    // The fake profile as a file, so that step 11 can inject a fault by editing it.
    let profile_path = root.join("node-profile.yaml");
    let mut profile = crate::gpu::builtin_profile("dgx-h100").context("built-in profile")?;
    std::fs::write(&profile_path, serde_yaml::to_string(&profile)?)?;
    let profile_arg = profile_path.display().to_string();
    let config = PluginConfig {
        http_addr: Some(([127, 0, 0, 1], 0).into()),
        mig_mode: MigMode::Dynamic,
        // The plugin runs MPS daemons in Pods of its own image; the runner below plays the kubelet.
        mps: crate::plugin::MpsConfig {
            image: Some("gpu-dra:demo".to_string()),
            ..Default::default()
        },
        ..PluginConfig::fake_node_under(root, DRIVER, NODE, &profile_arg)
    };
    let _pod_runner = crate::support::pod_runner::PodRunner::start(
        api.handle(),
        NODE,
        crate::support::pod_runner::PodRunner::binary(),
    );
    let plugin = crate::plugin::start(config.clone(), api.client()).await?;
    step(
        out,
        2,
        "Started the plugin with the fake backend (profile dgx-h100: 8x H100 80GB) and dynamic MIG",
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
    say(
        out,
        &format!(
            "dialled by its raw path, as the kubelet does: HTTP/2 :authority {}",
            crate::support::grpc_dial::encode_authority(
                &config.registration_socket().to_string_lossy()
            )
        ),
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
    let counter_sets = slices
        .iter()
        .flat_map(|s| s.spec.shared_counters.clone().unwrap_or_default())
        .count();
    step(
        out,
        4,
        &format!(
            "The plugin published {} ResourceSlice(s) with {} devices and {counter_sets} counter sets for pool {NODE}:",
            slices.len(),
            devices.len(),
        ),
    )?;
    say(
        out,
        "each GPU: the whole GPU and every MIG profile at every placement, all consuming the GPU's counter set",
    )?;
    let first_gpu: Vec<_> = devices
        .iter()
        .filter(|d| d.name == "gpu-0" || d.name.starts_with("gpu-0-"))
        .cloned()
        .collect();
    for line in crate::devices::table(&first_gpu).lines() {
        say(out, line)?;
    }
    say(out, "... and the same for gpu-1 to gpu-7")?;

    let (uid, allocated) = create_and_allocate(
        &api,
        CLAIM,
        serde_json::json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}),
    )
    .await?;
    let result = crate::claims::allocation_results(&allocated)
        .first()
        .context("the claim has no allocation result")?;
    step(
        out,
        5,
        &format!(
            "Created ResourceClaim {NAMESPACE}/{CLAIM} (uid {uid}); the allocator behind `gpu-dra selectors allocate`\n    (the scheduler's rules: class selectors in CEL, counters, taints) gave request {:?} device {}/{}",
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

    let mig_uid = demo_mig_claim(out, &api, &kubelet, &plugin).await?;
    let shared = demo_sharing(out, &api, &kubelet, &plugin, &profile_arg, root).await?;

    if let Some(addr) = plugin.http_addr {
        let ready = http_get(addr, "/readyz")
            .await
            .unwrap_or_else(|e| format!("unreachable: {e}"));
        let metrics = http_get(addr, "/metrics").await.unwrap_or_default();
        step(
            out,
            10,
            &format!("http://{addr}/readyz says: {}", ready.trim()),
        )?;
        for line in metrics.lines().filter(|l| {
            l.starts_with("gpu_dra_claims_prepared_total")
                || l.starts_with("gpu_dra_published_devices")
        }) {
            say(out, line)?;
        }
    }

    let mig_ref = ClaimRef::new(NAMESPACE, MIG_CLAIM, mig_uid.clone());
    let mut done = vec![claim_ref.clone(), mig_ref.clone()];
    done.extend(shared.iter().cloned());
    let unprepared = kubelet.unprepare(&done).await?;
    for answer in unprepared.values() {
        if let Err(error) = answer {
            bail!("unprepare failed: {error}");
        }
    }
    let mig_left = crate::gpu::FakeBackend::with_state_file(
        NODE,
        &profile_arg,
        Some(root.join("fake-gpu-state.json")),
    )?
    .inventory()?
    .gpus
    .iter()
    .filter_map(|g| g.mig.as_ref())
    .map(|m| m.instances.len())
    .sum::<usize>();
    let modes_left = crate::gpu::FakeBackend::with_state_file(
        NODE,
        &profile_arg,
        Some(root.join("fake-gpu-state.json")),
    )?
    .sharing_modes()
    .len();
    let daemons_left = std::fs::read_dir(plugin.config.plugin_dir().join("mps"))
        .map(|dir| dir.count())
        .unwrap_or(0);
    step(
        out,
        11,
        &format!(
            "NodeUnprepareResources succeeded for all four claims; CDI specs removed: {}; MIG devices left: {mig_left};\n    GPUs not in their default sharing mode: {modes_left}; MPS daemons left: {daemons_left}",
            !spec_path.exists() && !plugin.preparer.cdi_spec_path(&mig_uid).exists()
        ),
    )?;

    let mut health = kubelet.watch_health().await?;
    profile.gpus[5].faults = vec![crate::gpu::FakeFault {
        kind: crate::gpu::FakeFaultKind::Xid,
        xid: Some(79),
        mig_start: None,
    }];
    std::fs::write(&profile_path, serde_yaml::to_string(&profile)?)?;
    let tainted = wait_for_taints(&api.client(), |n| n > 0).await?;
    step(
        out,
        12,
        "Injected XID 79 (GPU fallen off the bus) on gpu-5 by editing the fake profile:",
    )?;
    say(
        out,
        &format!("{tainted} devices (gpu-5 and all its MIG devices) now carry the taint gpu.dra.dev/xid=79:NoExecute"),
    )?;
    loop {
        let Some(list) = health.next().await? else {
            bail!("the health stream ended");
        };
        if let Some(device) = list
            .iter()
            .find(|d| d.device == "gpu-5" && !d.message.is_empty())
        {
            say(
                out,
                &format!(
                    "kubelet health stream: {} {:?}: {}",
                    device.device, device.health, device.message
                ),
            )?;
            break;
        }
    }
    profile.gpus[5].faults.clear();
    std::fs::write(&profile_path, serde_yaml::to_string(&profile)?)?;
    let left = wait_for_taints(&api.client(), |n| n == 0).await?;
    step(
        out,
        13,
        &format!("Removed the fault (the GPU recovered): devices with taints: {left}"),
    )?;

    demo_explain(out, &api).await?;

    domains::demo_compute_domain(out, &api, 15).await?;

    let sockets = [config.registration_socket(), config.dra_socket()];
    plugin.shutdown().await;
    step(
        out,
        21,
        &format!(
            "Plugin stopped; sockets removed: {}",
            sockets.iter().all(|s| !s.exists())
        ),
    )?;
    writeln!(out, "\nDemo complete.")?;
    Ok(())
}

/// Waits until the number of tainted devices in the node's slices satisfies `done`; returns it.
async fn wait_for_taints(client: &kube::Client, done: impl Fn(usize) -> bool) -> Result<usize> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let tainted = api
            .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
            .await?
            .items
            .iter()
            .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
            .filter(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
            .count();
        if done(tainted) {
            return Ok(tainted);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the taints did not change within 10 s ({tainted} tainted devices)");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the node's pool is complete: every slice of its newest generation is there.
async fn wait_for_slices(client: &kube::Client) -> Result<Vec<ResourceSlice>> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let slices = api
            .list(&ListParams::default().fields(&format!("spec.nodeName={NODE}")))
            .await?
            .items;
        let newest = slices.iter().map(|s| s.spec.pool.generation).max();
        let current: Vec<ResourceSlice> = slices
            .into_iter()
            .filter(|s| Some(s.spec.pool.generation) == newest)
            .collect();
        if current
            .first()
            .is_some_and(|s| s.spec.pool.resource_slice_count == current.len() as i64)
        {
            return Ok(current);
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
