//! MIG and NVLink end to end against the doubles: dynamic MIG devices published as partitionable devices,
//! allocated by the scheduler double with counters, created at prepare and destroyed at unprepare, their
//! UUIDs in the claim status, the start-up sweep of unowned MIG devices, static MIG, both slice layouts,
//! and multi-GPU claims kept on one NVLink domain.

use std::time::Duration;

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::GpuBackend;
use gpu_dra::support::apiserver::ServerVersion;
use gpu_dra::support::cdi_runtime;
use gpu_dra::support::harness::{admin_split_h100_profile, Harness, DRIVER, MIG_CLASS, NODE};
use gpu_dra::support::kubelet::ClaimRef;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use serde_json::json;

fn mig_request(profile: &str) -> serde_json::Value {
    json!({"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS,
        "selectors": [{"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].profile == \"{profile}\"")}}]
    }}]})
}

async fn dynamic_node(profile: &str, version: ServerVersion) -> Harness {
    let mut node = Harness::with_version(profile, version).await;
    node.config.mig_mode = MigMode::Dynamic;
    node
}

fn allocated_device(claim: &ResourceClaim) -> String {
    gpu_dra::claims::allocation_results(claim)[0].device.clone()
}

async fn get_claim(node: &Harness, name: &str) -> ResourceClaim {
    let claims: Api<ResourceClaim> = Api::namespaced(node.api.client(), "default");
    claims.get(name).await.unwrap()
}

