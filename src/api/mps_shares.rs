//! `spec.sharing` of a `GpuNodePolicy`: publishing GPUs and MIG devices for sharing among claims
//! (consumable shares): counted by memory, by a fixed number of shares per device, or unlimited,
//! kept apart by MPS, time-slicing or nothing. `mpsMemoryShares` is the older spelling of whole GPUs
//! shared by memory with MPS. `problems` names every problem by field path, and
//! [`SharingSpec::resolved`] is what the device model gets once they are valid.

use std::borrow::Cow;
use std::fmt;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::policy::{ShareDeviceKind, ShareEnforcement, ShareInterval, ShareMode};
use crate::devices::{Enforcement, MemoryShares, ShareCapacity, Shares as DeviceShares};
use crate::gpu::TimeSliceInterval;
use crate::quantity::Quantity;

/// The smallest share when `minimum` is left out: 1Gi.
pub const DEFAULT_MINIMUM_BYTES: u64 = 1 << 30;

/// `apimachinery`'s Quantity pattern, as CRD generators put it into a schema.
const QUANTITY_PATTERN: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// How the selected nodes publish their GPUs for sharing.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharingSpec {
    /// Publish devices for sharing among claims: several claims get the same GPU or MIG device
    /// while what they consume fits (DRA consumable capacity; needs the DRAConsumableCapacity feature
    /// gate). Not together with `mpsMemoryShares`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares: Option<Shares>,
    /// Publish each whole GPU for MPS sharing: several claims may get the same GPU, each with a share of
    /// its memory (`capacity.requests.memory` in the claim; `minimum` when it asks none), rounded up to
    /// `minimum` plus a multiple of `step`. The GPUs carry the attribute `sharing: MPS`. Needs the
    /// DRAConsumableCapacity feature gate. The same as `shares` with mode Memory, devices [Gpus] and
    /// enforcement MPS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_memory_shares: Option<MpsMemoryShares>,
}

/// Devices published for sharing among claims.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Shares {
    /// How a device is counted out: `Memory` (each claim takes the memory it asks for, in the sizes
    /// of `memory`), `Count` (at most `count` claims per device) or `Unlimited`.
    pub mode: ShareMode,
    /// With mode Memory: the share sizes (default: minimum 1Gi, steps of the minimum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MpsMemoryShares>,
    /// With mode Count: how many claims one device takes (at least 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<i64>,
    /// Which devices are shared: `Gpus` (whole GPUs), `MigDevices` (static and dynamic); default
    /// `[Gpus]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<ShareDeviceKind>>,
    /// What keeps the claims on one device apart, unless a claim's config asks for another strategy:
    /// `MPS` (each claim its own MPS daemon, its memory share its pinned-memory limit; the default),
    /// `TimeSlicing` (whole GPUs get `interval`, and a claim may not ask for another) or `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<ShareEnforcement>,
    /// With enforcement TimeSlicing: `Default`, `Short`, `Medium` or `Long` (default `Default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<ShareInterval>,
}

/// The largest `count`: what a quantity's int64 holds is far beyond any use; this keeps it readable.
pub const MAX_SHARE_COUNT: i64 = 1 << 20;

/// The share sizes of a GPU published for MPS sharing.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MpsMemoryShares {
    /// The smallest share, and the share of a claim that asks for no memory (default 1Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minimum: Option<QuantityText>,
    /// Shares grow from `minimum` in steps of this size (default: `minimum`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<QuantityText>,
}

/// A quantity as the admin wrote it (`10Gi`, or a number of bytes), checked by `validate` rather than
/// when decoding, so that a bad value makes its policy invalid instead of breaking the decoding of every
/// policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantityText(pub String);

impl fmt::Display for QuantityText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for QuantityText {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for QuantityText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // int-or-string, as Kubernetes quantities are; other numbers are kept for `validate` to refuse.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Unsigned(u64),
            Signed(i64),
            Float(f64),
        }
        Ok(QuantityText(match Raw::deserialize(deserializer)? {
            Raw::Text(text) => text,
            Raw::Unsigned(n) => n.to_string(),
            Raw::Signed(n) => n.to_string(),
            Raw::Float(n) => n.to_string(),
        }))
    }
}

impl JsonSchema for QuantityText {
    fn schema_name() -> Cow<'static, str> {
        "QuantityText".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        // The `anyOf: [integer, string]` that usually goes with it would lose its types to kube's
        // structural rewrite; the extension alone is a valid structural schema.
        json_schema!({
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": true,
        })
    }
}

/// Valid share sizes in bytes: what the device model publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareSizes {
    pub minimum_bytes: u64,
    pub step_bytes: u64,
}

