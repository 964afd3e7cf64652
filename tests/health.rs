//! Faults end to end: a fault injected through the fake profile becomes a taint on the affected devices
//! in the API server and UNHEALTHY on the kubelet's health stream; removing it clears both without a
//! restart; informational XIDs follow the server version; bursts are coalesced; MIG faults stay on the
//! MIG device; the admin's policy changes effects while the plugin runs.

use std::time::{Duration, Instant};

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{FakeFault, FakeFaultKind, FakeProfile};
use gpu_dra::health::{HealthPolicy, TaintEffect};
use gpu_dra::plugin::NodePolicy;
use gpu_dra::support::apiserver::ServerVersion;
use gpu_dra::support::harness::{Harness, NODE};
use gpu_dra::support::kubelet::{DeviceHealth, HealthStatus, HealthWatch};
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

const WAIT: Duration = Duration::from_secs(10);

struct Node {
    harness: Harness,
    path: std::path::PathBuf,
    profile: FakeProfile,
}

impl Node {
    async fn new(gpus: usize, version: ServerVersion, mig_mode: MigMode) -> Node {
        let mut harness = Harness::with_version("dgx-h100", version).await;
        let mut profile = gpu_dra::gpu::builtin_profile("dgx-h100").unwrap();
        profile.gpus.truncate(gpus);
        let path = harness.dir.path().join("faults.yaml");
        std::fs::write(&path, serde_yaml::to_string(&profile).unwrap()).unwrap();
        harness.config.backend = gpu_dra::plugin::BackendChoice::Fake {
            profile: path.display().to_string(),
            state_file: Some(harness.dir.path().join("state.json")),
        };
        harness.config.mig_mode = mig_mode;
        Node {
            harness,
            path,
            profile,
        }
    }

    fn set_faults(&mut self, gpu: usize, faults: Vec<FakeFault>) {
        self.profile.gpus[gpu].faults = faults;
        std::fs::write(&self.path, serde_yaml::to_string(&self.profile).unwrap()).unwrap();
    }

