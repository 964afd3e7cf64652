//! Bad GPUs and MIG under pressure, end to end against the doubles: a GPU that cannot be read is left
//! out and reported while the others are published, and comes back at a rescan; static MIG with several
//! compute instances per GPU instance; a prepare cancelled by the kubelet's deadline mid-create is
//! adopted by the retry; parallel prepares and an unprepare on one GPU with slow MIG operations; a
//! MIG device held by a process makes unprepare a per-claim error the kubelet retries; a GPU whose MIG
//! mode cannot be switched off is no longer offered whole; one whose MIG mode cannot be switched on fails
//! a dynamic MIG prepare with a per-claim error naming the GPU and the NVML call; an A100 with MIG mode
//! off under dynamic MIG is told, once, with the commands that enable it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{FakeProfile, GpuBackend};
use gpu_dra::support::apiserver::ServerVersion;
use gpu_dra::support::harness::{Harness, DRIVER, MIG_CLASS};
use gpu_dra::support::kubelet::{ClaimRef, HealthStatus};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

/// A node with a profile file the test edits, as an admin or a failing GPU would change the node.
struct Node {
    harness: Harness,
    path: PathBuf,
    profile: FakeProfile,
}

impl Node {
    async fn new(gpus: usize, mig_mode: MigMode, edit: impl FnOnce(&mut FakeProfile)) -> Node {
        Node::of("dgx-h100", gpus, mig_mode, edit).await
    }

