//! Cross-checks the CDI specs gpu-dra writes against the `container-device-interface` crate, a port of the
//! CDI Go library that container runtimes use: what we write it must load, at the `cdiVersion` it computes,
//! and what it rejects our validator must reject too.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use container_device_interface::spec::read_spec;
use container_device_interface::version::minimum_required_version;
use gpu_dra::cdi::{validate, CdiRegistry, ContainerEdits, DeviceNode, Hook, Mount, Spec};
use gpu_dra::support::cdi_runtime;

const DRIVER: &str = "gpu.dra.dev";
const CLAIM: &str = "3f2c1a9e-8b7d-4c6e-9a01-23456789abcd";

type Devices = Vec<(String, ContainerEdits)>;

/// A fake GPU as the fake backend prepares it: device nodes that exist on no host, with `/dev/null`'s
/// numbers so that the runtime makes them on a node without GPUs.
fn fake_gpu(index: u32) -> (String, ContainerEdits) {
    let node = |path: &str| DeviceNode {
        path: path.into(),
        device_type: Some("c".into()),
        major: Some(1),
        minor: Some(3),
        ..Default::default()
    };
    let edits = ContainerEdits {
        env: vec![format!(
            "GPU_DRA_DEVICE_GPU_{index}=GPU-8f3e2d1c-0000-4000-8000-00000000000{index}"
        )],
        device_nodes: vec![node(&format!("/dev/nvidia{index}")), node("/dev/nvidiactl")],
        ..Default::default()
    };
    (format!("gpu-{index}"), edits)
}

/// Loads `path` with the CDI crate; on success returns its qualified device names and minimum version.
fn load_with_cdi_crate(path: &Path) -> Result<(BTreeSet<String>, String), String> {
    let spec = read_spec(&PathBuf::from(path), 0).map_err(|e| format!("{e:#}"))?;
    let names = spec
        .get_devices()
        .values()
        .map(|d| d.get_qualified_name())
        .collect();
    let minimum = minimum_required_version(&spec.cdi_spec).map_err(|e| format!("{e:#}"))?;
    Ok((names, minimum.to_string()))
}

fn written_version(path: &Path) -> String {
    let json: serde_json::Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
    json["cdiVersion"].as_str().unwrap().to_owned()
}

#[test]
fn written_specs_load_in_the_cdi_crate_at_its_minimum_version() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cdi"); // created by the writer
    let registry = CdiRegistry::new(&root, DRIVER);

    let typed_mount = ContainerEdits {
        mounts: vec![Mount {
            host_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
            container_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
            options: vec!["ro".into(), "nosuid".into(), "bind".into()],
            mount_type: Some("bind".into()),
        }],
        hooks: vec![Hook {
            hook_name: "createContainer".into(),
            path: "/usr/bin/nvidia-cdi-hook".into(),
            args: vec!["nvidia-cdi-hook".into(), "update-ldcache".into()],
            timeout: Some(10),
            ..Default::default()
        }],
        ..Default::default()
    };
    let with_gids = ContainerEdits {
        env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
        additional_gids: vec![44],
        ..Default::default()
    };
    let cases: Vec<(&str, Devices, &str)> = vec![
        (CLAIM, vec![fake_gpu(0), fake_gpu(1)], "0.5.0"),
        ("claim-a", vec![("mig-1g".into(), typed_mount)], "0.4.0"),
        ("claim-b", vec![("gpu-0".into(), with_gids)], "0.7.0"),
        (
            "claim-c",
            vec![(
                "gpu-0".into(),
                ContainerEdits {
                    env: vec!["A=1".into()],
                    ..Default::default()
                },
            )],
            "0.3.0",
        ),
    ];
    for (claim, devices, expected_version) in cases {
        let ids = registry.write_claim_spec(claim, &devices).unwrap();
        let path = registry.spec_path(claim);
        assert_eq!(path.parent(), Some(root.as_path()));
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );

        let (names, minimum) =
            load_with_cdi_crate(&path).unwrap_or_else(|e| panic!("{claim}: {e}"));
        let version = written_version(&path);
        assert_eq!(
            version, minimum,
            "{claim}: written cdiVersion is not the CDI crate's minimum"
        );
        assert_eq!(version, expected_version, "{claim}");
        assert_eq!(
            names,
            ids.iter().cloned().collect::<BTreeSet<_>>(),
            "{claim}"
        );
        let expected_ids: Vec<String> = devices
            .iter()
            .map(|(d, _)| format!("k8s.gpu.dra.dev/gpu={claim}-{d}"))
            .collect();
        assert_eq!(ids, expected_ids, "ids in the order of the devices");

        let read = registry.read_claim_spec(claim).unwrap().unwrap();
        assert!(validate(&read).is_ok());
        assert_eq!(read.devices.len(), devices.len());
        // And a runtime creates a container from it on a host without GPU device files.
        cdi_runtime::inject(&[&root], &ids).unwrap_or_else(|e| panic!("{claim}: {e}"));
    }
}