    async fn devices_where(&self, check: impl Fn(&[Device]) -> bool) -> Vec<Device> {
        let deadline = Instant::now() + WAIT;
        loop {
            let slices: Vec<ResourceSlice> = self
                .harness
                .api
                .list("resourceslices")
                .into_iter()
                .map(|v| serde_json::from_value(v).unwrap())
                .collect();
            let devices: Vec<Device> = slices
                .iter()
                .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
                .collect();
            if !devices.is_empty() && check(&devices) {
                return devices;
            }
            assert!(
                Instant::now() < deadline,
                "devices never got there: {devices:#?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn xid(number: u64) -> FakeFault {
    FakeFault {
        kind: FakeFaultKind::Xid,
        xid: Some(number),
        mig_start: None,
    }
}

fn taints(devices: &[Device], name: &str) -> Vec<(String, Option<String>, String)> {
    devices
        .iter()
        .find(|d| d.name == name)
        .and_then(|d| d.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|t| (t.key, t.value, t.effect))
        .collect()
}

async fn next_where(
    watch: &mut HealthWatch,
    check: impl Fn(&[DeviceHealth]) -> bool,
) -> Vec<DeviceHealth> {
    let deadline = Instant::now() + WAIT;
    loop {
        let list = tokio::time::timeout(WAIT, watch.next())
            .await
            .expect("a health update in time")
            .expect("a healthy stream")
            .expect("the stream stays open");
        if check(&list) {
            return list;
        }
        assert!(
            Instant::now() < deadline,
            "health never got there: {list:#?}"
        );
    }
}

fn health_of<'a>(list: &'a [DeviceHealth], device: &str) -> &'a DeviceHealth {
    list.iter().find(|d| d.device == device).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_taints_the_gpu_and_reports_it_unhealthy_until_it_clears() {
    let mut node = Node::new(2, ServerVersion::V1_35, MigMode::Static).await;
    let plugin = node.harness.start_plugin().await;
    let kubelet = node.harness.kubelet().await;
    let mut health = kubelet.watch_health().await.unwrap();
    let first = next_where(&mut health, |l| l.len() == 2).await;
    assert!(first
        .iter()
        .all(|d| d.health == HealthStatus::Healthy && d.pool == NODE));
    node.devices_where(|d| d.len() == 2).await;

    node.set_faults(1, vec![xid(79)]);
    let devices = node.devices_where(|d| !taints(d, "gpu-1").is_empty()).await;
    assert_eq!(
        taints(&devices, "gpu-1"),
        vec![(
            "gpu.dra.dev/xid".into(),
            Some("79".into()),
            "NoExecute".into()
        )]
    );
    assert!(taints(&devices, "gpu-0").is_empty());
    let list = next_where(&mut health, |l| {
        health_of(l, "gpu-1").health == HealthStatus::Unhealthy
    })
    .await;
    assert!(health_of(&list, "gpu-1").message.contains("79"), "{list:?}");
    assert_eq!(health_of(&list, "gpu-0").health, HealthStatus::Healthy);
    let metrics = plugin.metrics.encode();
    assert!(
        metrics.contains("gpu_dra_faults_total{kind=\"xid_79\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpu_dra_device_healthy{device=\"gpu-1\"} 0"),
        "{metrics}"
    );

    // Removing the fault from the profile is the GPU recovering: the taint goes, without a restart.
    node.set_faults(1, Vec::new());
    node.devices_where(|d| taints(d, "gpu-1").is_empty()).await;
    next_where(&mut health, |l| {
        l.iter().all(|d| d.health == HealthStatus::Healthy)
    })
    .await;
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn informational_xids_taint_with_effect_none_from_1_35_and_not_at_all_on_1_34() {
    for (version, expected) in [
        (
            ServerVersion::V1_35,
            vec![(
                "gpu.dra.dev/xid".to_string(),
                Some("13".to_string()),
                "None".to_string(),
            )],
        ),
        (ServerVersion::V1_34, vec![]),
    ] {
        let mut node = Node::new(1, version, MigMode::Static).await;
        let plugin = node.harness.start_plugin().await;
        node.devices_where(|d| d.len() == 1).await;
        // A fatal fault on the same node shows the fault was seen before checking the XID 13 taint.
        node.set_faults(
            0,
            vec![
                xid(13),
                FakeFault {
                    kind: FakeFaultKind::DoubleBitEcc,
                    xid: None,
                    mig_start: None,
                },
            ],
        );
        let devices = node
            .devices_where(|d| taints(d, "gpu-0").iter().any(|t| t.0 == "gpu.dra.dev/ecc"))
            .await;
        let informational: Vec<_> = taints(&devices, "gpu-0")
            .into_iter()
            .filter(|t| t.0 == "gpu.dra.dev/xid")
            .collect();
        assert_eq!(informational, expected, "{version:?}");
        plugin.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_faults_makes_at_most_two_slice_writes() {
    let mut node = Node::new(2, ServerVersion::V1_35, MigMode::Static).await;
    let plugin = node.harness.start_plugin().await;
    node.devices_where(|d| d.len() == 2).await;
    tokio::time::sleep(Duration::from_millis(1100)).await; // past the initial publish's window
    node.harness.api.clear_requests();
    let started = Instant::now();
    for (i, number) in [48u64, 63, 74, 92, 94, 95, 119, 120].iter().enumerate() {
        node.set_faults(i % 2, vec![xid(*number)]);
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    // The last state arrives, and the whole burst cost at most two writes.
    node.devices_where(|d| {
        taints(d, "gpu-0")
            .first()
            .is_some_and(|t| t.1.as_deref() == Some("119"))
            && taints(d, "gpu-1")
                .first()
                .is_some_and(|t| t.1.as_deref() == Some("120"))
    })
    .await;
    assert!(
        node.harness.api.writes("resourceslices") <= 2,
        "{:?}",
        node.harness.api.requests()
    );
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_fault_taints_only_that_mig_device() {
    let mut node = Node::new(1, ServerVersion::V1_35, MigMode::Dynamic).await;
    let plugin = node.harness.start_plugin().await;
    node.devices_where(|d| d.len() == 26).await;
    // A claim gets a 3g.40gb MIG device, which the plugin creates; then that MIG device faults.
    let claim = node
        .harness
        .allocated_claim_with(
            "mig",
            serde_json::json!({"requests": [{"name": "mig", "exactly": {
                "deviceClassName": "mig.gpu.dra.dev",
                "selectors": [{"cel": {"expression": "device.attributes[\"gpu.dra.dev\"].profile == \"3g.40gb\""}}]
            }}]}),
        )
        .await
        .unwrap();
    let kubelet = node.harness.kubelet().await;
    let prepared = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .clone()
        .unwrap();
    let name = prepared[0].device_name.clone();
    let start: u32 = name.rsplit('-').next().unwrap().parse().unwrap();
    node.set_faults(
        0,
        vec![FakeFault {
            kind: FakeFaultKind::Xid,
            xid: Some(94),
            mig_start: Some(start),
        }],
    );
    let devices = node.devices_where(|d| !taints(d, &name).is_empty()).await;
    let tainted: Vec<&str> = devices
        .iter()
        .filter(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
        .map(|d| d.name.as_str())
        .collect();
    assert_eq!(tainted, vec![name.as_str()]);
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_changes_effects_while_the_plugin_runs() {
    let mut node = Node::new(1, ServerVersion::V1_35, MigMode::Static).await;
    let plugin = node.harness.start_plugin().await;
    node.devices_where(|d| d.len() == 1).await;
    node.set_faults(0, vec![xid(31)]);
    node.devices_where(|d| taints(d, "gpu-0").first().is_some_and(|t| t.2 == "None"))
        .await;
    // The admin treats XID 31 as fatal and evicts on fatal faults.
    let _ = plugin.policy.send(NodePolicy {
        health: HealthPolicy {
            extra_fatal_xids: [31].into(),
            fatal_effect: TaintEffect::NoExecute,
            ..Default::default()
        },
        ..Default::default()
    });
    node.devices_where(|d| {
        taints(d, "gpu-0")
            .first()
            .is_some_and(|t| t.2 == "NoExecute")
    })
    .await;
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_node_policy_sets_health_and_mig_mode_and_a_broken_edit_keeps_the_last_good_one() {
    use gpu_dra::api::GpuNodePolicy;
    use kube::api::{Api, PostParams};

    let mut node = Node::new(1, ServerVersion::V1_35, MigMode::Static).await;
    let plugin = node.harness.start_plugin().await;
    node.devices_where(|d| d.len() == 1).await;
    let policies: Api<GpuNodePolicy> = Api::all(node.harness.api.client());
    let policy: GpuNodePolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "gpu.dra.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": {"name": "h100-nodes"},
        "spec": {
            "nodeSelector": {},
            "health": {"fatalXids": [31], "fatalEffect": "NoExecute"},
            "migMode": "dynamic"
        }
    }))
    .unwrap();
    policies
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();

    // Dynamic MIG without a restart: the whole GPU and its 25 MIG placements.
    node.devices_where(|d| d.len() == 26).await;
    node.set_faults(0, vec![xid(31)]);
    node.devices_where(|d| {
        taints(d, "gpu-0")
            .first()
            .is_some_and(|t| t.2 == "NoExecute")
    })
    .await;

    // An invalid edit is reported in the policy's status and the last good one stays in force.
    let mut broken = policies.get("h100-nodes").await.unwrap();
    broken.spec.health.as_mut().unwrap().ignored_xids = vec![31];
    policies
        .replace("h100-nodes", &PostParams::default(), &broken)
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let condition = loop {
        let current = policies.get("h100-nodes").await.unwrap();
        let invalid = current
            .status
            .unwrap_or_default()
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Accepted" && c.status == "False");
        if let Some(condition) = invalid {
            break condition;
        }
        assert!(Instant::now() < deadline, "no Accepted=False condition");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(condition.message.contains("31"), "{condition:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let devices = node.devices_where(|d| d.len() == 26).await;
    assert_eq!(taints(&devices, "gpu-0")[0].2, "NoExecute");
    plugin.shutdown().await;
}
