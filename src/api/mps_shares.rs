//! `spec.sharing` of a `GpuNodePolicy`: publishing whole GPUs for MPS sharing, with `memory` as
//! consumable capacity, so that the scheduler packs several claims onto one GPU by the memory each asks
//! for. The sizes are quantities; `validate` names every problem by field path, and [`ShareSizes`]
//! is what the device model gets once they are valid.

use std::borrow::Cow;
use std::fmt;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::quantity::Quantity;

/// The smallest share when `minimum` is left out: 1Gi.
pub const DEFAULT_MINIMUM_BYTES: u64 = 1 << 30;

/// `apimachinery`'s Quantity pattern, as CRD generators put it into a schema.
const QUANTITY_PATTERN: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// How the selected nodes publish their GPUs for sharing.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharingSpec {
    /// Publish each whole GPU for MPS sharing: several claims may get the same GPU, each with a share of
    /// its memory (`capacity.requests.memory` in the claim; `minimum` when it asks none), rounded up to
    /// `minimum` plus a multiple of `step`. The GPUs carry the attribute `sharing: MPS`. Needs the
    /// DRAConsumableCapacity feature gate; not with `migMode: dynamic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_memory_shares: Option<MpsMemoryShares>,
}

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
    pub(super) fn problems(&self, path: &str, dynamic_mig: bool) -> Vec<String> {
        let Some(shares) = &self.mps_memory_shares else {
            return Vec::new();
        };
        let path = format!("{path}.mpsMemoryShares");
        let mut problems = shares.sizes(&path).err().unwrap_or_default();
        if dynamic_mig {
            problems.push(format!(
                "{path}: not allowed with migMode dynamic: there a whole GPU takes the shared counters \
                 of the MIG devices it may be split into, and cannot be split by memory among claims \
                 at the same time; use migMode none or static (GPUs with MIG mode on are not shared)"
            ));
        }
        problems
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
