//! Fuzzing the decoder: JSON-ish token soup, random trees with the real field names, and valid
//! configs mutated at random (a field replaced, added or dropped, keys repeated). The decoder must
//! never panic, and every error must read `<path>: <reason>` with one of the known reasons.

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use serde_json::{Map, Value};

use super::decode::*;
use super::*;

/// Cases per test; three tests, 1,800 cases in all, about 1.5 s in a debug build. `PROPTEST_CASES`
/// asks for more (a longer run by hand).
const CASES: u32 = 600;

fn config() -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(CASES);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..Config::default()
    }
}

const REASONS: &[&str] = &[
    API_VERSION,
    KIND,
    UNKNOWN_FIELD,
    DUPLICATE_KEY,
    MUST_BE_STRING,
    MUST_BE_INTEGER,
    MUST_BE_OBJECT,
    STRATEGY,
    REQUIRED,
    INTERVAL,
    ONLY_TIME_SLICING,
    NOT_IN_MIG,
    ONLY_MPS,
    PERCENTAGE,
    QUANTITY,
    DEVICE_NAME,
];

/// The error has the `<path>: <reason>` shape: a path that names something and a reason we know.
fn assert_shape(error: &ConfigError) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        error.to_string(),
        format!("{}: {}", error.path, error.reason)
    );
    prop_assert!(!error.path.is_empty(), "empty path in {}", error);
    prop_assert!(well_formed(&error.path), "malformed path in {}", error);
    let known = REASONS.contains(&error.reason.as_str())
        || (error.reason.starts_with(&format!("{NOT_JSON} (")) && error.reason.ends_with(')'));
    prop_assert!(known, "unknown reason in {}", error);
    Ok(())
}

/// Names joined by dots, each plain (letters, digits, `-`, `_`, `/`) or a JSON string, each followed
/// by any number of `[key]`, the key plain or a JSON string too.
fn well_formed(path: &str) -> bool {
    fn name(rest: &str) -> Option<&str> {
        if rest.starts_with('"') {
            let mut strings = serde_json::Deserializer::from_str(rest).into_iter::<String>();
            strings.next()?.ok()?;
            return rest.get(strings.byte_offset()..);
        }
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || "-_/".contains(c)))
            .unwrap_or(rest.len());
        (end > 0).then(|| &rest[end..])
    }
    let mut rest = path;
    loop {
        let Some(after) = name(rest) else {
            return false;
        };
        rest = after;
        while let Some(key) = rest.strip_prefix('[') {
            match name(key).and_then(|after| after.strip_prefix(']')) {
                Some(after) => rest = after,
                None => return false,
            }
        }
        if rest.is_empty() {
            return true;
        }
        match rest.strip_prefix('.') {
            Some(after) => rest = after,
            None => return false,
        }
    }
}

#[test]
fn the_path_shape_check_can_fail() {
    for good in [
        "parameters",
        "sharing.mpsConfig.x",
        r#"a."b.c"[gpu-0]"#,
        r#"x["]"][0]"#,
    ] {
        assert!(well_formed(good), "{good}");
    }
    for bad in ["", "sharing.", ".a", "a..b", "a[b", "a[]", r#"a."b"#, "a b"] {
        assert!(!well_formed(bad), "{bad}");
    }
}

/// Decodes the text both ways; where nothing is repeated, the two decoders must agree.
fn check_text(text: &str, has_duplicates: bool) -> Result<(), TestCaseError> {
    let strict = decode_config(text);
    if let Err(error) = &strict {
        assert_shape(error)?;
    }
    if let Ok(value) = serde_json::from_str::<Value>(text) {
        let lenient = decode_config_value(&value);
        if let Err(error) = &lenient {
            assert_shape(error)?;
        }
        if !has_duplicates {
            prop_assert_eq!(strict, lenient);
        }
    }
    Ok(())
}

const NAMES: &[&str] = &[
    "apiVersion",
    "kind",
    "sharing",
    "strategy",
    "timeSlicingConfig",
    "interval",
    "mpsConfig",
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "defaultPerDevicePinnedMemoryLimit",
    "gpu-0",
    "gpu-1-mig-1g10gb-0",
    "metadata",
    "",
    "a.b",
    "x[0]",
    "ü\n\"",
];

