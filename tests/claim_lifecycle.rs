//! A claim's life as one state machine, as the kubelet and a crash see it. A prepare is held right
//! after each thing it makes (MIG device created, GPU mode changed, tmpfs mounted, daemon Pod created,
//! domain joined, IOMMU group bound to vfio-pci, CDI spec written); the kubelet's call is cancelled there (its deadline), or the
//! plugin is killed with SIGKILL and started again; then the kubelet unprepares the claim, and nothing
//! may be left: no MIG device, daemon Pod, mount, MPS directory, GPU sharing mode, PCI function bound
//! to vfio-pci (or with a driver_override), CDI spec, checkpoint
//! entry or ComputeDomain status entry. A call answers within its budget while the work goes on, and
//! the kubelet's retry gets the outcome.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpu_dra::claims::checkpoint::CheckpointFile;
use gpu_dra::claims::lifecycle::holds;
use gpu_dra::claims::{checkpoint_path, Step};
use gpu_dra::devices::MigMode;
use gpu_dra::gpu::GpuBackend;
use gpu_dra::support::apiserver::ServerVersion;
use gpu_dra::support::harness::{Harness, PluginProcess, DRIVER, MIG_CLASS};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};
use gpu_dra::support::rack;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);
/// What the kubelet double waits before it cancels its call: the work goes on after it.
const IMPATIENT: Duration = Duration::from_millis(300);

/// `spec.devices` for one whole GPU shared through MPS: the prepare changes the GPU's compute mode,
/// mounts the claim's tmpfs, starts its daemon Pod and writes its spec.
fn mps_gpu() -> Value {
    json!({
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}
        }}}]
    })
}

/// `spec.devices` for one MIG device made for the claim (dynamic MIG).
fn dynamic_mig() -> Value {
    json!({"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS,
        "selectors": [{"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].profile == \"1g.10gb\"")}}]
    }}]})
}

/// `spec.devices` for the passthrough GPU (bound to vfio-pci with its IOMMU group).
fn vfio_gpu() -> Value {
    json!({"requests": [{"name": "vm", "exactly": {"deviceClassName": "vfio.gpu.dra.dev"}}]})
}

/// An eight-H100 node in dynamic MIG mode on a 1.35 API server (partitionable devices), whose last
/// GPU an admin's policy chose for passthrough.
async fn node() -> Harness {
    let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
    node.config.mig_mode = MigMode::Dynamic;
    node.api.insert(
        "gpunodepolicies",
        json!({
            "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuNodePolicy",
            "metadata": {"name": "vms", "generation": 1},
            "spec": {"passthrough": {"gpus": ["gpu-7"]}},
        }),
    );
    node
}

/// The claim `name` allocated with `devices`, once the node publishes what it needs.
async fn claim_for(node: &Harness, name: &str, devices: Value) -> ClaimRef {
    node.wait_for_whole_pool().await;
    node.allocated_claim_with(name, devices)
        .await
        .unwrap_or_else(|e| panic!("claim {name}: {e}"))
}

