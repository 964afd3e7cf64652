//! GPU sharing when the GPU driver misbehaves: a change of a GPU's sharing mode that does not return
//! (an `nvidia-smi` stuck in the kernel) must fail its claim in bounded time and hold up no other
//! GPU; and a plugin that crashes after setting a time-slice interval (which NVML cannot read back)
//! must not leave the GPU time-sliced for good.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gpu_dra::claims::checkpoint::CheckpointFile;
use gpu_dra::claims::checkpoint_path;
use gpu_dra::gpu::{FakeProfile, GpuBackend, GpuSharingMode, TimeSliceInterval};
use gpu_dra::plugin::BackendChoice;
use gpu_dra::support::harness::{Harness, DRIVER};
use gpu_dra::support::kubelet::{ClaimRef, KubeletDouble};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{json, Value};

/// `spec.devices` for one whole GPU, time-sliced with `interval`.
fn time_sliced(interval: &str) -> Value {
    let config = json!({
        "apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}
    });
    json!({
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": config}}]
    })
}

/// A node of two fake H100s from a profile file the test edits, with its GPU state in a file.
fn two_gpus(node: &mut Harness) -> (PathBuf, PathBuf) {
    let profile = node.write_h100_profile(2);
    let state = node.dir.path().join("gpu-state.json");
    node.config.backend = BackendChoice::Fake {
        profile: profile.display().to_string(),
        state_file: Some(state.clone()),
    };
    (profile, state)
}

/// Sets or clears `sharingHangs` on the GPU with this minor (the profile lists GPUs by minor).
fn set_hang(profile: &Path, minor: u32, hangs: bool) {
    let mut edited: FakeProfile =
        serde_yaml::from_str(&std::fs::read_to_string(profile).unwrap()).unwrap();
    edited.gpus[minor as usize].sharing_hangs = hangs;
    std::fs::write(profile, serde_yaml::to_string(&edited).unwrap()).unwrap();
}

/// The device the scheduler gave the claim (`gpu-<minor>`), and its minor.
async fn allocated_gpu(node: &Harness, claim: &ClaimRef) -> (String, u32) {
    let claims: kube::Api<ResourceClaim> = kube::Api::namespaced(node.api.client(), "default");
    let stored = claims.get(&claim.name).await.unwrap();
    let results = stored
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .expect("the claim is allocated");
    let device = results[0].device.clone();
    let minor = device.trim_start_matches("gpu-").parse().unwrap();
    (device, minor)
}

