//! The admin's health policy: which XIDs to ignore or treat as fatal beyond the built-in table, the
//! taint effect of each class, and whether faults clear when the backend reports recovery.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::xid::{self, XidClass};

/// A DRA device taint effect, spelled as the API spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TaintEffect {
    /// Recorded for people and tools to see; scheduling is unaffected (servers 1.35+ only).
    None,
    /// No new claims get the device; pods using it keep running.
    NoSchedule,
    /// No new claims get the device, and pods using it are evicted.
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(&self) -> &'static str {
        match self {
            TaintEffect::None => "None",
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }

    /// How strongly the effect keeps work away, for keeping the most severe taints under the cap.
    pub(crate) fn rank(effect: &str) -> u8 {
        match effect {
            "NoExecute" => 2,
            "NoSchedule" => 1,
            _ => 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PolicyError {
    #[error("health policy: XID {0} is listed both as ignored and as fatal")]
    XidIgnoredAndFatal(u64),
}

/// How faults become taints.
///
/// Defaults: informational events get `None` (visible, harmless; NVIDIA's driver does the same);
/// reset-required faults get `NoSchedule`, so running work finishes or fails on its own while no new
/// work lands on the device (a reset cannot happen while processes hold the GPU anyway); fatal
/// faults (off the bus, row-remap failure, uncorrectable memory) get `NoExecute`, because pods bound
/// to such a device can only crash-loop on it, and eviction lets their controllers place them on a
/// healthy one. Admins who want NVIDIA's never-evict behaviour set `fatalEffect: NoSchedule`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HealthPolicy {
    /// XIDs treated as informational besides the built-in application errors.
    pub extra_ignored_xids: BTreeSet<u64>,
    /// XIDs treated as fatal whatever the built-in table says.
    pub extra_fatal_xids: BTreeSet<u64>,
    pub informational_effect: TaintEffect,
    pub reset_required_effect: TaintEffect,
    pub fatal_effect: TaintEffect,
    /// Whether a recovery reported by the backend removes the faults (and so the taints). When
    /// false, only informational faults clear; the others stay until the driver restarts, so that an
    /// operator looks at the device before it is used again.
    pub clear_on_recovery: bool,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            extra_ignored_xids: BTreeSet::new(),
            extra_fatal_xids: BTreeSet::new(),
            informational_effect: TaintEffect::None,
            reset_required_effect: TaintEffect::NoSchedule,
            fatal_effect: TaintEffect::NoExecute,
            clear_on_recovery: true,
        }
    }
}

impl HealthPolicy {
    /// Refuses a policy that lists one XID as both ignored and fatal (the first such XID is named).
    pub fn validate(&self) -> Result<(), PolicyError> {
        match self
            .extra_ignored_xids
            .intersection(&self.extra_fatal_xids)
            .next()
        {
            Some(xid) => Err(PolicyError::XidIgnoredAndFatal(*xid)),
            None => Ok(()),
        }
    }

    /// The class of an XID with the admin's overrides applied; should an unvalidated policy list an
    /// XID in both sets, fatal wins, the safe side.
    pub fn classify(&self, xid: u64) -> XidClass {
        if self.extra_fatal_xids.contains(&xid) {
            XidClass::Fatal
        } else if self.extra_ignored_xids.contains(&xid) {
            XidClass::Informational
        } else {
            xid::classify(xid)
        }
    }

    /// The taint effect for a class.
    pub fn effect(&self, class: XidClass) -> TaintEffect {
        match class {
            XidClass::Informational => self.informational_effect,
            XidClass::ResetRequired => self.reset_required_effect,
            XidClass::Fatal => self.fatal_effect,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_change_the_class() {
        let policy = HealthPolicy {
            extra_ignored_xids: [74, 999].into(),
            extra_fatal_xids: [13, 94].into(),
            ..Default::default()
        };
        let cases: &[(u64, XidClass)] = &[
            (74, XidClass::Informational),  // table: reset required
            (999, XidClass::Informational), // unknown
            (13, XidClass::Fatal),          // table: informational
            (94, XidClass::Fatal),          // table: reset required
            (79, XidClass::Fatal),          // untouched
            (31, XidClass::Informational),  // untouched
            (48, XidClass::ResetRequired),  // untouched
        ];
        for (xid, class) in cases {
            assert_eq!(policy.classify(*xid), *class, "XID {xid}");
        }
        assert_eq!(policy.validate(), Ok(()));
    }

    #[test]
    fn an_xid_both_ignored_and_fatal_is_refused_by_number() {
        let policy = HealthPolicy {
            extra_ignored_xids: [31, 74].into(),
            extra_fatal_xids: [74, 79].into(),
            ..Default::default()
        };
        let error = policy.validate().unwrap_err();
        assert_eq!(error, PolicyError::XidIgnoredAndFatal(74));
        assert!(error.to_string().contains("XID 74"), "{error}");
        assert_eq!(policy.classify(74), XidClass::Fatal);
    }

    #[test]
    fn defaults_and_camel_case_fields() {
        let policy: HealthPolicy = serde_json::from_str(
            r#"{"extraIgnoredXids":[119],"fatalEffect":"NoSchedule","clearOnRecovery":false}"#,
        )
        .unwrap();
        assert_eq!(policy.extra_ignored_xids, [119].into());
        assert_eq!(policy.fatal_effect, TaintEffect::NoSchedule);
        assert!(!policy.clear_on_recovery);
        // Fields left out keep their defaults.
        assert_eq!(policy.informational_effect, TaintEffect::None);
        assert_eq!(policy.reset_required_effect, TaintEffect::NoSchedule);

        let default = HealthPolicy::default();
        assert_eq!(default.effect(XidClass::Informational), TaintEffect::None);
        assert_eq!(
            default.effect(XidClass::ResetRequired),
            TaintEffect::NoSchedule
        );
        assert_eq!(default.effect(XidClass::Fatal), TaintEffect::NoExecute);
        assert!(default.clear_on_recovery);
        let json = serde_json::to_value(&default).unwrap();
        assert_eq!(json["fatalEffect"], "NoExecute");
        assert_eq!(json["extraFatalXids"], serde_json::json!([]));
        assert!(serde_json::from_str::<HealthPolicy>(r#"{"fatalEffect":"Bogus"}"#).is_err());
    }
}
