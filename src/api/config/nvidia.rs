//! NVIDIA's opaque configs (`resource.nvidia.com/v1beta1`, kinds `GpuConfig` and `MigDeviceConfig`),
//! decoded with the rules of NVIDIA's driver and mapped onto this driver's [`SharingSettings`], so
//! that claims and classes written for NVIDIA's driver keep their meaning here.
//!
//! What maps to what:
//! - no `sharing` → Exclusive (NVIDIA has no `Exclusive` strategy: it is the absence of sharing);
//! - `TimeSlicing` → TimeSlicing with `timeSlicingConfig.interval` (`Default` when absent, NVIDIA's
//!   normalisation); on a MIG device always Default, since NVIDIA sets no interval on MIG devices;
//! - `MPS` → MPS: `defaultActiveThreadPercentage` 1..=100 as is, 0 as "not set" (see
//!   [`NvidiaMps::active_thread_percentage`]); limits in whole MiB, as NVIDIA rounds them
//!   (`bytes / 1024 / 1024`, refused when that is 0); per-device limits keyed by a GPU or MIG UUID,
//!   or by an index into the sorted UUIDs of the devices the config applies to, resolved at prepare
//!   ([`NvidiaMps::per_device_limits`]); `multiUser: true` starts the claim's daemon with `-M`, as
//!   NVIDIA's main branch does (on Volta or newer, checked at prepare).
//!
//! Errors are `<path>: <reason>` with NVIDIA's own reason texts where NVIDIA has one.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::decode::{self, Path};
use super::{ConfigError, SharingSettings, TimeSliceInterval};
use super::{MpsSettings, SharingStrategy};
use crate::quantity::Quantity;

/// The apiVersion of NVIDIA's configs.
pub const NVIDIA_CONFIG_API_VERSION: &str = "resource.nvidia.com/v1beta1";
/// NVIDIA's kind for whole GPUs.
pub const NVIDIA_GPU_CONFIG_KIND: &str = "GpuConfig";
/// NVIDIA's kind for MIG devices.
pub const NVIDIA_MIG_CONFIG_KIND: &str = "MigDeviceConfig";

const MIB: u64 = 1024 * 1024;

// Reasons. Those in NVIDIA's words are NVIDIA's texts (api/nvidia.com/resource/v1beta1).
const KIND: &str = "must be GpuConfig or MigDeviceConfig (the kinds of resource.nvidia.com/v1beta1 that gpu-dra supports)";
const NEGATIVE_PERCENTAGE: &str = "active thread percentage must not be negative";
const PERCENTAGE_OVER_100: &str = "active thread percentage must not be greater than 100";
const MPS_WITH_TIME_SLICING: &str = "cannot use MpsConfig with the 'TimeSlicing' strategy";
const TIME_SLICING_WITH_MPS: &str = "cannot use TimeSlicingConfig with the 'MPS' strategy";
const NOT_A_QUANTITY: &str =
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'";

/// A decoded NVIDIA config: the kind (whole GPU or MIG device) and its sharing, normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvidiaConfig {
    /// `MigDeviceConfig` (true) or `GpuConfig` (false).
    pub is_mig: bool,
    /// `None`: no sharing (Exclusive).
    pub sharing: Option<NvidiaSharing>,
}

/// NVIDIA's two sharing strategies, with Normalize's defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NvidiaSharing {
    TimeSlicing { interval: TimeSliceInterval },
    Mps(NvidiaMps),
}

/// `mpsConfig`, validated; limits in whole MiB as NVIDIA computes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvidiaMps {
    /// As written, 0..=100.
    pub default_active_thread_percentage: Option<u8>,
    pub default_pinned_memory_limit_mib: Option<u64>,
    /// Keyed as written: a device UUID, or an index into the sorted UUIDs of the config's devices.
    pub per_device_pinned_memory_limit_mib: BTreeMap<String, u64>,
    /// `multiUser: true` (NVIDIA's main branch): the daemon runs with `-M`.
    pub multi_user: bool,
}

