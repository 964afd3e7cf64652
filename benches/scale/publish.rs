//! Publishing a big node: from a cold start until every slice is stored, what one device change (a
//! fault, its recovery, a GPU going away and coming back) writes, and what prepare and unprepare ask of
//! the API server. An in-process plugin on the fake backend against the API server double, whose
//! request log is counted.

use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceSlice;

use gpu_dra::devices::MigMode;
use gpu_dra::gpu::{FakeBackend, FakeFault, FakeFaultKind, FakeProfile, GpuBackend, Inventory};
use gpu_dra::plugin::BackendChoice;
use gpu_dra::support::apiserver::ApiServer;
use gpu_dra::support::harness::{h100_profile, Harness, MIG_CLASS};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};

use crate::common::measure::{ms, percentile};
use crate::requests::{settle, Tally};

/// A node to publish: its GPUs and how MIG-capable GPUs are published.
pub struct NodeShape {
    pub title: &'static str,
    pub profile: FakeProfile,
    pub mig_mode: MigMode,
}

/// The two big nodes measured: 8 GPUs with every MIG profile at every placement, and 16 whole GPUs.
pub fn shapes() -> [NodeShape; 2] {
    [
        NodeShape {
            title: "8x H100 80GB, dynamic MIG (every profile at every placement)",
            profile: gpu_dra::gpu::builtin_profile("dgx-h100").expect("built-in profile"),
            mig_mode: MigMode::Dynamic,
        },
        NodeShape {
            title: "16x H100 80GB, whole GPUs (MIG mode off, the default static MIG mode)",
            profile: h100_profile(16),
            mig_mode: MigMode::Static,
        },
    ]
}

impl NodeShape {
    /// The GPUs as the fake backend reads them from the profile.
    pub fn inventory(&self) -> Inventory {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = write_profile(dir.path(), &self.profile);
        FakeBackend::new("node-a", &path)
            .expect("fake profile loads")
            .inventory()
            .expect("fake inventory")
    }

    /// A node's doubles with this profile in a file the plugin watches (edited to inject changes).
    async fn harness(&self) -> Harness {
        let mut node = Harness::new("dgx-h100").await;
        let path = write_profile(node.dir.path(), &self.profile);
        if let BackendChoice::Fake { profile, .. } = &mut node.config.backend {
            *profile = path;
        }
        node.config.mig_mode = self.mig_mode;
        node
    }
}

fn write_profile(dir: &std::path::Path, profile: &FakeProfile) -> String {
    let path = dir.join("profile.yaml");
    std::fs::write(&path, serde_yaml::to_string(profile).expect("profile YAML"))
        .expect("profile written");
    path.display().to_string()
}

/// What the API server stores of the node's slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub slices: usize,
    pub devices: usize,
    pub tainted: usize,
}

