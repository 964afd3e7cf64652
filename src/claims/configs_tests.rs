use serde_json::{json, Value};

use super::*;
use crate::api::config::{MpsSettings, TimeSliceInterval};

const DRIVER: &str = "gpu.dra.dev";

const OURS: &str = "gpu.dra.dev/v1alpha1";
const NVIDIAS: &str = "resource.nvidia.com/v1beta1";

/// The parameters of a config of `api_version` and `kind` with `sharing`.
fn params_in(api_version: &str, kind: &str, sharing: Value) -> Value {
    json!({"apiVersion": api_version, "kind": kind, "sharing": sharing})
}

fn time_slicing_in(api_version: &str, interval: &str) -> Value {
    params_in(
        api_version,
        "GpuConfig",
        json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}),
    )
}

fn mps_in(api_version: &str, kind: &str, percentage: u8) -> Value {
    params_in(
        api_version,
        kind,
        json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": percentage}}),
    )
}

/// The parameters of one of our configs of `kind` with `sharing`.
fn params(kind: &str, sharing: Value) -> Value {
    params_in(OURS, kind, sharing)
}

fn time_slicing(interval: &str) -> Value {
    time_slicing_in(OURS, interval)
}

fn mps(kind: &str, percentage: u8) -> Value {
    mps_in(OURS, kind, percentage)
}

fn entry<'a>(
    index: usize,
    from_class: bool,
    requests: &[&str],
    value: &'a Value,
) -> ConfigEntry<'a> {
    ConfigEntry {
        index,
        from_class,
        requests: requests.iter().map(|r| r.to_string()).collect(),
        driver: DRIVER.into(),
        raw: None,
        value: Some(value),
    }
}

fn sliced(interval: TimeSliceInterval) -> SharingSettings {
    SharingSettings::TimeSlicing { interval }
}

fn mps_settings(percentage: u8) -> SharingSettings {
    SharingSettings::Mps(MpsSettings {
        active_thread_percentage: Some(percentage),
        ..MpsSettings::default()
    })
}

