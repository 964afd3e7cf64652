//! Consumable shares under our own name: a GpuNodePolicy's `spec.sharing.shares` publishes MIG
//! devices (dynamic MIG here) for sharing by count, the scheduler double gives one device to as many
//! claims as it has shares and refuses the next with the scheduler's reason, and on the node the MIG
//! device is made by the first claim, reused by the others and destroyed by the last one: an
//! unprepare, or a prepare of a second claim cancelled half way and unprepared, leaves the device of
//! the claim that still holds it in place.

use std::time::{Duration, Instant};

use gpu_dra::api::NVIDIA_DRIVER_NAME;
use gpu_dra::claims::lifecycle::holds;
use gpu_dra::claims::Step;
use gpu_dra::devices::{MigMode, Shares};
use gpu_dra::plugin::BackendChoice;
use gpu_dra::support::apiserver::ServerVersion;
use gpu_dra::support::harness::{Harness, PluginProcess, DRIVER, MIG_CLASS};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};
use gpu_dra::support::scheduler::AllocationError;
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);
const IMPATIENT: Duration = Duration::from_millis(300);

/// One H100 in dynamic MIG mode on a 1.35 API server, whose policy shares MIG devices four ways.
async fn node() -> Harness {
    let mut node = Harness::with_version("dgx-h100", ServerVersion::V1_35).await;
    node.config.mig_mode = MigMode::Dynamic;
    let profile = node.write_h100_profile(1);
    let BackendChoice::Fake { state_file, .. } = &node.config.backend else {
        panic!("a fake backend")
    };
    node.config.backend = BackendChoice::Fake {
        profile: profile.display().to_string(),
        state_file: state_file.clone(),
    };
    node.api.insert(
        "gpunodepolicies",
        json!({
            "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuNodePolicy",
            "metadata": {"name": "shares", "generation": 1},
            "spec": {"migMode": "dynamic", "sharing": {"shares": {
                "mode": "Count", "count": 4, "devices": ["MigDevices"], "enforcement": "None"
            }}},
        }),
    );
    node
}

fn devices(slices: &[ResourceSlice]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect()
}

/// The whole-GPU MIG device (7g.80gb): one per GPU, so every claim lands on the same device.
fn full_mig() -> Value {
    json!({"requests": [{"name": "mig", "exactly": {
        "deviceClassName": MIG_CLASS,
        "selectors": [{"cel": {"expression": format!("device.attributes[\"{DRIVER}\"].profile == \"7g.80gb\"")}}]
    }}]})
}

async fn shared_mig_published(node: &Harness) {
    let slices = node
        .wait_for_slices_where(|s| {
            devices(s).iter().any(|d| {
                d.name.contains("-mig-7g80gb-") && d.allow_multiple_allocations == Some(true)
            })
        })
        .await;
    let mig = devices(&slices)
        .into_iter()
        .find(|d| d.name.contains("-mig-7g80gb-"))
        .expect("the 7g.80gb device");
    let capacity = mig.capacity.as_ref().expect("capacity");
    assert_eq!(capacity["shares"].value.0, "4");
    let sharing = &mig.attributes.as_ref().expect("attributes")["sharing"];
    assert_eq!(sharing.string.as_deref(), Some("None"));
    let whole = devices(&slices)
        .into_iter()
        .find(|d| d.name == "gpu-0")
        .expect("gpu-0");
    assert_eq!(
        whole.allow_multiple_allocations, None,
        "devices: [MigDevices] leaves whole GPUs exclusive"
    );
}

async fn prepared(kubelet: &KubeletDouble, claim: &ClaimRef) {
    let answers = kubelet
        .prepare(std::slice::from_ref(claim))
        .await
        .expect("kubelet call");
    match answers.get(&claim.uid) {
        Some(Ok(_)) => {}
        other => panic!("prepare of {}: {other:?}", claim.name),
    }
}

async fn unprepared(kubelet: &KubeletDouble, claim: &ClaimRef) {
    let answers = kubelet
        .unprepare(std::slice::from_ref(claim))
        .await
        .expect("kubelet call");
    if let Some(Err(error)) = answers.get(&claim.uid) {
        panic!("unprepare of {} failed: {error}", claim.name);
    }
}

/// The UUIDs of the MIG devices on the node.
fn mig_uuids(node: &Harness) -> Vec<String> {
    node.mig_devices()
        .into_iter()
        .map(|(_, _, uuid)| uuid)
        .collect()
}

