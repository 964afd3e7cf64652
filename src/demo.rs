//! `gpu-dra demo`: the whole driver on one machine without a cluster or GPUs. It starts the in-process
//! API server double, the plugin with the fake backend and dynamic MIG, and the kubelet double, then
//! walks a whole-GPU claim and a MIG claim through publish → allocate → prepare (the MIG device is
//! created) → CDI spec → unprepare (it is destroyed), shows a time-sliced and an MPS claim, injects a GPU fault (taints, health stream) and
//! clears it, and ends with a pod that cannot fit and what `gpu-dra explain` says about it, saying
//! what happens at each step.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, PostParams};

use crate::devices::MigMode;
use crate::gpu::GpuBackend;
use crate::plugin::PluginConfig;
use crate::support::apiserver::ApiServer;
use crate::support::kubelet::{ClaimRef, KubeletDouble};
use crate::support::scheduler;

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

    let sockets = [config.registration_socket(), config.dra_socket()];
    plugin.shutdown().await;
    step(
        out,
        15,
        &format!(
            "Plugin stopped; sockets removed: {}",
            sockets.iter().all(|s| !s.exists())
        ),
    )?;
    writeln!(out, "\nDemo complete.")?;
    Ok(())
}

/// Step 8: a claim for a 1g.10gb MIG device, allocated, prepared (the MIG device is created), with its
/// CDI edits and the UUID the plugin reports in the claim's status. Returns the claim's UID.
async fn demo_mig_claim(
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
async fn demo_sharing(
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
async fn demo_explain(out: &mut impl Write, api: &ApiServer) -> Result<()> {
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
async fn create_and_allocate(
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
