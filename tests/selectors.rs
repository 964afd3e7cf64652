//! `gpu-dra selectors check` and `gpu-dra selectors allocate` as a user runs them: the DeviceClasses of
//! deploy/base, claims from tests/fixtures/selectors, and the slices `gpu-dra devices` prints for a fake
//! DGX H100 (generated per test, so the fixtures follow the planner).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const CLASSES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/base/deviceclasses.yaml"
);

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/selectors")
        .join(name)
        .display()
        .to_string()
}

fn gpu_dra(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("GPU_BACKEND")
        .env_remove("FAKE_GPU_PROFILE")
        .env_remove("MIG_MODE")
        .output()
        .expect("gpu-dra runs")
}

/// The slices of node-a, a fake DGX H100 with dynamic MIG, in a temp dir that lives as long as the guard.
fn node_slices() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = gpu_dra(&[
        "devices",
        "-o",
        "json",
        "--backend",
        "fake",
        "--fake-profile",
        "dgx-h100",
        "--mig-mode",
        "dynamic",
        "--node-name",
        "node-a",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let path = dir.path().join("slices.json");
    std::fs::write(&path, &output.stdout).expect("write slices");
    (dir, path)
}

fn code(output: &Output) -> i32 {
    output.status.code().expect("exit code")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).to_string()
}

fn allocate(claim: &str, slices: &Path, more: &[&str]) -> Output {
    let mut args = vec![
        "selectors",
        "allocate",
        "--claim",
        claim,
        "--class",
        CLASSES,
        "--slices",
        slices.to_str().expect("utf-8 path"),
        "-o",
        "json",
    ];
    args.extend_from_slice(more);
    gpu_dra(&args)
}

#[test]
fn a_claim_that_fits_gets_two_gpus_of_one_nvlink_domain() {
    let (_dir, slices) = node_slices();
    let output = allocate(&fixture("claim-two-gpus.yaml"), &slices, &[]);
    assert_eq!(code(&output), 0, "{}", text(&output.stderr));
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(json["allocated"], true);
    let results = json["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    for (result, device) in results.iter().zip(["gpu-0", "gpu-1"]) {
        assert_eq!(result["request"], "gpus");
        assert_eq!(result["driver"], "gpu.dra.dev");
        assert_eq!(result["pool"], "node-a");
        assert_eq!(result["device"], device);
        assert!(
            result.get("adminAccess").is_none(),
            "only set when requested"
        );
    }

    // The same for people.
    let output = gpu_dra(&[
        "selectors",
        "allocate",
        "--claim",
        &fixture("claim-two-gpus.yaml"),
        "--class",
        CLASSES,
        "--slices",
        slices.to_str().expect("path"),
        "--node",
        "node-a",
    ]);
    assert_eq!(code(&output), 0);
    let stdout = text(&output.stdout);
    assert!(stdout.contains("allocated on node node-a"), "{stdout}");
    assert!(
        stdout.contains("gpus: gpu.dra.dev/node-a/gpu-1"),
        "{stdout}"
    );
}

#[test]
fn claims_that_do_not_fit_say_why_and_exit_1() {
    let (_dir, slices) = node_slices();
    let reason = |output: &Output| {
        assert_eq!(code(output), 1, "{}", text(&output.stderr));
        let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
        assert_eq!(json["allocated"], false);
        json["reason"].as_str().expect("reason").to_string()
    };

    let too_many = reason(&allocate(&fixture("claim-nine-gpus.yaml"), &slices, &[]));
    assert!(
        too_many.contains("not enough devices") && too_many.contains("9 wanted"),
        "{too_many}"
    );

    // Whole GPUs in use take every GPU's counters, so no full-size MIG device fits.
    let fits = allocate(&fixture("claim-mig-7g.yaml"), &slices, &[]);
    assert_eq!(code(&fits), 0, "{}", text(&fits.stderr));
    let in_use = fixture("in-use-all-gpus.json");
    let counters = reason(&allocate(
        &fixture("claim-mig-7g.yaml"),
        &slices,
        &["--in-use", &in_use],
    ));
    assert!(
        counters.contains("of counter") && counters.contains("left"),
        "{counters}"
    );

    // Another node sees none of node-a's devices.
    let elsewhere = reason(&allocate(
        &fixture("claim-two-gpus.yaml"),
        &slices,
        &["--node", "node-b"],
    ));
    assert!(elsewhere.contains("0 match"), "{elsewhere}");
}

