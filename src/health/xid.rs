//! XID errors: what each one means and what it takes to recover from it. The table follows the
//! "Resolution Bucket (Immediate Action)" column of NVIDIA's Xid catalog for Ampere and later
//! (docs.nvidia.com/deploy/xid-errors): RESTART_APP / IGNORE → informational, RESET_GPU → reset
//! required, RESTART_BM (node reboot) or replacement → fatal.

use serde::{Deserialize, Serialize};

/// What an XID means for the device it was reported on, from least to most severe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum XidClass {
    /// An application error (or a notice): the application that caused it dies, the device is fine.
    Informational,
    /// The device must be reset before it can be trusted again.
    ResetRequired,
    /// The device cannot recover without a node reboot or a hardware repair.
    Fatal,
}

impl XidClass {
    /// A lower-case name for messages and metrics labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            XidClass::Informational => "informational",
            XidClass::ResetRequired => "reset-required",
            XidClass::Fatal => "fatal",
        }
    }
}

/// One row of the table: XID, class, one-line description.
type Row = (u64, XidClass, &'static str);

use XidClass::{Fatal, Informational, ResetRequired};

/// The documented XIDs. An XID that is not here is [`XidClass::ResetRequired`]: a reset is the
/// cheapest action that is safe for an error nobody has classified.
const TABLE: &[Row] = &[
    (
        8,
        Informational,
        "GPU stopped processing (channel idle timeout)",
    ),
    (13, Informational, "graphics engine exception"),
    (31, Informational, "GPU memory page fault (MMU fault)"),
    (
        43,
        Informational,
        "GPU stopped processing (application error)",
    ),
    (
        45,
        Informational,
        "preemptive cleanup due to previous errors",
    ),
    (
        48,
        ResetRequired,
        "double-bit ECC error (uncorrectable memory error)",
    ),
    (
        61,
        ResetRequired,
        "internal micro-controller breakpoint or warning",
    ),
    (62, ResetRequired, "internal micro-controller halt"),
    (
        63,
        ResetRequired,
        "ECC page retirement or row remapping recorded; pending until reset",
    ),
    (64, Fatal, "ECC page retirement or row remapping failed"),
    (68, Informational, "video decoder (NVDEC) exception"),
    (74, ResetRequired, "NVLink error"),
    (79, Fatal, "GPU has fallen off the bus"),
    (92, ResetRequired, "high single-bit ECC error rate"),
    (94, ResetRequired, "contained ECC error"),
    (95, ResetRequired, "uncontained ECC error"),
    (109, Informational, "context switch timeout"),
    (119, ResetRequired, "GSP RPC timeout"),
    (120, ResetRequired, "GSP (GPU System Processor) error"),
    (140, ResetRequired, "unrecovered ECC error"),
    (154, ResetRequired, "GPU recovery action changed"),
];

/// The XIDs NVIDIA's own DRA driver treats as application errors by default; all of them are
/// informational here too, so that both drivers agree on them out of the box.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

fn row(xid: u64) -> Option<&'static Row> {
    TABLE.iter().find(|(number, _, _)| *number == xid)
}

/// The class of an XID by the built-in table alone (see [`super::HealthPolicy::classify`] for the
/// admin's overrides).
pub fn classify(xid: u64) -> XidClass {
    row(xid)
        .map(|(_, class, _)| *class)
        .unwrap_or(ResetRequired)
}

/// A one-line description of an XID, `unknown XID` for those the table does not know.
pub fn describe(xid: u64) -> &'static str {
    row(xid).map(|(_, _, text)| *text).unwrap_or("unknown XID")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_xids_have_their_class() {
        let cases: &[(u64, XidClass)] = &[
            (13, Informational),
            (31, Informational),
            (43, Informational),
            (45, Informational),
            (68, Informational),
            (109, Informational),
            (48, ResetRequired),
            (63, ResetRequired),
            (74, ResetRequired),
            (92, ResetRequired),
            (94, ResetRequired),
            (95, ResetRequired),
            (119, ResetRequired),
            (120, ResetRequired),
            (140, ResetRequired),
            (64, Fatal),
            (79, Fatal),
        ];
        for (xid, class) in cases {
            assert_eq!(classify(*xid), *class, "XID {xid}");
        }
    }

    #[test]
    fn application_xids_are_informational_and_unknown_ones_need_a_reset() {
        for xid in APPLICATION_XIDS {
            assert_eq!(classify(xid), Informational, "XID {xid}");
        }
        assert_eq!(classify(999), ResetRequired);
        assert_eq!(classify(0), ResetRequired);
        assert_eq!(describe(999), "unknown XID");
    }

    #[test]
    fn descriptions_name_the_error() {
        assert_eq!(describe(79), "GPU has fallen off the bus");
        assert_eq!(describe(13), "graphics engine exception");
        assert!(describe(48).contains("double-bit ECC"));
        assert!(describe(31).contains("MMU fault"));
    }

    #[test]
    fn table_has_one_row_per_xid_in_order() {
        for pair in TABLE.windows(2) {
            assert!(pair[0].0 < pair[1].0, "XID {} out of order", pair[1].0);
        }
        assert!(TABLE.iter().all(|(_, _, text)| !text.is_empty()));
    }
}