async fn prepare(kubelet: &KubeletDouble, claim: &ClaimRef) -> Result<Vec<String>, String> {
    let answers = kubelet.prepare(std::slice::from_ref(claim)).await.unwrap();
    answers[&claim.uid]
        .clone()
        .map(|devices| devices.into_iter().map(|d| d.device_name).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_stuck_in_a_sharing_change_fails_its_claim_in_time_and_holds_up_no_other_gpu() {
    let mut node = Harness::new("dgx-h100").await;
    let (profile, _) = two_gpus(&mut node);
    node.config.sharing_timeout = Duration::from_secs(1);
    let plugin = node.start_plugin().await;
    let kubelet = node.kubelet().await;
    node.wait_for_slices().await;
    let stuck = node
        .allocated_claim_with("stuck", time_sliced("Long"))
        .await
        .unwrap();
    let other = node
        .allocated_claim_with("other", time_sliced("Short"))
        .await
        .unwrap();
    let (stuck_gpu, stuck_minor) = allocated_gpu(&node, &stuck).await;
    let (other_gpu, other_minor) = allocated_gpu(&node, &other).await;
    assert_ne!(stuck_gpu, other_gpu);
    set_hang(&profile, stuck_minor, true);

    // Both claims in one call, as for one pod: the other GPU's claim is prepared; the stuck one
    // fails once the bound is reached, naming the GPU and what is stuck.
    let started = Instant::now();
    let answers = tokio::time::timeout(
        Duration::from_secs(20),
        kubelet.prepare(&[stuck.clone(), other.clone()]),
    )
    .await
    .expect("the kubelet's call returns although a GPU is stuck")
    .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let prepared = answers[&other.uid]
        .as_ref()
        .expect("the other GPU's claim is prepared");
    assert_eq!(prepared[0].device_name, other_gpu);
    let modes = node.fake_backend().sharing_modes();
    assert_eq!(
        modes.get(&node.gpu_uuid(&format!("gpu-{other_minor}"))),
        Some(&GpuSharingMode::TimeSlice(TimeSliceInterval::Short))
    );
    let error = answers[&stuck.uid]
        .as_ref()
        .expect_err("the stuck GPU's claim fails");
    assert!(error.contains("ResourceClaim default/stuck"), "{error}");
    assert!(
        error.contains(&format!(
            "{stuck_gpu}: setting compute mode DEFAULT with time-slice interval Long did not return within 1s"
        )),
        "{error}"
    );

    // The kubelet's retry fails at once while the change is still stuck.
    let started = Instant::now();
    let error = prepare(&kubelet, &stuck).await.expect_err("still stuck");
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    assert!(
        error.contains(&format!(
            "{stuck_gpu}: an earlier change to compute mode DEFAULT with time-slice interval Long has not returned for"
        )),
        "{error}"
    );
    assert!(
        error.contains("no change to this GPU can be made until it returns"),
        "{error}"
    );

    // Once the driver comes back, the retry prepares.
    set_hang(&profile, stuck_minor, false);
    let deadline = Instant::now() + Duration::from_secs(10);
    let devices = loop {
        match prepare(&kubelet, &stuck).await {
            Ok(devices) => break devices,
            Err(error) if Instant::now() < deadline && error.contains("has not returned") => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(error) => panic!("{error}"),
        }
    };
    assert_eq!(devices, [stuck_gpu]);
    assert_eq!(
        node.fake_backend()
            .sharing_modes()
            .get(&node.gpu_uuid(&format!("gpu-{stuck_minor}"))),
        Some(&GpuSharingMode::TimeSlice(TimeSliceInterval::Long))
    );
    for claim in [&stuck, &other] {
        let answers = kubelet
            .unprepare(std::slice::from_ref(claim))
            .await
            .unwrap();
        assert!(answers[&claim.uid].is_ok(), "{answers:?}");
    }
    assert!(node.fake_backend().sharing_modes().is_empty());
    plugin.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_interval_is_set_leaves_no_gpu_time_sliced_after_restart() {
    let mut node = Harness::new("dgx-h100").await;
    let (profile, state) = two_gpus(&mut node);
    let kubeconfig = node.dir.path().join("kubeconfig");
    node.api.write_kubeconfig(&kubeconfig).unwrap();
    // The plugin as a process of its own, so that it can crash for real.
    let mut child = node
        .plugin_command(
            Path::new(env!("CARGO_BIN_EXE_gpu-dra")),
            &profile,
            &kubeconfig,
        )
        .arg("--fake-state")
        .arg(&state)
        .stdout(Stdio::null())
        .spawn()
        .expect("plugin binary starts");
    let kubelet =
        KubeletDouble::register(&node.config.registry_dir, DRIVER, Duration::from_secs(30))
            .await
            .unwrap();
    node.wait_for_slices().await;
    let claim = node
        .allocated_claim_with("sliced", time_sliced("Long"))
        .await
        .unwrap();
    let (_, minor) = allocated_gpu(&node, &claim).await;
    let uuid = node.gpu_uuid(&format!("gpu-{minor}"));

    // The interval takes effect and nvidia-smi does not return; the plugin dies right then, before
    // the claim is prepared.
    set_hang(&profile, minor, true);
    let call = tokio::spawn(async move { kubelet.prepare(&[claim]).await });
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.fake_backend().sharing_modes().get(&uuid)
        != Some(&GpuSharingMode::TimeSlice(TimeSliceInterval::Long))
    {
        assert!(Instant::now() < deadline, "the interval was never set");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().expect("SIGKILL");
    child.wait().unwrap();
    let _ = call.await;
    set_hang(&profile, minor, false);
    assert_eq!(
        node.fake_backend().sharing(&uuid).unwrap(),
        GpuSharingMode::Default,
        "as on NVML, the interval cannot be read back"
    );

    // The next start resets the GPU: no prepared claim needs the interval.
    let plugin = node.start_plugin().await;
    assert!(
        node.fake_backend().sharing_modes().is_empty(),
        "the GPU is back to its default: {:?}",
        node.fake_backend().sharing_modes()
    );
    assert!(plugin.preparer.prepared_claims().is_empty());
    plugin.shutdown().await;
    let stored = CheckpointFile::new(checkpoint_path(
        &node.config.plugin_dir(),
        &node.config.driver_name,
    ))
    .load()
    .unwrap()
    .unwrap();
    assert!(stored.gpu_modes.is_empty(), "{:?}", stored.gpu_modes);
}
