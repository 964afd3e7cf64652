//! The `gpu-dra` binary's subcommands as a user runs them.

use std::process::Command;

fn gpu_dra(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("GPU_BACKEND")
        .env_remove("FAKE_GPU_PROFILE")
        .output()
        .expect("gpu-dra runs")
}

fn stdout(output: &std::process::Output) -> String {
    assert!(
        output.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).to_string()
}

#[test]
fn fake_profiles_lists_the_builtins() {
    let text = stdout(&gpu_dra(&["fake", "profiles"]));
    for expected in [
        "dgx-h100",
        "NVIDIA H100 80GB HBM3",
        "dgx-a100",
        "NVIDIA A100-SXM4-40GB",
        "l40s-4",
        "NVIDIA L40S",
    ] {
        assert!(text.contains(expected), "{expected} missing in\n{text}");
    }
}

#[test]
fn a_shown_profile_is_a_valid_profile_file() {
    let yaml = stdout(&gpu_dra(&["fake", "show", "l40s-4"]));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mine.yaml");
    std::fs::write(&path, yaml.replace("l40s-4", "mine")).unwrap();
    let json = stdout(&gpu_dra(&[
        "devices",
        "--backend",
        "fake",
        "--fake-profile",
        path.to_str().unwrap(),
        "-o",
        "json",
    ]));
    let slices: Vec<k8s_openapi::api::resource::v1::ResourceSlice> =
        serde_json::from_str(&json).unwrap();
    assert_eq!(slices[0].spec.devices.as_ref().unwrap().len(), 4);

    let output = gpu_dra(&["fake", "show", "nope"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown fake GPU profile \"nope\""));
}

#[test]
fn devices_prints_the_slices_as_json_yaml_and_table() {
    let json = stdout(&gpu_dra(&[
        "devices",
        "--backend",
        "fake",
        "--node-name",
        "n1",
        "-o",
        "json",
    ]));
    let slices: Vec<k8s_openapi::api::resource::v1::ResourceSlice> =
        serde_json::from_str(&json).unwrap();
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].spec.node_name.as_deref(), Some("n1"));
    assert_eq!(slices[0].spec.devices.as_ref().unwrap().len(), 8);

    let yaml = stdout(&gpu_dra(&[
        "devices",
        "--backend",
        "fake",
        "--fake-profile",
        "l40s-4",
        "--node-name",
        "n1",
        "-o",
        "yaml",
    ]));
    let doc = yaml.trim_start_matches("---\n");
    let slice: k8s_openapi::api::resource::v1::ResourceSlice = serde_yaml::from_str(doc).unwrap();
    assert_eq!(slice.spec.devices.unwrap()[0].name, "gpu-0");

    let table = stdout(&gpu_dra(&[
        "devices",
        "--backend",
        "fake",
        "--fake-profile",
        "dgx-a100",
    ]));
    assert_eq!(table.lines().count(), 9, "{table}");
    assert!(
        table.contains("NVIDIA A100-SXM4-40GB") && table.contains("40.0"),
        "{table}"
    );
}