/// What each device gets, as (settings, config index).
fn resolved(
    entries: &[ConfigEntry<'_>],
    devices: &[(&str, &str, bool)],
) -> Vec<(SharingSettings, Option<usize>)> {
    resolve(DRIVER, entries, devices)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .map(|r| (r.settings, r.source))
        .collect()
}

const GPU: (&str, &str, bool) = ("gpu", "gpu-0", false);

#[test]
fn no_config_means_exclusive() {
    assert_eq!(
        resolved(&[], &[GPU, ("mig", "gpu-1-mig-1g10gb-0", true)]),
        [
            (SharingSettings::Exclusive, None),
            (SharingSettings::Exclusive, None)
        ]
    );
    // A config for another request leaves this one Exclusive.
    let long = time_slicing("Long");
    assert_eq!(
        resolved(&[entry(0, false, &["other"], &long)], &[GPU]),
        [(SharingSettings::Exclusive, None)]
    );
}

#[test]
fn claim_configs_override_class_configs() {
    let short = time_slicing("Short");
    let with_mps = mps("GpuConfig", 50);
    // The scheduler lists class configs first; the claim's, later, win.
    let entries = [
        entry(0, true, &["gpu"], &short),
        entry(1, false, &["gpu"], &with_mps),
    ];
    assert_eq!(resolved(&entries, &[GPU]), [(mps_settings(50), Some(1))]);
    // Class configs come first whatever order they are given in.
    let entries = [
        entry(1, false, &["gpu"], &with_mps),
        entry(0, true, &["gpu"], &short),
    ];
    assert_eq!(resolved(&entries, &[GPU]), [(mps_settings(50), Some(1))]);
}

#[test]
fn later_entries_win() {
    let short = time_slicing("Short");
    let long = time_slicing("Long");
    for requests in [&[][..], &["gpu"][..]] {
        let entries = [
            entry(0, false, requests, &short),
            entry(1, false, requests, &long),
        ];
        assert_eq!(
            resolved(&entries, &[GPU]),
            [(sliced(TimeSliceInterval::Long), Some(1))],
            "{requests:?}"
        );
    }
    // Among class configs too.
    let entries = [
        entry(0, true, &["gpu"], &short),
        entry(1, true, &["gpu"], &long),
    ];
    assert_eq!(
        resolved(&entries, &[GPU]),
        [(sliced(TimeSliceInterval::Long), Some(1))]
    );
}

#[test]
fn a_config_naming_the_request_beats_one_for_all_requests() {
    let short = time_slicing("Short");
    let long = time_slicing("Long");
    // The named one is earlier, yet wins.
    let entries = [
        entry(0, false, &["gpu"], &short),
        entry(1, false, &[], &long),
    ];
    assert_eq!(
        resolved(&entries, &[GPU, ("other", "gpu-1", false)]),
        [
            (sliced(TimeSliceInterval::Short), Some(0)),
            (sliced(TimeSliceInterval::Long), Some(1))
        ]
    );
    // The scheduler copies a class config naming the requests of its class; the claim's config for
    // all requests still overrides it, because claim configs come before class configs.
    let entries = [
        entry(0, true, &["gpu"], &short),
        entry(1, false, &[], &long),
    ];
    assert_eq!(
        resolved(&entries, &[GPU]),
        [(sliced(TimeSliceInterval::Long), Some(1))]
    );
    // Within the class's configs a named one beats one for all requests as well.
    let entries = [entry(0, true, &["gpu"], &short), entry(1, true, &[], &long)];
    assert_eq!(
        resolved(&entries, &[GPU]),
        [(sliced(TimeSliceInterval::Short), Some(0))]
    );
}

#[test]
fn a_main_request_names_its_subrequests() {
    let short = time_slicing("Short");
    let long = time_slicing("Long");
    let medium = time_slicing("Medium");
    let entries = [
        entry(0, false, &["gpu"], &short),
        entry(1, false, &["gpu/small"], &long),
        entry(2, false, &["gpus"], &medium),
    ];
    assert_eq!(
        resolved(
            &entries,
            &[
                ("gpu/big", "gpu-0", false),
                ("gpu/small", "gpu-1", false),
                ("gpu", "gpu-2", false),
                ("gpus/x", "gpu-3", false),
                ("gp/u", "gpu-4", false),
            ]
        ),
        [
            (sliced(TimeSliceInterval::Short), Some(0)),
            (sliced(TimeSliceInterval::Long), Some(1)),
            (sliced(TimeSliceInterval::Short), Some(0)),
            (sliced(TimeSliceInterval::Medium), Some(2)),
            (SharingSettings::Exclusive, None),
        ]
    );
}

#[test]
fn other_drivers_configs_are_ignored_even_malformed() {
    let long = time_slicing("Long");
    let garbage = json!({"whatever": [1, 2]});
    let mut theirs = entry(1, false, &["gpu"], &garbage);
    theirs.driver = "nic.example.com".into();
    theirs.raw = Some("{not json");
    let entries = [entry(0, false, &[], &long), theirs];
    assert_eq!(
        resolved(&entries, &[GPU]),
        [(sliced(TimeSliceInterval::Long), Some(0))]
    );
}

#[test]
fn a_named_config_of_the_wrong_kind_is_an_error() {
    let mig = mps("MigConfig", 20);
    let entries = [entry(3, false, &["gpu"], &mig)];
    let error = resolve(DRIVER, &entries, &[GPU]).expect_err("MigConfig on a GPU");
    assert_eq!(
        error.to_string(),
        "config[3] (MigConfig from the claim): kind: MigConfig does not fit gpu-0 (a whole GPU); use GpuConfig"
    );
    let gpu = mps("GpuConfig", 20);
    let entries = [entry(0, true, &["mig"], &gpu)];
    let error = resolve(DRIVER, &entries, &[("mig", "gpu-0-mig-1g10gb-0", true)])
        .expect_err("GpuConfig on a MIG device");
    assert_eq!(
        error.to_string(),
        "config[0] (GpuConfig from the class): kind: GpuConfig does not fit gpu-0-mig-1g10gb-0 (a MIG device); use MigConfig"
    );
}

#[test]
fn a_config_for_all_requests_of_the_wrong_kind_is_skipped() {
    // A class may carry one config of each kind for all its requests.
    let mig = mps("MigConfig", 20);
    let gpu = time_slicing("Long");
    let entries = [entry(0, false, &[], &mig), entry(1, false, &[], &gpu)];
    assert_eq!(
        resolved(&entries, &[GPU, ("mig", "gpu-1-mig-1g10gb-0", true)]),
        [
            (sliced(TimeSliceInterval::Long), Some(1)),
            (mps_settings(20), Some(0))
        ]
    );
    // Nothing fits: Exclusive.
    assert_eq!(
        resolved(&[entry(0, false, &[], &mig)], &[GPU]),
        [(SharingSettings::Exclusive, None)]
    );
}

#[test]
fn a_malformed_config_fails_the_claim_even_unused() {
    let long = time_slicing("Long");
    let bad = params(
        "GpuConfig",
        json!({"strategy": "MPS", "mpsConfig": {"foo": 1}}),
    );
    let entries = [
        entry(0, false, &[], &long),
        entry(1, false, &["unallocated"], &bad),
    ];
    let error = resolve(DRIVER, &entries, &[GPU]).expect_err("malformed");
    assert_eq!(error.index, 1);
    assert_eq!(
        error.to_string(),
        "config[1] (GpuConfig from the claim): sharing.mpsConfig.foo: unknown field"
    );
    // Without a kind of ours, the message says what it can.
    let other_kind = json!({"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "VfioDeviceConfig"});
    let error = resolve(DRIVER, &[entry(0, true, &["gpu"], &other_kind)], &[GPU])
        .expect_err("unknown kind");
    assert_eq!(
        error.to_string(),
        "config[0] (from the class): kind: must be GpuConfig or MigConfig"
    );
    // With no parameters at all.
    let mut empty = entry(2, false, &[], &long);
    empty.value = None;
    assert_eq!(
        resolve(DRIVER, &[empty], &[GPU])
            .expect_err("no parameters")
            .to_string(),
        "config[2] (from the claim): parameters: must be an object"
    );
}

#[test]
fn the_raw_text_is_decoded_when_given_and_catches_repeated_keys() {
    let long = time_slicing("Long");
    let mut with_raw = entry(0, false, &[], &long);
    with_raw.raw = Some(
        r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing", "strategy": "MPS"}}"#,
    );
    assert_eq!(
        resolve(DRIVER, &[with_raw], &[GPU])
            .expect_err("duplicate")
            .to_string(),
        "config[0] (GpuConfig from the claim): sharing.strategy: duplicate key"
    );
}

/// A claim as the API server returns it, allocated, with configs from its class and its own.
const CLAIM: &str = r#"{
  "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
  "metadata": {"name": "train", "namespace": "ml", "uid": "u-1"},
  "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}}]}},
  "status": {"allocation": {"devices": {
    "results": [{"request": "gpu", "driver": "gpu.dra.dev", "pool": "node-a", "device": "gpu-0"}],
    "config": [
      {"source": "FromClass", "requests": ["gpu"], "opaque": {"driver": "gpu.dra.dev",
        "parameters": {"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}}},
      {"source": "FromClaim", "opaque": {"driver": "nic.example.com", "parameters": {"mtu": 9000}}},
      {"source": "FromClaim", "opaque": {"driver": "gpu.dra.dev",
        "parameters": {"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "strategy": "Exclusive"}}}}
    ]}}}
}"#;

#[test]
fn entries_come_from_the_claims_allocation() {
    let claim: ResourceClaim = serde_json::from_str(CLAIM).expect("claim");
    let entries = allocation_config_entries(&claim, &[]);
    assert_eq!(entries.len(), 3);
    assert_eq!(
        entries
            .iter()
            .map(|e| (e.index, e.from_class, e.requests.clone(), e.driver.as_str()))
            .collect::<Vec<_>>(),
        [
            (0, true, vec!["gpu".to_string()], "gpu.dra.dev"),
            (1, false, vec![], "nic.example.com"),
            (2, false, vec![], "gpu.dra.dev"),
        ]
    );
    // The decoded claim kept the last "strategy"; the claim's config beats the class's.
    assert_eq!(
        resolved(&entries, &[GPU]),
        [(SharingSettings::Exclusive, Some(2))]
    );

    // The raw text of the same body shows the repeated key.
    let raw = raw_allocation_parameters(CLAIM);
    assert_eq!(raw.len(), 3);
    assert!(raw[1].as_deref().is_some_and(|r| r.contains("9000")));
    let entries = allocation_config_entries(&claim, &raw);
    assert_eq!(
        resolve(DRIVER, &entries, &[GPU])
            .expect_err("duplicate")
            .to_string(),
        "config[2] (GpuConfig from the claim): sharing.strategy: duplicate key"
    );
    assert!(raw_allocation_parameters("not a claim").is_empty());
}

#[test]
fn specs_are_checked_for_every_malformed_config() {
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": "gpu.dra.dev"},
        "spec": {"config": [
            {"opaque": {"driver": DRIVER, "parameters": time_slicing("Long")}},
            {"opaque": {"driver": DRIVER, "parameters": params("GpuConfig", json!({"strategy": "Shared"}))}},
            {"opaque": {"driver": "nic.example.com", "parameters": {"bogus": true}}},
            {"opaque": {"driver": DRIVER, "parameters": {"apiVersion": "v1"}}}
        ]}
    }))
    .expect("class");
    let problems: Vec<String> = check_device_class(DRIVER, &class)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        problems,
        [
            "config[1] (GpuConfig): sharing.strategy: must be one of Exclusive, TimeSlicing, MPS",
            "config[3]: apiVersion: must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1",
        ]
    );

    let spec = json!({"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.dra.dev"}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER,
            "parameters": params("MigConfig", json!({"strategy": "TimeSlicing", "timeSlicingConfig": {}}))}}]
    }});
    let template: ResourceClaimTemplate =
        serde_json::from_value(json!({"metadata": {"name": "t"}, "spec": {"spec": spec}}))
            .expect("template");
    let claim: ResourceClaim =
        serde_json::from_value(json!({"metadata": {"name": "c"}, "spec": spec})).expect("claim");
    let expected = ["config[0] (MigConfig): sharing.timeSlicingConfig: not allowed in MigConfig (MIG devices have no time-slice interval)"];
    for problems in [
        check_claim_template(DRIVER, &template),
        check_claim(DRIVER, &claim),
    ] {
        let problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(problems, expected);
    }
    assert!(check_claim(DRIVER, &ResourceClaim::default()).is_empty());
}

