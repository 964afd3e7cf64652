//! Kubernetes `resource.Quantity`: parsing with apimachinery's grammar and rounding, exact arithmetic
//! and value-based comparison. Values are kept exactly as a whole number of nano units (10^-9) in a
//! `BigInt`, so nothing overflows and equal values compare and hash equal. The crate's one quantity
//! parser: the CEL environment, the allocator, the config decoder, the device model and the slice
//! publisher (which must not take the API server's canonical form, `40Gi` for `42949672960`, for a
//! change) all use it.
//!
//! Hand-written because no crate matches apimachinery: `kube_quantity` 0.9 (rust_decimal inside)
//! refuses `1E`, `1Ei` and `1e100`, which the API server accepts, and keeps `0.1n` where apimachinery
//! rounds up to `1n`; a selector comparing such a capacity would then fail where the scheduler's passes.

use std::fmt;
use std::str::FromStr;

use num_bigint::{BigInt, Sign};
use num_integer::Integer;
use num_traits::{Signed, ToPrimitive, Zero};

/// The regular expression apimachinery names in its syntax error (`ErrFormatWrong`).
const SPLIT_RE: &str = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$";

/// Largest accepted `|exponent|` of an `e<int>` / `E<int>` suffix. apimachinery stores the exponent
/// unevaluated, so it never pays for `1e999999999`; an exact port would have to build a number of a
/// billion digits. Beyond this bound [`Quantity::parse`] returns [`QuantityError::ExponentOutOfRange`]
/// (upstream accepts such text; it also silently truncates exponents beyond int32).
pub const MAX_EXPONENT: i64 = 1000;

/// Nano units per unit.
const NANO_EXP: u32 = 9;

/// Characters apimachinery's scanner accepts as the letter part of a suffix.
const SUFFIX_LETTERS: &[u8] = b"eEinumkKMGTP";

/// Why a text is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// The text does not have the number-then-suffix shape (upstream `ErrFormatWrong`), e.g. ``,
    /// `10Mo`, `1.2.3`, ` 1`.
    #[error("quantities must match the regular expression '{SPLIT_RE}'")]
    Format,
    /// The suffix has the right characters but is not a known one (upstream `ErrSuffix`), e.g.
    /// `10Mm`, `200K`, `1e`, `5i`.
    #[error("unable to parse quantity's suffix")]
    Suffix,
    /// The number has no digits and upstream takes its arbitrary-precision path, whose decimal
    /// parser needs a digit (upstream `ErrNumeric`), e.g. `Pi`, `Ei`, `e-10`.
    #[error("unable to parse numeric part of quantity")]
    Numeric,
    /// The `e<int>` exponent is beyond [`MAX_EXPONENT`] (a limit of this port, not of upstream).
    #[error(
        "quantity exponent {exponent} is out of the supported range -{MAX_EXPONENT}..={MAX_EXPONENT}"
    )]
    ExponentOutOfRange { exponent: String },
}

/// An exact Kubernetes quantity. Equality, order and hash are by value: `200M == 0.2G`,
/// `1Gi == 1073741824`, `1000m == 1`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Quantity {
    /// The value in nano units (value × 10^9).
    nanos: BigInt,
}

/// How a suffix scales the number.
enum Suffix {
    /// Multiply by 10^exp (decimal SI letters and `e<int>`).
    Decimal(i64),
    /// Multiply by 2^exp (`Ki` … `Ei`).
    Binary(u32),
}

fn interpret_suffix(suffix: &str) -> Result<Suffix, QuantityError> {
    let decimal = match suffix {
        "n" => Some(-9),
        "u" => Some(-6),
        "m" => Some(-3),
        "" => Some(0),
        "k" => Some(3),
        "M" => Some(6),
        "G" => Some(9),
        "T" => Some(12),
        "P" => Some(15),
        "E" => Some(18),
        _ => None,
    };
    if let Some(exp) = decimal {
        return Ok(Suffix::Decimal(exp));
    }
    let binary = match suffix {
        "Ki" => Some(10),
        "Mi" => Some(20),
        "Gi" => Some(30),
        "Ti" => Some(40),
        "Pi" => Some(50),
        "Ei" => Some(60),
        _ => None,
    };
    if let Some(exp) = binary {
        return Ok(Suffix::Binary(exp));
    }
    let rest = suffix
        .strip_prefix('e')
        .or_else(|| suffix.strip_prefix('E'))
        .filter(|rest| !rest.is_empty())
        .ok_or(QuantityError::Suffix)?;
    // Go's strconv.ParseInt: optional sign then ASCII digits, within int64.
    let digits = rest.strip_prefix(['+', '-']).unwrap_or(rest);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(QuantityError::Suffix);
    }
    let exp: i64 = rest.parse().map_err(|_| QuantityError::Suffix)?;
    if exp.abs() > MAX_EXPONENT {
        return Err(QuantityError::ExponentOutOfRange {
            exponent: rest.to_string(),
        });
    }
    Ok(Suffix::Decimal(exp))
}

