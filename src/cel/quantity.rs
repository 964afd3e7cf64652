//! Kubernetes resource quantities as exact values (`40Gi`, `1.5`, `500m`, `1e3`), so that capacities in
//! selectors and shared counters compare and add up exactly, as `resource.Quantity` does in the scheduler.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// Nano units per unit: Kubernetes keeps quantities to 10^-9 and rounds finer precision up.
const NANO: i128 = 1_000_000_000;
/// The largest power of ten an i128 holds.
const MAX_POW10: u32 = 38;

/// An exact quantity, stored in units of 10^-9.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Quantity(i128);

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuantityError {
    #[error("quantity {0:?} does not match the quantity syntax (number with optional suffix Ki..Ei, n..E or e<exponent>)")]
    Syntax(String),
    #[error("quantity {0:?} is outside the range this allocator supports (about ±1.7e29)")]
    Range(String),
}

impl Quantity {
    pub const ZERO: Quantity = Quantity(0);

    /// Parses a quantity like `resource.ParseQuantity`: a signed decimal number and one suffix.
    pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
        let syntax = || QuantityError::Syntax(text.to_string());
        let range = || QuantityError::Range(text.to_string());

        let (negative, rest) = match text.as_bytes().first() {
            Some(b'-') => (true, &text[1..]),
            Some(b'+') => (false, &text[1..]),
            _ => (false, text),
        };
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(number_len);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(syntax());
        }

        // The value is mantissa * 10^-fraction.len() * multiplier.
        let digits = format!("{whole}{fraction}");
        let significant = digits.trim_start_matches('0');
        let mantissa: i128 = if significant.is_empty() {
            0
        } else {
            significant.parse().map_err(|_| range())?
        };
        let fraction_len = i64::try_from(fraction.len()).map_err(|_| range())?;

        let magnitude = match suffix {
            "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => {
                let power = match suffix {
                    "Ki" => 10,
                    "Mi" => 20,
                    "Gi" => 30,
                    "Ti" => 40,
                    "Pi" => 50,
                    _ => 60,
                };
                let scaled = mantissa.checked_mul(1i128 << power).ok_or_else(range)?;
                scale_pow10(scaled, 9 - fraction_len).ok_or_else(range)?
            }
            _ => {
                let exponent: i64 = match suffix {
                    "" => 0,
                    "n" => -9,
                    "u" => -6,
                    "m" => -3,
                    "k" => 3,
                    "M" => 6,
                    "G" => 9,
                    "T" => 12,
                    "P" => 15,
                    "E" => 18,
                    other => parse_exponent(other).ok_or_else(syntax)?,
                };
                let shift = exponent.checked_add(9 - fraction_len).ok_or_else(range)?;
                scale_pow10(mantissa, shift).ok_or_else(range)?
            }
        };
        Ok(Quantity(if negative { -magnitude } else { magnitude }))
    }

    /// The value in units of 10^-9.
    pub fn nanos(self) -> i128 {
        self.0
    }

    /// Zero; the form the exact evaluator's Quantity (not `Copy`) also offers.
    pub fn zero() -> Quantity {
        Quantity::ZERO
    }

    /// `self + other`, saturating at the range's ends.
    pub fn add(&self, other: &Quantity) -> Quantity {
        self.saturating_add(*other)
    }

    /// `self - other`, saturating at the range's ends.
    pub fn sub(&self, other: &Quantity) -> Quantity {
        self.saturating_sub(*other)
    }

    pub fn saturating_add(self, other: Quantity) -> Quantity {
        Quantity(self.0.saturating_add(other.0))
    }

    pub fn saturating_sub(self, other: Quantity) -> Quantity {
        Quantity(self.0.saturating_sub(other.0))
    }
}

