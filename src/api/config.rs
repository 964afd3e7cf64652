//! The opaque device configurations of this driver (`gpu.dra.dev/v1alpha1`), written in DeviceClass
//! `spec.config[].opaque.parameters` and ResourceClaim `spec.devices.config[].opaque.parameters`:
//! `GpuConfig` for whole GPUs and `MigConfig` for MIG devices, each with an optional `sharing`.
//! Field names follow NVIDIA's driver, so a config ports by changing its apiVersion. NVIDIA's own
//! configs (`resource.nvidia.com/v1beta1` `GpuConfig` and `MigDeviceConfig`) are accepted too, with
//! NVIDIA's rules, whatever the driver name; [`nvidia`] says how they map onto ours.
//!
//! Decoding is strict ([`decode_config`]): an unknown field, a repeated key, a wrong type or an
//! out-of-range value is an error `<path>: <reason>`, the same text the admission policy gives, so a
//! claim is never prepared with a guessed setting. [`DeviceConfig::effective`] turns a config into the
//! [`SharingSettings`] a device gets; [`config_schema`] is the JSON schema checked in under `crd/`.
//!
//! ```
//! use gpu_dra::api::config::{decode_config, SharingSettings, TimeSliceInterval};
//!
//! let config = decode_config(r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig",
//!     "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}"#).unwrap();
//! assert_eq!(config.effective(), SharingSettings::TimeSlicing { interval: TimeSliceInterval::Long });
//! assert_eq!(config.effective().env_value(), "TimeSlicing/Long");
//!
//! let error = decode_config(r#"{"apiVersion": "gpu.dra.dev/v1alpha1", "kind": "GpuConfig",
//!     "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}}"#).unwrap_err();
//! assert_eq!(error.to_string(),
//!     "sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100");
//! ```

mod decode;
pub mod nvidia;
pub mod vfio;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::quantity::Quantity;

pub use decode::{declared_kind, decode_config, decode_config_value};
pub use nvidia::{NvidiaConfig, NVIDIA_CONFIG_API_VERSION};

/// The apiVersion of every config of this driver.
pub const CONFIG_API_VERSION: &str = "gpu.dra.dev/v1alpha1";
/// The kind for whole GPUs.
pub const GPU_CONFIG_KIND: &str = "GpuConfig";
/// The kind for MIG devices.
pub const MIG_CONFIG_KIND: &str = "MigConfig";

/// Where the generated schemas live, relative to the crate root.
pub const GPU_CONFIG_SCHEMA_PATH: &str = "schemas/gpu.dra.dev_v1alpha1_gpuconfig.schema.json";
pub const MIG_CONFIG_SCHEMA_PATH: &str = "schemas/gpu.dra.dev_v1alpha1_migconfig.schema.json";

/// A decoded config; the variant is its `kind`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceConfig {
    Gpu(GpuConfig),
    Mig(MigConfig),
    /// NVIDIA's `resource.nvidia.com/v1beta1` `GpuConfig` or `MigDeviceConfig` ([`nvidia`]).
    Nvidia(NvidiaConfig),
}

/// Settings for whole GPUs (`kind: GpuConfig`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    /// How processes share the GPU; absent means Exclusive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<Sharing>,
}

/// Settings for MIG devices (`kind: MigConfig`): the same `sharing` as GpuConfig without
/// `timeSlicingConfig`, since a MIG device has no time-slice interval of its own.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigConfig {
    /// How processes share the MIG device; absent means Exclusive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<MigSharingSchema>")]
    pub sharing: Option<Sharing>,
}

/// How processes share a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("allOf" = [
    {"if": {"required": ["timeSlicingConfig"],
            "properties": {"timeSlicingConfig": {"not": {"type": "null"}}}},
     "then": {"properties": {"strategy": {"const": "TimeSlicing"}}}},
    {"if": {"required": ["mpsConfig"],
            "properties": {"mpsConfig": {"not": {"type": "null"}}}},
     "then": {"properties": {"strategy": {"const": "MPS"}}}}
]))]
pub struct Sharing {
    pub strategy: SharingStrategy,
    /// Only with strategy TimeSlicing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing_config: Option<TimeSlicingConfig>,
    /// Only with strategy MPS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_config: Option<MpsConfig>,
}