#[test]
fn a_cel_runtime_error_aborts_with_exit_2() {
    let (_dir, slices) = node_slices();
    let output = allocate(&fixture("claim-runtime-error.yaml"), &slices, &[]);
    assert_eq!(code(&output), 2);
    assert!(output.stdout.is_empty());
    // Said once: the error's cause is part of its text, and not repeated after it.
    assert_eq!(
        text(&output.stderr),
        "error: claim ml/typo: request gpu: selector #0 on device gpu.dra.dev/node-a/gpu-0: CEL runtime error: no such key: cudaCores. consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has() for optional fields\n"
    );
}

#[test]
fn malformed_input_exits_2_naming_the_file() {
    let (_dir, slices) = node_slices();
    let broken = fixture("broken.yaml");
    let output = allocate(&broken, &slices, &[]);
    assert_eq!(code(&output), 2);
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains(&broken) && stderr.contains("document 1"),
        "{stderr}"
    );

    // Slices in place of classes: the wrong kind.
    let output = gpu_dra(&[
        "selectors",
        "allocate",
        "--claim",
        &fixture("claim-two-gpus.yaml"),
        "--class",
        slices.to_str().expect("path"),
        "--slices",
        slices.to_str().expect("path"),
    ]);
    assert_eq!(code(&output), 2);
    assert!(text(&output.stderr).contains("kind ResourceSlice, expected DeviceClass"));

    // A file that is not there: the OS's reason, once.
    let output = gpu_dra(&[
        "selectors",
        "check",
        "--class",
        "/no/such/classes.yaml",
        "--slices",
        slices.to_str().expect("path"),
    ]);
    assert_eq!(code(&output), 2);
    assert_eq!(
        text(&output.stderr),
        "error: /no/such/classes.yaml: cannot read: No such file or directory (os error 2)\n"
    );
}

#[test]
fn check_reports_matches_and_exit_codes() {
    let (_dir, slices) = node_slices();
    let slices = slices.to_str().expect("path");
    // deploy/base's classes and a claim that fits: exit 0.
    let output = gpu_dra(&[
        "selectors",
        "check",
        "--class",
        CLASSES,
        "--claim",
        &fixture("claim-two-gpus.yaml"),
        "--slices",
        slices,
    ]);
    assert_eq!(code(&output), 0, "{}", text(&output.stderr));
    let table = text(&output.stdout);
    assert!(table.contains("class gpu.dra.dev: 8 of "), "{table}");
    assert!(
        table.contains("claim ml/train request gpus (class gpu.dra.dev): 8 of"),
        "{table}"
    );
    assert!(
        table.contains("no match (class gpu.dra.dev selector #0"),
        "{table}"
    );

    // A class that matches nothing: exit 1.
    let output = gpu_dra(&[
        "selectors",
        "check",
        "--class",
        &fixture("class-vgpu.yaml"),
        "--slices",
        slices,
        "-o",
        "json",
    ]);
    assert_eq!(code(&output), 1);
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(json["exitCode"], 1);
    assert_eq!(json["subjects"][0]["class"], "vgpu.gpu.dra.dev");
    assert_eq!(json["subjects"][0]["matching"], 0);

    // A runtime error: blocking, exit 2, with the error in the report.
    let output = gpu_dra(&[
        "selectors",
        "check",
        "--class",
        CLASSES,
        "--claim",
        &fixture("claim-runtime-error.yaml"),
        "--slices",
        slices,
        "-o",
        "json",
    ]);
    assert_eq!(code(&output), 2);
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let request = json["subjects"]
        .as_array()
        .expect("subjects")
        .iter()
        .find(|s| s["request"] == "gpu")
        .expect("the claim's request");
    assert_eq!(
        request["errors"].as_array().expect("errors").len(),
        1,
        "one error for the 8 GPUs"
    );
    assert_eq!(request["errors"][0]["blocking"], true);
    assert_eq!(request["errors"][0]["device"], "gpu.dra.dev/node-a/gpu-0");
    assert_eq!(
        request["errors"][0]["devices"][7],
        "gpu.dra.dev/node-a/gpu-7"
    );
    assert_eq!(request["errors"][0]["evaluated"], 8);
}

