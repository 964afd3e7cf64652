//! Unit tests of the CDI spec types and checks: the minimum `cdiVersion` each feature needs, what a
//! container runtime would reject (named by device and field), and the Go structs' JSON keys.

use super::*;

fn gpu_edits() -> ContainerEdits {
    ContainerEdits {
        env: vec!["GPU_DRA_DEVICE_GPU_0=GPU-0".into()],
        device_nodes: vec![DeviceNode {
            path: "/dev/nvidia0".into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn spec_with(edits: ContainerEdits) -> Spec {
    Spec {
        cdi_version: "0.7.0".into(),
        kind: "k8s.gpu.dra.dev/gpu".into(),
        devices: vec![Device {
            name: "gpu-0".into(),
            container_edits: edits,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn error_of(spec: &Spec) -> String {
    match validate(spec) {
        Err(e) => e.to_string(),
        Ok(()) => panic!("spec should be rejected: {spec:?}"),
    }
}

#[test]
fn minimum_0_3_0_for_plain_specs() {
    assert_eq!(minimum_version(&spec_with(gpu_edits())), "0.3.0");
}

#[test]
fn minimum_0_4_0_for_typed_mount() {
    let mut spec = spec_with(gpu_edits());
    spec.devices[0].container_edits.mounts.push(Mount {
        host_path: "/a".into(),
        container_path: "/b".into(),
        mount_type: Some("bind".into()),
        ..Default::default()
    });
    assert_eq!(minimum_version(&spec), "0.4.0");
    spec.devices[0].container_edits.mounts[0].mount_type = Some(String::new());
    assert_eq!(minimum_version(&spec), "0.3.0");
}

#[test]
fn minimum_0_5_0_for_host_path_or_digit_start() {
    let mut spec = spec_with(gpu_edits());
    spec.container_edits.device_nodes.push(DeviceNode {
        path: "/dev/nvidiactl".into(),
        host_path: Some("/dev/null".into()),
        ..Default::default()
    });
    assert_eq!(minimum_version(&spec), "0.5.0");

    let mut spec = spec_with(gpu_edits());
    spec.devices[0].name = "0-gpu".into();
    assert_eq!(minimum_version(&spec), "0.5.0");
}

#[test]
fn minimum_0_6_0_for_annotations_or_dotted_class() {
    let mut spec = spec_with(gpu_edits());
    spec.annotations.insert("a".into(), "b".into());
    assert_eq!(minimum_version(&spec), "0.6.0");

    let mut spec = spec_with(gpu_edits());
    spec.devices[0].annotations.insert("a".into(), "b".into());
    assert_eq!(minimum_version(&spec), "0.6.0");

    let mut spec = spec_with(gpu_edits());
    spec.kind = "vendor.com/gpu.mig".into();
    assert_eq!(minimum_version(&spec), "0.6.0");
}

#[test]
fn minimum_0_7_0_for_additional_gids() {
    let mut spec = spec_with(gpu_edits());
    spec.devices[0].container_edits.additional_gids.push(44);
    assert_eq!(minimum_version(&spec), "0.7.0");

    let mut spec = spec_with(gpu_edits());
    spec.container_edits.additional_gids.push(44);
    spec.devices[0].name = "0-gpu".into();
    assert_eq!(minimum_version(&spec), "0.7.0");
}

#[test]
fn accepts_a_typical_spec_and_versions_with_v_prefix() {
    let mut spec = spec_with(gpu_edits());
    assert!(validate(&spec).is_ok());
    spec.cdi_version = "v0.3.0".into();
    assert!(validate(&spec).is_ok());
}

#[test]
fn rejects_unknown_or_too_low_versions() {
    let mut spec = spec_with(gpu_edits());
    spec.cdi_version = "0.9.0".into();
    assert!(error_of(&spec).contains("unknown cdiVersion"));
    spec.devices[0].container_edits.additional_gids.push(44);
    spec.cdi_version = "0.6.0".into();
    assert!(error_of(&spec).contains("minimum"));
}

#[test]
fn rejects_bad_kinds() {
    for kind in [
        "gpu",
        "/gpu",
        "vendor/",
        "a/b/c",
        "1vendor/gpu",
        "vendor/gpu-",
        "ven dor/gpu",
    ] {
        let mut spec = spec_with(gpu_edits());
        spec.kind = kind.into();
        assert!(error_of(&spec).contains("kind"), "{kind}");
    }
}

#[test]
fn rejects_bad_device_names_and_duplicates() {
    for name in ["", "-gpu", "gpu-", "gp/u", "gpu 0", ".."] {
        let mut spec = spec_with(gpu_edits());
        spec.devices[0].name = name.into();
        assert!(error_of(&spec).contains("device name"), "{name:?}");
    }
    let mut spec = spec_with(gpu_edits());
    spec.devices.push(spec.devices[0].clone());
    assert!(error_of(&spec).contains("used twice"));
    spec.devices.clear();
    assert!(error_of(&spec).contains("no devices"));
}

#[test]
fn rejects_bad_edits_naming_device_and_field() {
    type Edit = fn(&mut ContainerEdits);
    let cases: [(Edit, &str); 10] = [
        (
            |e| *e = ContainerEdits::default(),
            "containerEdits is empty",
        ),
        (|e| e.env.push("=x".into()), "containerEdits.env[1]"),
        (|e| e.env.push("NOVALUE".into()), "containerEdits.env[1]"),
        (
            |e| e.device_nodes[0].path = "dev/nvidia0".into(),
            "deviceNodes[0].path",
        ),
        (
            |e| e.device_nodes[0].device_type = Some("x".into()),
            "deviceNodes[0].type",
        ),
        (
            |e| e.device_nodes[0].permissions = Some("rx".into()),
            "deviceNodes[0].permissions",
        ),
        (
            |e| {
                e.mounts.push(Mount {
                    host_path: "/a".into(),
                    ..Default::default()
                })
            },
            "mounts[0].containerPath",
        ),
        (
            |e| {
                e.hooks.push(Hook {
                    hook_name: "prestart".into(),
                    path: "hook".into(),
                    ..Default::default()
                })
            },
            "hooks[0].path",
        ),
        (
            |e| {
                e.hooks.push(Hook {
                    hook_name: "preStart".into(),
                    path: "/hook".into(),
                    ..Default::default()
                })
            },
            "hooks[0].hookName",
        ),
        (
            |e| {
                e.hooks.push(Hook {
                    hook_name: "createContainer".into(),
                    path: "/hook".into(),
                    env: vec!["X".into()],
                    ..Default::default()
                })
            },
            "hooks[0].env[0]",
        ),
    ];
    for (edit, field) in cases {
        let mut spec = spec_with(gpu_edits());
        edit(&mut spec.devices[0].container_edits);
        let err = error_of(&spec);
        assert!(
            err.contains("device \"gpu-0\"") && err.contains(field),
            "{err} lacks {field}"
        );
    }
}

#[test]
fn accepts_none_and_empty_permissions() {
    for perms in ["", "none", "rw", "rwm"] {
        let mut spec = spec_with(gpu_edits());
        spec.devices[0].container_edits.device_nodes[0].permissions = Some(perms.into());
        assert!(validate(&spec).is_ok(), "{perms}");
    }
}

#[test]
fn serializes_go_keys_and_skips_empty_fields() {
    let mut spec = spec_with(gpu_edits());
    spec.devices[0].container_edits.device_nodes[0].host_path = Some("/dev/null".into());
    spec.devices[0].container_edits.additional_gids.push(44);
    let json = serde_json::to_value(&spec).unwrap_or_default();
    let expected = serde_json::json!({
        "cdiVersion": "0.7.0",
        "kind": "k8s.gpu.dra.dev/gpu",
        "devices": [{
            "name": "gpu-0",
            "containerEdits": {
                "env": ["GPU_DRA_DEVICE_GPU_0=GPU-0"],
                "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/null"}],
                "additionalGids": [44]
            }
        }]
    });
    assert_eq!(json, expected);
}

#[test]
fn rejects_unknown_fields_on_read() {
    let json = r#"{"cdiVersion":"0.7.0","kind":"a/b","devices":[{"name":"d","containerEdits":{"additionalGIDs":[1]}}]}"#;
    assert!(serde_json::from_str::<Spec>(json).is_err());
    // The array form that SPEC.md's sketch shows (and Akri copied); the spec-level edits are an object.
    let array_edits =
        r#"{"cdiVersion":"0.3.0","kind":"a/b","devices":[],"containerEdits":[{"env":["A=1"]}]}"#;
    assert!(serde_json::from_str::<Spec>(array_edits).is_err());
}