// The shape of `MigConfig.sharing`, for its schema only: decoding refuses `timeSlicingConfig` there
// with a message of its own.
#[derive(JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(description = "How processes share a MIG device.")]
#[schemars(extend("allOf" = [
    {"if": {"required": ["mpsConfig"],
            "properties": {"mpsConfig": {"not": {"type": "null"}}}},
     "then": {"properties": {"strategy": {"const": "MPS"}}}}
]))]
// Never built: it exists to describe MigConfig's `sharing` in the schema.
#[allow(dead_code)]
struct MigSharingSchema {
    strategy: SharingStrategy,
    /// Only with strategy MPS.
    mps_config: Option<MpsConfig>,
}

/// `Exclusive`: one process at a time, as without sharing. `TimeSlicing`: processes take turns
/// on the GPU. `MPS`: processes run at once through an MPS control daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum SharingStrategy {
    Exclusive,
    TimeSlicing,
    #[serde(rename = "MPS")]
    Mps,
}

impl SharingStrategy {
    pub const ALL: [SharingStrategy; 3] = [Self::Exclusive, Self::TimeSlicing, Self::Mps];

    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exclusive => "Exclusive",
            Self::TimeSlicing => "TimeSlicing",
            Self::Mps => "MPS",
        }
    }

    fn from_wire(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

impl fmt::Display for SharingStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Time-slicing settings of a whole GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TimeSlicingConfig {
    /// How long a process runs before the GPU switches to another; absent means Default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<TimeSliceInterval>,
}

/// A GPU's time slice, as `nvidia-smi compute-policy --set-timeslice` names them (0 to 3); the backend's
/// type, which sets it.
pub use crate::gpu::TimeSliceInterval;

fn interval_from_wire(text: &str) -> Option<TimeSliceInterval> {
    TimeSliceInterval::ALL
        .into_iter()
        .find(|i| i.as_str() == text)
}

/// What a DRA device name of this driver looks like (`devices::names::DeviceName` parses them):
/// `gpu-<minor>` or `gpu-<minor>-mig-<profile>-<start>[-ci<id>]`.
pub const DEVICE_NAME_PATTERN: &str = "^gpu-(0|[1-9][0-9]*)(-mig-[a-z0-9]([a-z0-9-]*[a-z0-9])?-(0|[1-9][0-9]*)(-ci(0|[1-9][0-9]*))?)?$";

/// Settings of the MPS control daemon that serves the claim's devices.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MpsConfig {
    /// The share of each device's compute a client may use, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub default_active_thread_percentage: Option<u8>,
    /// The device memory a client may pin on each device (a quantity such as 10Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_pinned_device_memory_limit: Option<ByteQuantity>,
    /// Per device (by DRA device name, such as gpu-0): a limit that replaces the default one.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("propertyNames" = {"pattern": DEVICE_NAME_PATTERN}))]
    pub default_per_device_pinned_memory_limit: BTreeMap<String, ByteQuantity>,
    /// The size of the claim's /dev/shm, which the MPS server and the claim's containers share (a
    /// quantity such as 1Gi, at most the node's memory); absent: the node's default, 64Mi unless
    /// the plugin's --mps-shm-size says otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_size: Option<ByteQuantity>,
}

/// A Kubernetes quantity that is a positive whole number of bytes (`10Gi`, `512Mi`, `1000000`),
/// kept as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteQuantity {
    text: String,
    bytes: u64,
}

