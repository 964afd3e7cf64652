//! `gpu-dra selectors allocate` on the inputs where the scheduler's answer is an error rather than
//! "does not fit" (exit 2), and on an empty cluster (exit 1); each message is printed once, without
//! its cause repeated.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};

const CLASS: &str = r#"{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
  "metadata": {"name": "gpu"},
  "spec": {"selectors": [{"cel": {"expression": "device.driver == \"gpu.dra.dev\""}}]}}"#;

/// Files in a temp dir that lives as long as the value.
struct Files(tempfile::TempDir);

impl Files {
    fn new() -> Files {
        let files = Files(tempfile::tempdir().expect("temp dir"));
        files.write("class.json", CLASS);
        files
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.path().join(name);
        std::fs::write(&path, text).expect("write");
        path
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

fn claim(requests: Value, constraints: Value) -> String {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": "c", "namespace": "ml"},
           "spec": {"devices": {"requests": requests, "constraints": constraints}}})
    .to_string()
}

fn one_gpu() -> String {
    claim(
        json!([{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]),
        json!([]),
    )
}

fn all_gpus(constraints: Value) -> String {
    claim(
        json!([{"name": "gpus", "exactly": {"deviceClassName": "gpu", "allocationMode": "All"}}]),
        constraints,
    )
}

/// A slice of node-a's pool `node-a` at generation 1 of `count` slices.
fn slice(name: &str, count: i64, devices: Value) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
           "metadata": {"name": name},
           "spec": {"driver": "gpu.dra.dev", "nodeName": "node-a", "devices": devices,
                    "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": count}}})
}

fn gpu(name: &str, domain: &str) -> Value {
    json!({"name": name, "attributes": {"nvlinkDomain": {"string": domain}}})
}

fn list(items: Vec<Value>) -> String {
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

fn allocate(files: &Files, claim: &Path, slices: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-dra"))
        .args(["selectors", "allocate", "--claim"])
        .arg(claim)
        .arg("--class")
        .arg(files.path("class.json"))
        .arg("--slices")
        .arg(slices)
        .args(["--node", "node-a", "-o", "json"])
        .output()
        .expect("gpu-dra runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).to_string()
}

/// Exit 2, nothing on stdout, and exactly `message` on stderr.
#[track_caller]
fn assert_error(output: &Output, message: &str) {
    assert_eq!(output.status.code(), Some(2), "{}", stderr(output));
    assert!(output.stdout.is_empty());
    assert_eq!(stderr(output), format!("error: {message}\n"));
}

#[test]
fn invalid_pools_are_an_error_when_nothing_else_fits() {
    let files = Files::new();
    let claim = files.write("claim.json", &one_gpu());
    let duplicate = files.write(
        "slices.json",
        &list(vec![
            slice("node-a-1", 2, json!([gpu("gpu-0", "A")])),
            slice("node-a-2", 2, json!([gpu("gpu-0", "A")])),
        ]),
    );
    assert_error(
        &allocate(&files, &claim, &duplicate),
        "claim ml/c: invalid resource pools were encountered: pool gpu.dra.dev/node-a: \
         duplicate device name gpu-0",
    );

    // Another pool with a free GPU: the invalid one is passed over.
    let mut other = slice("other-1", 1, json!([gpu("gpu-7", "B")]));
    other["spec"]["pool"]["name"] = json!("other");
    let both = files.write(
        "both.json",
        &list(vec![
            slice("node-a-1", 2, json!([gpu("gpu-0", "A")])),
            slice("node-a-2", 2, json!([gpu("gpu-0", "A")])),
            other,
        ]),
    );
    let output = allocate(&files, &claim, &both);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(json["results"][0]["pool"], "other");
    assert_eq!(json["results"][0]["device"], "gpu-7");
}

#[test]
fn no_slices_at_all_is_not_allocated() {
    let files = Files::new();
    let claim = files.write("claim.json", &one_gpu());
    for (name, text) in [
        ("empty.yaml", ""),
        ("empty-list.json", &list(vec![]) as &str),
    ] {
        let slices = files.write(name, text);
        let output = allocate(&files, &claim, &slices);
        assert_eq!(output.status.code(), Some(1), "{name}: {}", stderr(&output));
        let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
        assert_eq!(json["allocated"], false);
        assert_eq!(
            json["reason"],
            "request gpu: not enough devices: 0 match the selectors, 0 of them usable, 1 wanted"
        );
    }
}

#[test]
fn all_mode_on_an_incomplete_pool_is_an_error() {
    let files = Files::new();
    let claim = files.write("claim.json", &all_gpus(json!([])));
    let slices = files.write(
        "slices.json",
        &list(vec![slice("node-a-1", 2, json!([gpu("gpu-0", "A")]))]),
    );
    assert_error(
        &allocate(&files, &claim, &slices),
        "claim ml/c: request gpus: asks for all devices, but resource pool gpu.dra.dev/node-a is \
         currently being updated (incomplete: 1 of 2 slices at generation 1)",
    );
}

#[test]
fn a_constraint_all_mode_devices_cannot_meet_is_an_error() {
    let files = Files::new();
    let claim = files.write(
        "claim.json",
        &all_gpus(json!([{"matchAttribute": "gpu.dra.dev/nvlinkDomain"}])),
    );
    let slices = files.write(
        "slices.json",
        &list(vec![slice(
            "node-a-1",
            1,
            json!([gpu("gpu-0", "A"), gpu("gpu-1", "B")]),
        )]),
    );
    assert_error(
        &allocate(&files, &claim, &slices),
        "claim ml/c: request gpus: cannot add device gpu.dra.dev/node-a/gpu-1 because \
         constraint #0 would not be satisfied",
    );
}

#[test]
fn causes_are_not_repeated() {
    let files = Files::new();
    let claim = files.write("claim.json", &one_gpu());
    let missing = files.path("no-such-file.json");
    let output = allocate(&files, &claim, &missing);
    assert_error(
        &output,
        &format!(
            "{}: cannot read: No such file or directory (os error 2)",
            missing.display()
        ),
    );

    // A CEL runtime error names the claim, request, selector and device once.
    let typo = files.write(
        "typo.json",
        &claim_with_selector(r#"device.attributes["gpu.dra.dev"].cudaCores >= 1000"#),
    );
    let slices = files.write(
        "slices.json",
        &list(vec![slice("node-a-1", 1, json!([gpu("gpu-0", "A")]))]),
    );
    let output = allocate(&files, &typo, &slices);
    assert_eq!(output.status.code(), Some(2));
    let text = stderr(&output);
    assert!(
        text.starts_with(
            "error: claim ml/c: request gpu: selector #0 on device gpu.dra.dev/node-a/gpu-0: \
             CEL runtime error: "
        ),
        "{text}"
    );
    assert_eq!(text.matches("runtime error").count(), 1, "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");
}

fn claim_with_selector(expression: &str) -> String {
    claim(
        json!([{"name": "gpu", "exactly": {"deviceClassName": "gpu",
            "selectors": [{"cel": {"expression": expression}}]}}]),
        json!([]),
    )
}
