//! Quantity parsing, arithmetic and formatting, checked against apimachinery's behaviour.

use super::*;

fn q(text: &str) -> Quantity {
    match Quantity::parse(text) {
        Ok(value) => value,
        Err(e) => panic!("{text:?} should parse: {e}"),
    }
}

#[test]
fn every_suffix_scales_the_number() {
    let table = [
        ("1n", "0.000000001"),
        ("1u", "0.000001"),
        ("1m", "0.001"),
        ("1", "1"),
        ("1k", "1000"),
        ("1M", "1000000"),
        ("1G", "1000000000"),
        ("1T", "1000000000000"),
        ("1P", "1000000000000000"),
        ("1E", "1000000000000000000"),
        ("1Ki", "1024"),
        ("1Mi", "1048576"),
        ("1Gi", "1073741824"),
        ("1Ti", "1099511627776"),
        ("1Pi", "1125899906842624"),
        ("1Ei", "1152921504606846976"),
        ("1e3", "1000"),
        ("1E3", "1000"),
        ("1e+3", "1000"),
        ("1e-3", "0.001"),
        ("12e0", "12"),
    ];
    for (text, want) in table {
        assert_eq!(q(text).to_string(), want, "{text}");
    }
}

#[test]
fn number_forms() {
    assert_eq!(q(".5").to_string(), "0.5");
    assert_eq!(q("5.").to_string(), "5");
    assert_eq!(q("+1"), Quantity::from_int(1));
    assert_eq!(q("-1.5Gi").to_string(), "-1610612736");
    assert_eq!(q("0.5Ki").to_string(), "512");
    assert_eq!(q("1.5").to_string(), "1.5");
    assert_eq!(q("007"), Quantity::from_int(7));
    assert_eq!(q("0"), Quantity::zero());
    assert_eq!(q("-0"), Quantity::zero());
    assert_eq!(q(".000000001Ki").to_string(), "0.000001024");
    "3k".parse::<Quantity>().map_or_else(
        |e| panic!("FromStr failed: {e}"),
        |v| assert_eq!(v, Quantity::from_int(3000)),
    );
}

#[test]
fn digitless_numbers_follow_upstream() {
    // apimachinery's int64 path reads an empty number as 0; its big-decimal path rejects it.
    for text in ["Mi", ".", "+", "-", "k", "Ti", "e5"] {
        assert_eq!(q(text), Quantity::zero(), "{text}");
    }
    for text in ["Pi", "Ei", "e-10", ".n0"] {
        let got = Quantity::parse(text);
        if text == ".n0" {
            assert_eq!(got, Err(QuantityError::Suffix), "{text}");
        } else {
            assert_eq!(got, Err(QuantityError::Numeric), "{text}");
        }
    }
}

#[test]
fn finer_than_nano_rounds_away_from_zero() {
    assert_eq!(q("1n").to_string(), "0.000000001");
    assert_eq!(q("0.1n"), q("1n"));
    assert_eq!(q("0.9n"), q("1n"));
    assert_eq!(q("1.1n"), q("2n"));
    assert_eq!(q("-0.1n"), q("-1n"));
    assert_eq!(q("-0.1n").to_string(), "-0.000000001");
    assert_eq!(q("0.0n"), Quantity::zero());
    assert_eq!(q(".000000000001Ki"), q("2n"));
    assert_eq!(q("1e-1000"), q("1n"));
}

#[test]
fn binary_values_are_capped_like_upstream() {
    let max = Quantity::from_int(i64::MAX);
    assert_eq!(q("8Ei"), max);
    assert_eq!(q("100000Ei"), max);
    assert_eq!(q("-8Ei"), Quantity::zero().sub(&max));
    assert_eq!(q("7Ei").to_string(), "8070450532247928832");
    // Decimal values are not capped.
    assert_eq!(q("10E").to_string(), "10000000000000000000");
}

#[test]
fn equality_and_order_are_by_value() {
    assert_eq!(q("200M"), q("0.2G"));
    assert_eq!(q("1Gi"), q("1073741824"));
    assert_eq!(q("1000m"), q("1"));
    assert_eq!(q("1e3"), q("1k"));
    assert!(q("50M") < q("50Mi"));
    assert!(q("150Mi") > q("100Mi"));
    assert!(q("-1") < q("1m"));
    assert_eq!(q("50M").cmp(&q("50M")), std::cmp::Ordering::Equal);
    let set: std::collections::HashSet<Quantity> = ["200M", "0.2G", "200000k", "1Gi"]
        .iter()
        .map(|t| q(t))
        .collect();
    assert_eq!(set.len(), 2);
}

