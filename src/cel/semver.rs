//! Kubernetes' CEL `semver()` type: strict parsing with blang/semver v4 rules (`semver.Parse`), the
//! normalizing variant `semver(s, true)`, and SemVer 2.0.0 precedence that ignores build metadata.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};

const NUMBERS: &str = "0123456789";

/// Why a text is not a semantic version. Texts follow blang/semver v4 (`%q` rendered as Go would for
/// printable text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SemverError {
    #[error("Version string empty")]
    Empty,
    #[error("No Major.Minor.Patch elements found")]
    MissingParts,
    /// `part` is "major", "minor" or "patch".
    #[error("Invalid character(s) found in {part} number {}", go_quote(.text))]
    InvalidNumber { part: &'static str, text: String },
    /// `part` is "Major", "Minor" or "Patch".
    #[error("{part} number must not contain leading zeroes {}", go_quote(.text))]
    LeadingZero { part: &'static str, text: String },
    /// Go's `strconv.ParseUint` failure (empty or beyond u64).
    #[error("strconv.ParseUint: parsing {}: {reason}", go_quote(.text))]
    Number { text: String, reason: &'static str },
    #[error("Prerelease is empty")]
    PrereleaseEmpty,
    #[error("Numeric PreRelease version must not contain leading zeroes {}", go_quote(.text))]
    PrereleaseLeadingZero { text: String },
    #[error("Invalid character(s) found in prerelease {}", go_quote(.text))]
    PrereleaseInvalid { text: String },
    #[error("Build meta data is empty")]
    BuildEmpty,
    #[error("Invalid character(s) found in build meta data {}", go_quote(.text))]
    BuildInvalid { text: String },
    /// From `semver(s, true)`: fewer than three parts and a `-` or `+` in the last one.
    #[error("short version cannot contain PreRelease/Build meta data")]
    ShortWithSuffix,
    /// The `semver` crate refused a version blang accepts (not expected; kept instead of a panic).
    #[error("version {text:?} is not representable: {reason}")]
    Unrepresentable { text: String, reason: String },
}

/// Go's `%q` for the texts these errors quote: escapes quotes, backslashes and control characters.
fn go_quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Go's `containsOnly`: true for the empty string too.
fn contains_only(text: &str, set: &str) -> bool {
    text.chars().all(|c| set.contains(c))
}

fn is_alphanum(text: &str) -> bool {
    text.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

fn has_leading_zero(text: &str) -> bool {
    text.len() > 1 && text.starts_with('0')
}

fn parse_u64(text: &str) -> Result<u64, SemverError> {
    let reason = if text.is_empty() {
        "invalid syntax"
    } else {
        "value out of range"
    };
    text.parse().map_err(|_| SemverError::Number {
        text: text.to_string(),
        reason,
    })
}

/// Checks one of major / minor / patch the way blang does, in blang's order.
fn parse_number(text: &str, part: &'static str, capital: &'static str) -> Result<u64, SemverError> {
    if !contains_only(text, NUMBERS) {
        return Err(SemverError::InvalidNumber {
            part,
            text: text.to_string(),
        });
    }
    if has_leading_zero(text) {
        return Err(SemverError::LeadingZero {
            part: capital,
            text: text.to_string(),
        });
    }
    parse_u64(text)
}

/// A semantic version. Equality, order and hash follow SemVer precedence: build metadata is ignored,
/// so `1.0.0+a == 1.0.0+b`.
///
/// Differences from blang that remain: `major()` etc. wrap numbers above `i64::MAX` to negative,
/// as Go's `int64(uint64)` does; error texts quote non-ASCII control characters slightly differently
/// from Go's `%q`.
#[derive(Debug, Clone)]
pub struct Semver(::semver::Version);

impl Semver {
    /// Strict parse with blang `semver.Parse` rules (SemVer 2.0.0): three numbers without leading
    /// zeros, no `v`, dot-separated non-empty prerelease identifiers (`[0-9A-Za-z-]`, numeric ones
    /// without leading zeros and within u64) and build identifiers (`[0-9A-Za-z-]`, leading zeros
    /// allowed). The `semver` crate alone would accept numeric prerelease identifiers beyond u64.
    pub fn parse(text: &str) -> Result<Semver, SemverError> {
        if text.is_empty() {
            return Err(SemverError::Empty);
        }
        let parts: Vec<&str> = text.splitn(3, '.').collect();
        let [major, minor, rest] = parts.as_slice() else {
            return Err(SemverError::MissingParts);
        };
        let major = parse_number(major, "major", "Major")?;
        let minor = parse_number(minor, "minor", "Minor")?;
        let (rest, build) = match rest.split_once('+') {
            Some((rest, build)) => (rest, Some(build)),
            None => (*rest, None),
        };
        let (patch, pre) = match rest.split_once('-') {
            Some((patch, pre)) => (patch, Some(pre)),
            None => (rest, None),
        };
        let patch = parse_number(patch, "patch", "Patch")?;
        if let Some(pre) = pre {
            for ident in pre.split('.') {
                check_prerelease_identifier(ident)?;
            }
        }
        if let Some(build) = build {
            for ident in build.split('.') {
                if ident.is_empty() {
                    return Err(SemverError::BuildEmpty);
                }
                if !is_alphanum(ident) {
                    return Err(SemverError::BuildInvalid {
                        text: ident.to_string(),
                    });
                }
            }
        }
        let unrepresentable = |e: ::semver::Error| SemverError::Unrepresentable {
            text: text.to_string(),
            reason: e.to_string(),
        };
        let mut version = ::semver::Version::new(major, minor, patch);
        if let Some(pre) = pre {
            version.pre = ::semver::Prerelease::new(pre).map_err(unrepresentable)?;
        }
        if let Some(build) = build {
            version.build = ::semver::BuildMetadata::new(build).map_err(unrepresentable)?;
        }
        Ok(Semver(version))
    }

    /// `semver(s, true)`: strips one leading `v`, drops leading zeros of each of the (up to) three
    /// dot-separated parts, fills a missing minor / patch with 0, then parses strictly. A short
    /// version whose last part holds `-` or `+` is an error. Whitespace is not trimmed.
    pub fn parse_normalized(text: &str) -> Result<Semver, SemverError> {
        let text = text.strip_prefix('v').unwrap_or(text);
        let mut parts: Vec<String> = text
            .splitn(3, '.')
            .map(|part| {
                if part.len() <= 1 {
                    return part.to_string();
                }
                // Upstream trims zeros, then puts one back when nothing or no digit leads
                // ("00" -> "0", "0-rc" -> "0-rc", "003-rc" -> "3-rc").
                let trimmed = part.trim_start_matches('0');
                if trimmed.starts_with(|c: char| c.is_ascii_digit()) {
                    trimmed.to_string()
                } else {
                    format!("0{trimmed}")
                }
            })
            .collect();
        if parts.len() < 3 {
            if parts.last().is_some_and(|last| last.contains(['+', '-'])) {
                return Err(SemverError::ShortWithSuffix);
            }
            parts.resize(3, "0".to_string());
        }
        Semver::parse(&parts.join("."))
    }

    /// The major number (wrapped to `i64` like Go's conversion).
    pub fn major(&self) -> i64 {
        self.0.major as i64
    }

    /// The minor number (wrapped to `i64` like Go's conversion).
    pub fn minor(&self) -> i64 {
        self.0.minor as i64
    }

    /// The patch number (wrapped to `i64` like Go's conversion).
    pub fn patch(&self) -> i64 {
        self.0.patch as i64
    }

    /// SemVer precedence; build metadata ignored (CEL `compareTo`).
    pub fn compare(&self, other: &Semver) -> Ordering {
        self.0.cmp_precedence(&other.0)
    }
}

fn check_prerelease_identifier(ident: &str) -> Result<(), SemverError> {
    if ident.is_empty() {
        return Err(SemverError::PrereleaseEmpty);
    }
    if contains_only(ident, NUMBERS) {
        if has_leading_zero(ident) {
            return Err(SemverError::PrereleaseLeadingZero {
                text: ident.to_string(),
            });
        }
        parse_u64(ident)?;
        return Ok(());
    }
    if is_alphanum(ident) {
        Ok(())
    } else {
        Err(SemverError::PrereleaseInvalid {
            text: ident.to_string(),
        })
    }
}

impl PartialEq for Semver {
    fn eq(&self, other: &Semver) -> bool {
        self.compare(other) == Ordering::Equal
    }
}

impl Eq for Semver {}

impl PartialOrd for Semver {
    fn partial_cmp(&self, other: &Semver) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Semver {
    fn cmp(&self, other: &Semver) -> Ordering {
        self.compare(other)
    }
}

impl Hash for Semver {
    /// Numeric prerelease identifiers have no leading zeros, so equal precedence means equal text.
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.major.hash(state);
        self.0.minor.hash(state);
        self.0.patch.hash(state);
        self.0.pre.as_str().hash(state);
    }
}

impl fmt::Display for Semver {
    /// `major.minor.patch[-pre][+build]`, as parsed (after normalization for `parse_normalized`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(text: &str) -> Semver {
        match Semver::parse(text) {
            Ok(value) => value,
            Err(e) => panic!("{text:?} should parse: {e}"),
        }
    }

    fn n(text: &str) -> Semver {
        match Semver::parse_normalized(text) {
            Ok(value) => value,
            Err(e) => panic!("{text:?} should normalize: {e}"),
        }
    }

    #[test]
    fn strict_accepts_semver_2() {
        for text in [
            "0.0.0",
            "1.2.3",
            "1.2.3-alpha",
            "1.2.3-alpha.1",
            "1.2.3-0",
            "1.2.3-0a",
            "1.2.3-x-y-z.--",
            "1.2.3+build.001",
            "1.0.0-rc.1+exp.sha.5114f85",
            "1.2.3-a-b+c-d",
            "18446744073709551615.0.0",
        ] {
            assert_eq!(v(text).to_string(), text);
        }
        let x = v("10.20.30-rc.1+b");
        assert_eq!((x.major(), x.minor(), x.patch()), (10, 20, 30));
    }

    #[test]
    fn strict_rejects_like_blang() {
        let table: &[(&str, &str)] = &[
            ("", "Version string empty"),
            ("1.2", "No Major.Minor.Patch elements found"),
            ("1", "No Major.Minor.Patch elements found"),
            (
                "v1.2.3",
                r#"Invalid character(s) found in major number "v1""#,
            ),
            (
                " 1.2.3",
                r#"Invalid character(s) found in major number " 1""#,
            ),
            (
                "01.2.3",
                r#"Major number must not contain leading zeroes "01""#,
            ),
            (
                "1.02.3",
                r#"Minor number must not contain leading zeroes "02""#,
            ),
            ("1.x.3", r#"Invalid character(s) found in minor number "x""#),
            (
                "1.2.03",
                r#"Patch number must not contain leading zeroes "03""#,
            ),
            (
                "1.2.3.4",
                r#"Invalid character(s) found in patch number "3.4""#,
            ),
            (
                "1.2.3 ",
                r#"Invalid character(s) found in patch number "3 ""#,
            ),
            ("1..3", r#"strconv.ParseUint: parsing "": invalid syntax"#),
            (
                "18446744073709551616.0.0",
                r#"strconv.ParseUint: parsing "18446744073709551616": value out of range"#,
            ),
            ("1.2.3-", "Prerelease is empty"),
            ("1.2.3-a..b", "Prerelease is empty"),
            (
                "1.2.3-01",
                r#"Numeric PreRelease version must not contain leading zeroes "01""#,
            ),
            ("1.2.3-@", r#"Invalid character(s) found in prerelease "@""#),
            (
                "1.2.3-99999999999999999999",
                r#"strconv.ParseUint: parsing "99999999999999999999": value out of range"#,
            ),
            ("1.2.3+", "Build meta data is empty"),
            ("1.2.3+a..b", "Build meta data is empty"),
            (
                "1.2.3+a+b",
                r#"Invalid character(s) found in build meta data "a+b""#,
            ),
            (
                "1.2.3+é",
                r#"Invalid character(s) found in build meta data "é""#,
            ),
        ];
        for (text, want) in table {
            match Semver::parse(text) {
                Ok(got) => panic!("{text:?} parsed as {got}"),
                Err(e) => assert_eq!(e.to_string(), *want, "{text:?}"),
            }
        }
    }

    #[test]
    fn normalization() {
        let table = [
            ("v01.01", "1.1.0"),
            ("1", "1.0.0"),
            ("v1", "1.0.0"),
            ("1.2", "1.2.0"),
            ("v1.2.3", "1.2.3"),
            ("01.02.003-rc.1", "1.2.3-rc.1"),
            ("1.2.00", "1.2.0"),
            ("1.2.0-rc", "1.2.0-rc"),
            ("00.0.0", "0.0.0"),
            // Upstream quirk: a zero is put in front of a part that does not start with a digit.
            ("1.2.-1", "1.2.0-1"),
        ];
        for (text, want) in table {
            assert_eq!(n(text).to_string(), want, "{text}");
        }
        assert_eq!(n("v01.01"), v("1.1.0"));
        for text in ["v1.2-rc1", "1+b", "1.2+b"] {
            assert_eq!(
                Semver::parse_normalized(text),
                Err(SemverError::ShortWithSuffix),
                "{text}"
            );
        }
        for text in ["vv1.0.0", " 1.0.0", "1.0.0 ", "v", "", "1.2.3-01", "V1.0.0"] {
            assert!(Semver::parse_normalized(text).is_err(), "{text:?}");
        }
    }

    #[test]
    fn precedence() {
        let chain = [
            "1.0.0-alpha",
            "1.0.0-alpha.1",
            "1.0.0-alpha.beta",
            "1.0.0-beta",
            "1.0.0-beta.2",
            "1.0.0-beta.11",
            "1.0.0-rc.1",
            "1.0.0",
            "1.0.1",
            "1.1.0",
            "2.0.0",
            "10.0.0",
        ];
        for pair in chain.windows(2) {
            let (a, b) = (v(pair[0]), v(pair[1]));
            assert!(a < b, "{a} < {b}");
            assert_eq!(a.compare(&b), Ordering::Less);
            assert_eq!(b.compare(&a), Ordering::Greater);
        }
        assert_eq!(v("1.2.3").compare(&v("1.2.3")), Ordering::Equal);
    }

    #[test]
    fn build_metadata_is_ignored() {
        assert_eq!(v("1.0.0+a"), v("1.0.0+b"));
        assert_eq!(v("1.0.0-rc.1+a").compare(&v("1.0.0-rc.1")), Ordering::Equal);
        assert_ne!(v("1.0.0-rc.1"), v("1.0.0"));
        let set: std::collections::HashSet<Semver> = ["1.0.0+a", "1.0.0+b", "1.0.0", "1.0.0-rc"]
            .iter()
            .map(|t| v(t))
            .collect();
        assert_eq!(set.len(), 2);
    }

    #[test]
    fn huge_numbers_wrap_like_go() {
        assert_eq!(v("18446744073709551615.0.0").major(), -1);
        assert_eq!(v("9223372036854775807.1.2").major(), i64::MAX);
    }
}