fn spec_of(node: &Harness, claim: &ClaimRef) -> bool {
    node.cdi_files().iter().any(|f| f.contains(&claim.uid))
}

async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_claims_share_one_dynamic_mig_device_made_once_and_destroyed_by_the_last() {
    let node = node().await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    shared_mig_published(&node).await;

    let mut claims = Vec::new();
    for n in 0..4 {
        let claim = node
            .allocated_claim_with(&format!("share-{n}"), full_mig())
            .await
            .unwrap_or_else(|e| panic!("share {n}: {e}"));
        claims.push(claim);
    }
    let error = node
        .allocated_claim_with("fifth", full_mig())
        .await
        .expect_err("four shares per device");
    let text = error.to_string();
    assert!(
        matches!(error, AllocationError::Unallocatable { .. }),
        "{text}"
    );
    assert!(text.contains("capacity shares"), "{text}");

    prepared(&kubelet, &claims[0]).await;
    let made = mig_uuids(&node);
    assert_eq!(made.len(), 1, "the first claim made the MIG device");
    prepared(&kubelet, &claims[1]).await;
    assert_eq!(mig_uuids(&node), made, "the second claim reused it");

    unprepared(&kubelet, &claims[0]).await;
    assert_eq!(
        mig_uuids(&node),
        made,
        "the claim that made it is gone, the one that shares it holds it"
    );
    assert!(spec_of(&node, &claims[1]));
    unprepared(&kubelet, &claims[1]).await;
    assert!(mig_uuids(&node).is_empty(), "the last claim destroyed it");
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_share_of_a_dynamic_mig_device_leaves_the_other_claims_device_in_place() {
    let node = node().await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    shared_mig_published(&node).await;
    let first = node
        .allocated_claim_with("first", full_mig())
        .await
        .expect("first share");
    let second = node
        .allocated_claim_with("second", full_mig())
        .await
        .expect("second share");
    prepared(&kubelet, &first).await;
    let made = mig_uuids(&node);
    assert_eq!(made.len(), 1);

    // The second claim's prepare is held right after it has the MIG device; the kubelet gives up.
    let held = holds::hold(&second.uid, Step::MigCreate);
    let impatient = kubelet.clone().with_call_timeout(IMPATIENT);
    assert!(impatient
        .prepare(std::slice::from_ref(&second))
        .await
        .is_err());
    tokio::time::timeout(WAIT, held.reached())
        .await
        .expect("the second prepare reached the MIG device");
    // Unprepared while held; then the prepare goes on, finds the claim going and is undone.
    let unprepare = tokio::spawn({
        let (kubelet, claim) = (kubelet.clone(), second.clone());
        async move { unprepared(&kubelet, &claim).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release();
    unprepare.await.expect("unprepare task");
    until("the second claim's spec is gone", || {
        !spec_of(&node, &second)
    })
    .await;
    assert_eq!(
        mig_uuids(&node),
        made,
        "the first claim's MIG device survives the second claim's roll-back"
    );
    assert!(spec_of(&node, &first));

    unprepared(&kubelet, &first).await;
    until("the MIG device is gone", || mig_uuids(&node).is_empty()).await;
    plugin.shutdown().await;
}

/// `gpu-dra plugin` as a process of its own for this node (dynamic MIG), paused for ever at `pause` of a
/// prepare (writing the marker there) when given; killed when dropped.
fn plugin_process(node: &Harness, pause: Option<(Step, &std::path::Path)>) -> PluginProcess {
    node.plugin_process(
        std::path::Path::new(env!("CARGO_BIN_EXE_gpu-dra")),
        &["--mig-mode", "dynamic"],
        pause,
    )
}

async fn registered(node: &Harness) -> KubeletDouble {
    KubeletDouble::register(&node.config.registry_dir, DRIVER, WAIT)
        .await
        .expect("plugin registers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_during_a_second_share_keeps_the_first_claims_mig_device_at_restart() {
    let node = node().await;
    let marker = node.dir.path().join("paused");
    let first = {
        let _plugin = plugin_process(&node, None);
        let kubelet = registered(&node).await;
        shared_mig_published(&node).await;
        let first = node
            .allocated_claim_with("first", full_mig())
            .await
            .expect("first share");
        prepared(&kubelet, &first).await;
        first
    };
    let made = mig_uuids(&node);
    assert_eq!(made.len(), 1);
    let second = node
        .allocated_claim_with("second", full_mig())
        .await
        .expect("second share");

    // Killed right after the second claim got the MIG device, before its spec.
    let mut plugin = plugin_process(&node, Some((Step::MigCreate, &marker)));
    let kubelet = registered(&node).await;
    let call = tokio::spawn({
        let (kubelet, claim) = (kubelet.clone(), second.clone());
        async move { kubelet.prepare(std::slice::from_ref(&claim)).await }
    });
    until("the second prepare pauses at the MIG device", || {
        marker.exists()
    })
    .await;
    drop(plugin);
    let _ = call.await;

    // The restart rolls the second claim back and keeps the first claim's device.
    plugin = plugin_process(&node, None);
    let kubelet = registered(&node).await;
    unprepared(&kubelet, &second).await;
    assert_eq!(
        mig_uuids(&node),
        made,
        "the first claim's MIG device survives a crash in the second claim's prepare"
    );
    assert!(spec_of(&node, &first));
    unprepared(&kubelet, &first).await;
    until("the MIG device is gone", || mig_uuids(&node).is_empty()).await;
    drop(plugin);
}

/// One H100 under NVIDIA's name with `--consumable-shares=4`.
async fn nvidia_node() -> Harness {
    let mut node = Harness::nvidia_compat("dgx-h100").await;
    let profile = node.write_h100_profile(1);
    let BackendChoice::Fake { state_file, .. } = &node.config.backend else {
        panic!("a fake backend")
    };
    node.config.backend = BackendChoice::Fake {
        profile: profile.display().to_string(),
        state_file: state_file.clone(),
    };
    node.config.consumable_shares = Shares::nvidia_flag("4").expect("NVIDIA's value");
    node
}

/// A claim for one GPU of NVIDIA's class, with NVIDIA's GpuConfig `sharing` when given.
fn nvidia_gpu(sharing: Option<Value>) -> Value {
    let mut devices =
        json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": NVIDIA_DRIVER_NAME}}]});
    if let Some(sharing) = sharing {
        devices["config"] = json!([{"requests": ["gpu"], "opaque": {"driver": NVIDIA_DRIVER_NAME, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing
        }}}]);
    }
    devices
}

async fn prepare_error(kubelet: &KubeletDouble, claim: &ClaimRef) -> String {
    let answers = kubelet
        .prepare(std::slice::from_ref(claim))
        .await
        .expect("kubelet call");
    match answers.get(&claim.uid) {
        Some(Err(error)) => error.clone(),
        other => panic!("{} was prepared: {other:?}", claim.name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidias_consumable_shares_publish_its_shapes_and_refuse_what_it_refuses() {
    let node = nvidia_node().await;
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    let slices = node
        .wait_for_slices_where(|s| {
            devices(s)
                .iter()
                .any(|d| d.name == "gpu-0" && d.allow_multiple_allocations == Some(true))
        })
        .await;
    let gpu = devices(&slices)
        .into_iter()
        .find(|d| d.name == "gpu-0")
        .expect("gpu-0");
    let shares = serde_json::to_value(&gpu.capacity.as_ref().expect("capacity")["shares"]).unwrap();
    assert_eq!(
        shares,
        json!({"value": "4", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}})
    );
    assert!(
        !gpu.attributes
            .as_ref()
            .expect("attributes")
            .contains_key("sharing"),
        "NVIDIA's attributes only"
    );

    let sliced = json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}});
    let first = node
        .allocated_claim_with("long", nvidia_gpu(Some(sliced.clone())))
        .await
        .expect("first share");
    let same = node
        .allocated_claim_with("long-too", nvidia_gpu(Some(sliced)))
        .await
        .expect("second share");
    let plain = node
        .allocated_claim_with("plain", nvidia_gpu(None))
        .await
        .expect("third share");
    let mps = node
        .allocated_claim_with("mps", nvidia_gpu(Some(json!({"strategy": "MPS"}))))
        .await
        .expect("fourth share");
    prepared(&kubelet, &first).await;
    prepared(&kubelet, &same).await;
    let error = prepare_error(&kubelet, &plain).await;
    assert!(
        error.contains(
            "requested device gpu-0 has conflicting configuration with already prepared claim default/long"
        ),
        "{error}"
    );
    assert!(!spec_of(&node, &plain));
    let error = prepare_error(&kubelet, &mps).await;
    assert!(
        error.contains("MPS sharing is not supported when consumable shares is enabled"),
        "{error}"
    );
    plugin.shutdown().await;
}
