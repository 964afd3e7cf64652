//! NVIDIA's configs: the quickstart examples decode to the settings NVIDIA gives them, and what
//! NVIDIA refuses is refused with NVIDIA's reason at the field's path.

use std::collections::BTreeMap;

use super::*;
use crate::api::config::{decode_config, decode_config_value, DeviceConfig};

fn settings(json: &str) -> SharingSettings {
    decode_config(json).expect("accepted").effective()
}

fn error(json: &str) -> String {
    decode_config(json).expect_err("refused").to_string()
}

fn gpu(sharing: &str) -> String {
    format!(
        r#"{{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {sharing}}}"#
    )
}

fn mig(sharing: &str) -> String {
    format!(
        r#"{{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig", "sharing": {sharing}}}"#
    )
}

fn mps(percentage: Option<u8>, limit: Option<u64>) -> SharingSettings {
    SharingSettings::Mps(MpsSettings {
        active_thread_percentage: percentage,
        pinned_memory_limit_bytes: limit,
        per_device_pinned_memory_limit_bytes: BTreeMap::new(),
        multi_user: false,
        shm_size_bytes: None,
    })
}

#[test]
fn quickstart_time_slicing_long() {
    // gpu-test5 and gpu-test6: TimeSlicing with interval Long.
    assert_eq!(
        settings(&gpu(
            r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}"#
        )),
        SharingSettings::TimeSlicing {
            interval: TimeSliceInterval::Long
        }
    );
}

#[test]
fn quickstart_mps_half_the_threads_and_10gi() {
    // gpu-test5 and gpu-test-mps: MPS, 50 %, 10Gi pinned.
    let config = gpu(
        r#"{"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
        "defaultPinnedDeviceMemoryLimit": "10Gi"}}"#,
    );
    assert_eq!(settings(&config), mps(Some(50), Some(10 << 30)));
}

#[test]
fn quickstart_configs_from_yaml_decode() {
    // A claim's config as a user writes it in YAML, through the same value path prepare uses.
    let yaml = "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n  strategy: MPS\n  mpsConfig:\n    defaultActiveThreadPercentage: 50\n    defaultPinnedDeviceMemoryLimit: 10Gi\n";
    let value: serde_json::Value = serde_yaml::from_str(yaml).expect("yaml");
    let config = decode_config_value(&value).expect("accepted");
    assert_eq!(config.kind(), "GpuConfig");
    assert_eq!(config.effective(), mps(Some(50), Some(10 << 30)));
}