/// Everything the plugin may have made on the node, named; empty when nothing is left.
fn leftovers(node: &Harness) -> Vec<String> {
    let mut left = Vec::new();
    for (minor, start, uuid) in node.mig_devices() {
        left.push(format!("MIG device {uuid} on gpu-{minor} at slice {start}"));
    }
    for (uuid, mode) in node.fake_backend().sharing_modes() {
        left.push(format!("GPU {uuid} in sharing mode {mode}"));
    }
    let pci = node
        .fake_backend()
        .pci()
        .expect("fake /sys")
        .expect("a PCI bus");
    let devices = pci.root().join("bus/pci/devices");
    for function in std::fs::read_dir(&devices).into_iter().flatten().flatten() {
        let address = function.file_name().to_string_lossy().into_owned();
        if pci.driver(&address).ok().flatten().as_deref() == Some("vfio-pci") {
            left.push(format!("PCI function {address} bound to vfio-pci"));
        }
        let over =
            std::fs::read_to_string(function.path().join("driver_override")).unwrap_or_default();
        if over.trim() != "(null)" {
            left.push(format!(
                "PCI function {address} with driver_override {over:?}"
            ));
        }
    }
    for pod in node.api.list("pods") {
        let labels = &pod["metadata"]["labels"];
        if labels["app.kubernetes.io/name"] == "gpu-dra" {
            left.push(format!("Pod {}", pod["metadata"]["name"]));
        }
    }
    let root = node.dir.path();
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    for point in mounts.lines().filter_map(|line| line.split(' ').nth(1)) {
        if Path::new(point).starts_with(root) {
            left.push(format!("mount {point}"));
        }
    }
    for dir in ["mps", "imex", "dra-device-metadata"] {
        let path = node.config.plugin_dir().join(dir);
        for entry in std::fs::read_dir(&path).into_iter().flatten().flatten() {
            left.push(format!("directory {}", entry.path().display()));
        }
    }
    for spec in node.cdi_files() {
        left.push(format!("CDI spec {spec}"));
    }
    let checkpoint = CheckpointFile::new(checkpoint_path(&node.config.plugin_dir(), DRIVER)).load();
    if let Ok(Some(data)) = checkpoint {
        left.extend(
            data.claims
                .keys()
                .map(|uid| format!("checkpoint entry {uid}")),
        );
        left.extend(
            data.mig_devices_made
                .iter()
                .map(|made| format!("checkpoint MIG record {made:?}")),
        );
        left.extend(
            data.gpu_modes
                .keys()
                .map(|uuid| format!("checkpoint mode record {uuid}")),
        );
    }
    left
}

