//! Which of a claim's opaque configs applies to each of its allocated devices (pure). The scheduler
//! copies the configs into `status.allocation.devices.config`: the classes' first (source
//! `FromClass`, each naming the requests of that class), then the claim's (`FromClaim`). Of those for
//! this driver:
//! - every one is decoded, used or not: a malformed config fails the claim;
//! - a device takes the last config that names its request (`main` names `main/sub` too); if its
//!   kind does not fit the device (a MigConfig for a whole GPU) that is an error;
//! - else the last config for all requests whose kind fits the device (a class may carry both kinds);
//! - else the device is Exclusive.
//!
//! Under NVIDIA's driver name (`gpu.nvidia.com`, the compatibility mode) NVIDIA's precedence applies
//! instead, to NVIDIA's configs and ours alike: class configs then claim configs, walked from the last;
//! the first that names the request exactly, or names none and fits the device, wins
//! ([`resolve_with_uuids`]). NVIDIA's per-device MPS limits (keyed by UUID or index) are resolved here
//! too, against the devices each config applies to.
//!
//! [`check_device_class`] and [`check_claim_spec`] find malformed configs before any allocation,
//! for `gpu-dra selectors check`.

use std::fmt;

use k8s_openapi::api::resource::v1::{
    DeviceClass, OpaqueDeviceConfiguration, ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::api::config::{
    declared_kind, decode_config, decode_config_value, ConfigError, DeviceConfig, SharingSettings,
};
use crate::api::NVIDIA_DRIVER_NAME;
use crate::domains::api::ChannelConfig;

/// The `source` of a config the scheduler copied from the DeviceClass.
pub const SOURCE_FROM_CLASS: &str = "FromClass";

/// One entry of `status.allocation.devices.config` that has an `opaque` part.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigEntry<'a> {
    /// Its index in `status.allocation.devices.config`.
    pub index: usize,
    /// `source: FromClass` (else `FromClaim`).
    pub from_class: bool,
    /// The requests it names; empty means all.
    pub requests: Vec<String>,
    /// `opaque.driver`.
    pub driver: String,
    /// The raw JSON text of `opaque.parameters`, when the caller has it: only the text shows a
    /// repeated key. Used in preference to `value`.
    pub raw: Option<&'a str>,
    /// `opaque.parameters` as decoded JSON.
    pub value: Option<&'a Value>,
}

/// What one allocated device gets, and from which config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedSharing {
    pub settings: SharingSettings,
    /// The index of the config in `status.allocation.devices.config`; `None`: no config applied.
    pub source: Option<usize>,
}

/// A config of this driver that fails the claim:
/// `config[<i>] (<Kind> from the <class|claim>): <path>: <reason>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigEntryError {
    pub index: usize,
    /// The kind the config declares, if it is one of ours.
    pub kind: Option<&'static str>,
    pub from_class: bool,
    pub error: ConfigError,
}

impl fmt::Display for ConfigEntryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = if self.from_class { "class" } else { "claim" };
        match self.kind {
            Some(kind) => write!(f, "config[{}] ({kind} from the {source}): ", self.index)?,
            None => write!(f, "config[{}] (from the {source}): ", self.index)?,
        }
        write!(f, "{}", self.error)
    }
}