#[test]
fn check_prints_an_error_of_many_devices_once_with_the_nearest_published_name() {
    let (_dir, slices) = node_slices();
    let output = gpu_dra(&[
        "selectors",
        "check",
        "--class",
        CLASSES,
        "--claim",
        &fixture("claim-typo.yaml"),
        "--slices",
        slices.to_str().expect("path"),
    ]);
    assert_eq!(code(&output), 2, "{}", text(&output.stderr));
    let table = text(&output.stdout);
    let lines: Vec<&str> = table.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("claim ml/typo request h100 (class gpu.dra.dev)"))
        .unwrap_or_else(|| panic!("no subject for the request:\n{table}"));
    // The class's selector keeps the 200 MIG devices away; the request's fails on the 8 GPUs it sees.
    let errors: Vec<&str> = lines[at..]
        .iter()
        .take_while(|l| !l.is_empty())
        .filter(|l| {
            l.trim_start().starts_with("BLOCKING error") || l.trim_start().starts_with("hint")
        })
        .copied()
        .collect();
    assert_eq!(
        errors,
        [
            "  BLOCKING error: request h100: selector #0 on all 8 devices: CEL runtime error: no such key: productNam. consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has() for optional fields",
            "    hint: no device has attribute gpu.dra.dev/productNam: did you mean productName?",
        ],
        "{table}"
    );

    // A class that errors on the 8 full GPUs (no profile) of the 208 devices: a few are named. The
    // name exists on the MIG devices, so there is no hint.
    let output = gpu_dra(&[
        "selectors",
        "check",
        "--class",
        &fixture("class-1g-unguarded.yaml"),
        "--slices",
        slices.to_str().expect("path"),
    ]);
    assert_eq!(code(&output), 2, "{}", text(&output.stderr));
    let table = text(&output.stdout);
    let errors: Vec<&str> = table
        .lines()
        .filter(|l| l.contains("BLOCKING error") || l.contains("hint:"))
        .collect();
    assert_eq!(
        errors,
        ["  BLOCKING error: class 1g.gpu.dra.dev: selector #0 on 8 of 208 devices (gpu.dra.dev/node-a/gpu-0, gpu.dra.dev/node-a/gpu-1, gpu.dra.dev/node-a/gpu-2, ...): CEL runtime error: no such key: profile. consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has() for optional fields"],
        "{table}"
    );
}

#[test]
fn check_without_slices_uses_the_nodes_devices() {
    let output = gpu_dra(&[
        "selectors",
        "check",
        "--class",
        CLASSES,
        "--backend",
        "fake",
        "--fake-profile",
        "dgx-h100",
    ]);
    assert_eq!(
        code(&output),
        1,
        "static MIG mode without MIG devices: the MIG class matches nothing"
    );
    let table = text(&output.stdout);
    assert!(
        table.contains("class gpu.dra.dev: 8 of 8 devices match"),
        "{table}"
    );
    assert!(table.contains("class mig.gpu.dra.dev: 0 of 8"), "{table}");
}