impl NvidiaConfig {
    pub fn kind(&self) -> &'static str {
        if self.is_mig {
            NVIDIA_MIG_CONFIG_KIND
        } else {
            NVIDIA_GPU_CONFIG_KIND
        }
    }

    /// The settings a device gets, without per-device limits (they need the devices' UUIDs:
    /// [`NvidiaMps::per_device_limits`]).
    pub fn effective(&self) -> SharingSettings {
        match &self.sharing {
            None => SharingSettings::Exclusive,
            Some(NvidiaSharing::TimeSlicing { interval }) => SharingSettings::TimeSlicing {
                interval: if self.is_mig {
                    TimeSliceInterval::default()
                } else {
                    *interval
                },
            },
            Some(NvidiaSharing::Mps(mps)) => SharingSettings::Mps(MpsSettings {
                active_thread_percentage: mps.active_thread_percentage(),
                pinned_memory_limit_bytes: mps.default_pinned_memory_limit_mib.map(|m| m * MIB),
                per_device_pinned_memory_limit_bytes: BTreeMap::new(),
                multi_user: mps.multi_user,
                // NVIDIA's MpsConfig has no field for it: the node's default.
                shm_size_bytes: None,
            }),
        }
    }

    /// The config as NVIDIA's JSON object, normalised (defaults filled in, limits in whole Mi).
    pub fn to_value(&self) -> Value {
        let sharing = match &self.sharing {
            None => None,
            Some(NvidiaSharing::TimeSlicing { .. }) if self.is_mig => {
                Some(json!({"strategy": "TimeSlicing"}))
            }
            Some(NvidiaSharing::TimeSlicing { interval }) => Some(json!({
                "strategy": "TimeSlicing",
                "timeSlicingConfig": {"interval": interval.as_str()},
            })),
            Some(NvidiaSharing::Mps(mps)) => {
                let mut config = Map::new();
                if let Some(p) = mps.default_active_thread_percentage {
                    config.insert("defaultActiveThreadPercentage".into(), p.into());
                }
                if let Some(mib) = mps.default_pinned_memory_limit_mib {
                    config.insert(
                        "defaultPinnedDeviceMemoryLimit".into(),
                        format!("{mib}Mi").into(),
                    );
                }
                if !mps.per_device_pinned_memory_limit_mib.is_empty() {
                    let limits: Map<String, Value> = mps
                        .per_device_pinned_memory_limit_mib
                        .iter()
                        .map(|(key, mib)| (key.clone(), format!("{mib}Mi").into()))
                        .collect();
                    config.insert("defaultPerDevicePinnedMemoryLimit".into(), limits.into());
                }
                if mps.multi_user {
                    config.insert("multiUser".into(), true.into());
                }
                Some(json!({"strategy": "MPS", "mpsConfig": config}))
            }
        };
        let mut object = json!({"apiVersion": NVIDIA_CONFIG_API_VERSION, "kind": self.kind()});
        if let (Some(sharing), Some(object)) = (sharing, object.as_object_mut()) {
            object.insert("sharing".into(), sharing);
        }
        object
    }

    /// The MPS settings, if the strategy is MPS.
    pub fn mps(&self) -> Option<&NvidiaMps> {
        match &self.sharing {
            Some(NvidiaSharing::Mps(mps)) => Some(mps),
            _ => None,
        }
    }

    /// The strategy on the wire (`None`: no sharing).
    pub fn strategy(&self) -> Option<SharingStrategy> {
        self.sharing.as_ref().map(|s| match s {
            NvidiaSharing::TimeSlicing { .. } => SharingStrategy::TimeSlicing,
            NvidiaSharing::Mps(_) => SharingStrategy::Mps,
        })
    }
}

impl NvidiaMps {
    /// The percentage our MPS daemon is given. NVIDIA passes any value it accepts, 0 included, to
    /// `set_default_active_thread_percentage`; the MPS control daemon takes a percentage in
    /// (0, 100] only, so 0 cannot take effect there and the daemon keeps its default (100 %).
    /// We choose to send nothing for 0, which leaves the daemon in that same state without a
    /// failed command.
    pub fn active_thread_percentage(&self) -> Option<u8> {
        self.default_active_thread_percentage.filter(|p| *p > 0)
    }

    /// The per-device limits in bytes by device, given the devices the config applies to as
    /// `(device name, UUID)`: a key is a UUID among them, else an index into their UUIDs sorted
    /// (NVIDIA's `MpsPerDevicePinnedMemoryLimit.Normalize`). An error is `(key, NVIDIA's reason)`.
    pub fn per_device_limits(
        &self,
        devices: &[(&str, &str)],
    ) -> Result<BTreeMap<String, u64>, (String, String)> {
        let mut uuids: Vec<(&str, &str)> = devices.iter().map(|&(d, u)| (u, d)).collect();
        uuids.sort();
        let mut limits = BTreeMap::new();
        for (key, mib) in &self.per_device_pinned_memory_limit_mib {
            let device = match uuids.iter().find(|(uuid, _)| uuid == key) {
                Some((_, device)) => *device,
                None => {
                    let index: i64 = key.parse().map_err(|_| {
                        (
                            key.clone(),
                            format!("invalid device: unable to parse key as an integer: {key}"),
                        )
                    })?;
                    usize::try_from(index)
                        .ok()
                        .and_then(|i| uuids.get(i))
                        .map(|(_, device)| *device)
                        .ok_or_else(|| {
                            (
                                key.clone(),
                                format!("invalid device: invalid device index: {index}"),
                            )
                        })?
                }
            };
            limits.insert(device.to_string(), mib * MIB);
        }
        Ok(limits)
    }
}