/// The sharing of each device in `devices`, given as `(request, device name, is a MIG device)`, in
/// that order. Entries of other drivers are ignored, even malformed ones. Under NVIDIA's driver name
/// ([`NVIDIA_DRIVER_NAME`]) NVIDIA's precedence applies (see [`resolve_with_uuids`]).
pub fn resolve(
    driver: &str,
    entries: &[ConfigEntry<'_>],
    devices: &[(&str, &str, bool)],
) -> Result<Vec<ResolvedSharing>, ConfigEntryError> {
    resolve_with_uuids(driver, entries, devices, &[])
}

/// [`resolve`], with the UUID of each device where known (`uuids[i]` for `devices[i]`): NVIDIA's
/// per-device MPS limits name devices by UUID, or by index into the sorted UUIDs of the devices one
/// config applies to, so they are resolved here, once the devices of each config are known.
///
/// Precedence under our driver name, highest first: claim configs before class configs; within one
/// source a config that names the request (`main` names `main/sub` too) before one for all
/// requests; then the later entry before the earlier.
///
/// Under [`NVIDIA_DRIVER_NAME`], NVIDIA's (its kubelet plugin's `getConfigResultsMap`): the class
/// configs then the claim configs, in order, are walked from the last; a device takes the first
/// that names its request exactly (a wrong kind for the device is then an error) or that names no
/// request and whose kind fits the device. So a claim's config for all requests placed after one
/// naming the request wins, where ours would take the named one.
pub fn resolve_with_uuids(
    driver: &str,
    entries: &[ConfigEntry<'_>],
    devices: &[(&str, &str, bool)],
    uuids: &[Option<&str>],
) -> Result<Vec<ResolvedSharing>, ConfigEntryError> {
    let mut ours = Vec::new();
    // ComputeDomain channel configs are read where the claim joins its domain, not here.
    for entry in entries
        .iter()
        .filter(|e| e.driver == driver && channel_config(driver, e).is_none() && !is_vfio_config(e))
    {
        let config = decode_entry(entry).map_err(|(kind, error)| ConfigEntryError {
            index: entry.index,
            kind,
            from_class: entry.from_class,
            error,
        })?;
        ours.push((entry, config));
    }
    let nvidia = driver == NVIDIA_DRIVER_NAME;
    if nvidia {
        // Class configs first, then claim configs; the order within each is kept.
        ours.sort_by_key(|(entry, _)| !entry.from_class);
    }
    let chosen: Vec<Option<usize>> = devices
        .iter()
        .map(|&(request, device, is_mig)| {
            if nvidia {
                choose_nvidia(&ours, request, device, is_mig)
            } else {
                choose_ours(&ours, request, device, is_mig)
            }
        })
        .collect::<Result<_, _>>()?;
    chosen
        .iter()
        .enumerate()
        .map(|(i, choice)| {
            let Some(at) = *choice else {
                return Ok(ResolvedSharing {
                    settings: SharingSettings::Exclusive,
                    source: None,
                });
            };
            let (entry, config) = &ours[at];
            let mut settings = config.effective();
            if let (DeviceConfig::Nvidia(nvidia), SharingSettings::Mps(mps)) = (config, &mut settings)
            {
                if let Some(limits) = nvidia
                    .mps()
                    .filter(|m| !m.per_device_pinned_memory_limit_mib.is_empty())
                {
                    // The devices this config applies to, as NVIDIA groups them.
                    let mut group = Vec::new();
                    for (j, _) in chosen.iter().enumerate().filter(|(_, c)| **c == Some(at)) {
                        let device = devices[j].1;
                        let uuid = uuids.get(j).copied().flatten().ok_or_else(|| {
                            entry_error(entry, config, PER_DEVICE_PATH.into(), format!(
                                "the UUID of device {device} is not known here, and per-device limits name devices by UUID or index"
                            ))
                        })?;
                        group.push((device, uuid));
                    }
                    let by_device = limits.per_device_limits(&group).map_err(|(key, reason)| {
                        entry_error(entry, config, format!("{PER_DEVICE_PATH}[{key}]"), reason)
                    })?;
                    mps.per_device_pinned_memory_limit_bytes = by_device
                        .into_iter()
                        .filter(|(device, _)| device == devices[i].1)
                        .collect();
                }
            }
            Ok(ResolvedSharing {
                settings,
                source: Some(entry.index),
            })
        })
        .collect()
}

/// Whether the entry is NVIDIA's `VfioDeviceConfig`: read where passthrough devices are prepared
/// (`claims::vfio`), never applied to a GPU or MIG device.
pub fn is_vfio_config(entry: &ConfigEntry<'_>) -> bool {
    vfio_config(entry).is_some()
}

/// The entry as NVIDIA's `VfioDeviceConfig`, decoded, if it is one.
pub fn vfio_config(
    entry: &ConfigEntry<'_>,
) -> Option<Result<crate::api::config::vfio::VfioSettings, ConfigError>> {
    match entry.raw {
        Some(raw) => crate::api::config::vfio::parse(&serde_json::from_str::<Value>(raw).ok()?),
        None => crate::api::config::vfio::parse(entry.value?),
    }
}

const PER_DEVICE_PATH: &str = "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit";

type Decoded<'e, 'a> = (&'e ConfigEntry<'a>, DeviceConfig);

/// Our precedence: the position in `ours` of the config the device takes.
fn choose_ours(
    ours: &[Decoded<'_, '_>],
    request: &str,
    device: &str,
    is_mig: bool,
) -> Result<Option<usize>, ConfigEntryError> {
    for from_class in [false, true] {
        let source = || {
            ours.iter()
                .enumerate()
                .rev()
                .filter(|(_, (e, _))| e.from_class == from_class)
        };
        if let Some((at, (entry, config))) = source().find(|(_, (e, _))| names_request(e, request))
        {
            if config.is_mig() != is_mig {
                return Err(kind_mismatch(entry, config, device, is_mig));
            }
            return Ok(Some(at));
        }
        if let Some((at, _)) =
            source().find(|(_, (e, config))| e.requests.is_empty() && config.is_mig() == is_mig)
        {
            return Ok(Some(at));
        }
    }
    Ok(None)
}

/// NVIDIA's precedence over `ours` sorted class configs first: the position of the config the
/// device takes. The request must be named exactly: NVIDIA's driver does not apply a config naming
/// `main` to a device of subrequest `main/sub`, and doing so here would give a claim written for
/// NVIDIA's driver a sharing it never had there.
fn choose_nvidia(
    ours: &[Decoded<'_, '_>],
    request: &str,
    device: &str,
    is_mig: bool,
) -> Result<Option<usize>, ConfigEntryError> {
    for (at, (entry, config)) in ours.iter().enumerate().rev() {
        if entry.requests.iter().any(|named| named == request) {
            if config.is_mig() != is_mig {
                let reason = format!(
                    "cannot apply {} to device {device:?} of type {:?} (request: {request})",
                    config.kind(),
                    if is_mig { "mig" } else { "gpu" }
                );
                return Err(entry_error(entry, config, "kind".into(), reason));
            }
            return Ok(Some(at));
        }
        if entry.requests.is_empty() && config.is_mig() == is_mig {
            return Ok(Some(at));
        }
    }
    Ok(None)
}

fn entry_error(
    entry: &ConfigEntry<'_>,
    config: &DeviceConfig,
    path: String,
    reason: String,
) -> ConfigEntryError {
    ConfigEntryError {
        index: entry.index,
        kind: Some(config.kind()),
        from_class: entry.from_class,
        error: ConfigError { path, reason },
    }
}

/// Whether the entry names the request: `main/sub` is named by `main/sub` and by `main`.
fn names_request(entry: &ConfigEntry<'_>, request: &str) -> bool {
    let main = request.split_once('/').map(|(main, _)| main);
    entry
        .requests
        .iter()
        .any(|named| named == request || Some(named.as_str()) == main)
}

fn kind_mismatch(
    entry: &ConfigEntry<'_>,
    config: &DeviceConfig,
    device: &str,
    is_mig: bool,
) -> ConfigEntryError {
    let (what, fitting) = if is_mig {
        ("a MIG device", "MigConfig")
    } else {
        ("a whole GPU", "GpuConfig")
    };
    ConfigEntryError {
        index: entry.index,
        kind: Some(config.kind()),
        from_class: entry.from_class,
        error: ConfigError {
            path: "kind".into(),
            reason: format!(
                "{} does not fit {device} ({what}); use {fitting}",
                config.kind()
            ),
        },
    }
}

/// Decodes the raw text if there is one, else the value; on error also the kind it declares.
fn decode_entry(
    entry: &ConfigEntry<'_>,
) -> Result<DeviceConfig, (Option<&'static str>, ConfigError)> {
    let null = Value::Null;
    let result = match entry.raw {
        Some(raw) => decode_config(raw),
        None => decode_config_value(entry.value.unwrap_or(&null)),
    };
    result.map_err(|error| {
        let kind = match entry.raw {
            Some(raw) => serde_json::from_str::<Value>(raw)
                .ok()
                .and_then(|v| declared_kind(&v)),
            None => entry.value.and_then(declared_kind),
        };
        (kind, error)
    })
}

/// The ComputeDomain channel config an entry holds, if it is one (malformed or not).
pub fn channel_config(
    driver: &str,
    entry: &ConfigEntry<'_>,
) -> Option<Result<ChannelConfig, String>> {
    let parsed;
    let value = match entry.raw {
        Some(raw) => {
            parsed = serde_json::from_str::<Value>(raw).ok()?;
            &parsed
        }
        None => entry.value?,
    };
    ChannelConfig::parse(driver, value)
}

/// The opaque entries of a claim's `status.allocation.devices.config`, for [`resolve`].
/// `raw_parameters[i]`, where given, is the raw JSON text of entry `i`'s `opaque.parameters`
/// (see [`raw_allocation_parameters`]).
pub fn allocation_config_entries<'a>(
    claim: &'a ResourceClaim,
    raw_parameters: &'a [Option<String>],
) -> Vec<ConfigEntry<'a>> {
    let configs = claim
        .status
        .iter()
        .filter_map(|status| status.allocation.as_ref())
        .filter_map(|allocation| allocation.devices.as_ref())
        .flat_map(|devices| devices.config.iter().flatten());
    configs
        .enumerate()
        .filter_map(|(index, config)| {
            let opaque = config.opaque.as_ref()?;
            Some(ConfigEntry {
                index,
                from_class: config.source == SOURCE_FROM_CLASS,
                requests: config.requests.clone().unwrap_or_default(),
                driver: opaque.driver.clone(),
                raw: raw_parameters.get(index).and_then(|raw| raw.as_deref()),
                value: Some(&opaque.parameters.0),
            })
        })
        .collect()
}