impl ByteQuantity {
    /// `None` unless `text` is a quantity (Kubernetes syntax) of at least one whole byte.
    pub fn parse(text: &str) -> Option<ByteQuantity> {
        let quantity = Quantity::parse(text).ok()?;
        let bytes = u64::try_from(quantity.as_integer()?).ok()?;
        (bytes > 0).then(|| ByteQuantity {
            text: text.to_string(),
            bytes,
        })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The quantity as it was written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl Serialize for ByteQuantity {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for ByteQuantity {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        decode::byte_quantity(&value).ok_or_else(|| serde::de::Error::custom(decode::QUANTITY))
    }
}

impl JsonSchema for ByteQuantity {
    fn schema_name() -> Cow<'static, str> {
        "ByteQuantity".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        // Kubernetes' quantity syntax without a sign: the value must be a positive whole number of bytes.
        json_schema!({
            "description": "A positive whole number of bytes, as a Kubernetes quantity such as 10Gi.",
            "type": "string",
            "pattern": "^\\+?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))))?$"
        })
    }
}

/// Why a config was refused: `<path>: <reason>`, where the path is relative to the config object
/// (`opaque.parameters`), dotted, with map keys in brackets (`parameters` for the object itself).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct ConfigError {
    pub path: String,
    pub reason: String,
}

impl DeviceConfig {
    /// `GpuConfig` or `MigConfig`.
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceConfig::Gpu(_) => GPU_CONFIG_KIND,
            DeviceConfig::Mig(_) => MIG_CONFIG_KIND,
            DeviceConfig::Nvidia(config) => config.kind(),
        }
    }

    /// Whether this kind applies to a MIG device (true) or a whole GPU (false).
    pub fn is_mig(&self) -> bool {
        match self {
            DeviceConfig::Gpu(_) => false,
            DeviceConfig::Mig(_) => true,
            DeviceConfig::Nvidia(config) => config.is_mig,
        }
    }

    /// The `sharing` of one of our kinds (`None` for NVIDIA's, see [`DeviceConfig::Nvidia`]).
    pub fn sharing(&self) -> Option<&Sharing> {
        match self {
            DeviceConfig::Gpu(config) => config.sharing.as_ref(),
            DeviceConfig::Mig(config) => config.sharing.as_ref(),
            DeviceConfig::Nvidia(_) => None,
        }
    }

    /// What a device configured this way gets: Exclusive without `sharing`, TimeSlicing with the
    /// interval (Default when not given; always Default on MIG devices), MPS with limits in bytes.
    /// NVIDIA's configs map as [`NvidiaConfig::effective`] says.
    pub fn effective(&self) -> SharingSettings {
        if let DeviceConfig::Nvidia(config) = self {
            return config.effective();
        }
        let Some(sharing) = self.sharing() else {
            return SharingSettings::Exclusive;
        };
        match sharing.strategy {
            SharingStrategy::Exclusive => SharingSettings::Exclusive,
            SharingStrategy::TimeSlicing => SharingSettings::TimeSlicing {
                interval: sharing
                    .time_slicing_config
                    .as_ref()
                    .and_then(|c| c.interval)
                    .filter(|_| !self.is_mig())
                    .unwrap_or_default(),
            },
            SharingStrategy::Mps => {
                let config = sharing.mps_config.clone().unwrap_or_default();
                SharingSettings::Mps(MpsSettings {
                    active_thread_percentage: config.default_active_thread_percentage,
                    pinned_memory_limit_bytes: config
                        .default_pinned_device_memory_limit
                        .map(|q| q.bytes()),
                    per_device_pinned_memory_limit_bytes: config
                        .default_per_device_pinned_memory_limit
                        .into_iter()
                        .map(|(device, q)| (device, q.bytes()))
                        .collect(),
                    // gpu-dra's own MpsConfig has no multi-user mode.
                    multi_user: false,
                    shm_size_bytes: config.shm_size.map(|q| q.bytes()),
                })
            }
        }
    }

    /// The config as its JSON object, with apiVersion and kind.
    pub fn to_value(&self) -> Value {
        // Strings, small numbers and maps with string keys: serializing cannot fail.
        let body = match self {
            DeviceConfig::Gpu(config) => serde_json::to_value(config),
            DeviceConfig::Mig(config) => serde_json::to_value(config),
            DeviceConfig::Nvidia(config) => return config.to_value(),
        };
        let mut object = match body {
            Ok(Value::Object(object)) => object,
            _ => serde_json::Map::new(),
        };
        object.insert("apiVersion".into(), CONFIG_API_VERSION.into());
        object.insert("kind".into(), self.kind().into());
        Value::Object(object)
    }
}