#[test]
fn claim_specs_lists_own_files_cleans_temp_files_and_leaves_others_alone() {
    let dir = tempfile::tempdir().unwrap();
    let registry = CdiRegistry::new(dir.path(), DRIVER);
    assert_eq!(registry.claim_specs().unwrap(), Vec::<String>::new());
    registry
        .write_claim_spec("claim-b", &[fake_gpu(0)])
        .unwrap();
    registry
        .write_claim_spec("claim-a", &[fake_gpu(1)])
        .unwrap();

    let leftover = dir
        .path()
        .join(".k8s.gpu.dra.dev-gpu_claim-c.json.123.0.tmp");
    let others = [
        dir.path().join("nvidia.com-gpu.yaml"),
        dir.path().join("k8s.other.dev-gpu_claim-a.json"),
        dir.path().join(".k8s.other.dev-gpu_claim-a.json.1.0.tmp"),
    ];
    for path in others.iter().chain([&leftover]) {
        fs::write(path, "{}").unwrap();
    }

    assert_eq!(registry.claim_specs().unwrap(), vec!["claim-a", "claim-b"]);
    assert!(
        !leftover.exists(),
        "a temp file of ours left by a crash is removed"
    );
    assert!(
        others.iter().all(|p| p.exists()),
        "files of other vendors are never touched"
    );

    registry.remove_claim_spec("claim-a").unwrap();
    registry.remove_claim_spec("claim-a").unwrap(); // already gone is fine
    assert_eq!(registry.read_claim_spec("claim-a").unwrap(), None);
    assert_eq!(registry.claim_specs().unwrap(), vec!["claim-b"]);
}