/// The raw JSON text of each `status.allocation.devices.config[i].opaque.parameters` in the JSON
/// of a ResourceClaim (as the API server sent it), by index; `None` where an entry has none. Empty
/// if the text is not a claim of that shape (the decoded values are used then).
pub fn raw_allocation_parameters(claim_json: &str) -> Vec<Option<String>> {
    #[derive(Deserialize)]
    struct Claim<'a> {
        #[serde(borrow)]
        status: Option<Status<'a>>,
    }
    #[derive(Deserialize)]
    struct Status<'a> {
        #[serde(borrow)]
        allocation: Option<Allocation<'a>>,
    }
    #[derive(Deserialize)]
    struct Allocation<'a> {
        #[serde(borrow)]
        devices: Option<Devices<'a>>,
    }
    #[derive(Deserialize)]
    struct Devices<'a> {
        #[serde(borrow, default)]
        config: Option<Vec<Entry<'a>>>,
    }
    #[derive(Deserialize)]
    struct Entry<'a> {
        #[serde(borrow)]
        opaque: Option<Opaque<'a>>,
    }
    #[derive(Deserialize)]
    struct Opaque<'a> {
        #[serde(borrow)]
        parameters: Option<&'a RawValue>,
    }
    let Ok(claim) = serde_json::from_str::<Claim<'_>>(claim_json) else {
        return Vec::new();
    };
    claim
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.config)
        .unwrap_or_default()
        .into_iter()
        .map(|entry| Some(entry.opaque?.parameters?.get().to_string()))
        .collect()
}