/// Read from the double's store directly, so that looking sends no request to count.
fn stored(api: &ApiServer) -> Stored {
    let slices: Vec<ResourceSlice> = api
        .list("resourceslices")
        .into_iter()
        .map(|value| serde_json::from_value(value).expect("slice"))
        .collect();
    let devices = || slices.iter().flat_map(|s| s.spec.devices.iter().flatten());
    Stored {
        slices: slices.len(),
        devices: devices().count(),
        tainted: devices()
            .filter(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
            .count(),
    }
}

async fn wait_until(api: &ApiServer, what: &str, done: impl Fn(Stored) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(stored(api)) {
        assert!(
            Instant::now() < deadline,
            "{what}: not stored in 20 s ({:?})",
            stored(api)
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// `rounds` cold starts, each with a fresh API server and node: from `plugin::start` until the
/// expected slices and devices are stored. Prints the times and the first start's requests.
pub async fn cold_start(shape: &NodeShape, expected: Stored, rounds: usize) {
    let mut times = Vec::with_capacity(rounds);
    let mut first = None;
    for _ in 0..rounds {
        let node = shape.harness().await;
        let started = Instant::now();
        let plugin = node.start_plugin().await;
        wait_until(&node.api, "cold start", |s| s == expected).await;
        times.push(started.elapsed());
        settle(&node.api).await;
        first.get_or_insert_with(|| Tally::of(&node.api.requests()));
        plugin.shutdown().await;
    }
    times.sort();
    println!(
        "cold start until {} devices in {} slices are stored: p50 {:.0} ms, max {:.0} ms ({rounds} starts)",
        expected.devices,
        expected.slices,
        ms(percentile(&times, 0.50)),
        ms(*times.last().expect("rounds")),
    );
    println!(
        "  requests of one start, until quiet: {}",
        first.expect("rounds")
    );
}

/// One change to the node's first GPU, and how to tell the server has it.
struct Change {
    what: &'static str,
    edit: fn(&mut FakeProfile),
    stored: fn(Stored, Stored) -> bool,
}

const CHANGES: [Change; 4] = [
    Change {
        what: "XID 79 on one GPU (taint)",
        edit: |p| {
            p.gpus[0].faults = vec![FakeFault {
                kind: FakeFaultKind::Xid,
                xid: Some(79),
                mig_start: None,
            }]
        },
        stored: |now, _| now.tainted > 0,
    },
    Change {
        what: "fault cleared (taint removed)",
        edit: |p| p.gpus[0].faults.clear(),
        stored: |now, _| now.tainted == 0,
    },
    Change {
        what: "one GPU unreadable (its devices go)",
        edit: |p| p.gpus[0].unreadable = Some("GPU is lost".into()),
        stored: |now, all| now.devices < all.devices,
    },
    Change {
        what: "the GPU back",
        edit: |p| p.gpus[0].unreadable = None,
        stored: |now, all| now == all,
    },
];

/// After a cold start, each of [`CHANGES`] in turn: what the plugin sent for it, until quiet.
pub async fn device_changes(shape: &NodeShape, expected: Stored) {
    let node = shape.harness().await;
    let plugin = node.start_plugin().await;
    wait_until(&node.api, "cold start", |s| s == expected).await;
    settle(&node.api).await;
    let mut profile = shape.profile.clone();
    let path = node.dir.path().join("profile.yaml");
    for change in &CHANGES {
        node.api.clear_requests();
        (change.edit)(&mut profile);
        let started = Instant::now();
        std::fs::write(&path, serde_yaml::to_string(&profile).expect("YAML")).expect("profile");
        wait_until(&node.api, change.what, |s| (change.stored)(s, expected)).await;
        let took = started.elapsed();
        settle(&node.api).await;
        let now = stored(&node.api);
        println!(
            "{}: stored in {:.0} ms ({} slices, {} devices, {} tainted); {}",
            change.what,
            ms(took),
            now.slices,
            now.devices,
            now.tainted,
            Tally::of(&node.api.requests())
        );
    }
    plugin.shutdown().await;
}

/// Prepare and unprepare of a whole GPU and of a dynamic MIG device, `rounds` times each, over the
/// kubelet double: what the plugin asked of the API server for them, until quiet.
pub async fn prepares(shape: &NodeShape, expected: Stored, rounds: usize) {
    let node = shape.harness().await;
    let plugin = node.start_plugin().await;
    let kubelet = KubeletDouble::register(
        &node.config.registry_dir,
        "gpu.dra.dev",
        Duration::from_secs(30),
    )
    .await
    .expect("plugin registers");
    wait_until(&node.api, "cold start", |s| s == expected).await;
    let whole = node.allocated_claim("whole", 1).await;
    let mig = node
        .allocated_claim_with(
            "mig",
            serde_json::json!({"requests": [{"name": "mig", "exactly": {
                "deviceClassName": MIG_CLASS,
                "selectors": [{"cel": {"expression": "device.attributes[\"gpu.dra.dev\"].profile == \"1g.10gb\""}}]
            }}]}),
        )
        .await
        .expect("MIG claim allocated");
    settle(&node.api).await;
    for (what, claim) in [("whole GPU", &whole), ("dynamic MIG 1g.10gb", &mig)] {
        let (mut prepares, mut unprepares) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            node.api.clear_requests();
            prepare(&kubelet, claim).await;
            settle(&node.api).await;
            prepares.extend(node.api.requests());
            node.api.clear_requests();
            unprepare(&kubelet, claim).await;
            settle(&node.api).await;
            unprepares.extend(node.api.requests());
        }
        println!("{what}, {rounds} prepares: {}", Tally::of(&prepares));
        println!("{what}, {rounds} unprepares: {}", Tally::of(&unprepares));
    }
    plugin.shutdown().await;
}

async fn prepare(kubelet: &KubeletDouble, claim: &ClaimRef) {
    let prepared = kubelet
        .prepare(std::slice::from_ref(claim))
        .await
        .expect("prepare call");
    assert!(prepared[&claim.uid].is_ok(), "{:?}", prepared[&claim.uid]);
}

async fn unprepare(kubelet: &KubeletDouble, claim: &ClaimRef) {
    let unprepared = kubelet
        .unprepare(std::slice::from_ref(claim))
        .await
        .expect("unprepare call");
    assert!(
        unprepared[&claim.uid].is_ok(),
        "{:?}",
        unprepared[&claim.uid]
    );
}