#[test]
fn specs_the_cdi_crate_rejects_are_rejected_by_our_validator() {
    let device = |edits: &str| format!(r#"{{"name":"gpu-0","containerEdits":{edits}}}"#);
    let spec = |version: &str, kind: &str, devices: &[String]| {
        format!(
            r#"{{"cdiVersion":"{version}","kind":"{kind}","devices":[{}]}}"#,
            devices.join(",")
        )
    };
    let node = r#"{"deviceNodes":[{"path":"/dev/nvidia0"}]}"#;
    let cases = [
        (
            "permissions rx",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(
                    r#"{"deviceNodes":[{"path":"/dev/nvidia0","permissions":"rx"}]}"#,
                )],
            ),
        ),
        (
            "empty device edits",
            spec("0.5.0", "k8s.gpu.dra.dev/gpu", &[device("{}")]),
        ),
        (
            "device node type",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(
                    r#"{"deviceNodes":[{"path":"/dev/nvidia0","type":"x"}]}"#,
                )],
            ),
        ),
        (
            "empty node path",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(r#"{"deviceNodes":[{"path":""}]}"#)],
            ),
        ),
        (
            "env without =",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(r#"{"env":["NOVALUE"]}"#)],
            ),
        ),
        (
            "env with empty name",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(r#"{"env":["=x"]}"#)],
            ),
        ),
        (
            "unknown hook",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(r#"{"hooks":[{"hookName":"preStart","path":"/h"}]}"#)],
            ),
        ),
        (
            "mount without container path",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(
                    r#"{"mounts":[{"hostPath":"/a","containerPath":""}]}"#,
                )],
            ),
        ),
        (
            "unknown version",
            spec("0.9.0", "k8s.gpu.dra.dev/gpu", &[device(node)]),
        ),
        (
            "digit start at 0.4.0",
            spec(
                "0.4.0",
                "k8s.gpu.dra.dev/gpu",
                &[r#"{"name":"0-gpu","containerEdits":{"env":["A=1"]}}"#.into()],
            ),
        ),
        (
            "additionalGids at 0.6.0",
            spec(
                "0.6.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(r#"{"additionalGids":[44]}"#)],
            ),
        ),
        (
            "bad device name",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[r#"{"name":"gpu/0","containerEdits":{"env":["A=1"]}}"#.into()],
            ),
        ),
        (
            "duplicate devices",
            spec(
                "0.5.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(node), device(node)],
            ),
        ),
        ("no devices", spec("0.5.0", "k8s.gpu.dra.dev/gpu", &[])),
        (
            "bad kind",
            spec("0.5.0", "k8s.gpu.dra.dev", &[device(node)]),
        ),
        ("bad vendor", spec("0.5.0", "1k8s/gpu", &[device(node)])),
        (
            "additionalGIDs spelling",
            spec(
                "0.7.0",
                "k8s.gpu.dra.dev/gpu",
                &[device(r#"{"additionalGIDs":[44]}"#)],
            ),
        ),
        (
            "array containerEdits",
            r#"{"cdiVersion":"0.5.0","kind":"a/b","devices":[{"name":"d","containerEdits":{"env":["A=1"]}}],"containerEdits":[{"env":["A=1"]}]}"#.into(),
        ),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (i, (what, json)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("case-{i}.json"));
        fs::write(&path, json).unwrap();
        assert!(
            load_with_cdi_crate(&path).is_err(),
            "{what}: the CDI crate accepts {json}"
        );
        let ours = serde_json::from_str::<Spec>(json)
            .map_err(|e| e.to_string())
            .and_then(|s| validate(&s).map_err(|e| e.to_string()));
        assert!(ours.is_err(), "{what}: our validator accepts {json}");
    }
    // And a good one, so that the cases above fail for their own reason.
    let good = spec("0.5.0", "k8s.gpu.dra.dev/gpu", &[device(node)]);
    let path = dir.path().join("good.json");
    fs::write(&path, &good).unwrap();
    assert!(load_with_cdi_crate(&path).is_ok());
    assert!(validate(&serde_json::from_str(&good).unwrap()).is_ok());
}

/// The runtime double refuses what containerd refuses when it creates a container from a spec: a
/// device node without type and numbers whose host path does not exist, a type the host file does
/// not have, a device no spec names; and takes the spec's numbers as they are when it gives them.
#[test]
fn the_runtime_double_stats_host_paths_only_for_nodes_without_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let registry = CdiRegistry::new(dir.path(), DRIVER);
    let missing = "/dev/nvidia-caps/nvidia-cap4242";
    assert!(!Path::new(missing).exists());
    let node =
        |host_path: Option<&str>, device_type: Option<&str>, major: Option<i64>| DeviceNode {
            path: missing.into(),
            host_path: host_path.map(str::to_string),
            device_type: device_type.map(str::to_string),
            major,
            minor: major.map(|_| 4242),
            ..Default::default()
        };
    // (what, node, Ok((type, major, minor)) or the error's start)
    type Case<'a> = (&'a str, DeviceNode, Result<(&'a str, i64, i64), &'a str>);
    let cases: Vec<Case> = vec![
        (
            "no numbers, no host file",
            node(None, None, None),
            Err("failed to stat CDI host device \"/dev/nvidia-caps/nvidia-cap4242\": lstat /dev/nvidia-caps/nvidia-cap4242: no such file or directory"),
        ),
        (
            "a type without a major is not enough",
            node(None, Some("c"), None),
            Err("failed to stat CDI host device"),
        ),
        ("type and numbers", node(None, Some("c"), Some(237)), Ok(("c", 237, 4242))),
        (
            "from the host file",
            node(Some("/dev/null"), None, None),
            Ok(("c", 1, 3)),
        ),
        (
            "the host file is not a block device",
            node(Some("/dev/null"), Some("b"), None),
            Err("host type mismatch (b, c)"),
        ),
        (
            "a directory is no device",
            node(Some("/dev"), None, None),
            Err("failed to stat CDI host device \"/dev\": not a device node"),
        ),
    ];
    for (i, (what, node, expected)) in cases.into_iter().enumerate() {
        let claim = format!("claim-{i}");
        let edits = ContainerEdits {
            device_nodes: vec![node],
            ..Default::default()
        };
        let ids = registry
            .write_claim_spec(&claim, &[("gpu-0".to_string(), edits)])
            .unwrap();
        let got = cdi_runtime::inject(&[dir.path()], &ids);
        match (got, expected) {
            (Ok(container), Ok((device_type, major, minor))) => {
                let made = &container.devices[0];
                assert_eq!(made.path, missing, "{what}");
                assert_eq!(
                    (made.device_type.as_str(), made.major, made.minor),
                    (device_type, major, minor),
                    "{what}"
                );
            }
            (Err(error), Err(says)) => {
                let error = error.to_string();
                assert!(error.contains(says), "{what}: {error}");
            }
            (got, expected) => panic!("{what}: got {got:?}, expected {expected:?}"),
        }
    }
    let unknown = cdi_runtime::inject(&[dir.path()], &["k8s.gpu.dra.dev/gpu=nope".to_string()])
        .unwrap_err()
        .to_string();
    assert!(
        unknown.starts_with("unresolvable CDI devices k8s.gpu.dra.dev/gpu=nope"),
        "{unknown}"
    );
}
