//! A node swapped from NVIDIA's DRA plugin to ours while pods NVIDIA's plugin prepared still run. The
//! plugin, started as `gpu.nvidia.com`, takes those claims over from NVIDIA's checkpoint: a repeated
//! prepare answers what NVIDIA's plugin answered, other claims cannot take their devices, and when
//! the pods go, unprepare undoes what NVIDIA's plugin set up (its MPS daemon's Deployment and
//! directory, its GPU's time-slicing, its claim spec) without ever writing NVIDIA's checkpoint, and
//! without taking the claim over again at the next start. Its MIG devices stay, in dynamic MIG mode
//! too: NVIDIA's checkpoint does not say whether its plugin made them or an admin did.

use std::path::Path;

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, PostParams};
use serde_json::json;

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{GpuBackend, GpuSharingMode, MigPlacement, MigRequest, TimeSliceInterval};
use gpu_dra::support::harness::{admin_split_h100_profile, Harness};
use gpu_dra::support::kubelet::{ClaimRef, PreparedDevice};

const NVIDIA_NS: &str = "nvidia-dra-driver-gpu";
const TIME_SLICED: &str = "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d01";
const WITH_MPS: &str = "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d02";
const WITH_MIG: &str = "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d03";
const NOT_COMPLETED: &str = "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d04";
const MPS_ID: &str = "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d02-3fa9c";
/// An MPS daemon directory of NVIDIA's whose claim this plugin does not know: never touched.
const STRANGER_MPS_ID: &str = "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d99-00b1e";

/// One device group as NVIDIA's plugin writes it (prepared.go): the kubelet's Device with its CDI id
/// into NVIDIA's claim spec, beside what NVIDIA made.
fn gpu_group(uid: &str, device: &str, uuid: &str, mps: &str) -> serde_json::Value {
    json!({"devices": [{"gpu": {"info": {"uuid": uuid}, "device": {
        "Requests": ["gpu"], "PoolName": "node-a", "DeviceName": device,
        "CDIDeviceIDs": [format!("k8s.gpu.nvidia.com/claim={uid}-{device}")]}}, "mig": null}],
        "configState": {"mpsControlDaemonID": mps, "containerEdits": null}})
}

fn claim(state: &str, name: &str, group: serde_json::Value) -> serde_json::Value {
    json!({"checkpointState": state, "name": name, "namespace": "gpu-test",
           "status": {}, "preparedDevices": [group]})
}

fn write_spec(cdi: &Path, uid: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(cdi).unwrap();
    let path = cdi.join(format!("k8s.gpu.nvidia.com-claim_{uid}.yaml"));
    std::fs::write(
        &path,
        "cdiVersion: 0.5.0\nkind: k8s.gpu.nvidia.com/claim\ndevices: []\n",
    )
    .unwrap();
    path
}

