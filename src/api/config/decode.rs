//! The strict decoder. Raw JSON text becomes a value with every repeated key refused (serde_json
//! would keep the last one silently); the value becomes a config with every unknown field, wrong
//! type and out-of-range value refused. The first problem found is returned as `<path>: <reason>`;
//! the reasons are the admission policy's too, so keep the two in step.

use std::cell::RefCell;
use std::fmt;

use serde::de::{DeserializeSeed, Error as _, MapAccess, SeqAccess, Visitor};
use serde::Deserializer;
use serde_json::{Map, Number, Value};

use super::nvidia::{self, NVIDIA_CONFIG_API_VERSION};
use super::{
    ByteQuantity, ConfigError, DeviceConfig, GpuConfig, MigConfig, MpsConfig, Sharing,
    SharingStrategy, TimeSlicingConfig, CONFIG_API_VERSION, GPU_CONFIG_KIND, MIG_CONFIG_KIND,
};
use crate::devices::names::DeviceName;

/// The path of the config object itself.
pub(super) const ROOT: &str = "parameters";

// The reasons; tests and the admission policy match these texts.
pub(super) const API_VERSION: &str = "must be gpu.dra.dev/v1alpha1 or resource.nvidia.com/v1beta1";
pub(super) const KIND: &str = "must be GpuConfig or MigConfig";
pub(super) const UNKNOWN_FIELD: &str = "unknown field";
pub(super) const DUPLICATE_KEY: &str = "duplicate key";
pub(super) const MUST_BE_STRING: &str = "must be a string";
pub(super) const MUST_BE_INTEGER: &str = "must be an integer";
pub(super) const MUST_BE_OBJECT: &str = "must be an object";
pub(super) const STRATEGY: &str = "must be one of Exclusive, TimeSlicing, MPS";
pub(super) const REQUIRED: &str = "required";
pub(super) const INTERVAL: &str = "must be one of Default, Short, Medium, Long";
pub(super) const ONLY_TIME_SLICING: &str = "only allowed with strategy TimeSlicing";
pub(super) const NOT_IN_MIG: &str =
    "not allowed in MigConfig (MIG devices have no time-slice interval)";
pub(super) const ONLY_MPS: &str = "only allowed with strategy MPS";
pub(super) const PERCENTAGE: &str = "must be between 1 and 100";
pub(super) const QUANTITY: &str = "must be a positive quantity of bytes such as 10Gi";
pub(super) const DEVICE_NAME: &str =
    "not a device name of this driver (gpu-<minor> or gpu-<minor>-mig-...)";
/// The start of the reason for text that is not JSON; serde_json's message follows in parentheses.
pub(super) const NOT_JSON: &str = "not valid JSON";

/// The one map whose keys are data (device names), shown in brackets rather than as fields.
const PER_DEVICE_LIMITS: &str = "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit";

/// Decodes a config from the raw JSON text of `opaque.parameters`, strictly: a repeated key is an
/// error too, which only the text shows.
pub fn decode_config(json_text: &str) -> Result<DeviceConfig, ConfigError> {
    decode_config_value(&parse_strict(json_text)?)
}

/// Decodes a config from a JSON value: the checks of [`decode_config`] except repeated keys, which a
/// value no longer has.
pub fn decode_config_value(value: &Value) -> Result<DeviceConfig, ConfigError> {
    let root = Path::default();
    let object = object(value, &root)?;
    // apiVersion and kind of another type are simply not ours: the same message as a wrong value.
    let api_version = root.field("apiVersion");
    match object.get("apiVersion").and_then(Value::as_str) {
        Some(CONFIG_API_VERSION) => {}
        Some(NVIDIA_CONFIG_API_VERSION) => {
            return nvidia::decode(object, &root).map(DeviceConfig::Nvidia)
        }
        _ => return Err(api_version.error(API_VERSION)),
    }
    let kind = root.field("kind");
    let is_mig = match object.get("kind").and_then(Value::as_str) {
        Some(GPU_CONFIG_KIND) => false,
        Some(MIG_CONFIG_KIND) => true,
        _ => return Err(kind.error(KIND)),
    };
    unknown_fields(object, &["apiVersion", "kind", "sharing"], &root)?;
    let sharing = present(object.get("sharing"))
        .map(|value| decode_sharing(value, &root.field("sharing"), is_mig))
        .transpose()?;
    Ok(if is_mig {
        DeviceConfig::Mig(MigConfig { sharing })
    } else {
        DeviceConfig::Gpu(GpuConfig { sharing })
    })
}

/// The kind a config says it is, if it is one of ours: to name it in an error about the rest.
pub fn declared_kind(value: &Value) -> Option<&'static str> {
    let nvidia = value.get("apiVersion").and_then(Value::as_str) == Some(NVIDIA_CONFIG_API_VERSION);
    match value.get("kind")?.as_str()? {
        GPU_CONFIG_KIND => Some(GPU_CONFIG_KIND),
        MIG_CONFIG_KIND if !nvidia => Some(MIG_CONFIG_KIND),
        nvidia::NVIDIA_MIG_CONFIG_KIND if nvidia => Some(nvidia::NVIDIA_MIG_CONFIG_KIND),
        _ => None,
    }
}