/// `e<int>` or `E<int>` (an optional sign is allowed after the letter).
fn parse_exponent(suffix: &str) -> Option<i64> {
    let digits = suffix.strip_prefix(['e', 'E'])?;
    let unsigned = digits.strip_prefix(['+', '-']).unwrap_or(digits);
    if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `value * 10^shift` for a non-negative value; a negative shift divides and rounds up, as Kubernetes
/// does below 1n. `None` on overflow.
fn scale_pow10(value: i128, shift: i64) -> Option<i128> {
    if value == 0 {
        return Some(0);
    }
    if shift >= 0 {
        let power = u32::try_from(shift).ok().filter(|p| *p <= MAX_POW10)?;
        return value.checked_mul(10i128.pow(power));
    }
    let power = shift.unsigned_abs();
    if power > u64::from(MAX_POW10) {
        return Some(1); // a positive value far below 1n rounds up to 1n
    }
    let divisor = 10i128.pow(power as u32);
    Some(value / divisor + i128::from(value % divisor != 0))
}

impl FromStr for Quantity {
    type Err = QuantityError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Quantity::parse(text)
    }
}

impl fmt::Display for Quantity {
    /// A plain decimal number (no suffix), exact to 10^-9.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let magnitude = self.0.unsigned_abs();
        let nano = NANO.unsigned_abs();
        let (whole, fraction) = (magnitude / nano, magnitude % nano);
        if fraction == 0 {
            write!(f, "{sign}{whole}")
        } else {
            let fraction = format!("{fraction:09}");
            write!(f, "{sign}{whole}.{}", fraction.trim_end_matches('0'))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Quantity, QuantityError};

    fn q(text: &str) -> Quantity {
        Quantity::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn suffixes_scale_exactly() {
        assert_eq!(q("40Gi"), q("42949672960"));
        assert_eq!(q("1.5Gi"), q("1610612736"));
        assert_eq!(q("1Ki"), q("1024"));
        assert_eq!(q("1Ei"), q("1152921504606846976"));
        assert_eq!(q("1k"), q("1000"));
        assert_eq!(q("2M"), q("2000000"));
        assert_eq!(q("1E"), q("1000000000000000000"));
        assert_eq!(q("500m"), q("0.5"));
        assert_eq!(q("1e3"), q("1k"));
        assert_eq!(q("1E3"), q("1000"));
        assert_eq!(q("1e-3"), q("1m"));
        assert_eq!(q("1.5e+2"), q("150"));
        assert_eq!(q(".5"), q("500m"));
        assert_eq!(q("5."), q("5"));
        assert_eq!(q("+7"), q("7"));
        assert_eq!(q("-1").nanos(), -1_000_000_000);
        assert_eq!(q("0Gi"), Quantity::ZERO);
        assert_ne!(q("1Gi"), q("1G"));
        assert!(q("40Gi") > q("40G"));
        assert!(q("79Gi") < q("80Gi"));
    }

    #[test]
    fn precision_below_nano_is_rounded_up() {
        assert_eq!(q("1n").nanos(), 1);
        assert_eq!(q("0.1n").nanos(), 1);
        assert_eq!(q("1.0000000001").nanos(), 1_000_000_001);
        assert_eq!(q("1e-40").nanos(), 1);
        assert_eq!(q("0e-40").nanos(), 0);
    }

    #[test]
    fn display_is_a_plain_number() {
        assert_eq!(q("40Gi").to_string(), "42949672960");
        assert_eq!(q("1500m").to_string(), "1.5");
        assert_eq!(q("-2").to_string(), "-2");
    }

    #[test]
    fn malformed_quantities_are_refused() {
        for bad in [
            "", "Gi", "Mi", "10Mo", "200K", "10Mm", "1.2.3", "--1", "+-1", "1e", "1e+", ".",
            "1 Gi", " 1", "abc", "1Gi ", "0x10",
        ] {
            assert!(
                matches!(Quantity::parse(bad), Err(QuantityError::Syntax(_))),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn out_of_range_quantities_are_errors_not_wrapped_values() {
        for huge in [
            "1e40",
            "9999999999999999999999999999999999999G",
            "1e9999999999",
        ] {
            assert!(
                matches!(Quantity::parse(huge), Err(QuantityError::Range(_))),
                "{huge:?}"
            );
        }
    }
}
