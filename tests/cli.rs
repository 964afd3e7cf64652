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
    assert!(String::from_utf8_lossy(&output.stderr).contains("nvml"));
}

#[test]
fn demo_walks_through_every_step() {
    let text = stdout(&gpu_dra(&["demo"]));
    for expected in [
        "[1] Started a Kubernetes API server double",
        "[3] The kubelet double found the registration socket and registered the plugin",
        "[4] The plugin published 1 ResourceSlice(s) with 8 devices",
        "NodePrepareResources answered",
        "k8s.gpu.dra.dev/gpu=",
        "\"cdiVersion\": \"0.5.0\"",
        "readyz says: ready",
        "CDI spec removed: true",
        "sockets removed: true",
        "Demo complete.",
    ] {
        assert!(text.contains(expected), "{expected:?} missing in\n{text}");
    }
}
