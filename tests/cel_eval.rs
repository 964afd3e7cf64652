//! `gpu-dra cel eval` as a user runs it: one expression against one device file, with the exit codes of
//! the contract (0 true/false, 2 compile error, 3 runtime error, 1 unreadable device).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::json;

fn device_file(dir: &Path) -> PathBuf {
    let path = dir.join("device.json");
    let device = json!({
        "name": "gpu-0",
        "attributes": {
            "type": {"string": "gpu"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "driverVersion": {"version": "550.54.15"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
            "index": {"int": 0},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    });
    std::fs::write(&path, serde_json::to_vec_pretty(&device).expect("json")).expect("write device");
    path
}

fn eval(device: &Path, extra: &[&str], expression: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .args(["cel", "eval", "--device"])
        .arg(device)
        .args(extra)
        .arg(expression)
        .output()
        .expect("gpu-dra runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).to_string()
}

#[test]
fn prints_true_or_false_and_exits_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let device = device_file(dir.path());
    for (expression, expected) in [
        (
            r#"device.attributes["gpu.dra.dev"].type == "gpu""#,
            "true\n",
        ),
        (
            r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40Gi")) >= 0"#,
            "true\n",
        ),
        (
            r#"device.capacity["gpu.dra.dev"].memory.isGreaterThan(quantity("100Gi"))"#,
            "false\n",
        ),
        (r#"device.driver == "gpu.dra.dev""#, "true\n"),
        (
            r#"device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:00""#,
            "true\n",
        ),
        (
            r#"device.attributes["gpu.dra.dev"].driverVersion.isGreaterThan(semver("535.0.0"))"#,
            "true\n",
        ),
        // An unknown domain is an empty map, so guarding with has() or .? is false, not an error.
        (
            r#"has(device.attributes["no.such.domain"].type)"#,
            "false\n",
        ),
        (
            r#"device.attributes["gpu.dra.dev"].?nosuch.orValue("x") == "x""#,
            "true\n",
        ),
    ] {
        let output = eval(&device, &[], expression);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{expression}: {}",
            text(&output.stderr)
        );
        assert_eq!(text(&output.stdout), expected, "{expression}");
    }
}

#[test]
fn the_driver_flag_sets_device_driver_and_the_domain_of_plain_names() {
    let dir = tempfile::tempdir().expect("tempdir");
    let device = device_file(dir.path());
    let output = eval(
        &device,
        &["--driver", "gpu.example.com"],
        r#"device.driver == "gpu.example.com" && device.attributes["gpu.example.com"].index == 0"#,
    );
    assert_eq!(text(&output.stdout), "true\n", "{}", text(&output.stderr));
}

#[test]
fn a_compile_error_exits_2_and_a_runtime_error_exits_3() {
    let dir = tempfile::tempdir().expect("tempdir");
    let device = device_file(dir.path());

    let output = eval(&device, &[], r#"device.attributes["gpu.dra.dev"].type =="#);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        text(&output.stderr).starts_with("compile error:"),
        "{}",
        text(&output.stderr)
    );
    assert!(output.stdout.is_empty());

    // An unknown attribute is an error, never false: in the scheduler it aborts allocation.
    let output = eval(
        &device,
        &[],
        r#"device.attributes["gpu.dra.dev"].model == "H100""#,
    );
    assert_eq!(output.status.code(), Some(3));
    let stderr = text(&output.stderr);
    assert!(stderr.starts_with("runtime error:"), "{stderr}");
    assert!(stderr.contains("no such key: model"), "{stderr}");
    assert!(output.stdout.is_empty());
}

#[test]
fn api_server_mode_applies_the_feature_gates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let device = device_file(dir.path());
    let expression = "device.allowMultipleAllocations == false";
    // The scheduler knows every field.
    assert_eq!(text(&eval(&device, &[], expression).stdout), "true\n");
    // A new selector needs the DRAConsumableCapacity gate for this field.
    let output = eval(&device, &["--new-expression"], expression);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        text(&output.stderr).contains("undefined field 'allowMultipleAllocations'"),
        "{}",
        text(&output.stderr)
    );
    let output = eval(
        &device,
        &["--new-expression", "--consumable-capacity"],
        expression,
    );
    assert_eq!(text(&output.stdout), "true\n", "{}", text(&output.stderr));
}

#[test]
fn an_unreadable_device_file_names_the_file_and_exits_1() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, r#"{"attributes": {}}"#).expect("write");
    let output = eval(&broken, &[], "true");
    assert_eq!(output.status.code(), Some(1));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("broken.json"), "{stderr}");
    assert!(stderr.contains("name"), "{stderr}");

    let output = eval(&dir.path().join("missing.json"), &[], "true");
    assert_eq!(output.status.code(), Some(1));
    assert!(text(&output.stderr).contains("missing.json"));
}
