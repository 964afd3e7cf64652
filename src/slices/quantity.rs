//! Just enough of Kubernetes' Quantity to tell whether two quantities are equal: the API server
//! rewrites quantities into canonical form (`42949672960` may come back as `40Gi`), and the publisher
//! must not see that as a change.

/// The value of a quantity in units of 10^-9 (nano), or `None` if it is not a valid quantity.
pub fn parse_quantity(text: &str) -> Option<i128> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let (negative, digits) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number.strip_prefix('+').unwrap_or(number)),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    if !whole
        .bytes()
        .chain(fraction.bytes())
        .all(|b| b.is_ascii_digit())
        || fraction.len() > 9
    {
        return None;
    }
    let mut nanos: i128 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    nanos = nanos.checked_mul(1_000_000_000)?;
    if !fraction.is_empty() {
        let scale = 10i128.pow(9 - fraction.len() as u32);
        nanos = nanos.checked_add(fraction.parse::<i128>().ok()? * scale)?;
    }
    let multiplied = match suffix {
        "" => Some(nanos),
        "n" => Some(nanos / 1_000_000_000),
        "u" => Some(nanos / 1_000_000),
        "m" => Some(nanos / 1_000),
        "k" => nanos.checked_mul(1_000),
        "M" => nanos.checked_mul(1_000_000),
        "G" => nanos.checked_mul(1_000_000_000),
        "T" => nanos.checked_mul(1_000_000_000_000),
        "P" => nanos.checked_mul(1_000_000_000_000_000),
        "E" => nanos.checked_mul(1_000_000_000_000_000_000),
        "Ki" => nanos.checked_mul(1 << 10),
        "Mi" => nanos.checked_mul(1 << 20),
        "Gi" => nanos.checked_mul(1 << 30),
        "Ti" => nanos.checked_mul(1 << 40),
        "Pi" => nanos.checked_mul(1 << 50),
        "Ei" => nanos.checked_mul(1 << 60),
        exponent => {
            let power: u32 = exponent.strip_prefix(['e', 'E'])?.parse().ok()?;
            nanos.checked_mul(10i128.checked_pow(power)?)
        }
    }?;
    Some(if negative { -multiplied } else { multiplied })
}

#[cfg(test)]
mod tests {
    use super::parse_quantity;

    #[test]
    fn canonical_forms_compare_equal() {
        assert_eq!(parse_quantity("42949672960"), parse_quantity("40Gi"));
        assert_eq!(parse_quantity("85520809984"), parse_quantity("81559Mi"));
        assert_eq!(parse_quantity("1k"), parse_quantity("1000"));
        assert_eq!(parse_quantity("1e3"), parse_quantity("1k"));
        assert_eq!(parse_quantity("500m"), parse_quantity("0.5"));
        assert_ne!(parse_quantity("1Gi"), parse_quantity("1G"));
    }

    #[test]
    fn garbage_is_not_a_quantity() {
        for bad in ["", "Gi", "1.2.3", "12XB", "--1", "1e", "abc"] {
            assert_eq!(parse_quantity(bad), None, "{bad}");
        }
    }
}