/// Decodes an object whose apiVersion is [`NVIDIA_CONFIG_API_VERSION`].
pub(super) fn decode(
    object: &Map<String, Value>,
    root: &Path,
) -> Result<NvidiaConfig, ConfigError> {
    let is_mig = match object.get("kind").and_then(Value::as_str) {
        Some(NVIDIA_GPU_CONFIG_KIND) => false,
        Some(NVIDIA_MIG_CONFIG_KIND) => true,
        _ => return Err(root.field("kind").error(KIND)),
    };
    decode::unknown_fields(object, &["apiVersion", "kind", "sharing"], root)?;
    let path = root.field("sharing");
    let Some(value) = decode::present(object.get("sharing")) else {
        return Ok(NvidiaConfig {
            is_mig,
            sharing: None,
        });
    };

    // Decoding: the shape, as NVIDIA's strict decoder checks it.
    let sharing = decode::object(value, &path)?;
    let allowed: &[&str] = if is_mig {
        &["strategy", "mpsConfig"]
    } else {
        &["strategy", "timeSlicingConfig", "mpsConfig"]
    };
    decode::unknown_fields(sharing, allowed, &path)?;
    let strategy_path = path.field("strategy");
    let strategy = decode::string(sharing.get("strategy"), &strategy_path)?.unwrap_or("");
    let time_slicing_path = path.field("timeSlicingConfig");
    let interval = match decode::present(sharing.get("timeSlicingConfig")) {
        None => None,
        Some(value) => {
            let config = decode::object(value, &time_slicing_path)?;
            decode::unknown_fields(config, &["interval"], &time_slicing_path)?;
            let interval_path = time_slicing_path.field("interval");
            Some(
                decode::string(config.get("interval"), &interval_path)?
                    .map(|text| (text, interval_path)),
            )
        }
    };
    let mps_path = path.field("mpsConfig");
    let mps = decode::present(sharing.get("mpsConfig"))
        .map(|value| decode_mps(value, &mps_path))
        .transpose()?;

    // Validation, in NVIDIA's order: the strategy, then the settings of that strategy, then (at
    // NVIDIA's prepare) the other strategy's settings given alongside, then the limits.
    let sharing = match strategy {
        "TimeSlicing" => {
            let interval = match interval.flatten() {
                // `timeSlicingConfig: {}` leaves the interval unset; the default then, as without
                // timeSlicingConfig.
                None => TimeSliceInterval::default(),
                Some((text, interval_path)) => {
                    super::interval_from_wire(text).ok_or_else(|| {
                        interval_path.error(&format!(
                            "unknown time-slice interval: {text}, supported time-slice intervals: Default, Short, Medium, Long"
                        ))
                    })?
                }
            };
            // NVIDIA's MigDeviceSharing ignores mpsConfig under TimeSlicing; only GpuSharing refuses it.
            if mps.is_some() && !is_mig {
                return Err(mps_path.error(MPS_WITH_TIME_SLICING));
            }
            NvidiaSharing::TimeSlicing { interval }
        }
        "MPS" => {
            let mps = mps.unwrap_or_default();
            let percentage = match mps.percentage {
                None => None,
                Some((p, _)) if (0..=100).contains(&p) => u8::try_from(p).ok(),
                Some((p, ref at)) if p < 0 => return Err(at.error(NEGATIVE_PERCENTAGE)),
                Some((_, ref at)) => return Err(at.error(PERCENTAGE_OVER_100)),
            };
            if interval.is_some() {
                return Err(time_slicing_path.error(TIME_SLICING_WITH_MPS));
            }
            let default_pinned_memory_limit_mib = mps
                .default_limit
                .map(|(q, at)| {
                    megabytes(&q).ok_or_else(|| {
                        at.error(&format!(
                            "invalid limit: default value set too low: {}",
                            q.0
                        ))
                    })
                })
                .transpose()?;
            let mut per_device_pinned_memory_limit_mib = BTreeMap::new();
            for (key, q, at) in mps.per_device {
                let mib = megabytes(&q).ok_or_else(|| {
                    at.error(&format!("invalid limit: value set too low: {key}: {}", q.0))
                })?;
                per_device_pinned_memory_limit_mib.insert(key, mib);
            }
            NvidiaSharing::Mps(NvidiaMps {
                default_active_thread_percentage: percentage,
                default_pinned_memory_limit_mib,
                per_device_pinned_memory_limit_mib,
                multi_user: mps.multi_user,
            })
        }
        other => {
            return Err(strategy_path.error(&format!(
                "unknown GPU sharing strategy: {other}, supported GPU sharing strategies: TimeSlicing, MPS"
            )))
        }
    };
    Ok(NvidiaConfig {
        is_mig,
        sharing: Some(sharing),
    })
}