/// Waits until nothing is left (daemon Pods go once the kubelet ended them).
async fn nothing_left(node: &Harness, after: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = leftovers(node);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{after}, still on the node: {left:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn unprepared(kubelet: &KubeletDouble, claim: &ClaimRef) {
    let answers = kubelet
        .unprepare(std::slice::from_ref(claim))
        .await
        .expect("kubelet call");
    if let Some(Err(error)) = answers.get(&claim.uid) {
        panic!("unprepare failed: {error}");
    }
}

/// Holds the claim's prepare at `step`, lets the kubelet give up on the call there, then unprepares
/// the claim while the prepare is still held, lets it go on, and checks that nothing is left.
async fn cancelled_at(step: Step, devices: Value) {
    let node = node().await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let claim = claim_for(&node, "held", devices).await;
    let held = holds::hold(&claim.uid, step);

    let impatient = kubelet.clone().with_call_timeout(IMPATIENT);
    assert!(
        impatient
            .prepare(std::slice::from_ref(&claim))
            .await
            .is_err(),
        "the kubelet gave up on the call"
    );
    tokio::time::timeout(WAIT, held.reached())
        .await
        .unwrap_or_else(|_| panic!("the prepare never reached {}", step.as_str()));
    assert!(
        !leftovers(&node).is_empty(),
        "at {} something exists on the node",
        step.as_str()
    );

    // The kubelet's unprepare comes while the prepare is still held; it waits for it, then undoes it.
    let unprepare = tokio::spawn({
        let (kubelet, claim) = (kubelet.clone(), claim.clone());
        async move { unprepared(&kubelet, &claim).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release();
    unprepare.await.unwrap();
    nothing_left(
        &node,
        &format!(
            "a prepare cancelled at {} and then unprepared",
            step.as_str()
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_cancelled_after_the_mig_create_leaves_nothing_after_unprepare() {
    cancelled_at(Step::MigCreate, dynamic_mig()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_cancelled_after_the_mode_change_leaves_nothing_after_unprepare() {
    cancelled_at(Step::ModeChange, mps_gpu()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_cancelled_after_the_tmpfs_mount_leaves_nothing_after_unprepare() {
    cancelled_at(Step::TmpfsMount, mps_gpu()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_cancelled_after_the_daemon_pod_start_leaves_nothing_after_unprepare() {
    cancelled_at(Step::DaemonPodStart, mps_gpu()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_cancelled_after_the_spec_write_leaves_nothing_after_unprepare() {
    cancelled_at(Step::SpecWrite, mps_gpu()).await;
    cancelled_at(Step::SpecWrite, dynamic_mig()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passthrough_prepare_cancelled_after_the_bind_or_the_spec_write_gives_the_gpu_back() {
    cancelled_at(Step::VfioBind, vfio_gpu()).await;
    cancelled_at(Step::SpecWrite, vfio_gpu()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_prepare_finishes_in_the_background_and_the_retry_gets_it() {
    let node = node().await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let claim = claim_for(&node, "retried", mps_gpu()).await;
    let held = holds::hold(&claim.uid, Step::DaemonPodStart);
    let impatient = kubelet.clone().with_call_timeout(IMPATIENT);
    assert!(impatient
        .prepare(std::slice::from_ref(&claim))
        .await
        .is_err());
    tokio::time::timeout(WAIT, held.reached()).await.unwrap();
    held.release();

    // The retry waits for the work the first call started and answers with its devices: one daemon.
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let devices = answer[&claim.uid].clone().expect("the retry succeeds");
    assert_eq!(devices.len(), 1);
    let daemons: Vec<Value> = node
        .api
        .list("pods")
        .into_iter()
        .filter(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] == "mps-control-daemon")
        .collect();
    assert_eq!(daemons.len(), 1, "one daemon Pod: {daemons:#?}");
    assert_eq!(
        plugin.preparer.phase_of(&claim.uid),
        Some(gpu_dra::claims::Phase::Completed)
    );
    unprepared(&kubelet, &claim).await;
    nothing_left(&node, "the retried claim unprepared").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_answers_within_its_budget_while_the_work_goes_on() {
    let mut node = node().await;
    node.config.call_budget = Duration::from_secs(1);
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let claim = claim_for(&node, "slow", mps_gpu()).await;
    let held = holds::hold(&claim.uid, Step::DaemonPodStart);

    let began = Instant::now();
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let took = began.elapsed();
    let error = answer[&claim.uid].clone().unwrap_err();
    assert!(took < Duration::from_secs(5), "answered after {took:?}");
    assert!(
        error.contains("prepare has not finished within 1s")
            && error.contains("phase mpsDaemon")
            && error.contains("goes on in the background"),
        "{error}"
    );

    // A retry while the work is still held cannot take the claim's lock: it says so within its budget.
    let again = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert!(
        again[&claim.uid]
            .clone()
            .unwrap_err()
            .contains("goes on in the background"),
        "{again:?}"
    );
    held.release();
    let deadline = Instant::now() + WAIT;
    let devices = loop {
        let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
        match answer[&claim.uid].clone() {
            Ok(devices) => break devices,
            Err(error) if Instant::now() < deadline => {
                eprintln!("retry: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("{error}"),
        }
    };
    assert_eq!(devices.len(), 1);
    unprepared(&kubelet, &claim).await;
    nothing_left(&node, "the slow claim unprepared").await;
}

/// `gpu-dra plugin` as a process of its own for this node (dynamic MIG, MPS daemons in Pods), paused
/// for ever at `pause` (writing `marker` when it gets there) when given.
fn plugin_process(node: &Harness, pause: Option<(Step, &Path)>) -> PluginProcess {
    node.plugin_process(
        Path::new(env!("CARGO_BIN_EXE_gpu-dra")),
        &[
            "--mig-mode",
            "dynamic",
            "--mps-daemon-image",
            "gpu-dra:test",
        ],
        pause,
    )
}

async fn registered(node: &Harness) -> KubeletDouble {
    KubeletDouble::register(&node.config.registry_dir, DRIVER, WAIT)
        .await
        .expect("plugin registers")
}

/// Kills the plugin with SIGKILL right after `step` of the claim's prepare, starts it again, has the
/// kubelet unprepare the claim, and checks that nothing is left.
async fn killed_at(step: Step, devices: Value) {
    let node = node().await;
    let marker: PathBuf = node.dir.path().join("paused");
    let mut plugin = plugin_process(&node, Some((step, &marker)));
    let kubelet = registered(&node).await;
    let claim = claim_for(&node, "killed", devices).await;
    let call = tokio::spawn({
        let (kubelet, claim) = (kubelet.clone(), claim.clone());
        async move { kubelet.prepare(std::slice::from_ref(&claim)).await }
    });
    let deadline = Instant::now() + WAIT;
    while !marker.exists() {
        assert!(
            Instant::now() < deadline,
            "the prepare never reached {}",
            step.as_str()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    plugin.kill();
    assert!(
        !leftovers(&node).is_empty(),
        "at {} something exists on the node",
        step.as_str()
    );
    let _ = call.await;

    let mut restarted = plugin_process(&node, None);
    let kubelet = registered(&node).await;
    unprepared(&kubelet, &claim).await;
    nothing_left(
        &node,
        &format!(
            "a plugin killed at {} of a prepare, restarted, and the claim unprepared",
            step.as_str()
        ),
    )
    .await;
    restarted.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_at_each_step_of_an_mps_prepare_leaves_nothing_after_restart_and_unprepare()
{
    for step in [
        Step::ModeChange,
        Step::TmpfsMount,
        Step::DaemonPodStart,
        Step::SpecWrite,
    ] {
        killed_at(step, mps_gpu()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_after_a_mig_create_leaves_nothing_after_restart_and_unprepare() {
    killed_at(Step::MigCreate, dynamic_mig()).await;
    killed_at(Step::SpecWrite, dynamic_mig()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_after_a_vfio_bind_gives_the_gpu_back_after_restart_and_unprepare() {
    killed_at(Step::VfioBind, vfio_gpu()).await;
    killed_at(Step::SpecWrite, vfio_gpu()).await;
}

/// A one-tray rack in NVLink clique 0 with the controller, a domain of one node and its worker
/// scheduled: the worker's channel claim is allocated on the tray, not prepared yet.
struct DomainJob {
    api: gpu_dra::support::apiserver::ApiServer,
    rack: rack::Rack,
    controller: rack::RunningController,
    claim: ClaimRef,
}

const TEAM: &str = "team";
const TRAY: &str = "t0";

impl DomainJob {
    async fn start() -> DomainJob {
        let api = gpu_dra::support::apiserver::ApiServer::start()
            .await
            .expect("API server double");
        gpu_dra::support::harness::install_device_classes(&api);
        let rack =
            rack::Rack::start(&api, &[(TRAY, rack::Fabric::Clique(0))], "gpu-dra:test").await;
        let client = api.client();
        let controller = rack::RunningController::start(&client, Duration::from_millis(300));
        rack::create_gpus_template(&client, TEAM, "four-gpus", 4).await;
        rack::create_domain(&client, TEAM, "job", 1).await;
        let templates: kube::Api<k8s_openapi::api::resource::v1::ResourceClaimTemplate> =
            kube::Api::namespaced(client.clone(), TEAM);
        rack::wait_for("the channel template", WAIT, async || {
            templates.get_opt("job-channel").await.ok().flatten()
        })
        .await;
        rack::create_worker(&client, TEAM, "worker", "four-gpus", "job-channel").await;
        let node = rack
            .schedule(&client, TEAM, "worker")
            .await
            .unwrap_or_else(|why| panic!("the worker fits no node: {why}"));
        assert_eq!(node, TRAY);
        let claims: kube::Api<k8s_openapi::api::resource::v1::ResourceClaim> =
            kube::Api::namespaced(client.clone(), TEAM);
        let channel = claims
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|claim| {
                gpu_dra::claims::allocation_results(claim)
                    .iter()
                    .any(|r| r.device == "imex-channel-0")
            })
            .expect("the worker's channel claim");
        let claim = ClaimRef::new(
            TEAM,
            channel.metadata.name.as_deref().unwrap_or_default(),
            channel.metadata.uid.clone().unwrap_or_default(),
        );
        DomainJob {
            api,
            rack,
            controller,
            claim,
        }
    }

    fn tray(&self) -> &rack::RackNode {
        self.rack.node(TRAY)
    }

    /// What the tray's plugin may have made for the channel claim, named; empty when nothing is left.
    async fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        let domain = rack::domain(&self.api.client(), TEAM, "job").await;
        for entry in &domain.status.nodes {
            left.push(format!("status entry of {} ({})", entry.name, entry.status));
        }
        for pod in self.api.list("pods") {
            if pod["metadata"]["labels"]["app.kubernetes.io/component"] == "imex-daemon" {
                left.push(format!("IMEX daemon Pod {}", pod["metadata"]["name"]));
            }
        }
        let config = &self.tray().config;
        let spec =
            gpu_dra::cdi::CdiRegistry::new(&config.cdi_root, DRIVER).spec_path(&self.claim.uid);
        if spec.exists() {
            left.push(format!("CDI spec {}", spec.display()));
        }
        let checkpoint = CheckpointFile::new(checkpoint_path(&config.plugin_dir(), DRIVER)).load();
        if let Ok(Some(data)) = checkpoint {
            if data.claims.contains_key(&self.claim.uid) {
                left.push(format!("checkpoint entry {}", self.claim.uid));
            }
        }
        left
    }

    async fn nothing_left(&self, after: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = self.leftovers().await;
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "{after}, still there: {left:#?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(self) {
        self.controller.stop().await;
        self.rack.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prepare_cancelled_after_the_domain_join_leaves_nothing_after_unprepare() {
    let job = DomainJob::start().await;
    let claim = job.claim.clone();
    let held = holds::hold(&claim.uid, Step::DomainJoin);
    let kubelet = job.tray().kubelet.clone();
    let impatient = kubelet.clone().with_call_timeout(IMPATIENT);
    assert!(impatient
        .prepare(std::slice::from_ref(&claim))
        .await
        .is_err());
    tokio::time::timeout(WAIT, held.reached())
        .await
        .expect("the prepare reaches the domain join");
    assert!(
        !job.leftovers().await.is_empty(),
        "joined: the tray's entry and daemon exist"
    );
    let unprepare = tokio::spawn({
        let claim = claim.clone();
        async move { unprepared(&kubelet, &claim).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release();
    unprepare.await.unwrap();
    job.nothing_left("a prepare cancelled at domain-join and then unprepared")
        .await;
    job.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plugin_stopped_dead_after_the_domain_join_leaves_the_domain_at_restart() {
    let mut job = DomainJob::start().await;
    let claim = job.claim.clone();
    let held = holds::hold(&claim.uid, Step::DomainJoin);
    let impatient = job.tray().kubelet.clone().with_call_timeout(IMPATIENT);
    assert!(impatient
        .prepare(std::slice::from_ref(&claim))
        .await
        .is_err());
    tokio::time::timeout(WAIT, held.reached())
        .await
        .expect("the prepare reaches the domain join");
    // The held prepare never goes on, as in a process killed there: only its record on file speaks
    // for it. A new plugin starts on the same directories.
    std::mem::forget(held);
    job.rack.restart_plugin(TRAY).await;
    let kubelet = job.tray().kubelet.clone();
    unprepared(&kubelet, &claim).await;
    job.nothing_left("a plugin stopped dead at domain-join, restarted, and the claim unprepared")
        .await;
    job.stop().await;
}