#[test]
fn defaults_follow_normalize() {
    let no_sharing = r#"{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}"#;
    assert_eq!(settings(no_sharing), SharingSettings::Exclusive);
    assert_eq!(settings(&gpu("null")), SharingSettings::Exclusive);
    assert_eq!(
        settings(&gpu(r#"{"strategy": "TimeSlicing"}"#)),
        SharingSettings::TimeSlicing {
            interval: TimeSliceInterval::Default
        }
    );
    assert_eq!(
        settings(&gpu(
            r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {}}"#
        )),
        SharingSettings::TimeSlicing {
            interval: TimeSliceInterval::Default
        }
    );
    assert_eq!(settings(&gpu(r#"{"strategy": "MPS"}"#)), mps(None, None));
    assert_eq!(
        settings(&mig(r#"{"strategy": "MPS", "mpsConfig": null}"#)),
        mps(None, None)
    );
    assert_eq!(
        settings(&mig(r#"{"strategy": "TimeSlicing"}"#)),
        SharingSettings::TimeSlicing {
            interval: TimeSliceInterval::Default
        }
    );
    let config = decode_config(&mig(r#"{"strategy": "MPS"}"#)).expect("accepted");
    assert!(config.is_mig());
    assert_eq!(config.kind(), "MigDeviceConfig");
}

#[test]
fn percentages_0_to_100_are_accepted_and_0_leaves_the_daemon_default() {
    for (p, expected) in [(0, None), (1, Some(1)), (100, Some(100))] {
        let config = gpu(&format!(
            r#"{{"strategy": "MPS", "mpsConfig": {{"defaultActiveThreadPercentage": {p}}}}}"#
        ));
        assert_eq!(settings(&config), mps(expected, None), "{p}");
    }
}

#[test]
fn limits_are_whole_mib_as_nvidia_rounds_them() {
    for (text, mib) in [
        (r#""10Gi""#, 10240),
        (r#""1.5Gi""#, 1536),
        (r#""1Mi""#, 1),
        (r#"" 2Mi ""#, 2),
        ("2097152", 2),
        (r#""1048577""#, 1),
        (r#""1G""#, 953),
    ] {
        let config = gpu(&format!(
            r#"{{"strategy": "MPS", "mpsConfig": {{"defaultPinnedDeviceMemoryLimit": {text}}}}}"#
        ));
        assert_eq!(
            settings(&config),
            mps(None, Some(mib * 1024 * 1024)),
            "{text}"
        );
    }
}

#[test]
fn refusals_carry_nvidias_reasons_and_the_path() {
    let cases = [
        (gpu(r#"{"strategy": "Exclusive"}"#),
         "sharing.strategy: unknown GPU sharing strategy: Exclusive, supported GPU sharing strategies: TimeSlicing, MPS"),
        (gpu(r#"{}"#),
         "sharing.strategy: unknown GPU sharing strategy: , supported GPU sharing strategies: TimeSlicing, MPS"),
        (gpu(r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}"#),
         "sharing.timeSlicingConfig.interval: unknown time-slice interval: Forever, supported time-slice intervals: Default, Short, Medium, Long"),
        (gpu(r#"{"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}"#),
         "sharing.mpsConfig.defaultActiveThreadPercentage: active thread percentage must not be greater than 100"),
        (gpu(r#"{"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": -1}}"#),
         "sharing.mpsConfig.defaultActiveThreadPercentage: active thread percentage must not be negative"),
        (gpu(r#"{"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50.5}}"#),
         "sharing.mpsConfig.defaultActiveThreadPercentage: must be an integer"),
        (gpu(r#"{"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1Ki"}}"#),
         "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: invalid limit: default value set too low: 1Ki"),
        (gpu(r#"{"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "1Ki"}}}"#),
         "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[0]: invalid limit: value set too low: 0: 1Ki"),
        (gpu(r#"{"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "ten"}}"#),
         "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"),
        (gpu(r#"{"strategy": "MPS", "mpsConfig": {"multiUser": "yes"}}"#),
         "sharing.mpsConfig.multiUser: must be a boolean"),
        (gpu(r#"{"strategy": "TimeSlicing", "extra": 1}"#), "sharing.extra: unknown field"),
        (gpu(r#"{"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentag": 5}}"#),
         "sharing.mpsConfig.defaultActiveThreadPercentag: unknown field"),
        (gpu(r#"{"strategy": "TimeSlicing", "strategy": "MPS"}"#), "sharing.strategy: duplicate key"),
        (mig(r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}"#),
         "sharing.timeSlicingConfig: unknown field"),
        (gpu(r#"{"strategy": "TimeSlicing", "mpsConfig": {}}"#),
         "sharing.mpsConfig: cannot use MpsConfig with the 'TimeSlicing' strategy"),
        (gpu(r#"{"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}"#),
         "sharing.timeSlicingConfig: cannot use TimeSlicingConfig with the 'MPS' strategy"),
        (r#"{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "VfioDeviceConfig"}"#.to_string(),
         "kind: must be GpuConfig or MigDeviceConfig (the kinds of resource.nvidia.com/v1beta1 that gpu-dra supports)"),
        (r#"{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigConfig"}"#.to_string(),
         "kind: must be GpuConfig or MigDeviceConfig (the kinds of resource.nvidia.com/v1beta1 that gpu-dra supports)"),
        (r#"{"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}"#.to_string(),
         "apiVersion: must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1"),
    ];
    for (json, expected) in cases {
        assert_eq!(error(&json), expected, "{json}");
    }
}

#[test]
fn mig_time_slicing_ignores_mps_config_as_nvidia_does() {
    // NVIDIA's MigDeviceSharing neither validates nor refuses mpsConfig under TimeSlicing.
    let config =
        mig(r#"{"strategy": "TimeSlicing", "mpsConfig": {"defaultActiveThreadPercentage": 500}}"#);
    assert_eq!(
        settings(&config),
        SharingSettings::TimeSlicing {
            interval: TimeSliceInterval::Default
        }
    );
    // Its shape is still checked strictly.
    let config = mig(r#"{"strategy": "TimeSlicing", "mpsConfig": {"other": 1}}"#);
    assert_eq!(error(&config), "sharing.mpsConfig.other: unknown field");
}

#[test]
fn multi_user_false_is_accepted() {
    let config = gpu(r#"{"strategy": "MPS", "mpsConfig": {"multiUser": false}}"#);
    assert_eq!(settings(&config), mps(None, None));
}

#[test]
fn multi_user_true_asks_for_a_multi_user_daemon() {
    // NVIDIA's main branch starts the daemon with -M; gpu-dra passes the option NVIDIA documents,
    // -multiuser-server (mps::supervisor::MULTI_USER_OPTION).
    let config = gpu(
        r#"{"strategy": "MPS", "mpsConfig": {"multiUser": true, "defaultActiveThreadPercentage": 40}}"#,
    );
    let SharingSettings::Mps(mps) = settings(&config) else {
        panic!("MPS");
    };
    assert!(mps.multi_user);
    assert_eq!(mps.active_thread_percentage, Some(40));
    // Normalised back to NVIDIA's JSON with the field kept.
    let DeviceConfig::Nvidia(nvidia) =
        decode_config_value(&serde_json::from_str(&config).unwrap()).unwrap()
    else {
        panic!("NVIDIA's config");
    };
    assert_eq!(nvidia.to_value()["sharing"]["mpsConfig"]["multiUser"], true);
}

#[test]
fn per_device_keys_are_uuids_or_indexes_into_the_sorted_uuids() {
    let config = gpu(
        r#"{"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "2Gi",
        "defaultPerDevicePinnedMemoryLimit": {"GPU-bbb": "1Gi", "0": "3Gi"}}}"#,
    );
    let DeviceConfig::Nvidia(config) = decode_config(&config).expect("accepted") else {
        panic!("not NVIDIA's");
    };
    let mps = config.mps().expect("MPS");
    // Sorted UUIDs: GPU-aaa (gpu-3) is index 0, GPU-bbb (gpu-1) is named.
    let limits = mps
        .per_device_limits(&[("gpu-1", "GPU-bbb"), ("gpu-3", "GPU-aaa")])
        .expect("resolved");
    assert_eq!(
        limits,
        BTreeMap::from([
            ("gpu-1".to_string(), 1 << 30),
            ("gpu-3".to_string(), 3 << 30)
        ])
    );
    assert_eq!(
        mps.per_device_limits(&[("gpu-1", "GPU-ccc")]),
        Err((
            "GPU-bbb".into(),
            "invalid device: unable to parse key as an integer: GPU-bbb".into()
        ))
    );
    let config = gpu(
        r#"{"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"2": "1Gi"}}}"#,
    );
    let DeviceConfig::Nvidia(config) = decode_config(&config).expect("accepted") else {
        panic!("not NVIDIA's");
    };
    assert_eq!(
        config
            .mps()
            .expect("MPS")
            .per_device_limits(&[("gpu-0", "GPU-a"), ("gpu-1", "GPU-b")]),
        Err(("2".into(), "invalid device: invalid device index: 2".into()))
    );
}

#[test]
fn to_value_round_trips() {
    for json in [
        gpu(r#"{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}"#),
        gpu(
            r#"{"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0, "defaultPinnedDeviceMemoryLimit": "1.5Gi", "defaultPerDevicePinnedMemoryLimit": {"1": "1Gi"}}}"#,
        ),
        mig(r#"{"strategy": "TimeSlicing"}"#),
        r#"{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"}"#.to_string(),
    ] {
        let config = decode_config(&json).expect("accepted");
        assert_eq!(
            decode_config_value(&config.to_value()),
            Ok(config),
            "{json}"
        );
    }
}