#[test]
fn arithmetic_is_exact() {
    let huge = q("9999999999999999999999999999999999999G");
    assert_eq!(
        huge.to_string(),
        "9999999999999999999999999999999999999000000000"
    );
    assert!(!huge.is_integer());
    assert_eq!(
        huge.add(&q("1G")).to_string(),
        format!("1{}", "0".repeat(46))
    );
    assert_eq!(huge.sub(&huge), Quantity::zero());
    assert_eq!(q("0.1").add(&q("0.2")), q("0.3"));
    let v = q("50k").add(&Quantity::from_int(20)).sub(&q("100k"));
    assert_eq!(v.as_integer(), Some(-49980));
    assert_eq!(v.sub(&Quantity::from_int(-50000)).as_integer(), Some(20));
    assert_eq!(q("1n").sub(&q("2n")).to_string(), "-0.000000001");
}

#[test]
fn as_integer_boundaries() {
    assert_eq!(q("9223372036854775807").as_integer(), Some(i64::MAX));
    assert_eq!(q("9223372036854775808").as_integer(), None);
    assert_eq!(q("-9223372036854775808").as_integer(), Some(i64::MIN));
    assert_eq!(q("-9223372036854775809").as_integer(), None);
    assert_eq!(q("1.5").as_integer(), None);
    assert!(!q("1n").is_integer());
    assert_eq!(q("50k").as_integer(), Some(50_000));
    assert_eq!(q("1.5Gi").as_integer(), Some(1_610_612_736));
    assert!(q("1000m").is_integer());
    assert_eq!(Quantity::from_int(i64::MIN).as_integer(), Some(i64::MIN));
}

#[test]
fn approximate_float() {
    assert_eq!(q("1.5Gi").as_approximate_float(), 1_610_612_736.0);
    assert_eq!(q("0.1").as_approximate_float(), 0.1);
    assert_eq!(q("-2.5m").as_approximate_float(), -0.0025);
    assert_eq!(q("1e308").as_approximate_float(), 1e308);
    assert_eq!(q("1e400").as_approximate_float(), f64::INFINITY);
    assert_eq!(q("-1e400").as_approximate_float(), f64::NEG_INFINITY);
    assert_eq!(Quantity::zero().as_approximate_float(), 0.0);
}

#[test]
fn sign() {
    assert_eq!(q("-1n").sign(), -1);
    assert_eq!(q("0Gi").sign(), 0);
    assert_eq!(q("3m").sign(), 1);
}

#[test]
fn malformed_texts_give_upstream_errors() {
    let format = "quantities must match the regular expression \
                  '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'";
    for text in [
        "", "10Mo", "1.2.3", " 1", "1 ", "aoeu", "1.1.M", "1+1.0M", "1,3G", "Three",
    ] {
        let err = Quantity::parse(text).expect_err(text);
        assert_eq!(err, QuantityError::Format, "{text}");
        assert_eq!(err.to_string(), format);
    }
    for text in [
        "10Mm",
        "200K",
        "0.1mi",
        "5i",
        ".5i",
        "1e",
        "1E",
        "1e+",
        "-3.01e-",
        "1Ki2",
        "1e99999999999999999999",
    ] {
        if text == "1E" {
            // Plain `E` is the exa suffix.
            assert_eq!(q(text), q("1000000000000000000"));
            continue;
        }
        let err = Quantity::parse(text).expect_err(text);
        assert_eq!(err, QuantityError::Suffix, "{text}");
        assert_eq!(err.to_string(), "unable to parse quantity's suffix");
    }
}

#[test]
fn exponent_is_bounded() {
    assert_eq!(q("1e1000").to_string(), format!("1{}", "0".repeat(1000)));
    assert!(q("1e-1000").sign() == 1);
    for text in ["1e1001", "1e-1001", "1e999999999", "-5E-999999999"] {
        let err = Quantity::parse(text).expect_err(text);
        assert!(
            matches!(err, QuantityError::ExponentOutOfRange { .. }),
            "{text}: {err}"
        );
    }
}

#[test]
fn nanos_compare_canonical_forms_equal() {
    // The slice publisher's comparison: the API server may store another form of the same value.
    assert_eq!(parse_nanos("42949672960"), parse_nanos("40Gi"));
    assert_eq!(parse_nanos("85520809984"), parse_nanos("81559Mi"));
    assert_eq!(parse_nanos("1k"), parse_nanos("1000"));
    assert_eq!(parse_nanos("1e3"), parse_nanos("1k"));
    assert_eq!(parse_nanos("500m"), parse_nanos("0.5"));
    assert_ne!(parse_nanos("1Gi"), parse_nanos("1G"));
    assert_eq!(parse_nanos(" 2Ki "), Some(2048 * 1_000_000_000));
}

#[test]
fn nanos_refuse_garbage() {
    for bad in ["", "Gi", "1.2.3", "12XB", "--1", "1e", "abc", ".", "-k"] {
        assert_eq!(parse_nanos(bad), None, "{bad}");
    }
}
