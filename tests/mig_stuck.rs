//! Dynamic MIG when the GPU driver misbehaves: a MIG create or destroy that does not return (an NVML
//! call stuck in the driver) must fail its claim in bounded time, mark that GPU stuck with what is
//! stuck, hold up no other GPU (neither its MIG devices nor its sharing changes), make later
//! operations on the stuck GPU fail at once, and, once the call returns, leave nothing behind: the
//! MIG device a late create made is adopted by the kubelet's retry, or destroyed by the next start.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{FakeProfile, GpuSharingMode, TimeSliceInterval};
use gpu_dra::plugin::RunningPlugin;
use gpu_dra::support::apiserver::ServerVersion;
use gpu_dra::support::harness::{Harness, DRIVER, MIG_CLASS};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};

/// The bound on each MIG operation in these tests.
const BOUND: Duration = Duration::from_secs(1);
/// What "fails at once" means here: well under the bound.
const AT_ONCE: Duration = Duration::from_millis(500);

/// A node of three H100s in dynamic MIG mode, from a profile file the test edits.
struct Node {
    harness: Harness,
    path: PathBuf,
    profile: FakeProfile,
}

impl Node {
    async fn new() -> Node {
        let mut harness = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
        let mut profile = gpu_dra::gpu::builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(3);
        let path = harness.dir.path().join("node.yaml");
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        harness.config.backend = gpu_dra::plugin::BackendChoice::Fake {
            profile: path.display().to_string(),
            state_file: Some(harness.dir.path().join("state.json")),
        };
        harness.config.mig_mode = MigMode::Dynamic;
        harness.config.mig_timeout = BOUND;
        Node {
            harness,
            path,
            profile,
        }
    }

    /// Starts the plugin and the kubelet, once the whole pool (MIG devices included) is published.
    async fn start(&self) -> (RunningPlugin, KubeletDouble) {
        let plugin = self.harness.start_plugin().await;
        let kubelet = self.harness.kubelet().await;
        self.harness.wait_for_whole_pool().await;
        (plugin, kubelet)
    }

    /// Sets or clears `migHangs` on the GPU with this minor.
    /// Sets or clears `migHangs` on the GPU with this minor, replacing the file at once (the plugin
    /// reads it at any moment).
    fn set_mig_hangs(&mut self, minor: usize, hangs: bool) {
        self.profile.gpus[minor].mig_hangs = hangs;
        let next = self.path.with_extension("yaml.next");
        std::fs::write(&next, serde_yaml::to_string(&self.profile).unwrap()).unwrap();
        std::fs::rename(&next, &self.path).unwrap();
    }

    /// MIG devices on GPU `minor` now, as (placement start, UUID).
    fn mig_devices_on(&self, minor: u32) -> Vec<(u32, String)> {
        self.harness
            .mig_devices()
            .into_iter()
            .filter(|(parent, _, _)| *parent == minor)
            .map(|(_, start, uuid)| (start, uuid))
            .collect()
    }

    fn spec(&self, claim: &ClaimRef) -> Option<String> {
        std::fs::read_to_string(
            self.harness
                .cdi_dir()
                .join(format!("k8s.{DRIVER}-gpu_{}.json", claim.uid)),
        )
        .ok()
    }

    /// The device the scheduler gave the claim.
    async fn allocated_device(&self, claim: &ClaimRef) -> String {
        let claims: kube::Api<ResourceClaim> =
            kube::Api::namespaced(self.harness.api.client(), "default");
        let stored = claims.get(&claim.name).await.unwrap();
        stored
            .status
            .and_then(|s| s.allocation)
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .expect("the claim is allocated")[0]
            .device
            .clone()
    }
}

/// `spec.devices` for one 1g.10gb MIG device on the GPU with this minor.
fn mig_on(minor: u32) -> Value {
    json!({"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS,
        "selectors": [{"cel": {"expression": format!(
            "device.attributes[\"{DRIVER}\"].profile == \"1g.10gb\" && device.attributes[\"{DRIVER}\"].minor == {minor}"
        )}}]
    }}]})
}

/// `spec.devices` for the whole GPU with this minor, time-sliced.
fn time_sliced_gpu(minor: u32) -> Value {
    let config = json!({
        "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
    });
    json!({
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER, "selectors": [{"cel": {
            "expression": format!("device.attributes[\"{DRIVER}\"].minor == {minor}")}}]}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": config}}]
    })
}

/// The memory slice a MIG device name (`gpu-0-mig-1g10gb-3`) starts at.
fn start_of(device: &str) -> u32 {
    device.rsplit('-').next().unwrap().parse().unwrap()
}

async fn prepare(kubelet: &KubeletDouble, claim: &ClaimRef) -> Result<(), String> {
    kubelet.prepare(std::slice::from_ref(claim)).await.unwrap()[&claim.uid]
        .clone()
        .map(|_| ())
}