fn decode_sharing(value: &Value, path: &Path, is_mig: bool) -> Result<Sharing, ConfigError> {
    let object = object(value, path)?;
    unknown_fields(
        object,
        &["strategy", "timeSlicingConfig", "mpsConfig"],
        path,
    )?;
    let strategy_path = path.field("strategy");
    let strategy = match string(object.get("strategy"), &strategy_path)? {
        None => return Err(strategy_path.error(REQUIRED)),
        Some(text) => {
            SharingStrategy::from_wire(text).ok_or_else(|| strategy_path.error(STRATEGY))?
        }
    };

    let time_slicing_path = path.field("timeSlicingConfig");
    let time_slicing_config = match present(object.get("timeSlicingConfig")) {
        None => None,
        Some(_) if is_mig => return Err(time_slicing_path.error(NOT_IN_MIG)),
        Some(_) if strategy != SharingStrategy::TimeSlicing => {
            return Err(time_slicing_path.error(ONLY_TIME_SLICING))
        }
        Some(value) => Some(decode_time_slicing(value, &time_slicing_path)?),
    };

    let mps_path = path.field("mpsConfig");
    let mps_config = match present(object.get("mpsConfig")) {
        None => None,
        Some(_) if strategy != SharingStrategy::Mps => return Err(mps_path.error(ONLY_MPS)),
        Some(value) => Some(decode_mps(value, &mps_path)?),
    };

    Ok(Sharing {
        strategy,
        time_slicing_config,
        mps_config,
    })
}

fn decode_time_slicing(value: &Value, path: &Path) -> Result<TimeSlicingConfig, ConfigError> {
    let object = object(value, path)?;
    unknown_fields(object, &["interval"], path)?;
    let interval_path = path.field("interval");
    let interval = string(object.get("interval"), &interval_path)?
        .map(|text| super::interval_from_wire(text).ok_or_else(|| interval_path.error(INTERVAL)))
        .transpose()?;
    Ok(TimeSlicingConfig { interval })
}

fn decode_mps(value: &Value, path: &Path) -> Result<MpsConfig, ConfigError> {
    const PERCENTAGE_FIELD: &str = "defaultActiveThreadPercentage";
    const LIMIT_FIELD: &str = "defaultPinnedDeviceMemoryLimit";
    const PER_DEVICE_FIELD: &str = "defaultPerDevicePinnedMemoryLimit";
    const SHM_SIZE_FIELD: &str = "shmSize";
    let object = object(value, path)?;
    unknown_fields(
        object,
        &[
            PERCENTAGE_FIELD,
            LIMIT_FIELD,
            PER_DEVICE_FIELD,
            SHM_SIZE_FIELD,
        ],
        path,
    )?;

    let percentage_path = path.field(PERCENTAGE_FIELD);
    let default_active_thread_percentage = present(object.get(PERCENTAGE_FIELD))
        .map(|value| match value {
            Value::Number(number) if number.is_i64() || number.is_u64() => number
                .as_u64()
                .filter(|p| (1..=100).contains(p))
                .and_then(|p| u8::try_from(p).ok())
                .ok_or_else(|| percentage_path.error(PERCENTAGE)),
            _ => Err(percentage_path.error(MUST_BE_INTEGER)),
        })
        .transpose()?;

    let limit_path = path.field(LIMIT_FIELD);
    let default_pinned_device_memory_limit = present(object.get(LIMIT_FIELD))
        .map(|value| quantity_field(value, &limit_path))
        .transpose()?;

    let per_device_path = path.field(PER_DEVICE_FIELD);
    let mut default_per_device_pinned_memory_limit = std::collections::BTreeMap::new();
    if let Some(value) = present(object.get(PER_DEVICE_FIELD)) {
        for (device, limit) in self::object(value, &per_device_path)? {
            let device_path = per_device_path.key(device);
            if DeviceName::parse(device).is_none() {
                return Err(device_path.error(DEVICE_NAME));
            }
            let limit = quantity_field(limit, &device_path)?;
            default_per_device_pinned_memory_limit.insert(device.clone(), limit);
        }
    }

    let shm_size_path = path.field(SHM_SIZE_FIELD);
    let shm_size = present(object.get(SHM_SIZE_FIELD))
        .map(|value| quantity_field(value, &shm_size_path))
        .transpose()?;

    Ok(MpsConfig {
        default_active_thread_percentage,
        default_pinned_device_memory_limit,
        default_per_device_pinned_memory_limit,
        shm_size,
    })
}