/// `mpsConfig` as decoded, before validation (which depends on the strategy).
#[derive(Default)]
struct RawMps {
    percentage: Option<(i64, Path)>,
    default_limit: Option<(WrittenQuantity, Path)>,
    per_device: Vec<(String, WrittenQuantity, Path)>,
    /// `multiUser: true` was given.
    multi_user: bool,
}

/// A quantity with the text it was written as (NVIDIA's messages show it).
struct WrittenQuantity(String, Quantity);

fn decode_mps(value: &Value, path: &Path) -> Result<RawMps, ConfigError> {
    const PERCENTAGE: &str = "defaultActiveThreadPercentage";
    const LIMIT: &str = "defaultPinnedDeviceMemoryLimit";
    const PER_DEVICE: &str = "defaultPerDevicePinnedMemoryLimit";
    const MULTI_USER_FIELD: &str = "multiUser";
    let object = decode::object(value, path)?;
    decode::unknown_fields(
        object,
        &[PERCENTAGE, LIMIT, PER_DEVICE, MULTI_USER_FIELD],
        path,
    )?;
    let mut mps = RawMps::default();

    let at = path.field(PERCENTAGE);
    if let Some(value) = decode::present(object.get(PERCENTAGE)) {
        // A Go `int`: a JSON integer within 64 bits; 50.0 or "50" does not decode.
        let percentage = value
            .as_i64()
            .ok_or_else(|| at.error(decode::MUST_BE_INTEGER))?;
        mps.percentage = Some((percentage, at));
    }

    let at = path.field(LIMIT);
    if let Some(value) = decode::present(object.get(LIMIT)) {
        mps.default_limit = Some((quantity(value, &at)?, at));
    }

    let at = path.field(PER_DEVICE);
    if let Some(value) = decode::present(object.get(PER_DEVICE)) {
        for (key, limit) in decode::object(value, &at)? {
            let key_path = at.key(key);
            // A null map value decodes to a zero quantity in Go, which is then too low.
            let limit = match limit {
                Value::Null => WrittenQuantity("0".into(), Quantity::zero()),
                other => quantity(other, &key_path)?,
            };
            mps.per_device.push((key.clone(), limit, key_path));
        }
    }

    let at = path.field(MULTI_USER_FIELD);
    match decode::present(object.get(MULTI_USER_FIELD)) {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => mps.multi_user = true,
        Some(_) => return Err(at.error("must be a boolean")),
    }
    Ok(mps)
}

/// A quantity as apimachinery reads one from JSON: a string (spaces around it trimmed) or a bare
/// number, in Kubernetes quantity syntax; a sign is allowed (a negative limit is then too low).
fn quantity(value: &Value, path: &Path) -> Result<WrittenQuantity, ConfigError> {
    let text = match value {
        Value::String(text) => text.trim().to_string(),
        Value::Number(number) => number.to_string(),
        _ => return Err(path.error(decode::MUST_BE_STRING)),
    };
    let parsed = Quantity::parse(&text).map_err(|_| path.error(NOT_A_QUANTITY))?;
    Ok(WrittenQuantity(text, parsed))
}

/// NVIDIA's whole MiB of a limit: the value rounded up to whole bytes (`Quantity.Value()`), then
/// divided down to MiB; `None` when that is not positive.
fn megabytes(quantity: &WrittenQuantity) -> Option<u64> {
    let bytes = quantity.1.ceil_integer()?;
    u64::try_from(bytes / 1024 / 1024).ok().filter(|m| *m > 0)
}

#[cfg(test)]
#[path = "nvidia_tests.rs"]
mod tests;