/// A malformed config of this driver in a DeviceClass or claim spec: `config[<i>] (<Kind>): <path>:
/// <reason>`, `<i>` being the index in `spec.config` (class) or `spec.devices.config` (claim).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigProblem {
    pub index: usize,
    pub kind: Option<&'static str>,
    pub error: ConfigError,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            Some(kind) => write!(f, "config[{}] ({kind}): {}", self.index, self.error),
            None => write!(f, "config[{}]: {}", self.index, self.error),
        }
    }
}

/// Every malformed config of `driver` among `configs` (the `opaque` part of each entry, in order).
pub fn check_opaque_configs<'a>(
    driver: &str,
    configs: impl IntoIterator<Item = Option<&'a OpaqueDeviceConfiguration>>,
) -> Vec<ConfigProblem> {
    configs
        .into_iter()
        .enumerate()
        .filter_map(|(index, opaque)| {
            let opaque = opaque.filter(|o| o.driver == driver)?;
            let error = check_opaque_parameters(driver, &opaque.parameters.0)?;
            Some(ConfigProblem {
                index,
                kind: declared_kind(&opaque.parameters.0),
                error,
            })
        })
        .collect()
}

/// What is wrong with the parameters of one opaque config of `driver`: none for a valid device config
/// or ComputeDomain channel config. A malformed channel config is judged as a device config (its kind
/// is then the error), as the `gpu-dra-device-configs` admission policy judges it.
pub fn check_opaque_parameters(driver: &str, parameters: &Value) -> Option<ConfigError> {
    if let Some(Ok(_)) = ChannelConfig::parse(driver, parameters) {
        return None;
    }
    if let Some(vfio) = crate::api::config::vfio::parse(parameters) {
        return vfio.err();
    }
    decode_config_value(parameters).err()
}

/// The malformed configs of `driver` in a DeviceClass's `spec.config`.
pub fn check_device_class(driver: &str, class: &DeviceClass) -> Vec<ConfigProblem> {
    let configs = class.spec.iter().flat_map(|s| s.config.iter().flatten());
    check_opaque_configs(driver, configs.map(|c| c.opaque.as_ref()))
}

/// The malformed configs of `driver` in a claim spec's `spec.devices.config`.
pub fn check_claim_spec(driver: &str, spec: &ResourceClaimSpec) -> Vec<ConfigProblem> {
    let configs = spec.devices.iter().flat_map(|d| d.config.iter().flatten());
    check_opaque_configs(driver, configs.map(|c| c.opaque.as_ref()))
}

/// [`check_claim_spec`] of a ResourceClaim.
pub fn check_claim(driver: &str, claim: &ResourceClaim) -> Vec<ConfigProblem> {
    claim
        .spec
        .as_ref()
        .map(|spec| check_claim_spec(driver, spec))
        .unwrap_or_default()
}

/// [`check_claim_spec`] of the claim a ResourceClaimTemplate stamps out (`spec.spec`).
pub fn check_claim_template(driver: &str, template: &ResourceClaimTemplate) -> Vec<ConfigProblem> {
    template
        .spec
        .as_ref()
        .and_then(|s| s.spec.as_ref())
        .map(|spec| check_claim_spec(driver, spec))
        .unwrap_or_default()
}

#[cfg(test)]
#[path = "configs_tests.rs"]
mod tests;