/// The parts of a quantity text, as apimachinery's scanner splits it.
struct Scanned<'a> {
    negative: bool,
    int_digits: &'a str,
    frac_digits: &'a str,
    suffix: &'a str,
}

fn scan(text: &str) -> Result<Scanned<'_>, QuantityError> {
    let bytes = text.as_bytes();
    let mut pos = 0;
    let negative = match bytes.first() {
        Some(b'-') => {
            pos += 1;
            true
        }
        Some(b'+') => {
            pos += 1;
            false
        }
        _ => false,
    };
    let digits_end = |from: usize| {
        from + bytes[from..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count()
    };
    let int_end = digits_end(pos);
    let int_digits = &text[pos..int_end];
    pos = int_end;
    let mut frac_digits = "";
    if bytes.get(pos) == Some(&b'.') {
        let frac_end = digits_end(pos + 1);
        frac_digits = &text[pos + 1..frac_end];
        pos = frac_end;
    }
    let suffix_start = pos;
    pos += bytes[pos..]
        .iter()
        .take_while(|b| SUFFIX_LETTERS.contains(b))
        .count();
    if matches!(bytes.get(pos), Some(b'+' | b'-')) {
        pos += 1;
    }
    pos = digits_end(pos);
    if pos != bytes.len() {
        return Err(QuantityError::Format);
    }
    Ok(Scanned {
        negative,
        int_digits,
        frac_digits,
        suffix: &text[suffix_start..],
    })
}

fn pow10(exp: u32) -> BigInt {
    // Most scales fit in a u64 (10^19 is the last), which spares the big-number multiplications.
    match 10u64.checked_pow(exp) {
        Some(small) => BigInt::from(small),
        None => num_traits::pow(BigInt::from(10u32), exp as usize),
    }
}

fn digits_to_bigint(digits: &str) -> BigInt {
    if digits.is_empty() {
        return BigInt::zero();
    }
    // Up to 19 digits fit in a u64: the common case, without the general radix conversion.
    if digits.len() <= 19 {
        if let Ok(small) = digits.parse::<u64>() {
            return BigInt::from(small);
        }
    }
    // Only ASCII digits reach here (the scanner checked them), so parsing cannot fail.
    BigInt::parse_bytes(digits.as_bytes(), 10).unwrap_or_default()
}

impl Quantity {
    /// Parses `text` like `resource.ParseQuantity`: a signed decimal number (`1`, `1.5`, `.5`, `5.`)
    /// and one suffix (`Ki`…`Ei`, `n u m k M G T P E` or none, `e<int>` / `E<int>`). No surrounding
    /// whitespace. A value finer than nano is rounded away from zero to a whole nano (`0.1n` → `1n`,
    /// `-0.1n` → `-1n`), as upstream does; a binary-suffixed value is capped at ±(2^63-1), as
    /// upstream silently does. Exponents beyond ±[`MAX_EXPONENT`] are refused.
    ///
    /// Upstream quirks kept on purpose: a number without digits is zero (`Mi`, `.`, `+`, `-k` parse as
    /// 0), except where upstream's arbitrary-precision path rejects it (`Pi`, `Ei`, exponents below
    /// -9), which gives [`QuantityError::Numeric`].
    pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
        if text.is_empty() {
            return Err(QuantityError::Format);
        }
        let scanned = scan(text)?;
        let suffix = interpret_suffix(scanned.suffix)?;
        let has_digits = !(scanned.int_digits.is_empty() && scanned.frac_digits.is_empty());
        if !has_digits {
            // Upstream's int64 fast path turns an empty number into 0; its inf.Dec path fails.
            // Without digits that path is taken for decimal exponents below -9 and for binary
            // suffixes whose precision estimate goes negative (Pi, Ei).
            let slow = match suffix {
                Suffix::Decimal(exp) => exp < -9,
                Suffix::Binary(exp) => exp >= 50,
            };
            return if slow {
                Err(QuantityError::Numeric)
            } else {
                Ok(Quantity::zero())
            };
        }