    async fn of(
        name: &str,
        gpus: usize,
        mig_mode: MigMode,
        edit: impl FnOnce(&mut FakeProfile),
    ) -> Node {
        let mut harness = Harness::with_version(name, ServerVersion::V1_35).await;
        let mut profile = gpu_dra::gpu::builtin_profile(name).unwrap();
        profile.gpus.truncate(gpus);
        edit(&mut profile);
        let path = harness.dir.path().join("node.yaml");
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

    fn edit(&mut self, edit: impl FnOnce(&mut FakeProfile)) {
        edit(&mut self.profile);
        std::fs::write(&self.path, serde_yaml::to_string(&self.profile).unwrap()).unwrap();
    }

    /// Names of the devices in this node's slices, once `done` holds for them.
    async fn device_names_where(&self, done: impl Fn(&[String]) -> bool) -> Vec<String> {
        let slices = self
            .harness
            .wait_for_slices_where(|slices| done(&names(slices)))
            .await;
        names(&slices)
    }

    /// MIG devices on the fake GPUs now, as (minor, start, UUID).
    fn mig_devices(&self) -> Vec<(u32, u32, String)> {
        self.harness.mig_devices()
    }

    fn spec(&self, claim: &ClaimRef) -> Option<String> {
        std::fs::read_to_string(
            self.harness
                .cdi_dir()
                .join(format!("k8s.{DRIVER}-gpu_{}.json", claim.uid)),
        )
        .ok()
    }

    /// Events on the Node with this reason, as (type, note).
    fn events(&self, reason: &str) -> Vec<(String, String)> {
        self.harness
            .api
            .list("events")
            .into_iter()
            .filter(|e| e["reason"] == reason)
            .map(|e| {
                (
                    e["type"].as_str().unwrap_or_default().to_string(),
                    e["note"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect()
    }

    async fn events_where(
        &self,
        reason: &str,
        done: impl Fn(&[(String, String)]) -> bool,
    ) -> Vec<(String, String)> {
        let deadline = Instant::now() + WAIT;
        loop {
            let found = self.events(reason);
            if done(&found) {
                return found;
            }
            assert!(Instant::now() < deadline, "{reason} Events: {found:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn names(slices: &[ResourceSlice]) -> Vec<String> {
    let mut names: Vec<String> = slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .map(|d| d.name)
        .collect();
    names.sort();
    names
}

fn mig_request(profile: &str) -> serde_json::Value {
    json!({"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS,
        "selectors": [{"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].profile == \"{profile}\"")}}]
    }}]})
}

async fn metrics_where(
    plugin: &gpu_dra::plugin::RunningPlugin,
    done: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let text = plugin.metrics.encode();
        if done(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_gpu_is_left_out_and_reported_and_published_once_it_reads_again() {
    let mut node = Node::new(3, MigMode::Static, |p| {
        p.gpus[1].unreadable = Some("GPU is lost".into());
    })
    .await;
    let plugin = node.harness.start_plugin().await;
    let kubelet = node.harness.kubelet().await;

    // The healthy GPUs are published; the lost one is not.
    let names = node.device_names_where(|names| !names.is_empty()).await;
    assert_eq!(names, vec!["gpu-0", "gpu-2"]);

    // A Warning Event on the Node names the GPU and the reason, once.
    let events = node
        .events_where("GpuUnreadable", |found| !found.is_empty())
        .await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, "Warning");
    assert!(
        events[0].1.contains("gpu-1") && events[0].1.contains("GPU is lost"),
        "{events:?}"
    );
    assert!(events[0].1.contains("0000:2a:00.0"), "{events:?}");
    metrics_where(&plugin, |t| t.contains("gpu_dra_unreadable_gpus 1")).await;

    // The kubelet hears that gpu-1 is unhealthy.
    let mut health = kubelet.watch_health().await.unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let list = tokio::time::timeout(WAIT, health.next())
            .await
            .expect("a health update in time")
            .unwrap()
            .expect("the stream stays open");
        if let Some(gpu1) = list.iter().find(|d| d.device == "gpu-1") {
            assert_eq!(gpu1.health, HealthStatus::Unhealthy);
            assert!(gpu1.message.contains("GPU is lost"), "{}", gpu1.message);
            break;
        }
        assert!(Instant::now() < deadline, "{list:?}");
    }

    // A rescan reads it again: it is published, the gauge drops, and no second Warning was made.
    node.edit(|p| p.gpus[1].unreadable = None);
    node.device_names_where(|names| names.len() == 3).await;
    metrics_where(&plugin, |t| t.contains("gpu_dra_unreadable_gpus 0")).await;
    let events = node
        .events_where("GpuUnreadable", |found| found.len() == 2)
        .await;
    assert_eq!(events[1].0, "Normal", "{events:?}");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_compute_instances_are_devices_of_their_own_and_a_gpu_instance_without_one_is_reported(
) {
    let node = Node::new(1, MigMode::Static, |p| {
        p.gpus[0].mig_enabled = true;
        p.gpus[0].mig_instances = serde_yaml::from_str(
            "[{profile: 3g.40gb, start: 0, computeInstances: [1, 1, 1]}, \
              {profile: 2g.20gb, start: 4, computeInstances: []}]",
        )
        .unwrap();
    })
    .await;
    let _plugin = node.harness.start_plugin().await;
    let kubelet = node.harness.kubelet().await;
    let names = node.device_names_where(|names| !names.is_empty()).await;
    assert_eq!(
        names,
        vec![
            "gpu-0-mig-3g40gb-0-ci0",
            "gpu-0-mig-3g40gb-0-ci1",
            "gpu-0-mig-3g40gb-0-ci2"
        ]
    );
    let events = node
        .events_where("MigInstanceWithoutComputeInstance", |f| !f.is_empty())
        .await;
    assert!(
        events[0].1.contains("2g.20gb at memory slice 4"),
        "{events:?}"
    );

    // Two claims get two compute instances of the one GPU instance, each its own MIG device.
    let first = node
        .harness
        .allocated_claim_with("first", mig_request("3g.40gb"))
        .await
        .unwrap();
    let second = node
        .harness
        .allocated_claim_with("second", mig_request("3g.40gb"))
        .await
        .unwrap();
    let answer = kubelet
        .prepare(&[first.clone(), second.clone()])
        .await
        .unwrap();
    let first_device = answer[&first.uid].clone().unwrap()[0].device_name.clone();
    let second_device = answer[&second.uid].clone().unwrap()[0].device_name.clone();
    assert_ne!(first_device, second_device);
    let uuid_of = |device: &str| -> String {
        let ci: u32 = device.rsplit_once("-ci").unwrap().1.parse().unwrap();
        let inventory = node.harness.fake_backend().inventory().unwrap();
        inventory.gpus[0]
            .mig
            .as_ref()
            .unwrap()
            .instances
            .iter()
            .find(|i| i.placement.start == 0 && i.compute_instance_id == ci)
            .unwrap()
            .uuid
            .clone()
    };
    let (first_uuid, second_uuid) = (uuid_of(&first_device), uuid_of(&second_device));
    let first_spec = node.spec(&first).unwrap();
    assert!(first_spec.contains(&first_uuid), "{first_spec}");
    assert!(!first_spec.contains(&second_uuid), "{first_spec}");
    let second_spec = node.spec(&second).unwrap();
    assert!(second_spec.contains(&second_uuid), "{second_spec}");
}

/// A node with one H100 in dynamic MIG mode whose MIG operations take `delay_ms`.
async fn slow_dynamic_node(delay_ms: u64) -> Node {
    let node = Node::new(1, MigMode::Dynamic, |p| {
        p.mig_operation_delay_ms = Some(delay_ms)
    })
    .await;
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_cancelled_mid_create_is_adopted_by_the_retry() {
    let node = slow_dynamic_node(2000).await;
    let _plugin = node.harness.start_plugin().await;
    let kubelet = node.harness.kubelet().await;
    node.device_names_where(|n| n.iter().any(|d| d.contains("-mig-")))
        .await;
    let claim = node
        .harness
        .allocated_claim_with("slow", mig_request("1g.10gb"))
        .await
        .unwrap();

    // The kubelet gives up before the MIG device exists; the create goes on without it.
    let impatient = kubelet
        .clone()
        .with_call_timeout(Duration::from_millis(700));
    assert!(impatient
        .prepare(std::slice::from_ref(&claim))
        .await
        .is_err());
    // The cancelled prepare's create finishes on its own and leaves a MIG device no claim records.
    let deadline = Instant::now() + WAIT;
    while node.mig_devices().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the interrupted create never finished"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leaked = node.mig_devices();

    // The retry finds the device at the allocated placement and takes it.
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    answer[&claim.uid].clone().unwrap();
    let made = node.mig_devices();
    assert_eq!(made, leaked, "exactly one MIG device, the one adopted");
    let spec = node.spec(&claim).unwrap();
    assert!(spec.contains(&made[0].2), "{spec}");

    // It is the claim's: unprepare destroys it.
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap()[&claim.uid]
        .clone()
        .unwrap();
    assert!(node.mig_devices().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_prepares_and_an_unprepare_on_one_gpu_with_slow_mig_operations_all_succeed() {
    let node = slow_dynamic_node(200).await;
    let _plugin = node.harness.start_plugin().await;
    let kubelet = node.harness.kubelet().await;
    node.device_names_where(|n| n.iter().any(|d| d.contains("-mig-")))
        .await;
    let mut claims = Vec::new();
    for name in ["a", "b", "c", "d"] {
        claims.push(
            node.harness
                .allocated_claim_with(name, mig_request("1g.10gb"))
                .await
                .unwrap(),
        );
    }
    // The first one is the GPU's only MIG device; its destroy would switch MIG mode off.
    kubelet.prepare(&claims[..1]).await.unwrap()[&claims[0].uid]
        .clone()
        .unwrap();
    let (unprepared, prepared) = tokio::join!(
        kubelet.unprepare(&claims[..1]),
        kubelet.prepare(&claims[1..])
    );
    unprepared.unwrap()[&claims[0].uid].clone().unwrap();
    let prepared = prepared.unwrap();
    for claim in &claims[1..] {
        prepared[&claim.uid].clone().unwrap();
    }
    let made = node.mig_devices();
    assert_eq!(made.len(), 3, "{made:?}");
    for claim in &claims[1..] {
        let spec = node.spec(claim).unwrap();
        assert_eq!(
            made.iter()
                .filter(|(_, _, uuid)| spec.contains(uuid))
                .count(),
            1,
            "{spec}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_device_in_use_makes_unprepare_a_per_claim_error_that_the_retry_clears() {
    let mut node = Node::new(1, MigMode::Dynamic, |_| {}).await;
    let _plugin = node.harness.start_plugin().await;
    let kubelet = node.harness.kubelet().await;
    node.device_names_where(|n| n.iter().any(|d| d.contains("-mig-")))
        .await;
    let claim = node
        .harness
        .allocated_claim_with("busy", mig_request("1g.10gb"))
        .await
        .unwrap();
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .clone()
        .unwrap();
    let made = node.mig_devices();
    assert_eq!(made.len(), 1);
    let start = made[0].1;

    // A process still holds the MIG device.
    node.edit(|p| p.gpus[0].mig_in_use = vec![start]);
    let answer = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    let error = answer[&claim.uid].clone().unwrap_err();
    assert!(
        error.contains("in use") && error.contains(&made[0].2),
        "{error}"
    );
    // Nothing is lost: the device, the CDI spec and the claim's record stay for the retry.
    assert_eq!(node.mig_devices(), made);
    assert!(node.spec(&claim).is_some());

    node.edit(|p| p.gpus[0].mig_in_use.clear());
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap()[&claim.uid]
        .clone()
        .unwrap();
    assert!(node.mig_devices().is_empty());
    assert!(node.spec(&claim).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_whose_mig_mode_cannot_be_switched_off_is_not_offered_whole() {
    let node = Node::new(1, MigMode::Dynamic, |p| {
        p.gpus[0].mig_disable_fails = Some("In use by another client".into())
    })
    .await;
    let _plugin = node.harness.start_plugin().await;
    let kubelet = node.harness.kubelet().await;
    let names = node
        .device_names_where(|n| n.iter().any(|d| d.contains("-mig-")))
        .await;
    assert!(names.iter().any(|n| n == "gpu-0"), "{names:?}");
    let claim = node
        .harness
        .allocated_claim_with("once", mig_request("1g.10gb"))
        .await
        .unwrap();
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .clone()
        .unwrap();
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap()[&claim.uid]
        .clone()
        .unwrap();
    // The GPU stays in MIG mode: its MIG devices are still offered, the whole GPU no longer.
    let names = node
        .device_names_where(|n| !n.is_empty() && !n.iter().any(|d| d == "gpu-0"))
        .await;
    assert!(names.iter().all(|n| n.contains("-mig-")), "{names:?}");
    let events = node
        .events_where("MigModeNotSwitchedOff", |f| !f.is_empty())
        .await;
    assert!(
        events[0].1.contains("In use by another client"),
        "{events:?}"
    );
}

/// NVIDIA's mock NVML (and a real GPU a process holds) refuses `nvmlDeviceSetMigMode`: the prepare of a
/// dynamic MIG device is a per-claim error naming the GPU and the call, with nothing left behind, and
/// the GPU is still offered whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_whose_mig_mode_cannot_be_switched_on_fails_the_prepare_naming_the_gpu_and_the_call()
{
    let node = Node::new(1, MigMode::Dynamic, |p| {
        p.gpus[0].mig_enable_fails = Some("Not Supported".into())
    })
    .await;
    let _plugin = node.harness.start_plugin().await;
    let kubelet = node.harness.kubelet().await;
    node.device_names_where(|n| n.iter().any(|d| d.contains("-mig-")))
        .await;
    let claim = node
        .harness
        .allocated_claim_with("mig", mig_request("1g.10gb"))
        .await
        .unwrap();
    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let error = answer[&claim.uid].clone().unwrap_err();
    let gpu = node.harness.fake_backend().inventory().unwrap().gpus[0]
        .uuid
        .clone();
    for part in [
        "default/mig",
        gpu.as_str(),
        "switching MIG mode on failed",
        "nvmlDeviceSetMigMode",
        "Not Supported",
    ] {
        assert!(error.contains(part), "{error:?} lacks {part:?}");
    }
    assert!(node.mig_devices().is_empty());
    assert!(node.spec(&claim).is_none());
    let names = node.device_names_where(|n| !n.is_empty()).await;
    assert!(names.iter().any(|n| n == "gpu-0"), "{names:?}");
}

/// An A100 switches MIG mode only with a GPU reset, so under dynamic MIG with MIG mode off it offers
/// only the whole GPU. The plugin says so once per GPU, on the Node, with the commands an admin runs;
/// a republish (here, a profile edit) does not say it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_a100_with_mig_mode_off_under_dynamic_mig_is_reported_once_with_the_commands_to_enable_it(
) {
    let mut node = Node::of("dgx-a100", 2, MigMode::Dynamic, |_| {}).await;
    let _plugin = node.harness.start_plugin().await;
    let names = node.device_names_where(|n| n.len() == 2).await;
    assert_eq!(names, vec!["gpu-0", "gpu-1"]);
    let events = node
        .events_where("MigModeOffNeedsGpuReset", |f| f.len() == 2)
        .await;
    let inventory = gpu_dra::gpu::FakeBackend::new(
        gpu_dra::support::harness::NODE,
        node.path.to_str().unwrap(),
    )
    .unwrap()
    .inventory()
    .unwrap();
    let gpu = &inventory.gpus[1];
    let (kind, note) = events
        .iter()
        .find(|(_, note)| note.contains(&gpu.uuid))
        .expect("the Event of gpu-1");
    assert_eq!(kind, "Warning");
    assert_eq!(
        note,
        &format!(
            "gpu-1 (index 1, {}, NVIDIA A100-SXM4-40GB) publishes no MIG device under --mig-mode \
             dynamic: its MIG mode is off, and this GPU switches MIG mode only with a GPU reset, which \
             the plugin does not do. It is offered as a whole GPU. To offer its MIG devices, run \
             `nvidia-smi -i 1 -mig 1`, then reset the GPU with nothing using it \
             (`nvidia-smi --gpu-reset -i 1`) or reboot the node.",
            gpu.uuid
        )
    );
    let stored: Vec<serde_json::Value> = node
        .harness
        .api
        .list("events")
        .into_iter()
        .filter(|e| e["reason"] == "MigModeOffNeedsGpuReset")
        .collect();
    for event in &stored {
        assert_eq!(event["regarding"]["kind"], "Node", "{event:#}");
        assert_eq!(event["regarding"]["name"], gpu_dra::support::harness::NODE);
        assert_eq!(event["action"], "ReadGpu");
    }

    // A republish (the profile changed: a third GPU) reports the new GPU only.
    node.edit(|p| {
        let mut third = p.gpus[1].clone();
        third.pci_bus_id = "0000:c1:00.0".into();
        p.gpus.push(third);
    });
    node.device_names_where(|n| n.len() == 3).await;
    let events = node
        .events_where("MigModeOffNeedsGpuReset", |f| f.len() == 3)
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        node.events("MigModeOffNeedsGpuReset").len(),
        3,
        "{events:?}"
    );
    assert!(node
        .harness
        .api
        .list("events")
        .iter()
        .filter(|e| e["reason"] == "MigModeOffNeedsGpuReset")
        .all(|e| e["series"].is_null()));
}