async fn unprepare(kubelet: &KubeletDouble, claim: &ClaimRef) -> Result<(), String> {
    kubelet
        .unprepare(std::slice::from_ref(claim))
        .await
        .unwrap()[&claim.uid]
        .clone()
}

/// Waits until no GPU is stuck any more (the hung call returned).
async fn until_nothing_is_stuck(plugin: &RunningPlugin) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !plugin.preparer.stuck_gpus().is_empty() {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            plugin.preparer.stuck_gpus()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn stuck_gauge(plugin: &RunningPlugin, gpu: &str) -> Option<String> {
    let needle = format!("gpu_dra_gpu_operation_stuck{{gpu=\"{gpu}\"}} ");
    plugin
        .metrics
        .encode()
        .lines()
        .find_map(|line| line.strip_prefix(&needle).map(str::to_string))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_create_that_hangs_fails_its_claim_in_time_and_holds_up_no_other_gpu() {
    let mut node = Node::new().await;
    let (plugin, kubelet) = node.start().await;
    let stuck = node
        .harness
        .allocated_claim_with("stuck", mig_on(0))
        .await
        .unwrap();
    let other_mig = node
        .harness
        .allocated_claim_with("other-mig", mig_on(1))
        .await
        .unwrap();
    let other_gpu = node
        .harness
        .allocated_claim_with("other-gpu", time_sliced_gpu(2))
        .await
        .unwrap();
    let device = node.allocated_device(&stuck).await;
    let start = start_of(&device);
    node.set_mig_hangs(0, true);

    // All three in one call, as for one pod: the stuck GPU's claim fails once the bound is reached,
    // naming the GPU and the create; a MIG device on another GPU is made, and another GPU's sharing
    // mode is set, meanwhile.
    let started = Instant::now();
    let answers = tokio::time::timeout(
        Duration::from_secs(20),
        kubelet.prepare(&[stuck.clone(), other_mig.clone(), other_gpu.clone()]),
    )
    .await
    .expect("the kubelet's call returns although a GPU is stuck")
    .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    answers[&other_mig.uid]
        .as_ref()
        .expect("a MIG device on gpu-1 is made");
    assert_eq!(node.mig_devices_on(1).len(), 1);
    answers[&other_gpu.uid]
        .as_ref()
        .expect("gpu-2 is time-sliced");
    assert_eq!(
        node.harness
            .fake_backend()
            .sharing_modes()
            .get(&node.harness.gpu_uuid("gpu-2")),
        Some(&GpuSharingMode::TimeSlice(TimeSliceInterval::Long))
    );
    let error = answers[&stuck.uid]
        .as_ref()
        .expect_err("the stuck GPU's claim fails");
    for part in [
        "ResourceClaim default/stuck".to_string(),
        format!("MIG device {device}"),
        format!(
            "gpu-0: creating MIG device 1g.10gb at memory slice {start} did not return within 1s"
        ),
    ] {
        assert!(error.contains(&part), "{error:?} lacks {part:?}");
    }
    assert!(node.spec(&stuck).is_none());

    // The GPU is reported stuck, with what is stuck.
    let gpu0 = node.harness.gpu_uuid("gpu-0");
    let reported = plugin.preparer.stuck_gpus();
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert_eq!(reported[0].0, gpu0);
    assert!(
        reported[0].1.starts_with(&format!(
            "gpu-0: creating MIG device 1g.10gb at memory slice {start} has not returned for"
        )),
        "{reported:?}"
    );
    assert_eq!(stuck_gauge(&plugin, "gpu-0").as_deref(), Some("1"));

    // Another claim on that GPU, and the kubelet's retry, fail at once, naming what is stuck.
    let second = node
        .harness
        .allocated_claim_with("second", mig_on(0))
        .await
        .unwrap();
    for claim in [&second, &stuck] {
        let started = Instant::now();
        let error = prepare(&kubelet, claim).await.expect_err("still stuck");
        assert!(started.elapsed() < AT_ONCE, "{:?}", started.elapsed());
        let expected = format!(
            "gpu-0: an earlier create of MIG device 1g.10gb at memory slice {start} has not returned for"
        );
        assert!(error.contains(&expected), "{error:?} lacks {expected:?}");
    }

    // The create returns, late, having made the MIG device.
    node.set_mig_hangs(0, false);
    until_nothing_is_stuck(&plugin).await;
    assert_eq!(stuck_gauge(&plugin, "gpu-0").as_deref(), Some("0"));
    let late = node.mig_devices_on(0);
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0].0, start);

    // The GPU works again: the retry adopts the device the late create made, and the other claim
    // gets one of its own.
    prepare(&kubelet, &stuck).await.expect("the retry succeeds");
    assert!(node.spec(&stuck).unwrap().contains(&late[0].1));
    prepare(&kubelet, &second)
        .await
        .expect("the GPU takes creates again");
    assert_eq!(node.mig_devices_on(0).len(), 2);

    // Nothing is leaked: unprepare destroys both.
    for claim in [&stuck, &second, &other_mig] {
        unprepare(&kubelet, claim).await.unwrap();
    }
    assert!(
        node.harness.mig_devices().is_empty(),
        "{:?}",
        node.harness.mig_devices()
    );
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_device_a_late_create_made_for_a_claim_that_is_gone_is_destroyed_at_the_next_start() {
    let mut node = Node::new().await;
    let (plugin, kubelet) = node.start().await;
    let claim = node
        .harness
        .allocated_claim_with("gone", mig_on(0))
        .await
        .unwrap();
    node.set_mig_hangs(0, true);
    let error = prepare(&kubelet, &claim)
        .await
        .expect_err("the create hangs");
    assert!(error.contains("did not return within 1s"), "{error}");

    // The pod is deleted: the kubelet unprepares the claim it never prepared.
    unprepare(&kubelet, &claim).await.unwrap();
    node.set_mig_hangs(0, false);
    until_nothing_is_stuck(&plugin).await;
    let late = node.mig_devices_on(0);
    assert_eq!(late.len(), 1, "the late create made the device: {late:?}");

    // It was recorded before the create, so the next start's sweep destroys it.
    plugin.shutdown().await;
    let plugin = node.harness.start_plugin().await;
    assert_eq!(
        plugin.recovery.mig_devices_destroyed,
        vec![late[0].1.clone()]
    );
    assert!(plugin.recovery.mig_devices_left_alone.is_empty());
    assert!(node.harness.mig_devices().is_empty());
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_destroy_that_hangs_fails_the_unprepare_in_time_and_the_retry_after_it_returns_succeeds(
) {
    let mut node = Node::new().await;
    let (plugin, kubelet) = node.start().await;
    let claim = node
        .harness
        .allocated_claim_with("claim", mig_on(0))
        .await
        .unwrap();
    let other = node
        .harness
        .allocated_claim_with("other", mig_on(1))
        .await
        .unwrap();
    prepare(&kubelet, &claim).await.unwrap();
    let made = node.mig_devices_on(0);
    assert_eq!(made.len(), 1);
    let uuid = made[0].1.clone();
    node.set_mig_hangs(0, true);

    // The unprepare fails once the bound is reached, naming the GPU and the destroy; the claim stays
    // recorded, with its CDI spec, for the kubelet's retry.
    let started = Instant::now();
    let error = tokio::time::timeout(Duration::from_secs(20), unprepare(&kubelet, &claim))
        .await
        .expect("the kubelet's call returns although the GPU is stuck")
        .expect_err("the destroy hangs");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let expected = format!("gpu-0: destroying MIG device {uuid} did not return within 1s");
    assert!(error.contains("ResourceClaim default/claim"), "{error}");
    assert!(error.contains(&expected), "{error:?} lacks {expected:?}");
    assert!(plugin.preparer.prepared_claims().contains_key(&claim.uid));
    assert!(node.spec(&claim).is_some());
    let reported = plugin.preparer.stuck_gpus();
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(
        reported[0].1.starts_with(&format!(
            "gpu-0: destroying MIG device {uuid} has not returned for"
        )),
        "{reported:?}"
    );

    // Another GPU makes its MIG device meanwhile; the retry fails at once, naming what is stuck.
    prepare(&kubelet, &other)
        .await
        .expect("gpu-1 is not held up");
    let started = Instant::now();
    let error = unprepare(&kubelet, &claim).await.expect_err("still stuck");
    assert!(started.elapsed() < AT_ONCE, "{:?}", started.elapsed());
    let expected = format!("gpu-0: an earlier destroy of MIG device {uuid} has not returned for");
    assert!(error.contains(&expected), "{error:?} lacks {expected:?}");
    assert!(plugin.preparer.prepared_claims().contains_key(&claim.uid));

    // It returns; the kubelet's retry finishes the unprepare.
    node.set_mig_hangs(0, false);
    until_nothing_is_stuck(&plugin).await;
    unprepare(&kubelet, &claim)
        .await
        .expect("the retry succeeds");
    assert!(!plugin.preparer.prepared_claims().contains_key(&claim.uid));
    assert!(node.spec(&claim).is_none());
    assert!(node.mig_devices_on(0).is_empty());
    unprepare(&kubelet, &other).await.unwrap();
    assert!(node.harness.mig_devices().is_empty());

    // Nothing of it is left for the next start either.
    plugin.shutdown().await;
    let plugin = node.harness.start_plugin().await;
    assert!(plugin.recovery.mig_devices_destroyed.is_empty());
    assert!(plugin.recovery.mig_devices_left_alone.is_empty());
    plugin.shutdown().await;
}
