use serde_json::json;

use super::*;

/// A GpuConfig (or another kind) with `sharing` as JSON text.
fn config(kind: &str, sharing: &str) -> String {
    format!(r#"{{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "{kind}", "sharing": {sharing}}}"#)
}

fn error(text: &str) -> String {
    match decode_config(text) {
        Ok(config) => panic!("{text} decoded to {config:?}"),
        Err(error) => error.to_string(),
    }
}

fn gpu_error(sharing: &str) -> String {
    error(&config("GpuConfig", sharing))
}

fn decoded(text: &str) -> DeviceConfig {
    decode_config(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

#[test]
fn api_version_must_be_ours_or_nvidias() {
    for api_version in [r#""resource.nvidia.com/v1""#, r#""""#, "null"] {
        let text = format!(r#"{{"apiVersion": {api_version}, "kind": "GpuConfig"}}"#);
        assert_eq!(
            error(&text),
            "apiVersion: must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1",
            "{text}"
        );
    }
    assert_eq!(
        error(r#"{"kind": "GpuConfig"}"#),
        "apiVersion: must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1"
    );
}

#[test]
fn kind_must_be_one_of_ours() {
    for kind in ["MigDeviceConfig", "gpuconfig", ""] {
        assert_eq!(
            error(&config(kind, "null")),
            "kind: must be GpuConfig or MigConfig"
        );
    }
    assert_eq!(
        error(r#"{"apiVersion": "gpu.dra.dev/v1alpha1"}"#),
        "kind: must be GpuConfig or MigConfig"
    );
}

#[test]
fn unknown_fields_are_refused_at_every_level() {
    assert_eq!(
        error(r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "metadata": {}}"#),
        "metadata: unknown field"
    );
    assert_eq!(
        gpu_error(r#"{"strategy": "Exclusive", "Strategy": "MPS"}"#),
        "sharing.Strategy: unknown field"
    );
    assert_eq!(
        gpu_error(r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"intervall": "Long"}}"#),
        "sharing.timeSlicingConfig.intervall: unknown field"
    );
    assert_eq!(
        gpu_error(r#"{"strategy": "MPS", "mpsConfig": {"foo": 1}}"#),
        "sharing.mpsConfig.foo: unknown field"
    );
    // NVIDIA's field that this driver does not have.
    assert_eq!(
        gpu_error(r#"{"strategy": "MPS", "mpsConfig": {"multiUser": true}}"#),
        "sharing.mpsConfig.multiUser: unknown field"
    );
}

#[test]
fn duplicate_keys_are_refused_with_their_path() {
    assert_eq!(
        error(
            r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "kind": "MigConfig"}"#
        ),
        "kind: duplicate key"
    );
    assert_eq!(
        gpu_error(r#"{"strategy": "MPS", "strategy": "TimeSlicing"}"#),
        "sharing.strategy: duplicate key"
    );
    assert_eq!(
        gpu_error(
            r#"{"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"gpu-0": "1Gi", "gpu-1": "1Gi", "gpu-0": "2Gi"}}}"#
        ),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu-0]: duplicate key"
    );
    // Found while parsing, before any other check, even inside a field that is unknown anyway.
    assert_eq!(
        error(r#"{"apiVersion": "v1", "extra": [{"a": 1, "a": 2}]}"#),
        "extra[0].a: duplicate key"
    );
    // A value has no repeated keys left: decoding it sees the last one, as serde_json keeps it.
    let value: Value = serde_json::from_str(
        r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "MigConfig", "kind": "GpuConfig"}"#,
    )
    .expect("JSON");
    assert_eq!(
        decode_config_value(&value).expect("valid").kind(),
        "GpuConfig"
    );
}

#[test]
fn wrong_types_say_what_is_expected() {
    assert_eq!(
        error(r#"{"apiVersion": 1, "kind": "GpuConfig"}"#),
        "apiVersion: must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1"
    );
    assert_eq!(
        error(r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": ["GpuConfig"]}"#),
        "kind: must be GpuConfig or MigConfig"
    );
    assert_eq!(
        gpu_error(r#"{"strategy": true}"#),
        "sharing.strategy: must be a string"
    );
    assert_eq!(
        gpu_error(r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": 2}}"#),
        "sharing.timeSlicingConfig.interval: must be a string"
    );
    for percentage in [r#""50""#, "50.5", "50.0", "[50]"] {
        assert_eq!(
            gpu_error(&format!(
                r#"{{"strategy": "MPS", "mpsConfig": {{"defaultActiveThreadPercentage": {percentage}}}}}"#
            )),
            "sharing.mpsConfig.defaultActiveThreadPercentage: must be an integer",
            "{percentage}"
        );
    }
    assert_eq!(error("[]"), "parameters: must be an object");
    assert_eq!(error(r#""GpuConfig""#), "parameters: must be an object");
    assert_eq!(gpu_error(r#""MPS""#), "sharing: must be an object");
    assert_eq!(
        gpu_error(r#"{"strategy": "TimeSlicing", "timeSlicingConfig": "Long"}"#),
        "sharing.timeSlicingConfig: must be an object"
    );
    assert_eq!(
        gpu_error(r#"{"strategy": "MPS", "mpsConfig": []}"#),
        "sharing.mpsConfig: must be an object"
    );
    assert_eq!(
        gpu_error(
            r#"{"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": "4Gi"}}"#
        ),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: must be an object"
    );
}

#[test]
fn strategy_is_required_and_one_of_three() {
    assert_eq!(gpu_error("{}"), "sharing.strategy: required");
    assert_eq!(
        gpu_error(r#"{"strategy": null}"#),
        "sharing.strategy: required"
    );
    for strategy in ["Mps", "timeslicing", "", "MIG"] {
        assert_eq!(
            gpu_error(&format!(r#"{{"strategy": "{strategy}"}}"#)),
            "sharing.strategy: must be one of Exclusive, TimeSlicing, MPS"
        );
    }
}

#[test]
fn interval_is_one_of_four() {
    assert_eq!(
        gpu_error(r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "VeryLong"}}"#),
        "sharing.timeSlicingConfig.interval: must be one of Default, Short, Medium, Long"
    );
}

#[test]
fn settings_only_with_their_strategy() {
    for strategy in ["Exclusive", "MPS"] {
        assert_eq!(
            gpu_error(&format!(
                r#"{{"strategy": "{strategy}", "timeSlicingConfig": {{"interval": "Long"}}}}"#
            )),
            "sharing.timeSlicingConfig: only allowed with strategy TimeSlicing"
        );
    }
    for strategy in ["Exclusive", "TimeSlicing"] {
        assert_eq!(
            gpu_error(&format!(
                r#"{{"strategy": "{strategy}", "mpsConfig": {{}}}}"#
            )),
            "sharing.mpsConfig: only allowed with strategy MPS"
        );
    }
    assert_eq!(
        error(&config(
            "MigConfig",
            r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}"#
        )),
        "sharing.timeSlicingConfig: not allowed in MigConfig (MIG devices have no time-slice interval)"
    );
    // Even an empty one, and whatever the strategy.
    assert_eq!(
        error(&config("MigConfig", r#"{"strategy": "MPS", "timeSlicingConfig": {}}"#)),
        "sharing.timeSlicingConfig: not allowed in MigConfig (MIG devices have no time-slice interval)"
    );
    // null is absent, as in Kubernetes' decoding.
    decoded(&config(
        "GpuConfig",
        r#"{"strategy": "MPS", "timeSlicingConfig": null}"#,
    ));
}

#[test]
fn active_thread_percentage_is_1_to_100() {
    for percentage in ["0", "101", "-1", "255", "256", "18446744073709551615"] {
        assert_eq!(
            gpu_error(&format!(
                r#"{{"strategy": "MPS", "mpsConfig": {{"defaultActiveThreadPercentage": {percentage}}}}}"#
            )),
            "sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100",
            "{percentage}"
        );
    }
    for percentage in [1u8, 100] {
        let config = decoded(&config(
            "GpuConfig",
            &format!(
                r#"{{"strategy": "MPS", "mpsConfig": {{"defaultActiveThreadPercentage": {percentage}}}}}"#
            ),
        ));
        let SharingSettings::Mps(settings) = config.effective() else {
            panic!("MPS expected");
        };
        assert_eq!(settings.active_thread_percentage, Some(percentage));
    }
}

#[test]
fn memory_limits_are_positive_whole_bytes() {
    let limit = |value: &str| {
        config(
            "GpuConfig",
            &format!(
                r#"{{"strategy": "MPS", "mpsConfig": {{"defaultPinnedDeviceMemoryLimit": {value}}}}}"#
            ),
        )
    };
    for bad in [
        r#""0""#,
        r#""-1Gi""#,
        r#""1.5""#,
        r#""500m""#,
        r#""10GB""#,
        r#""""#,
        r#"" 1Gi""#,
    ] {
        assert_eq!(
            error(&limit(bad)),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be a positive quantity of bytes such as 10Gi",
            "{bad}"
        );
    }
    // A bare number is refused as the admission policy refuses it: quantities are strings.
    for bad in ["1073741824", "0", "-5", "1.5", "true", "{}"] {
        assert_eq!(
            error(&limit(bad)),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be a string",
            "{bad}"
        );
    }
    for (good, bytes) in [
        (r#""10Gi""#, 10u64 << 30),
        (r#""0.5Ki""#, 512),
        (r#""1e3""#, 1000),
        (r#""2G""#, 2_000_000_000),
        (r#""1073741824""#, 1 << 30),
    ] {
        let SharingSettings::Mps(settings) = decoded(&limit(good)).effective() else {
            panic!("MPS expected");
        };
        assert_eq!(settings.pinned_memory_limit_bytes, Some(bytes), "{good}");
    }
}

#[test]
fn the_shm_size_is_a_positive_quantity_of_bytes_that_reaches_the_settings() {
    let shm = |kind: &str, value: &str| {
        config(
            kind,
            &format!(r#"{{"strategy": "MPS", "mpsConfig": {{"shmSize": {value}}}}}"#),
        )
    };
    for bad in [r#""0""#, r#""-64Mi""#, r#""1.5""#, r#""1GB""#, r#""""#] {
        assert_eq!(
            error(&shm("GpuConfig", bad)),
            "sharing.mpsConfig.shmSize: must be a positive quantity of bytes such as 10Gi",
            "{bad}"
        );
    }
    assert_eq!(
        error(&shm("MigConfig", "67108864")),
        "sharing.mpsConfig.shmSize: must be a string"
    );
    for kind in ["GpuConfig", "MigConfig"] {
        let SharingSettings::Mps(settings) = decoded(&shm(kind, r#""1Gi""#)).effective() else {
            panic!("MPS expected");
        };
        assert_eq!(settings.shm_size_bytes, Some(1 << 30), "{kind}");
    }
    let SharingSettings::Mps(unset) =
        decoded(&config("GpuConfig", r#"{"strategy": "MPS"}"#)).effective()
    else {
        panic!("MPS expected");
    };
    assert_eq!(unset.shm_size_bytes, None, "the node's default");
}

#[test]
fn per_device_limits_need_device_names_and_quantities() {
    let limits = |map: &str| {
        config(
            "GpuConfig",
            &format!(
                r#"{{"strategy": "MPS", "mpsConfig": {{"defaultPerDevicePinnedMemoryLimit": {map}}}}}"#
            ),
        )
    };
    assert_eq!(
        error(&limits(r#"{"gpu-0": "4GiB"}"#)),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu-0]: must be a positive quantity of bytes such as 10Gi"
    );
    assert_eq!(
        error(&limits(r#"{"gpu-0": null}"#)),
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu-0]: must be a string"
    );
    // NVIDIA's keys are GPU indexes or UUIDs; ours are DRA device names.
    for key in [
        "0",
        "GPU-4b6f0c8e-0000-0000-0000-000000000000",
        "gpu-01",
        "x",
    ] {
        assert_eq!(
            error(&limits(&format!(r#"{{"{key}": "4Gi"}}"#))),
            format!("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{key}]: not a device name of this driver (gpu-<minor> or gpu-<minor>-mig-...)")
        );
    }
    let config = decoded(&limits(r#"{"gpu-0": "4Gi", "gpu-1-mig-1g10gb-0": "1Mi"}"#));
    let SharingSettings::Mps(settings) = config.effective() else {
        panic!("MPS expected");
    };
    assert_eq!(
        settings.per_device_pinned_memory_limit_bytes,
        BTreeMap::from([
            ("gpu-0".to_string(), 4u64 << 30),
            ("gpu-1-mig-1g10gb-0".to_string(), 1 << 20)
        ])
    );
}

#[test]
fn text_that_is_not_json_says_so() {
    for text in ["", "{", r#"{"kind": "GpuConfig",}"#, "{} {}", "nul"] {
        let error = decode_config(text).expect_err(text);
        assert_eq!(error.path, "parameters", "{text}");
        assert!(error.reason.starts_with("not valid JSON ("), "{error}");
    }
    // serde_json stops at 128 levels instead of overflowing the stack.
    let deep = "[".repeat(100_000);
    assert!(decode_config(&deep)
        .expect_err("deep")
        .reason
        .starts_with("not valid JSON"));
}

#[test]
fn odd_names_are_quoted_and_cut_short_in_paths() {
    let long = "x".repeat(200);
    let text =
        format!(r#"{{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "{long}": 1}}"#);
    assert_eq!(
        error(&text),
        format!("\"{}…\": unknown field", "x".repeat(64))
    );
    let unknown = |name: &str| {
        let text = format!(
            r#"{{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {{"strategy": "MPS", {name}: 1}}}}"#
        );
        error(&text)
    };
    assert_eq!(unknown(r#""a\nb""#), r#"sharing."a\nb": unknown field"#);
    assert_eq!(unknown(r#""""#), r#"sharing."": unknown field"#);
    assert_eq!(
        unknown(r#""mps.Config""#),
        r#"sharing."mps.Config": unknown field"#
    );
    assert_eq!(
        unknown(r#""mps_config""#),
        "sharing.mps_config: unknown field"
    );
    // At the top, an empty name is not the object itself.
    assert_eq!(
        error(r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "": 1}"#),
        r#""": unknown field"#
    );
    // Device names are plain; odd map keys are quoted too.
    assert_eq!(
        error(&config(
            "GpuConfig",
            r#"{"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"gpu 0]": "1Gi"}}}"#
        )),
        r#"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["gpu 0]"]: not a device name of this driver (gpu-<minor> or gpu-<minor>-mig-...)"#
    );
}

#[test]
fn valid_configs_and_what_they_mean() {
    let exclusive = decoded(r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig"}"#);
    assert_eq!(exclusive, DeviceConfig::Gpu(GpuConfig::default()));
    assert_eq!(exclusive.effective(), SharingSettings::Exclusive);
    assert_eq!(
        decoded(&config("GpuConfig", r#"{"strategy": "Exclusive"}"#)).effective(),
        SharingSettings::Exclusive
    );
    assert_eq!(
        decoded(&config("GpuConfig", r#"{"strategy": "TimeSlicing"}"#)).effective(),
        SharingSettings::TimeSlicing {
            interval: TimeSliceInterval::Default
        }
    );
    let medium = decoded(&config(
        "GpuConfig",
        r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}}"#,
    ));
    assert_eq!(
        medium.effective(),
        SharingSettings::TimeSlicing {
            interval: TimeSliceInterval::Medium
        }
    );
    // Time-slicing on a MIG device: its processes share it with the default scheduling.
    let mig = decoded(&config("MigConfig", r#"{"strategy": "TimeSlicing"}"#));
    assert_eq!(mig.kind(), "MigConfig");
    assert_eq!(mig.effective().env_value(), "TimeSlicing/Default");
    let mps = decoded(&config(
        "MigConfig",
        r#"{"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "2Gi",
            "defaultPerDevicePinnedMemoryLimit": {"gpu-0-mig-1g10gb-0": "1Gi"}}}"#,
    ));
    let SharingSettings::Mps(settings) = mps.effective() else {
        panic!("MPS expected");
    };
    assert_eq!(
        settings.pinned_memory_limit_for("gpu-0-mig-1g10gb-0"),
        Some(1 << 30)
    );
    assert_eq!(
        settings.pinned_memory_limit_for("gpu-0-mig-1g10gb-2"),
        Some(2 << 30)
    );
    // The value decoder agrees with the text decoder, and a config survives its own JSON.
    for config in [exclusive, medium, mig, mps] {
        assert_eq!(
            decode_config_value(&config.to_value()).as_ref(),
            Ok(&config)
        );
        assert_eq!(decode_config(&config.to_value().to_string()), Ok(config));
    }
}

#[test]
fn settings_read_well_in_the_checkpoint_and_the_environment() {
    let cases = [
        (
            SharingSettings::Exclusive,
            json!({"strategy": "Exclusive"}),
            "Exclusive",
        ),
        (
            SharingSettings::TimeSlicing {
                interval: TimeSliceInterval::Long,
            },
            json!({"strategy": "TimeSlicing", "interval": "Long"}),
            "TimeSlicing/Long",
        ),
        (
            SharingSettings::Mps(MpsSettings {
                active_thread_percentage: Some(50),
                pinned_memory_limit_bytes: Some(1 << 30),
                per_device_pinned_memory_limit_bytes: BTreeMap::from([("gpu-0".into(), 1 << 20)]),
                multi_user: false,
                shm_size_bytes: Some(1 << 31),
            }),
            json!({"strategy": "MPS", "activeThreadPercentage": 50,
                   "pinnedMemoryLimitBytes": 1073741824,
                   "perDevicePinnedMemoryLimitBytes": {"gpu-0": 1048576},
                   "shmSizeBytes": 2147483648u64}),
            "MPS",
        ),
        (
            SharingSettings::Mps(MpsSettings::default()),
            json!({"strategy": "MPS"}),
            "MPS",
        ),
    ];
    for (settings, wire, env) in cases {
        assert_eq!(serde_json::to_value(&settings).expect("serialize"), wire);
        assert_eq!(
            serde_json::from_value::<SharingSettings>(wire).expect("deserialize"),
            settings
        );
        assert_eq!(settings.env_value(), env);
    }
    assert!(SharingSettings::default().is_exclusive());
}

#[test]
fn schemas_close_every_object_and_list_the_values() {
    let gpu = config_schema("GpuConfig").expect("GpuConfig");
    let sharing = &gpu["properties"]["sharing"]["anyOf"][0];
    let mps = &sharing["properties"]["mpsConfig"];
    for object in [
        &gpu,
        sharing,
        &sharing["properties"]["timeSlicingConfig"],
        mps,
    ] {
        assert_eq!(object["additionalProperties"], false, "{object}");
    }
    assert_eq!(
        sharing["properties"]["strategy"]["enum"],
        json!(["Exclusive", "TimeSlicing", "MPS"])
    );
    assert_eq!(
        sharing["properties"]["timeSlicingConfig"]["properties"]["interval"]["enum"],
        json!(["Default", "Short", "Medium", "Long", null])
    );
    let percentage = &mps["properties"]["defaultActiveThreadPercentage"];
    assert_eq!(
        (&percentage["minimum"], &percentage["maximum"]),
        (&json!(1), &json!(100))
    );
    assert_eq!(gpu["properties"]["kind"]["enum"], json!(["GpuConfig"]));
    assert_eq!(gpu["required"], json!(["apiVersion", "kind"]));

    let mig = config_schema("MigConfig").expect("MigConfig");
    let mig_sharing = &mig["properties"]["sharing"]["anyOf"][0];
    assert_eq!(mig_sharing["additionalProperties"], false);
    assert!(mig_sharing["properties"].get("timeSlicingConfig").is_none());
    assert_eq!(mig["properties"]["kind"]["enum"], json!(["MigConfig"]));
    assert_eq!(config_schema("VfioDeviceConfig"), None);
}

#[test]
fn the_schemas_device_name_pattern_agrees_with_the_parser() {
    let pattern = regex::Regex::new(DEVICE_NAME_PATTERN).expect("pattern");
    for name in [
        "gpu-0",
        "gpu-12",
        "gpu-3-mig-1g10gb-me-6",
        "gpu-3-mig-3g40gb-4-ci2",
        "gpu-0-mig-1g10gb-ci-5",
        "gpu-3-mig-1g10gb",
        "gpu-3-mig--6",
        "gpu-03-mig-1g10gb-6",
        "gpu-3-mig-1G10GB-6",
        "gpu-3-mig-1g10gb-06",
        "gpu-x-mig-1g10gb-6",
        "gpu-3-mig-3g40gb-4-ci",
        "gpu-3-mig-3g40gb-4-ci01",
        "gpu-3-mig-3g40gb-ci1",
        "gpu-3-mig-3g40gb-4-cix",
        "gpu-",
        "gpu-01",
        "GPU-0",
        "0",
    ] {
        assert_eq!(
            pattern.is_match(name),
            crate::devices::names::DeviceName::parse(name).is_some(),
            "{name}"
        );
    }
}