// NVIDIA's precedence under NVIDIA's driver name.

fn nvidia_entry<'a>(
    index: usize,
    from_class: bool,
    requests: &[&str],
    value: &'a Value,
) -> ConfigEntry<'a> {
    ConfigEntry {
        driver: NVIDIA_DRIVER_NAME.into(),
        ..entry(index, from_class, requests, value)
    }
}

fn nvidia_params(kind: &str, sharing: Value) -> Value {
    params_in(NVIDIAS, kind, sharing)
}

fn nvidia_time_slicing(interval: &str) -> Value {
    time_slicing_in(NVIDIAS, interval)
}

fn nvidia_mps(kind: &str, percentage: u8) -> Value {
    mps_in(NVIDIAS, kind, percentage)
}

fn resolved_as(
    driver: &str,
    entries: &[ConfigEntry<'_>],
    devices: &[(&str, &str, bool)],
) -> Vec<(SharingSettings, Option<usize>)> {
    resolve(driver, entries, devices)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .map(|r| (r.settings, r.source))
        .collect()
}

#[test]
fn a_later_config_for_all_requests_wins_under_nvidias_rule_only() {
    // Claim configs [{requests: [gpu], TimeSlicing}, {requests: [], MPS}].
    let sliced_config = nvidia_time_slicing("Long");
    let mps_config = nvidia_mps("GpuConfig", 50);
    for driver in [NVIDIA_DRIVER_NAME, DRIVER] {
        let entries = [
            ConfigEntry {
                driver: driver.into(),
                ..entry(0, false, &["gpu"], &sliced_config)
            },
            ConfigEntry {
                driver: driver.into(),
                ..entry(1, false, &[], &mps_config)
            },
        ];
        let expected = if driver == NVIDIA_DRIVER_NAME {
            (mps_settings(50), Some(1))
        } else {
            (sliced(TimeSliceInterval::Long), Some(0))
        };
        assert_eq!(
            resolved_as(driver, &entries, &[GPU]),
            [expected],
            "{driver}"
        );
    }
}

#[test]
fn nvidia_walks_class_configs_before_claim_configs() {
    // A class config listed after a claim config still loses to it: class configs come first.
    let class = nvidia_time_slicing("Short");
    let claim = nvidia_time_slicing("Medium");
    let entries = [
        nvidia_entry(0, false, &[], &claim),
        nvidia_entry(1, true, &["gpu"], &class),
    ];
    assert_eq!(
        resolved_as(NVIDIA_DRIVER_NAME, &entries, &[GPU]),
        [(sliced(TimeSliceInterval::Medium), Some(0))]
    );
}

#[test]
fn nvidia_names_requests_exactly() {
    // NVIDIA does not apply a config naming `main` to subrequest `main/sub`; ours does.
    let named = nvidia_time_slicing("Long");
    let entries = [nvidia_entry(0, false, &["main"], &named)];
    let device = ("main/sub", "gpu-0", false);
    assert_eq!(
        resolved_as(NVIDIA_DRIVER_NAME, &entries, &[device]),
        [(SharingSettings::Exclusive, None)]
    );
    let ours = [ConfigEntry {
        driver: DRIVER.into(),
        ..entry(0, false, &["main"], &named)
    }];
    assert_eq!(
        resolved_as(DRIVER, &ours, &[device]),
        [(sliced(TimeSliceInterval::Long), Some(0))]
    );
}

#[test]
fn nvidia_refuses_a_named_config_of_the_wrong_kind_in_its_words() {
    let config = nvidia_mps("MigDeviceConfig", 50);
    let entries = [nvidia_entry(0, false, &["gpu"], &config)];
    let error = resolve(NVIDIA_DRIVER_NAME, &entries, &[GPU]).expect_err("wrong kind");
    assert_eq!(
        error.to_string(),
        "config[0] (MigDeviceConfig from the claim): kind: cannot apply MigDeviceConfig to device \"gpu-0\" of type \"gpu\" (request: gpu)"
    );
    // For all requests, a config of the wrong kind is passed over.
    let short = nvidia_time_slicing("Short");
    let entries = [
        nvidia_entry(0, false, &[], &short),
        nvidia_entry(1, false, &[], &config),
    ];
    assert_eq!(
        resolved_as(NVIDIA_DRIVER_NAME, &entries, &[GPU]),
        [(sliced(TimeSliceInterval::Short), Some(0))]
    );
}

#[test]
fn our_api_under_nvidias_driver_name_follows_nvidias_rule() {
    let sliced_config = time_slicing("Long");
    let mps_config = nvidia_mps("GpuConfig", 30);
    let entries = [
        nvidia_entry(0, false, &["gpu"], &sliced_config),
        nvidia_entry(1, false, &[], &mps_config),
    ];
    assert_eq!(
        resolved_as(NVIDIA_DRIVER_NAME, &entries, &[GPU]),
        [(mps_settings(30), Some(1))]
    );
}

#[test]
fn nvidia_per_device_limits_resolve_against_the_configs_devices() {
    let config = nvidia_params(
        "GpuConfig",
        json!({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "4Gi",
            "defaultPerDevicePinnedMemoryLimit": {"0": "1Gi", "GPU-b": "2Gi"}}}),
    );
    let other = nvidia_time_slicing("Long");
    let entries = [
        nvidia_entry(0, false, &["a"], &config),
        nvidia_entry(1, false, &["c"], &other),
    ];
    // Devices of the config: gpu-0 (GPU-z) and gpu-1 (GPU-b); sorted UUIDs: GPU-b, GPU-z, so index
    // 0 is gpu-1, and GPU-b is gpu-1 too (the later key, "GPU-b", sorts after "0" and wins).
    // gpu-2 (GPU-a) takes another config, so it is not in the index.
    let devices = [
        ("a", "gpu-0", false),
        ("a", "gpu-1", false),
        ("c", "gpu-2", false),
    ];
    let uuids = [Some("GPU-z"), Some("GPU-b"), Some("GPU-a")];
    let resolved = resolve_with_uuids(NVIDIA_DRIVER_NAME, &entries, &devices, &uuids)
        .unwrap_or_else(|e| panic!("{e}"));
    let limits = |i: usize| match &resolved[i].settings {
        SharingSettings::Mps(mps) => (
            mps.pinned_memory_limit_bytes,
            mps.per_device_pinned_memory_limit_bytes.clone(),
        ),
        other => panic!("{other:?}"),
    };
    assert_eq!(limits(0), (Some(4 << 30), Default::default()));
    assert_eq!(
        limits(1),
        (Some(4 << 30), [("gpu-1".to_string(), 2 << 30)].into())
    );
    assert_eq!(resolved[2].settings, sliced(TimeSliceInterval::Long));

    // An index past the config's devices, in NVIDIA's words, at the key's path.
    let config = nvidia_params(
        "GpuConfig",
        json!({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"1": "1Gi"}}}),
    );
    let entries = [nvidia_entry(0, false, &[], &config)];
    let error = resolve_with_uuids(NVIDIA_DRIVER_NAME, &entries, &[GPU], &[Some("GPU-z")])
        .expect_err("no device 1");
    assert_eq!(
        error.to_string(),
        "config[0] (GpuConfig from the claim): sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[1]: invalid device: invalid device index: 1"
    );
    // Without the UUIDs, the keys cannot be resolved: an error, never a silently dropped limit.
    let error = resolve(NVIDIA_DRIVER_NAME, &entries, &[GPU]).expect_err("no UUIDs");
    assert!(
        error
            .to_string()
            .contains("UUID of device gpu-0 is not known"),
        "{error}"
    );
}

#[test]
fn specs_with_nvidias_configs_are_checked_with_nvidias_rules() {
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": "mig.nvidia.com"},
        "spec": {"config": [
            {"opaque": {"driver": NVIDIA_DRIVER_NAME, "parameters": nvidia_mps("MigDeviceConfig", 0)}},
            {"opaque": {"driver": NVIDIA_DRIVER_NAME, "parameters": nvidia_params("MigDeviceConfig",
                json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}))}},
            {"opaque": {"driver": NVIDIA_DRIVER_NAME, "parameters": nvidia_time_slicing("Long")}}
        ]}
    }))
    .expect("class");
    let problems: Vec<String> = check_device_class(NVIDIA_DRIVER_NAME, &class)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        problems,
        ["config[1] (MigDeviceConfig): sharing.timeSlicingConfig: unknown field"]
    );
}