const STRINGS: &[&str] = &[
    "gpu.dra.dev/v1alpha1",
    "GpuConfig",
    "MigConfig",
    "Exclusive",
    "TimeSlicing",
    "MPS",
    "Default",
    "Short",
    "Medium",
    "Long",
    "10Gi",
    "0",
    "-1Gi",
    "1e1000",
    "1e-1000",
    "0.5Ki",
    "9223372036854775808",
    "18446744073709551616Ei",
    "Pi",
    ".",
    "",
];

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(NAMES).prop_map(str::to_string),
        1 => any::<String>(),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0i64..=101).prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop::sample::select(STRINGS).prop_map(Value::from),
        any::<String>().prop_map(Value::from),
    ]
}

fn tree() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(5, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((name(), inner), 0..6)
                .prop_map(|entries| Value::Object(entries.into_iter().collect())),
        ]
    })
}

/// A config that decodes, of either kind, with any combination of settings.
fn valid_config() -> impl Strategy<Value = DeviceConfig> {
    let quantity = prop_oneof![
        (1u64..=1 << 40).prop_map(|b| b.to_string()),
        (1u64..=1024).prop_map(|n| format!("{n}Gi")),
        (1u64..=1024).prop_map(|n| format!("{n}M")),
    ]
    .prop_filter_map("a byte quantity", |text| ByteQuantity::parse(&text));
    let device = prop_oneof![
        (0u32..16).prop_map(|m| format!("gpu-{m}")),
        (0u32..16, 0u32..8).prop_map(|(m, s)| format!("gpu-{m}-mig-1g10gb-{s}")),
    ];
    let mps = (
        prop::option::of(1u8..=100),
        prop::option::of(quantity.clone()),
        prop::collection::btree_map(device, quantity.clone(), 0..3),
        prop::option::of(quantity),
    )
        .prop_map(|(percentage, limit, per_device, shm_size)| MpsConfig {
            default_active_thread_percentage: percentage,
            default_pinned_device_memory_limit: limit,
            default_per_device_pinned_memory_limit: per_device,
            shm_size,
        });
    let interval = prop::option::of(prop::sample::select(&TimeSliceInterval::ALL[..]));
    (
        any::<bool>(),
        0u8..4,
        interval,
        prop::option::of(mps),
        any::<bool>(),
    )
        .prop_map(|(is_mig, strategy, interval, mps, with_settings)| {
            let sharing = match strategy {
                0 => None,
                1 => Some(Sharing {
                    strategy: SharingStrategy::Exclusive,
                    time_slicing_config: None,
                    mps_config: None,
                }),
                2 => Some(Sharing {
                    strategy: SharingStrategy::TimeSlicing,
                    time_slicing_config: (with_settings && !is_mig)
                        .then_some(TimeSlicingConfig { interval }),
                    mps_config: None,
                }),
                _ => Some(Sharing {
                    strategy: SharingStrategy::Mps,
                    time_slicing_config: None,
                    mps_config: mps,
                }),
            };
            if is_mig {
                DeviceConfig::Mig(MigConfig { sharing })
            } else {
                DeviceConfig::Gpu(GpuConfig { sharing })
            }
        })
}

/// One change somewhere in a value: `path` picks the place (each number an index into the keys
/// or items met on the way down), then the object there gets `replacement` for one key, a new
/// key, or loses a key.
fn mutate(value: &mut Value, path: &[usize], how: u8, key: String, replacement: Value) {
    if let Some((&step, rest)) = path.split_first() {
        let child = match value {
            Value::Object(object) if !object.is_empty() => {
                let key = object.keys().nth(step % object.len()).cloned();
                key.and_then(|k| object.get_mut(&k))
            }
            Value::Array(items) if !items.is_empty() => {
                let len = items.len();
                items.get_mut(step % len)
            }
            _ => None,
        };
        if let Some(child) = child.filter(|c| c.is_object() || c.is_array()) {
            return mutate(child, rest, how, key, replacement);
        }
    }
    let at = value;
    match (at, how % 3) {
        (Value::Object(object), 0) if !object.is_empty() => {
            let existing = object.keys().nth(path.len() % object.len()).cloned();
            if let Some(existing) = existing {
                object.insert(existing, replacement);
            }
        }
        (Value::Object(object), 1) => {
            object.insert(key, replacement);
        }
        (Value::Object(object), _) => {
            let existing = object.keys().next().cloned();
            if let Some(existing) = existing {
                object.remove(&existing);
            }
        }
        (other, _) => *other = replacement,
    }
}