#[test]
fn in_use_shares_leave_the_rest_of_a_shared_gpu_to_the_claim() {
    let dir = tempfile::tempdir().expect("temp dir");
    let write = |name: &str, value: Value| {
        let path = dir.path().join(name);
        std::fs::write(&path, value.to_string()).expect("write");
        path.display().to_string()
    };
    let slices = write(
        "slices.json",
        serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "node-a-gpu"},
            "spec": {
                "driver": "gpu.dra.dev", "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": [{
                    "name": "gpu-0", "allowMultipleAllocations": true,
                    "attributes": {"type": {"string": "gpu"}, "sharing": {"string": "MPS"}},
                    "capacity": {"memory": {"value": "80Gi", "requestPolicy":
                        {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}},
                }],
            },
        }),
    );
    let in_use = write(
        "in-use.json",
        serde_json::json!([{
            "driver": "gpu.dra.dev", "pool": "node-a", "device": "gpu-0",
            "shareID": "0b9c3e52-5f0e-4d6a-9a43-6d0f3c1f2b7e",
            "consumedCapacity": {"memory": "70Gi"},
        }]),
    );
    let claim = |memory: &str| {
        write(
            &format!("claim-{memory}.json"),
            serde_json::json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "mps", "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "gpu.dra.dev",
                    "capacity": {"requests": {"memory": memory}},
                }}]}},
            }),
        )
    };
    let slices = Path::new(&slices);

    let fits = allocate(&claim("9.5Gi"), slices, &["--in-use", &in_use]);
    assert_eq!(code(&fits), 0, "{}", text(&fits.stderr));
    let json: Value = serde_json::from_slice(&fits.stdout).expect("JSON");
    let result = &json["results"][0];
    assert_eq!(result["device"], "gpu-0");
    assert_eq!(
        result["consumedCapacity"],
        serde_json::json!({"memory": "10Gi"})
    );
    assert_eq!(
        result["shareID"].as_str().map(str::len),
        Some(36),
        "{result}"
    );

    let refused = allocate(&claim("20Gi"), slices, &["--in-use", &in_use]);
    assert_eq!(code(&refused), 1, "{}", text(&refused.stderr));
    let json: Value = serde_json::from_slice(&refused.stdout).expect("JSON");
    let reason = json["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("gpu-0 needs 20Gi of capacity memory, which has 10Gi left"),
        "{reason}"
    );
}

#[test]
fn check_reports_malformed_configs_naming_object_entry_and_field() {
    let (_dir, slices) = node_slices();
    let slices = slices.to_str().expect("path");
    let bad_class = fixture("class-bad-config.yaml");
    let bad_claims = fixture("claims-bad-config.yaml");
    let args = |output: &'static str| {
        vec![
            "selectors",
            "check",
            "--class",
            CLASSES,
            "--class",
            bad_class.as_str(),
            "--claim",
            bad_claims.as_str(),
            "--slices",
            slices,
            "-o",
            output,
        ]
    };

    let output = gpu_dra(&args("table"));
    assert_eq!(code(&output), 2, "{}", text(&output.stderr));
    let table = text(&output.stdout);
    for line in [
        "  config error: DeviceClass shared.gpu.dra.dev: config[1] (GpuConfig): sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100",
        "  config error: claim ml/mps: config[0] (GpuConfig): sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be a positive quantity of bytes such as 10Gi",
        "  config error: claim ml/sliced: config[0]: apiVersion: must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1",
        "  config error: claim ml/sliced: config[1] (MigConfig): sharing.timeSlicingConfig: not allowed in MigConfig (MIG devices have no time-slice interval)",
        "CONFIG errors: claims that carry these configs (theirs or their class's) fail to prepare",
    ] {
        assert!(table.contains(&format!("{line}\n")), "{line}\n---\n{table}");
    }
    assert!(!table.contains("nic.example.com"), "{table}");
    assert!(!table.contains("claim ml/fine: config"), "{table}");
    // Selectors are still checked: the class matches its GPUs.
    assert!(table.contains("class shared.gpu.dra.dev: 8 of "), "{table}");

    let output = gpu_dra(&args("json"));
    assert_eq!(code(&output), 2);
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(json["exitCode"], 2);
    let errors: Vec<(Value, Value, Value)> = json["subjects"]
        .as_array()
        .expect("subjects")
        .iter()
        .flat_map(|s| s["errors"].as_array().cloned().unwrap_or_default())
        .map(|e| {
            (
                e["config"].clone(),
                e["blocking"].clone(),
                e["message"].clone(),
            )
        })
        .collect();
    assert_eq!(errors.len(), 4, "{errors:?}");
    assert_eq!(
        errors[0],
        (
            Value::from(1),
            Value::from(false),
            Value::from("DeviceClass shared.gpu.dra.dev: config[1] (GpuConfig): sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100")
        )
    );
    assert_eq!(errors[3].0, 1);
}