/// How a device is shared once configs are resolved: what prepare applies and the checkpoint keeps.
/// JSON: `{"strategy": "Exclusive"}`, `{"strategy": "TimeSlicing", "interval": "Long"}`,
/// `{"strategy": "MPS", "activeThreadPercentage": 50, "pinnedMemoryLimitBytes": 1073741824}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "strategy")]
pub enum SharingSettings {
    #[default]
    Exclusive,
    TimeSlicing {
        #[serde(default)]
        interval: TimeSliceInterval,
    },
    #[serde(rename = "MPS")]
    Mps(MpsSettings),
}

/// MPS limits, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_memory_limit_bytes: Option<u64>,
    /// By DRA device name; replaces `pinned_memory_limit_bytes` for that device.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_device_pinned_memory_limit_bytes: BTreeMap<String, u64>,
    /// NVIDIA's `multiUser`: the claim's control daemon serves clients of different user ids at once
    /// (started with NVIDIA's documented `-multiuser-server`) instead of one user's at a time.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub multi_user: bool,
    /// `shmSize`: the size of the claim's shared-memory tmpfs; `None`, the node's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_size_bytes: Option<u64>,
}

impl MpsSettings {
    /// The pinned-memory limit for `device`: its own if given, else the default.
    pub fn pinned_memory_limit_for(&self, device: &str) -> Option<u64> {
        self.per_device_pinned_memory_limit_bytes
            .get(device)
            .copied()
            .or(self.pinned_memory_limit_bytes)
    }
}

impl SharingSettings {
    pub fn is_exclusive(&self) -> bool {
        matches!(self, SharingSettings::Exclusive)
    }

    /// The value of `GPU_DRA_SHARING` in the container: `Exclusive`, `TimeSlicing/<interval>`, `MPS`.
    pub fn env_value(&self) -> String {
        match self {
            SharingSettings::Exclusive => "Exclusive".to_string(),
            SharingSettings::TimeSlicing { interval } => format!("TimeSlicing/{interval}"),
            SharingSettings::Mps(_) => "MPS".to_string(),
        }
    }
}

/// The JSON schema of a config kind (`GpuConfig` or `MigConfig`), generated from the types, with
/// `apiVersion` and `kind` added; `None` for another kind.
pub fn config_schema(kind: &str) -> Option<Value> {
    let generator = schemars::generate::SchemaSettings::draft2020_12()
        .with(|s| s.inline_subschemas = true)
        .into_generator();
    let mut schema = match kind {
        GPU_CONFIG_KIND => generator.into_root_schema_for::<GpuConfig>(),
        MIG_CONFIG_KIND => generator.into_root_schema_for::<MigConfig>(),
        _ => return None,
    }
    .to_value();
    let object = schema.as_object_mut()?;
    object.insert(
        "$comment".into(),
        "Generated from src/api/config.rs; do not edit. Regenerate: UPDATE_CRD=1 cargo test config_schema_files_are_current".into(),
    );
    object.insert("title".into(), kind.into());
    let properties = object
        .entry("properties")
        .or_insert_with(|| Value::Object(serde_json::Map::new()))
        .as_object_mut()?;
    properties.insert(
        "apiVersion".into(),
        serde_json::json!({"type": "string", "enum": [CONFIG_API_VERSION]}),
    );
    properties.insert(
        "kind".into(),
        serde_json::json!({"type": "string", "enum": [kind]}),
    );
    object.insert("required".into(), serde_json::json!(["apiVersion", "kind"]));
    Some(schema)
}

/// The checked-in schema file of a kind: pretty JSON with a trailing newline.
pub fn config_schema_file(kind: &str) -> Option<String> {
    let schema = config_schema(kind)?;
    serde_json::to_string_pretty(&schema).ok().map(|s| s + "\n")
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "config_fuzz_tests.rs"]
mod fuzz;