/// JSON text of `value` in which, where `repeat` says so, an object's first entry is written again
/// at its end (with the same or another value); true if any key was repeated.
fn render(value: &Value, repeat: &mut impl Iterator<Item = bool>, out: &mut String) -> bool {
    match value {
        Value::Object(object) => {
            let mut repeated = false;
            out.push('{');
            let entries: Vec<(&String, &Value)> = object.iter().collect();
            for (i, (key, value)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::from(key.as_str()).to_string());
                out.push(':');
                repeated |= render(value, repeat, out);
            }
            if let Some((key, value)) = entries.first() {
                if repeat.next().unwrap_or(false) {
                    out.push(',');
                    out.push_str(&Value::from(key.as_str()).to_string());
                    out.push(':');
                    render(value, repeat, out);
                    repeated = true;
                }
            }
            out.push('}');
            repeated
        }
        Value::Array(items) => {
            let mut repeated = false;
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                repeated |= render(item, repeat, out);
            }
            out.push(']');
            repeated
        }
        other => {
            out.push_str(&other.to_string());
            false
        }
    }
}

const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    " ",
    "\n",
    "null",
    "true",
    "false",
    "0",
    "-1",
    "50",
    "101",
    "1.5",
    "1e400",
    "-0",
    "\"",
    "\\",
    "\\u0000",
    "\\ud800",
    "\"apiVersion\"",
    "\"kind\"",
    "\"sharing\"",
    "\"strategy\"",
    "\"mpsConfig\"",
    "\"timeSlicingConfig\"",
    "\"interval\"",
    "\"gpu.dra.dev/v1alpha1\"",
    "\"GpuConfig\"",
    "\"MigConfig\"",
    "\"MPS\"",
    "\"TimeSlicing\"",
    "\"defaultPerDevicePinnedMemoryLimit\"",
    "\"gpu-0\"",
    "\"10Gi\"",
];

proptest! {
    #![proptest_config(config())]

    #[test]
    fn token_soup_never_panics(
        tokens in prop::collection::vec(prop::sample::select(TOKENS), 0..40),
        noise in any::<String>(),
    ) {
        let text = tokens.concat();
        check_text(&text, true)?;
        check_text(&noise, true)?;
        check_text(&format!("{text}{noise}"), true)?;
    }

    #[test]
    fn random_trees_decode_or_say_where(
        sharing in tree(),
        extra in prop::option::of((name(), tree())),
        kind in prop::sample::select(&["GpuConfig", "MigConfig", "Other"][..]),
        repeat in prop::collection::vec(prop::bool::weighted(0.1), 0..64),
    ) {
        let mut object = Map::new();
        object.insert("apiVersion".into(), CONFIG_API_VERSION.into());
        object.insert("kind".into(), kind.into());
        object.insert("sharing".into(), sharing);
        if let Some((key, value)) = extra {
            object.insert(key, value);
        }
        let mut text = String::new();
        let repeated = render(&Value::Object(object), &mut repeat.into_iter(), &mut text);
        check_text(&text, repeated)?;
    }

    #[test]
    fn valid_configs_survive_their_json_and_mutations_are_caught(
        config in valid_config(),
        path in prop::collection::vec(any::<usize>(), 0..5),
        how in any::<u8>(),
        key in name(),
        replacement in tree(),
        repeat in prop::collection::vec(prop::bool::weighted(0.15), 0..16),
    ) {
        let value = config.to_value();
        prop_assert_eq!(decode_config(&value.to_string()), Ok(config.clone()));
        prop_assert_eq!(decode_config_value(&value), Ok(config));

        let mut mutated = value;
        mutate(&mut mutated, &path, how, key, replacement);
        let mut text = String::new();
        let repeated = render(&mutated, &mut repeat.into_iter(), &mut text);
        check_text(&text, repeated)?;
        if repeated {
            prop_assert!(decode_config(&text).is_err(), "a repeated key passed: {}", text);
        }
    }
}