async fn wait_for_dynamic_slices(node: &Harness, count: usize) -> Vec<ResourceSlice> {
    node.wait_for_slices_where(|slices| slices.len() == count)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dynamic_mig_claim_creates_the_device_and_unprepare_destroys_it() {
    let node = dynamic_node("dgx-h100", ServerVersion::V1_35).await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    // 1.35: one counters-only slice for the 8 GPUs, then two GPUs to a device slice.
    let slices = wait_for_dynamic_slices(&node, 5).await;
    let counter_slices: Vec<_> = slices
        .iter()
        .filter(|s| s.spec.shared_counters.is_some())
        .collect();
    assert_eq!(counter_slices.len(), 1);
    assert!(counter_slices[0].spec.devices.is_none());

    let claim = node
        .allocated_claim_with("small", mig_request("1g.10gb"))
        .await
        .unwrap();
    let device = allocated_device(&get_claim(&node, "small").await);
    assert!(
        device.ends_with("-mig-1g10gb-6"),
        "the first 1g device goes to the top memory slice: {device}"
    );

    let answer = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    let prepared = answer[&claim.uid].clone().unwrap();
    assert_eq!(prepared[0].device_name, device);
    let made = node.mig_devices();
    assert_eq!(made.len(), 1, "{made:?}");
    let mig_uuid = made[0].2.clone();
    assert_eq!(made[0].1, 6);

    // The CDI spec gives the container the parent GPU, the MIG capability files and the MIG UUID.
    let spec = std::fs::read_to_string(
        node.cdi_dir()
            .join(format!("k8s.{DRIVER}-gpu_{}.json", claim.uid)),
    )
    .unwrap();
    assert!(spec.contains("/dev/nvidia-caps/nvidia-cap"), "{spec}");
    assert!(
        spec.contains(&format!("/dev/nvidia{}\"", made[0].0)),
        "{spec}"
    );
    assert!(spec.contains(&mig_uuid), "{spec}");
    // Its capability files are those the driver's MIG table gives GPU instance 7 of that GPU; the
    // driver makes no file for them on the host, so the runtime makes them from the spec's numbers.
    let json: serde_json::Value = serde_json::from_str(&spec).unwrap();
    let nodes = json["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap();
    assert!(nodes.iter().all(|n| n.get("hostPath").is_none()), "{spec}");
    let gi_minor = 3 + made[0].0 * 135 + 7 * 9;
    let container = cdi_runtime::inject(&[&node.cdi_dir()], &prepared[0].cdi_device_ids)
        .unwrap_or_else(|e| panic!("{e}"));
    for minor in [gi_minor, gi_minor + 1] {
        let path = format!("/dev/nvidia-caps/nvidia-cap{minor}");
        let created = container
            .device(&path)
            .unwrap_or_else(|| panic!("{path} not in the container: {container:?}"));
        assert_eq!(created.device_type, "c");
        assert!(!std::path::Path::new(&path).exists());
    }

    // The claim's status reports the created device's UUID.
    let mut reported = None;
    for _ in 0..100 {
        let claim = get_claim(&node, "small").await;
        reported = claim
            .status
            .and_then(|s| s.devices)
            .and_then(|d| d.into_iter().next());
        if reported.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reported = reported.expect("status.devices written");
    assert_eq!(reported.device, device);
    assert_eq!(reported.driver, DRIVER);
    assert_eq!(reported.data.unwrap().0["uuid"], json!(mig_uuid));

    let answer = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    answer[&claim.uid].clone().unwrap();
    assert!(node.mig_devices().is_empty(), "MIG device destroyed");
    assert!(node.cdi_files().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_keep_whole_gpus_and_their_partitions_apart_on_1_34() {
    let node = dynamic_node("dgx-h100", ServerVersion::V1_34).await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    // 1.34: combined slices, counter sets with the devices that consume them, three GPUs to a slice
    // (27 of the 32 shared counters 1.34 allows).
    let slices = wait_for_dynamic_slices(&node, 3).await;
    let mut shapes: Vec<(usize, usize)> = slices
        .iter()
        .map(|s| {
            (
                s.spec.devices.as_ref().map_or(0, Vec::len),
                s.spec.shared_counters.as_ref().map_or(0, Vec::len),
            )
        })
        .collect();
    shapes.sort();
    assert_eq!(shapes, vec![(52, 2), (78, 3), (78, 3)]);

    // A 4g device takes half of the first GPU; a whole-GPU claim then goes elsewhere.
    let half = node
        .allocated_claim_with("half", mig_request("4g.40gb"))
        .await
        .unwrap();
    let half_device = allocated_device(&get_claim(&node, "half").await);
    let parent = half_device.split("-mig-").next().unwrap().to_string();
    let whole = node.allocated_claim("whole", 7).await;
    let whole_devices: Vec<String> =
        gpu_dra::claims::allocation_results(&get_claim(&node, "whole").await)
            .iter()
            .map(|r| r.device.clone())
            .collect();
    assert!(!whole_devices.contains(&parent), "{whole_devices:?}");
    // Every GPU is now used: nothing is left for an 8th whole GPU, and only the free half of the
    // partly used GPU is left for MIG devices.
    let error = node
        .allocated_claim_with(
            "too-many",
            json!({"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER}}]}),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("cannot be allocated"), "{error}");
    let third = node
        .allocated_claim_with("other-half", mig_request("3g.40gb"))
        .await
        .unwrap();
    assert_eq!(
        allocated_device(&get_claim(&node, "other-half").await),
        format!("{parent}-mig-3g40gb-4")
    );

    let answer = kubelet
        .prepare(&[half.clone(), whole.clone(), third.clone()])
        .await
        .unwrap();
    for claim in [&half, &whole, &third] {
        answer[&claim.uid].clone().unwrap();
    }
    assert_eq!(node.mig_devices().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_refuses_a_device_that_overlaps_one_in_use() {
    // Claims written by hand (no scheduler) that break the counters: the plugin still refuses.
    let node = dynamic_node("dgx-h100", ServerVersion::V1_35).await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    wait_for_dynamic_slices(&node, 5).await;
    let first = node
        .allocated_claim_with("first", mig_request("3g.40gb"))
        .await
        .unwrap();
    let device = allocated_device(&get_claim(&node, "first").await);
    kubelet.prepare(std::slice::from_ref(&first)).await.unwrap()[&first.uid]
        .clone()
        .unwrap();
    let parent = device.split("-mig-").next().unwrap();
    let overlapping = forge_claim(&node, "forged", &format!("{parent}-mig-1g10gb-6")).await;
    let answer = kubelet
        .prepare(std::slice::from_ref(&overlapping))
        .await
        .unwrap();
    let error = answer[&overlapping.uid].clone().unwrap_err();
    assert!(
        error.contains("already prepared for claim") && error.contains(&device),
        "{error}"
    );
    assert_eq!(
        node.mig_devices().len(),
        1,
        "nothing created for the refused claim"
    );
}

/// A claim whose allocation names `device` directly, as a broken scheduler might.
async fn forge_claim(node: &Harness, name: &str, device: &str) -> ClaimRef {
    let uid = node.create_claim(name, 1).await;
    let claims: Api<ResourceClaim> = Api::namespaced(node.api.client(), "default");
    let mut claim = claims.get(name).await.unwrap();
    claim.status = Some(
        serde_json::from_value(json!({
            "allocation": {"devices": {"results": [
                {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": device}
            ]}}
        }))
        .unwrap(),
    );
    claims
        .replace_status(name, &Default::default(), &claim)
        .await
        .unwrap();
    ClaimRef::new("default", name, uid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_leaves_mig_devices_the_plugin_did_not_make() {
    let node = dynamic_node("dgx-h200", ServerVersion::V1_35).await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    wait_for_dynamic_slices(&node, 5).await;
    let claim = node
        .allocated_claim_with("kept", mig_request("2g.35gb"))
        .await
        .unwrap();
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .clone()
        .unwrap();
    let kept = node.mig_devices();
    plugin.shutdown().await;

    // A MIG device made behind the plugin's back (an admin's): no record says the plugin made it.
    // (A crash between recording and creating one is tests/mig_ownership.rs's.)
    let backend = node.fake_backend();
    let gpu = backend.inventory().unwrap().gpus[5].clone();
    let profile = gpu.mig.as_ref().unwrap().profiles[0].clone();
    let stray = backend
        .create_mig(&gpu_dra::gpu::MigRequest {
            parent_uuid: gpu.uuid.clone(),
            profile_id: profile.id,
            placement: profile.placements[0],
        })
        .unwrap();

    let plugin = node.start_plugin().await;
    assert_eq!(plugin.recovery.kept, vec![claim.uid.clone()]);
    assert!(plugin.recovery.mig_devices_destroyed.is_empty());
    assert_eq!(
        plugin.recovery.mig_devices_left_alone,
        vec![stray.uuid.clone()]
    );
    let mut expected: Vec<String> = kept.into_iter().map(|d| d.2).collect();
    expected.push(stray.uuid);
    let mut now: Vec<String> = node.mig_devices().into_iter().map(|d| d.2).collect();
    now.sort();
    expected.sort();
    assert_eq!(
        now, expected,
        "the prepared claim's device and the admin's stay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_mig_devices_an_admin_made_are_published_and_prepared_in_place() {
    let mut node = Harness::new("dgx-h100").await;
    node.use_profile("static", &admin_split_h100_profile());
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let slices = node.wait_for_slices().await;
    let names: Vec<&str> = slices[0]
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| d.name.as_str())
        .collect();
    assert_eq!(
        names,
        vec![
            "gpu-0",
            "gpu-1-mig-3g40gb-0",
            "gpu-1-mig-2g20gb-4",
            "gpu-1-mig-1g10gb-6"
        ]
    );
    let before = node.mig_devices();

    let claim = node
        .allocated_claim_with("static", mig_request("2g.20gb"))
        .await
        .unwrap();
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .clone()
        .unwrap();
    let spec = std::fs::read_to_string(
        node.cdi_dir()
            .join(format!("k8s.{DRIVER}-gpu_{}.json", claim.uid)),
    )
    .unwrap();
    let uuid = &before.iter().find(|(_, start, _)| *start == 4).unwrap().2;
    assert!(spec.contains(uuid.as_str()), "{spec}");
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap()[&claim.uid]
        .clone()
        .unwrap();
    assert_eq!(
        node.mig_devices(),
        before,
        "static MIG devices are left alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_gpu_claim_with_match_attribute_stays_on_one_nvlink_domain() {
    // Two NVLink-bridged pairs: gpu-0 + gpu-1 and gpu-2 + gpu-3.
    let node = Harness::new("a100-pcie-4").await;
    let _plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let single = node.allocated_claim("single", 1).await;
    assert_eq!(allocated_device(&get_claim(&node, "single").await), "gpu-0");

    let pair = node
        .allocated_claim_with(
            "pair",
            json!({
                "requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 2}}],
                "constraints": [{"matchAttribute": format!("{DRIVER}/nvlinkDomain")}]
            }),
        )
        .await
        .unwrap();
    let devices: Vec<String> = gpu_dra::claims::allocation_results(&get_claim(&node, "pair").await)
        .iter()
        .map(|r| r.device.clone())
        .collect();
    assert_eq!(
        devices,
        vec!["gpu-2", "gpu-3"],
        "not gpu-1 + gpu-2 across domains"
    );
    let answer = kubelet.prepare(&[single, pair.clone()]).await.unwrap();
    assert_eq!(answer[&pair.uid].clone().unwrap().len(), 2);

    // Without the constraint, first fit would have crossed domains.
    let loose = node
        .allocated_claim_with(
            "loose",
            json!({"requests": [{"name": "gpus", "exactly": {"deviceClassName": DRIVER, "count": 1}}]}),
        )
        .await
        .unwrap();
    assert_eq!(allocated_device(&get_claim(&node, "loose").await), "gpu-1");
    drop(loose);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_a_prepared_claims_mig_device_is_made_again() {
    let node = dynamic_node("dgx-h100", ServerVersion::V1_35).await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    wait_for_dynamic_slices(&node, 5).await;
    let claim = node
        .allocated_claim_with("survivor", mig_request("3g.40gb"))
        .await
        .unwrap();
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .clone()
        .unwrap();
    let before = node.mig_devices();
    plugin.shutdown().await;

    // MIG configuration does not survive a reboot: the GPUs come back without MIG devices.
    std::fs::remove_file(node.dir.path().join("fake-gpu-state.json")).unwrap();
    assert!(node.mig_devices().is_empty());

    let plugin = node.start_plugin().await;
    assert_eq!(plugin.recovery.kept, vec![claim.uid.clone()]);
    let after = node.mig_devices();
    assert_eq!(after.len(), 1);
    assert_eq!(
        (after[0].0, after[0].1),
        (before[0].0, before[0].1),
        "same GPU and placement"
    );
    assert_ne!(after[0].2, before[0].2, "a new MIG device has a new UUID");
    let spec = std::fs::read_to_string(
        node.cdi_dir()
            .join(format!("k8s.{DRIVER}-gpu_{}.json", claim.uid)),
    )
    .unwrap();
    assert!(
        spec.contains(&after[0].2) && !spec.contains(&before[0].2),
        "{spec}"
    );
}