impl MpsMemoryShares {
    /// The sizes in bytes, or every problem prefixed with its field path under `path`.
    pub fn sizes(&self, path: &str) -> Result<ShareSizes, Vec<String>> {
        let mut problems = Vec::new();
        let mut bytes = |field: &str, text: &Option<QuantityText>| -> Option<Option<u64>> {
            let text = text.as_ref()?;
            match whole_bytes(&text.0) {
                Ok(bytes) => Some(Some(bytes)),
                Err(reason) => {
                    problems.push(format!("{path}.{field}: {text:?} {reason}", text = text.0));
                    Some(None)
                }
            }
        };
        let minimum = bytes("minimum", &self.minimum);
        let step = bytes("step", &self.step);
        if !problems.is_empty() {
            return Err(problems);
        }
        let minimum = minimum.flatten().unwrap_or(DEFAULT_MINIMUM_BYTES);
        Ok(ShareSizes {
            minimum_bytes: minimum,
            step_bytes: step.flatten().unwrap_or(minimum),
        })
    }
}

/// A positive whole number of bytes within what a Kubernetes quantity holds as an integer, or why not.
fn whole_bytes(text: &str) -> Result<u64, String> {
    let quantity =
        Quantity::parse(text).map_err(|e| format!("is not a quantity such as 10Gi: {e}"))?;
    if quantity.sign() <= 0 {
        return Err("must be greater than zero".into());
    }
    if quantity > Quantity::from_int(i64::MAX) {
        return Err("is too large (at most 8Ei)".into());
    }
    let bytes = quantity
        .as_integer()
        .ok_or_else(|| "must be a whole number of bytes".to_string())?;
    // Positive here, and every positive i64 fits a u64.
    u64::try_from(bytes).map_err(|_| "must be greater than zero".to_string())
}

impl SharingSpec {
    /// The problems of this spec, each prefixed with its field path under `path`.
    pub(super) fn problems(&self, path: &str) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(shares) = &self.mps_memory_shares {
            let path = format!("{path}.mpsMemoryShares");
            problems.extend(shares.sizes(&path).err().unwrap_or_default());
            if self.shares.is_some() {
                problems.push(format!(
                    "{path}: not together with {}.shares, which says the same in its general form \
                     (mode Memory, devices [Gpus], enforcement MPS); keep one",
                    path.trim_end_matches(".mpsMemoryShares")
                ));
            }
        }
        if let Some(shares) = &self.shares {
            problems.extend(shares.problems(&format!("{path}.shares")));
        }
        problems
    }

    /// What the device model publishes, for a valid spec (`None` where it shares nothing or is
    /// invalid: the watcher passes only accepted specs).
    pub fn resolved(&self) -> Option<DeviceShares> {
        if let Some(shares) = &self.shares {
            return shares.resolved("spec.sharing.shares").ok();
        }
        let sizes = self
            .mps_memory_shares
            .as_ref()?
            .sizes("spec.sharing.mpsMemoryShares")
            .ok()?;
        Some(DeviceShares::mps_memory(MemoryShares {
            minimum_bytes: sizes.minimum_bytes,
            step_bytes: sizes.step_bytes,
        }))
    }
}

impl Shares {
    fn problems(&self, path: &str) -> Vec<String> {
        self.resolved(path).err().unwrap_or_default()
    }