        let mut digits =
            String::with_capacity(scanned.int_digits.len() + scanned.frac_digits.len());
        digits.push_str(scanned.int_digits);
        digits.push_str(scanned.frac_digits);
        let mut magnitude = digits_to_bigint(&digits);
        let frac_len = i64::try_from(scanned.frac_digits.len()).unwrap_or(i64::MAX);
        // magnitude × 10^scale10 is the exact absolute value.
        let scale10 = match suffix {
            Suffix::Decimal(exp) => exp.saturating_sub(frac_len),
            Suffix::Binary(exp) => {
                magnitude <<= exp;
                -frac_len
            }
        };
        let nano_scale = scale10.saturating_add(i64::from(NANO_EXP));
        let mut nanos = if nano_scale >= 0 {
            // Bounded by MAX_EXPONENT + 9 because the fraction only lowers the scale.
            magnitude * pow10(u32::try_from(nano_scale).unwrap_or(u32::MAX))
        } else {
            // Round up in magnitude: any non-zero remainder adds one nano.
            let divisor = pow10(u32::try_from(-nano_scale).unwrap_or(u32::MAX));
            let (q, r) = magnitude.div_rem(&divisor);
            if r.is_zero() {
                q
            } else {
                q + 1u32
            }
        };
        if matches!(suffix, Suffix::Binary(_)) {
            let cap = BigInt::from(i64::MAX) * pow10(NANO_EXP);
            if nanos > cap {
                nanos = cap;
            }
        }
        if scanned.negative {
            nanos = -nanos;
        }
        Ok(Quantity { nanos })
    }

    /// The quantity 0.
    pub fn zero() -> Quantity {
        Quantity::default()
    }

    /// The whole number `value` (what CEL's `q.add(int)` adds).
    pub fn from_int(value: i64) -> Quantity {
        Quantity {
            nanos: BigInt::from(value) * pow10(NANO_EXP),
        }
    }

    /// `self + other`, exactly.
    pub fn add(&self, other: &Quantity) -> Quantity {
        Quantity {
            nanos: &self.nanos + &other.nanos,
        }
    }

    /// `self - other`, exactly.
    pub fn sub(&self, other: &Quantity) -> Quantity {
        Quantity {
            nanos: &self.nanos - &other.nanos,
        }
    }

    /// -1, 0 or 1.
    pub fn sign(&self) -> i64 {
        match self.nanos.sign() {
            Sign::Minus => -1,
            Sign::NoSign => 0,
            Sign::Plus => 1,
        }
    }

    /// The value as an `i64` when it is a whole number within `i64` (CEL `asInteger()`; `None` maps
    /// to "cannot convert value to integer").
    ///
    /// This is by value. Upstream (`Quantity.AsInt64`) depends on the internal form instead and
    /// refuses some whole numbers: `1000m`, `1.5Gi`, and any value that took its arbitrary-precision
    /// path.
    pub fn as_integer(&self) -> Option<i64> {
        let (whole, rem) = self.nanos.div_rem(&pow10(NANO_EXP));
        if !rem.is_zero() {
            return None;
        }
        whole.to_i64()
    }

    /// The value rounded up to a whole number when that fits an `i64`: apimachinery's `Value()`, which
    /// the allocator's request-policy arithmetic uses.
    pub fn ceil_integer(&self) -> Option<i64> {
        let (whole, rem) = self.nanos.div_mod_floor(&pow10(NANO_EXP));
        let whole = if rem.is_zero() { whole } else { whole + 1u32 };
        whole.to_i64()
    }

    /// Whether [`Quantity::as_integer`] succeeds (CEL `isInteger()`).
    pub fn is_integer(&self) -> bool {
        self.as_integer().is_some()
    }

    /// The nearest `f64` (within rounding of the two steps), ±Inf beyond the `f64` range.
    pub fn as_approximate_float(&self) -> f64 {
        let (whole, rem) = self.nanos.div_rem(&pow10(NANO_EXP));
        let whole = whole.to_f64().unwrap_or(if whole.is_negative() {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        });
        // |rem| < 10^9, so it converts exactly.
        let rem = rem.to_f64().unwrap_or(0.0);
        whole + rem / 1e9
    }
}

/// The value in nano units (10^-9) as an `i128`, for code that sums or compares plain quantities (the
/// device model, the slice publisher). Like [`Quantity::parse`], but surrounding whitespace is ignored
/// and a number without digits (`Gi`, `.`), which apimachinery reads as 0, is refused; `None` also
/// when the value does not fit.
pub fn parse_nanos(text: &str) -> Option<i128> {
    let text = text.trim();
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '+' | '-')))
        .unwrap_or(text.len());
    if !text[..number_end].bytes().any(|b| b.is_ascii_digit()) {
        return None;
    }
    Quantity::parse(text).ok()?.nanos.to_i128()
}

impl FromStr for Quantity {
    type Err = QuantityError;

    fn from_str(text: &str) -> Result<Quantity, QuantityError> {
        Quantity::parse(text)
    }
}

impl fmt::Display for Quantity {
    /// An exact plain decimal (`1073741824`, `0.5`, `-0.000000001`), not Kubernetes' canonical form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, rem) = self
            .nanos
            .magnitude()
            .div_rem(&pow10(NANO_EXP).into_parts().1);
        if self.nanos.is_negative() {
            f.write_str("-")?;
        }
        write!(f, "{whole}")?;
        if !rem.is_zero() {
            let frac = format!("{rem:09}");
            write!(f, ".{}", frac.trim_end_matches('0'))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