fn prepared_ids(answer: &Result<Vec<PreparedDevice>, String>) -> Vec<String> {
    answer
        .as_ref()
        .expect("prepared")
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_nvidias_plugin_prepared_are_taken_over_and_unprepared_as_nvidia_would() {
    let mut node = Harness::nvidia_compat("dgx-h100").await;
    node.config.mig_mode = MigMode::Dynamic;
    let backend = node.fake_backend();
    let (gpu0, gpu1, gpu2) = (
        node.gpu_uuid("gpu-0"),
        node.gpu_uuid("gpu-1"),
        node.gpu_uuid("gpu-2"),
    );
    // What NVIDIA's plugin did on the node: gpu-0 time-sliced, gpu-1 given to an MPS daemon, a
    // 1g.10gb MIG device made on gpu-2.
    backend
        .set_sharing(&gpu0, &GpuSharingMode::TimeSlice(TimeSliceInterval::Long))
        .unwrap();
    backend
        .set_sharing(&gpu1, &GpuSharingMode::ExclusiveProcess)
        .unwrap();
    let mig = backend
        .create_mig(&MigRequest {
            parent_uuid: gpu2.clone(),
            profile_id: 19,
            placement: MigPlacement { start: 0, size: 1 },
        })
        .unwrap();
    let mig_group = json!({"devices": [{"gpu": null, "mig": {
        "concrete": {"parentMinor": 2, "giId": mig.gpu_instance_id, "ciId": mig.compute_instance_id,
                     "migUUID": mig.uuid, "parentUUID": gpu2},
        "device": {"Requests": ["mig"], "PoolName": "node-a", "DeviceName": "gpu-2-mig-1g10gb-19-0",
                   "CDIDeviceIDs": [format!("k8s.gpu.nvidia.com/claim={WITH_MIG}-gpu-2-mig-1g10gb-19-0")]}}}],
        "configState": {}});
    let checkpoint = json!({"checksum": 1, "v2": {"checksum": 2,
        "nodeBootID": gpu_dra::boot::current_boot_id(),
        "preparedClaims": {
            TIME_SLICED: claim("PrepareCompleted", "ts", gpu_group(TIME_SLICED, "gpu-0", &gpu0, "")),
            WITH_MPS: claim("PrepareCompleted", "mps", gpu_group(WITH_MPS, "gpu-1", &gpu1, MPS_ID)),
            WITH_MIG: claim("PrepareCompleted", "mig", mig_group),
            NOT_COMPLETED: claim("PrepareStarted", "half", gpu_group(NOT_COMPLETED, "gpu-3", &node.gpu_uuid("gpu-3"), "")),
        }}})
    .to_string();
    let plugin_dir = node.config.plugin_dir();
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let nvidia_checkpoint = plugin_dir.join("checkpoint.json");
    std::fs::write(&nvidia_checkpoint, &checkpoint).unwrap();
    let cdi = node.cdi_dir();
    let specs: Vec<_> = [TIME_SLICED, WITH_MPS, WITH_MIG]
        .iter()
        .map(|uid| write_spec(&cdi, uid))
        .collect();
    let mps_dir = plugin_dir.join("mps").join(MPS_ID);
    let stranger_dir = plugin_dir.join("mps").join(STRANGER_MPS_ID);
    for dir in [&mps_dir, &stranger_dir] {
        for sub in ["pipe", "shm", "log"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
    }
    let deployments: Api<Deployment> = Api::namespaced(node.api.client(), NVIDIA_NS);
    let deployment: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": format!("mps-control-daemon-{MPS_ID}"), "namespace": NVIDIA_NS},
        "spec": {"selector": {"matchLabels": {"app": "mps"}},
                 "template": {"metadata": {"labels": {"app": "mps"}},
                              "spec": {"containers": [{"name": "mps", "image": "nvidia"}]}}}
    }))
    .unwrap();
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();

    let plugin = node.start_plugin().await;
    let adoption = &plugin.recovery.nvidia;
    assert_eq!(adoption.adopted.len(), 3, "{adoption:?}");
    assert!(
        adoption.not_adopted.len() == 1
            && adoption.not_adopted[0].contains(NOT_COMPLETED)
            && adoption.not_adopted[0].contains("did not complete"),
        "{adoption:?}"
    );
    // The start-up sweeps left NVIDIA's MIG device and both of its MPS directories alone.
    assert!(node.mig_devices().iter().any(|d| d.2 == mig.uuid));
    assert!(mps_dir.exists() && stranger_dir.exists());
    let kubelet = node.kubelet().await;

    // The kubelet prepares a claim again (a second pod, a kubelet restart): NVIDIA's answer.
    let ts = ClaimRef::new("gpu-test", "ts", TIME_SLICED);
    let answer = kubelet.prepare(std::slice::from_ref(&ts)).await.unwrap();
    assert_eq!(
        prepared_ids(&answer[TIME_SLICED]),
        vec![format!("k8s.gpu.nvidia.com/claim={TIME_SLICED}-gpu-0")]
    );
    // A claim of ours allocated gpu-0 (a scheduler that lost track) does not get it.
    node.wait_for_whole_pool().await;
    let ours = node
        .allocated_claim_with(
            "ours",
            json!({"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.nvidia.com",
                "selectors": [{"cel": {"expression": "device.attributes[\"gpu.nvidia.com\"].minor == 0"}}]}}]}),
        )
        .await
        .expect("allocated");
    let refused = kubelet.prepare(std::slice::from_ref(&ours)).await.unwrap();
    let error = refused[&ours.uid].as_ref().unwrap_err();
    assert!(
        error.contains("gpu-0") && error.contains("prepared by NVIDIA's plugin"),
        "{error}"
    );

    // A restart keeps them taken over, and takes nothing over twice.
    plugin.shutdown().await;
    let plugin = node.start_plugin().await;
    assert!(
        plugin.recovery.nvidia.adopted.is_empty(),
        "{:?}",
        plugin.recovery.nvidia
    );
    let kubelet = node.kubelet().await;

    // What the plugin's backend reads of the GPUs: NVIDIA's settings, still.
    let modes = node.fake_backend().sharing_modes();
    assert_eq!(
        modes.get(&gpu0),
        Some(&GpuSharingMode::TimeSlice(TimeSliceInterval::Long))
    );

    // The pods go.
    let mps = ClaimRef::new("gpu-test", "mps", WITH_MPS);
    let mig_claim = ClaimRef::new("gpu-test", "mig", WITH_MIG);
    let answers = kubelet
        .unprepare(&[ts.clone(), mps.clone(), mig_claim.clone()])
        .await
        .unwrap();
    for (uid, answer) in &answers {
        assert!(answer.is_ok(), "{uid}: {answer:?}");
    }
    // Back to the default (which the fake lists as no entry).
    let modes = node.fake_backend().sharing_modes();
    assert!(
        !modes.contains_key(&gpu0) && !modes.contains_key(&gpu1),
        "{modes:?}"
    );
    assert!(
        node.mig_devices().iter().any(|d| d.2 == mig.uuid),
        "NVIDIA's MIG device stays: its checkpoint does not say that NVIDIA's plugin made it"
    );
    assert!(
        deployments
            .get_opt(&format!("mps-control-daemon-{MPS_ID}"))
            .await
            .unwrap()
            .is_none(),
        "NVIDIA's MPS Deployment is deleted"
    );
    assert!(!mps_dir.exists(), "NVIDIA's MPS directory is removed");
    assert!(stranger_dir.exists(), "another claim's MPS directory stays");
    for spec in &specs {
        assert!(!spec.exists(), "{} is removed", spec.display());
    }
    assert_eq!(
        std::fs::read_to_string(&nvidia_checkpoint).unwrap(),
        checkpoint
    );
    // gpu-0 is free for our claims now.
    let answer = kubelet.prepare(std::slice::from_ref(&ours)).await.unwrap();
    assert!(answer[&ours.uid].is_ok(), "{:?}", answer[&ours.uid]);

    // Nothing is taken over again, although NVIDIA's file still lists the claims; the MIG device is
    // reported as one this plugin did not make, and left alone.
    plugin.shutdown().await;
    let plugin = node.start_plugin().await;
    assert!(plugin.recovery.nvidia.adopted.is_empty());
    assert_eq!(
        plugin.recovery.mig_devices_left_alone,
        vec![mig.uuid.clone()]
    );
    assert!(plugin.recovery.mig_devices_destroyed.is_empty());
    // Which of them NVIDIA's file still lists, for the Event that says to move it aside.
    assert_eq!(
        plugin.recovery.nvidia.unprepared_since.len(),
        3,
        "{:?}",
        plugin.recovery.nvidia
    );
    let kubelet = node.kubelet().await;
    let again = kubelet.unprepare(std::slice::from_ref(&ts)).await.unwrap();
    assert!(again[TIME_SLICED].is_ok());
    plugin.shutdown().await;
    assert_eq!(
        std::fs::read_to_string(&nvidia_checkpoint).unwrap(),
        checkpoint
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_an_earlier_boot_or_without_their_spec_are_not_taken_over() {
    let node = Harness::nvidia_compat("dgx-h100").await;
    let gpu0 = node.gpu_uuid("gpu-0");
    let plugin_dir = node.config.plugin_dir();
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let group = gpu_group(TIME_SLICED, "gpu-0", &gpu0, "");
    // Spec present, but the checkpoint names another boot.
    write_spec(&node.cdi_dir(), TIME_SLICED);
    std::fs::write(
        plugin_dir.join("checkpoint.json"),
        json!({"v2": {"nodeBootID": "another-boot", "preparedClaims": {
            TIME_SLICED: claim("PrepareCompleted", "ts", group.clone())}}})
        .to_string(),
    )
    .unwrap();
    let plugin = node.start_plugin().await;
    let nvidia = plugin.recovery.nvidia.clone();
    assert!(nvidia.adopted.is_empty(), "{nvidia:?}");
    assert!(nvidia.not_adopted[0].contains("earlier boot"), "{nvidia:?}");
    plugin.shutdown().await;

    // This boot (an older release writes no boot id), but the spec is gone.
    std::fs::remove_file(
        node.cdi_dir()
            .join(format!("k8s.gpu.nvidia.com-claim_{TIME_SLICED}.yaml")),
    )
    .unwrap();
    std::fs::write(
        plugin_dir.join("checkpoint.json"),
        json!({"v2": {"preparedClaims": {
            TIME_SLICED: claim("PrepareCompleted", "ts", group)}}})
        .to_string(),
    )
    .unwrap();
    let plugin = node.start_plugin().await;
    let nvidia = plugin.recovery.nvidia.clone();
    assert!(nvidia.adopted.is_empty(), "{nvidia:?}");
    assert!(nvidia.not_adopted[0].contains("is gone"), "{nvidia:?}");
    plugin.shutdown().await;
}

/// A node that ran NVIDIA's driver with static MIG (an admin's layout, as mig-parted makes it) moves to
/// gpu-dra with `--mig-mode dynamic` while pods still use the admin's MIG devices. NVIDIA's checkpoint
/// records them as it records MIG devices its own DynamicMIG made, so the claims taken over own them
/// only while they are prepared: when the pods go, every MIG device of the layout survives, and the
/// next start reports them as MIG devices this plugin did not make.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admins_static_mig_layout_survives_the_claims_taken_over_in_dynamic_mig_mode() {
    let mut node = Harness::nvidia_compat("dgx-h100").await;
    node.use_profile("static-layout", &admin_split_h100_profile());
    node.config.mig_mode = MigMode::Dynamic;
    let inventory = node.fake_backend().inventory().unwrap();
    let gpu1 = &inventory.gpus[1];
    let layout = gpu1.mig.as_ref().unwrap().instances.clone();
    assert_eq!(layout.len(), 3, "{layout:?}");
    let mut uuids: Vec<String> = layout.iter().map(|i| i.uuid.clone()).collect();
    uuids.sort();

    // One claim of NVIDIA's plugin per MIG device of the layout, as v25.12 writes them.
    let uids = [
        "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d11",
        "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d12",
        "0a6f2a6e-1b8e-4c1e-9d4e-1f2a3b4c5d13",
    ];
    let mut claims = serde_json::Map::new();
    for (uid, instance) in uids.iter().zip(&layout) {
        let device = format!(
            "gpu-1-mig-{}-{}-{}",
            instance.profile_id, instance.placement.start, instance.placement.size
        );
        let group = json!({"devices": [{"gpu": null, "mig": {
            "concrete": {"parentMinor": 1, "giId": instance.gpu_instance_id,
                         "ciId": instance.compute_instance_id, "migUUID": instance.uuid,
                         "parentUUID": gpu1.uuid},
            "device": {"Requests": ["mig"], "PoolName": "node-a", "DeviceName": device,
                       "CDIDeviceIDs": [format!("k8s.gpu.nvidia.com/claim={uid}-{device}")]}}}],
            "configState": {}});
        claims.insert(
            uid.to_string(),
            claim(
                "PrepareCompleted",
                &format!("mig-{}", instance.placement.start),
                group,
            ),
        );
    }
    let checkpoint = json!({"checksum": 1, "v2": {"checksum": 2,
        "nodeBootID": gpu_dra::boot::current_boot_id(), "preparedClaims": claims}});
    let plugin_dir = node.config.plugin_dir();
    std::fs::create_dir_all(&plugin_dir).unwrap();
    std::fs::write(plugin_dir.join("checkpoint.json"), checkpoint.to_string()).unwrap();
    for uid in uids {
        write_spec(&node.cdi_dir(), uid);
    }

    let plugin = node.start_plugin().await;
    assert_eq!(
        plugin.recovery.nvidia.adopted.len(),
        3,
        "{:?}",
        plugin.recovery.nvidia
    );
    assert!(plugin.recovery.mig_devices_destroyed.is_empty());
    let kubelet = node.kubelet().await;

    // The pods go; every claim is unprepared, and every MIG device of the layout stays.
    let refs: Vec<ClaimRef> = uids
        .iter()
        .zip(&layout)
        .map(|(uid, instance)| {
            ClaimRef::new(
                "gpu-test",
                format!("mig-{}", instance.placement.start),
                *uid,
            )
        })
        .collect();
    let answers = kubelet.unprepare(&refs).await.unwrap();
    for (uid, answer) in &answers {
        assert!(answer.is_ok(), "{uid}: {answer:?}");
    }
    let mut left: Vec<String> = node.mig_devices().into_iter().map(|d| d.2).collect();
    left.sort();
    assert_eq!(left, uuids, "the admin's layout is intact");
    for uid in uids {
        assert!(!node
            .cdi_dir()
            .join(format!("k8s.gpu.nvidia.com-claim_{uid}.yaml"))
            .exists());
    }

    // The next start's sweep of dynamic MIG reports them, and destroys none.
    plugin.shutdown().await;
    let plugin = node.start_plugin().await;
    assert!(plugin.recovery.mig_devices_destroyed.is_empty());
    let mut reported = plugin.recovery.mig_devices_left_alone.clone();
    reported.sort();
    assert_eq!(reported, uuids);
    let mut left: Vec<String> = node.mig_devices().into_iter().map(|d| d.2).collect();
    left.sort();
    assert_eq!(left, uuids);
    plugin.shutdown().await;
}