    /// The device model's form, or every problem prefixed with its field path under `path`.
    pub fn resolved(&self, path: &str) -> Result<DeviceShares, Vec<String>> {
        let mut problems = Vec::new();
        let mut capacity = None;
        match &self.mode {
            ShareMode::Memory => {
                let memory = self.memory.clone().unwrap_or_default();
                match memory.sizes(&format!("{path}.memory")) {
                    Ok(sizes) => {
                        capacity = Some(ShareCapacity::Memory(MemoryShares {
                            minimum_bytes: sizes.minimum_bytes,
                            step_bytes: sizes.step_bytes,
                        }))
                    }
                    Err(more) => problems.extend(more),
                }
            }
            ShareMode::Count => match self.count {
                None => problems.push(format!("{path}.count: required with mode Count")),
                Some(n) if !(2..=MAX_SHARE_COUNT).contains(&n) => problems.push(format!(
                    "{path}.count: {n} must be between 2 and {MAX_SHARE_COUNT} (one claim per device is not sharing)"
                )),
                Some(n) => capacity = Some(ShareCapacity::Count(n.unsigned_abs())),
            },
            ShareMode::Unlimited => capacity = Some(ShareCapacity::Unlimited),
            unknown @ ShareMode::Unknown(_) => {
                problems.extend(unknown.problem().map(|p| format!("{path}.mode: {p}")))
            }
        }
        if self.memory.is_some() && !matches!(self.mode, ShareMode::Memory) {
            problems.push(format!("{path}.memory: only with mode Memory"));
        }
        if self.count.is_some() && !matches!(self.mode, ShareMode::Count) {
            problems.push(format!("{path}.count: only with mode Count"));
        }
        let kinds = self
            .devices
            .clone()
            .unwrap_or_else(|| vec![ShareDeviceKind::Gpus]);
        if kinds.is_empty() {
            problems.push(format!(
                "{path}.devices: must name Gpus, MigDevices or both (leave it out for Gpus)"
            ));
        }
        for (index, kind) in kinds.iter().enumerate() {
            if let Some(problem) = kind.problem() {
                problems.push(format!("{path}.devices[{index}]: {problem}"));
            } else if kinds[..index].contains(kind) {
                problems.push(format!("{path}.devices[{index}]: {kind} is listed twice"));
            }
        }
        let enforcement = match self.enforcement.clone().unwrap_or(ShareEnforcement::Mps) {
            ShareEnforcement::Mps => Some(Enforcement::Mps),
            ShareEnforcement::None => Some(Enforcement::None),
            ShareEnforcement::TimeSlicing => {
                let interval = match self.interval.clone().unwrap_or(ShareInterval::Default) {
                    ShareInterval::Default => Some(TimeSliceInterval::Default),
                    ShareInterval::Short => Some(TimeSliceInterval::Short),
                    ShareInterval::Medium => Some(TimeSliceInterval::Medium),
                    ShareInterval::Long => Some(TimeSliceInterval::Long),
                    unknown @ ShareInterval::Unknown(_) => {
                        problems.extend(unknown.problem().map(|p| format!("{path}.interval: {p}")));
                        None
                    }
                };
                interval.map(Enforcement::TimeSlicing)
            }
            unknown @ ShareEnforcement::Unknown(_) => {
                problems.extend(
                    unknown
                        .problem()
                        .map(|p| format!("{path}.enforcement: {p}")),
                );
                None
            }
        };
        if self.interval.is_some() && self.enforcement != Some(ShareEnforcement::TimeSlicing) {
            problems.push(format!(
                "{path}.interval: only with enforcement TimeSlicing"
            ));
        }
        match (capacity, enforcement) {
            (Some(capacity), Some(enforcement)) if problems.is_empty() => Ok(DeviceShares {
                capacity,
                gpus: kinds.contains(&ShareDeviceKind::Gpus),
                mig_devices: kinds.contains(&ShareDeviceKind::MigDevices),
                enforcement,
                nvidia: false,
            }),
            _ => Err(problems),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares(minimum: Option<&str>, step: Option<&str>) -> MpsMemoryShares {
        MpsMemoryShares {
            minimum: minimum.map(|t| QuantityText(t.into())),
            step: step.map(|t| QuantityText(t.into())),
        }
    }

    #[test]
    fn sizes_default_to_one_gibibyte_steps_of_the_minimum() {
        let gib = 1u64 << 30;
        assert_eq!(
            shares(None, None).sizes("s"),
            Ok(ShareSizes {
                minimum_bytes: gib,
                step_bytes: gib
            })
        );
        assert_eq!(
            shares(Some("4Gi"), None).sizes("s"),
            Ok(ShareSizes {
                minimum_bytes: 4 * gib,
                step_bytes: 4 * gib
            })
        );
        assert_eq!(
            shares(Some("2G"), Some("512Mi")).sizes("s"),
            Ok(ShareSizes {
                minimum_bytes: 2_000_000_000,
                step_bytes: 512 << 20
            })
        );
    }

    #[test]
    fn bad_sizes_are_named_with_the_reason() {
        let problems = shares(Some("ten gigs"), Some("0")).sizes("spec.sharing.mpsMemoryShares");
        assert_eq!(
            problems,
            Err(vec![
                "spec.sharing.mpsMemoryShares.minimum: \"ten gigs\" is not a quantity such as 10Gi: \
                 quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
                    .to_string(),
                "spec.sharing.mpsMemoryShares.step: \"0\" must be greater than zero".to_string(),
            ])
        );
        let fractional = shares(Some("1.5"), Some("-1Gi")).sizes("p").unwrap_err();
        assert_eq!(
            fractional,
            [
                "p.minimum: \"1.5\" must be a whole number of bytes",
                "p.step: \"-1Gi\" must be greater than zero"
            ]
        );
        let huge = shares(Some("10E"), None).sizes("p").unwrap_err();
        assert_eq!(huge, ["p.minimum: \"10E\" is too large (at most 8Ei)"]);
    }

    #[test]
    fn integers_decode_as_quantities_and_serialize_as_text() {
        let decoded: MpsMemoryShares =
            serde_json::from_value(serde_json::json!({"minimum": 1073741824, "step": "1Gi"}))
                .unwrap();
        assert_eq!(decoded, shares(Some("1073741824"), Some("1Gi")));
        assert_eq!(
            serde_json::to_value(&decoded).unwrap(),
            serde_json::json!({"minimum": "1073741824", "step": "1Gi"})
        );
    }
}
