//! A GpuNodePolicy with `spec.sharing.mpsMemoryShares` publishes whole GPUs for MPS sharing by memory,
//! the scheduler double packs claims onto one GPU by the memory each asks for, and a server that drops
//! the fields of shared devices (DRAConsumableCapacity off) gets exclusive GPUs and a Warning Event.

use std::time::{Duration, Instant};

use gpu_dra::plugin::BackendChoice;
use gpu_dra::support::apiserver::{FeatureGate, FeatureGates, ServerVersion};
use gpu_dra::support::harness::{Harness, NODE};
use gpu_dra::support::scheduler::AllocationError;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use kube::Api;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

fn policy(shares: Value) -> Value {
    json!({
        "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuNodePolicy",
        "metadata": {"name": "mps", "generation": 1},
        "spec": {"migMode": "none", "sharing": {"mpsMemoryShares": shares}},
    })
}

async fn node(gates: FeatureGates, gpus: usize) -> Harness {
    let mut node = Harness::with_gates("dgx-h100", ServerVersion::V1_34, gates).await;
    let profile = node.write_h100_profile(gpus);
    node.config.backend = BackendChoice::Fake {
        profile: profile.display().to_string(),
        state_file: None,
    };
    node
}

fn devices(slices: &[ResourceSlice]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect()
}

fn shared(device: &Device) -> bool {
    device.allow_multiple_allocations == Some(true)
}

/// A claim for one GPU of the `gpu.dra.dev` class, asking for `memory` of it when given.
fn gpu_asking(memory: Option<&str>) -> Value {
    let mut exactly = json!({"deviceClassName": "gpu.dra.dev"});
    if let Some(memory) = memory {
        exactly["capacity"] = json!({"requests": {"memory": memory}});
    }
    json!({"requests": [{"name": "gpu", "exactly": exactly}]})
}

async fn results(node: &Harness, name: &str) -> Vec<Value> {
    let claims: Api<ResourceClaim> = Api::namespaced(node.api.client(), "default");
    let claim = serde_json::to_value(claims.get(name).await.expect("claim")).expect("JSON");
    claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_shares_gpus_by_memory_and_the_scheduler_packs_claims_onto_one() {
    let node = node(FeatureGates::all_enabled(), 1).await;
    let plugin = node.start_plugin().await;
    let exclusive = node.wait_for_slices().await;
    assert!(devices(&exclusive).iter().all(|d| !shared(d)));

    // The admin's policy arrives while the plugin runs.
    node.api.insert(
        "gpunodepolicies",
        policy(json!({"minimum": "2Gi", "step": "1Gi"})),
    );
    let slices = node
        .wait_for_slices_where(|s| devices(s).iter().any(shared))
        .await;
    let gpu = &devices(&slices)[0];
    assert_eq!(gpu.name, "gpu-0");
    let memory = &gpu.capacity.as_ref().expect("capacity")["memory"];
    let policy = serde_json::to_value(&memory.request_policy).expect("JSON");
    assert_eq!(
        policy,
        json!({"default": "2Gi", "validRange": {"min": "2Gi", "step": "1Gi"}})
    );
    let sharing = &gpu.attributes.as_ref().expect("attributes")["sharing"];
    assert_eq!(sharing.string.as_deref(), Some("MPS"));

    // 40Gi and 30Gi fit on the 79.6GiB GPU together; 20Gi more does not.
    node.allocated_claim_with("train", gpu_asking(Some("40Gi")))
        .await
        .expect("40Gi allocated");
    node.allocated_claim_with("serve", gpu_asking(Some("30Gi")))
        .await
        .expect("30Gi allocated beside it");
    let error = node
        .allocated_claim_with("more", gpu_asking(Some("20Gi")))
        .await
        .expect_err("only 9.6Gi left");
    let text = error.to_string();
    assert!(
        matches!(error, AllocationError::Unallocatable { .. }),
        "{text}"
    );
    assert!(
        text.contains("gpu-0 needs 20Gi of capacity memory, which has"),
        "{text}"
    );
    // A claim that asks no memory gets the minimum share, which still fits.
    node.allocated_claim_with("small", gpu_asking(None))
        .await
        .expect("the default share fits");

    let mut share_ids = Vec::new();
    for (claim, memory) in [("train", "40Gi"), ("serve", "30Gi"), ("small", "2Gi")] {
        let results = results(&node, claim).await;
        assert_eq!(results.len(), 1, "{claim}: {results:?}");
        assert_eq!(results[0]["device"], "gpu-0");
        assert_eq!(
            results[0]["consumedCapacity"],
            json!({"memory": memory}),
            "{claim}"
        );
        share_ids.push(
            results[0]["shareID"]
                .as_str()
                .expect("a shareID")
                .to_string(),
        );
    }
    share_ids.sort();
    share_ids.dedup();
    assert_eq!(share_ids.len(), 3, "each share has its own ID");
    plugin.shutdown().await;
}

/// The Events on the Node with `reason` whose note names `gate`, once at least one is there.
async fn events_naming(node: &Harness, reason: &str, gate: &str) -> Vec<Value> {
    let deadline = Instant::now() + WAIT;
    loop {
        let events: Vec<Value> = node
            .api
            .list("events")
            .into_iter()
            .filter(|e| {
                e["reason"] == reason && e["note"].as_str().is_some_and(|n| n.contains(gate))
            })
            .collect();
        if !events.is_empty() || Instant::now() > deadline {
            return events;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_consumable_capacity_gpus_are_published_exclusive_once_with_a_warning() {
    let node = node(
        FeatureGates::disabling([FeatureGate::DRAConsumableCapacity]),
        2,
    )
    .await;
    node.api.insert("gpunodepolicies", policy(json!({})));
    let plugin = node.start_plugin().await;
    node.wait_for_slices().await;

    let warnings = events_naming(&node, "FeatureGateDisabled", "DRAConsumableCapacity").await;
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert_eq!(warnings[0]["type"], "Warning");
    assert_eq!(warnings[0]["regarding"]["name"], NODE);
    let note = warnings[0]["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("exclusive use") && !note.contains("matters only"),
        "the policy asks for sharing, so the note says what it costs: {note}"
    );

    // Settled: exclusive GPUs, written without a loop of rewrites.
    let before = node.api.writes("resourceslices");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let settled = node.api.writes("resourceslices") - before;
    assert_eq!(settled, 0, "slice writes after the slices settled");
    let stored: Vec<ResourceSlice> = node
        .api
        .list("resourceslices")
        .into_iter()
        .map(|v| serde_json::from_value(v).expect("a stored ResourceSlice"))
        .collect();
    let devices = devices(&stored);
    assert_eq!(devices.len(), 2);
    for device in &devices {
        assert!(!shared(device), "{}", device.name);
        assert!(device
            .capacity
            .iter()
            .flatten()
            .all(|(_, c)| c.request_policy.is_none()));
        assert!(!device
            .attributes
            .iter()
            .flatten()
            .any(|(name, _)| name == "sharing"));
    }
    let text = plugin.metrics.encode();
    assert!(
        text.contains("gpu_dra_feature_gate_disabled{feature_gate=\"DRAConsumableCapacity\"} 1"),
        "{text}"
    );
    plugin.shutdown().await;
}