#[test]
fn mistakes_get_clear_errors() {
    let output = gpu_dra(&["devices", "--backend", "fake", "--fake-profile", "dgx-h999"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("unknown fake GPU profile \"dgx-h999\""),
        "{stderr}"
    );

    let output = gpu_dra(&["plugin", "--backend", "fake"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--node-name"));

    let output = gpu_dra(&["devices", "--backend", "nvml"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("GPU backend nvml is not available")
            && stderr.contains("libnvidia-ml.so.1")
            && stderr.contains("--backend fake"),
        "{stderr}"
    );

    // The probe is for GPU machines; without the driver it says what is missing.
    let output = gpu_dra(&[
        "nvml",
        "probe",
        "--library",
        "/nonexistent/libnvidia-ml.so.1",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("/nonexistent/libnvidia-ml.so.1") && stderr.contains("NVIDIA driver"),
        "{stderr}"
    );

    let output = gpu_dra(&["devices", "--backend", "fake", "--mig-mode", "sometimes"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--mig-mode") && stderr.contains("dynamic"),
        "{stderr}"
    );
}

/// Leader election timings that cannot work stop `gpu-dra controller` before it talks to any cluster,
/// with the flags named.
#[test]
fn the_controller_refuses_leader_election_timings_that_cannot_work() {
    let controller = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
            .arg("controller")
            .args(args)
            .env("KUBECONFIG", "/nonexistent/kubeconfig")
            .env_remove("LEADER_ELECT")
            .output()
            .expect("gpu-dra runs");
        assert!(!output.status.success(), "{args:?} accepted");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let stderr = controller(&["--leader-elect-renew-deadline", "15s"]);
    assert!(
        stderr.contains(
            "--leader-elect-renew-deadline (15s) must be shorter than --leader-elect-lease-duration (15s)"
        ),
        "{stderr}"
    );
    let stderr = controller(&["--leader-elect-retry-period=10s"]);
    assert!(
        stderr.contains(
            "--leader-elect-retry-period (10s) must be shorter than --leader-elect-renew-deadline (10s)"
        ),
        "{stderr}"
    );
    let stderr = controller(&["--leader-elect-retry-period", "2"]);
    assert!(
        stderr.contains("--leader-elect-retry-period") && stderr.contains("invalid duration \"2\""),
        "{stderr}"
    );
}

#[test]
fn devices_shows_dynamic_mig_in_both_slice_layouts() {
    let split = stdout(&gpu_dra(&[
        "devices",
        "--backend",
        "fake",
        "--fake-profile",
        "dgx-a100",
        "--mig-mode",
        "dynamic",
        "-o",
        "json",
    ]));
    let slices: Vec<serde_json::Value> = serde_json::from_str(&split).unwrap();
    // A100s with MIG mode off: whole GPUs only, in one slice, no counters.
    assert_eq!(slices.len(), 1);
    let h100 = stdout(&gpu_dra(&[
        "devices",
        "--backend",
        "fake",
        "--mig-mode",
        "dynamic",
        "--kubernetes-minor",
        "34",
        "-o",
        "json",
    ]));
    let slices: Vec<serde_json::Value> = serde_json::from_str(&h100).unwrap();
    let sets: Vec<usize> = slices
        .iter()
        .map(|s| s["spec"]["sharedCounters"].as_array().unwrap().len())
        .collect();
    assert_eq!(
        sets,
        vec![3, 3, 2],
        "combined slices of up to 3 GPUs on 1.34"
    );
    let table = stdout(&gpu_dra(&[
        "devices",
        "--backend",
        "fake",
        "--mig-mode",
        "dynamic",
    ]));
    assert!(table.contains("gpu-0-mig-1g10gb-6"), "{table}");
    assert!(table.contains("mig"), "{table}");
}

#[test]
fn demo_walks_through_every_step() {
    let text = stdout(&gpu_dra(&["demo"]));
    for expected in [
        "[1] Started a Kubernetes API server double",
        "[3] The kubelet double found the registration socket and registered the plugin",
        "dialled by its raw path, as the kubelet does: HTTP/2 :authority %2F",
        "[4] The plugin published 5 ResourceSlice(s) with 208 devices and 8 counter sets",
        "gpu-0-mig-1g10gb-6",
        "[8] ResourceClaim default/small-mig asked for a 1g.10gb MIG device",
        "/dev/nvidia-caps/nvidia-cap",
        "-mig-1g10gb-6 {\"parentUUID\":\"GPU-",
        "[9] Two claims share their GPU as their opaque GpuConfig asks",
        "default/time-sliced: container env GPU_DRA_SHARING=TimeSlicing/Long",
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "GPU_DRA_SHARING=MPS",
        "compute mode EXCLUSIVE_PROCESS",
        "compute mode DEFAULT with time-slice interval Long",
        "Cmd:set_default_active_thread_percentage 50",
        "[11] NodeUnprepareResources succeeded for all four claims",
        "MIG devices left: 0",
        "GPUs not in their default sharing mode: 0; MPS daemons left: 0",
        "[12] Injected XID 79",
        "26 devices (gpu-5 and all its MIG devices) now carry the taint",
        "kubelet health stream: gpu-5 Unhealthy: XID 79",
        "[13] Removed the fault (the GPU recovered): devices with taints: 0",
        "[14] Pod default/big-job wants 8 GPUs on one NVLink domain and stays Pending",
        "(exit code 1) says why:",
        "Pod default/big-job: fits on no node (2 nodes: 1 no devices, 1 too few free devices)",
        "scheduler: 0/2 nodes are available: 2 cannot allocate all claims.",
        "cpu-node   no     no devices published for this node",
        "demo-node  no     request gpu (8 wanted): 8 GPUs: 4 free, 3 allocated to other claims, 1 overlaps allocated devices (shared counters used up)",
        "[15] ComputeDomains: a rack of four more nodes",
        "rack-a0 (127.0.0.10) publishes 0 IMEX channel device(s)",
        "rack-b1 (127.0.0.12) publishes 1 IMEX channel device(s)",
        "placed it on clique 00000000-0000-0000-0000-000000000001.0 and wrote",
        "worker-0 → rack-b1",
        "worker-1 → rack-b2",
        "its container gets /dev/nvidia-caps-imex-channels/channel0 (type c",
        "the domain is Ready:",
        "rack-b2 127.0.0.13 (index 1, clique 00000000-0000-0000-0000-000000000001.0): Ready",
        "[19] Killed the IMEX daemon on rack-b2: the domain is NotReady",
        "lost connection to peer (demo)",
        "imex-channel-0 is tainted gpu.dra.dev/imex-daemon=NotReady:NoSchedule",
        "[20] The job ended: its 4 claims unprepared, both IMEX daemons stopped (their directories: removed)",
        "[21] Plugin stopped; sockets removed: true",
        "NodePrepareResources answered",
        "k8s.gpu.dra.dev/gpu=",
        "\"type\": \"c\"",
        "readyz says: ready",
        "CDI specs removed: true",
        "sockets removed: true",
        "Demo complete.",
    ] {
        assert!(text.contains(expected), "{expected:?} missing in\n{text}");
    }
}

#[test]
fn plugin_logs_json_and_cleans_up_on_sigint() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    // An API server that is not there: the plugin still starts, serves the kubelet and keeps retrying.
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: \"http://127.0.0.1:1\"}}]\n\
         users: [{name: u, user: {}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n",
    )
    .unwrap();
    let registry = dir.path().join("registry");
    // Relative directories, as a careless manifest might give them: the endpoint must still be absolute.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .current_dir(dir.path())
        .args([
            "plugin",
            "--node-name",
            "n1",
            "--backend",
            "fake",
            "--http-addr",
            "",
        ])
        .args(["--log-format", "json", "--kubeconfig", "kubeconfig"])
        .args([
            "--kubelet-registry-dir",
            "registry",
            "--kubelet-plugins-dir",
            "plugins",
            "--cdi-root",
            "cdi",
        ])
        .env("RUST_LOG", "info")
        // Not in a Pod, even where CI runs the tests in one (the preflight's hostPath check).
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = std::io::BufReader::new(stderr).lines();
    let mut started = false;
    for line in lines.by_ref().take(50) {
        let line = line.unwrap();
        let entry: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            entry["level"].is_string() && entry["fields"].is_object(),
            "{line}"
        );
        if entry["fields"]["message"] == "plugin started" {
            let endpoint = entry["fields"]["dra_socket"].as_str().unwrap_or_default();
            assert_eq!(
                std::path::Path::new(endpoint),
                dir.path().join("plugins/gpu.dra.dev/dra.sock")
            );
            started = true;
            break;
        }
    }
    assert!(started, "no 'plugin started' log line");
    let socket = registry.join("gpu.dra.dev-reg.sock");
    assert!(socket.exists());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    // Keep draining the logs so the plugin never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    assert!(child.wait().unwrap().success());
    assert!(!socket.exists());
    assert!(!dir.path().join("plugins/gpu.dra.dev/dra.sock").exists());
}

/// `gpu-dra devices | head -1`: a reader that has gone away ends the output quietly, not with a panic.
#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    for args in [
        &[
            "devices",
            "--backend",
            "fake",
            "--node-name",
            "n",
            "-o",
            "json",
        ][..],
        &["fake", "show", "dgx-h100"][..],
    ] {
        // The reader is closed before the command writes, so its first write meets a broken pipe.
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let output = Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .expect("gpu-dra runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(output.status.code(), Some(0), "{args:?}: {stderr}");
    }
}