/// A quantity field: a string in Kubernetes quantity syntax of at least one whole byte. A bare JSON
/// number is refused, as the admission policy refuses it: `10Gi` and `1073741824` say what they
/// mean, a number in YAML is easily a typo.
fn quantity_field(value: &Value, path: &Path) -> Result<ByteQuantity, ConfigError> {
    match value {
        Value::String(text) => ByteQuantity::parse(text).ok_or_else(|| path.error(QUANTITY)),
        _ => Err(path.error(MUST_BE_STRING)),
    }
}

/// A quantity as the types read it (a string of at least one whole byte).
pub(super) fn byte_quantity(value: &Value) -> Option<ByteQuantity> {
    value.as_str().and_then(ByteQuantity::parse)
}

/// An explicit `null` counts as absent, as in Kubernetes' own decoding.
pub(super) fn present(value: Option<&Value>) -> Option<&Value> {
    value.filter(|v| !v.is_null())
}

pub(super) fn object<'v>(
    value: &'v Value,
    path: &Path,
) -> Result<&'v Map<String, Value>, ConfigError> {
    value.as_object().ok_or_else(|| path.error(MUST_BE_OBJECT))
}

pub(super) fn string<'v>(
    value: Option<&'v Value>,
    path: &Path,
) -> Result<Option<&'v str>, ConfigError> {
    match present(value) {
        None => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(_) => Err(path.error(MUST_BE_STRING)),
    }
}

/// The first field (in key order) that `allowed` does not name.
pub(super) fn unknown_fields(
    object: &Map<String, Value>,
    allowed: &[&str],
    path: &Path,
) -> Result<(), ConfigError> {
    match object.keys().find(|key| !allowed.contains(&key.as_str())) {
        Some(key) => Err(path.field(key).error(UNKNOWN_FIELD)),
        None => Ok(()),
    }
}

/// A path in a config: `sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[gpu-0]`. Names from the
/// input are escaped and cut short, so an error message stays one readable line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Path(String);

impl Path {
    pub(super) fn field(&self, name: &str) -> Path {
        if self.0.is_empty() {
            Path(shown(name))
        } else {
            Path(format!("{}.{}", self.0, shown(name)))
        }
    }

    pub(super) fn key(&self, key: &str) -> Path {
        Path(format!("{self}[{}]", shown(key)))
    }

    fn index(&self, index: usize) -> Path {
        Path(format!("{self}[{index}]"))
    }

    pub(super) fn error(&self, reason: &str) -> ConfigError {
        ConfigError {
            path: self.to_string(),
            reason: reason.to_string(),
        }
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { ROOT } else { &self.0 })
    }
}

/// Longest name shown in a path, in characters.
const SHOWN_NAME: usize = 64;

/// A name as a path shows it: as it is when it is plain (letters, digits, `-`, `_`, `/`), else as a
/// JSON string (`""`, `"a.b"`, `"a\nb"`), so that the path stays readable and unambiguous; cut short
/// after [`SHOWN_NAME`] characters.
fn shown(name: &str) -> String {
    let plain = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'/');
    let mut cut: String = name.chars().take(SHOWN_NAME).collect();
    let long = cut.len() < name.len();
    if long {
        cut.push('…');
    }
    if plain && !long {
        cut
    } else {
        Value::String(cut).to_string()
    }
}

/// Parses JSON text into a value, refusing a key repeated in one object with the key's path.
fn parse_strict(text: &str) -> Result<Value, ConfigError> {
    let duplicate = RefCell::new(None);
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let seed = StrictValue {
        path: Path::default(),
        duplicate: &duplicate,
    };
    let parsed = seed
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value));
    parsed.map_err(|error| {
        duplicate
            .into_inner()
            .unwrap_or_else(|| Path::default().error(&format!("{NOT_JSON} ({error})")))
    })
}

/// Builds a `serde_json::Value` like its own `Deserialize`, but fails on a repeated key. serde_json
/// adds a position to a custom error's text, so the error itself travels in `duplicate`.
struct StrictValue<'a> {
    path: Path,
    duplicate: &'a RefCell<Option<ConfigError>>,
}

impl<'de> DeserializeSeed<'de> for StrictValue<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        Ok(Number::from_f64(value).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, value: &str) -> Result<Value, E> {
        Ok(Value::String(value.to_string()))
    }

    fn visit_string<E>(self, value: String) -> Result<Value, E> {
        Ok(Value::String(value))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        loop {
            let seed = StrictValue {
                path: self.path.index(items.len()),
                duplicate: self.duplicate,
            };
            match seq.next_element_seed(seed)? {
                Some(item) => items.push(item),
                None => return Ok(Value::Array(items)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let path = if self.path.0 == PER_DEVICE_LIMITS {
                self.path.key(&key)
            } else {
                self.path.field(&key)
            };
            if object.contains_key(&key) {
                *self.duplicate.borrow_mut() = Some(path.error(DUPLICATE_KEY));
                return Err(A::Error::custom(DUPLICATE_KEY));
            }
            let value = map.next_value_seed(StrictValue {
                path,
                duplicate: self.duplicate,
            })?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}
