//! The Kubernetes CEL libraries as selectors see them: quantity, semver, lists, regex, `includes`.

use serde_json::json;

use super::tests::{eval, gpu, view};
use super::CelError;

#[test]
fn quantity_library() {
    let d = gpu();
    let cases = [
        (r#"quantity("200M") == quantity("0.2G")"#, true),
        (r#"quantity("1Gi") != quantity("1G")"#, true),
        (
            r#"isQuantity("10Mi") && !isQuantity("10Mo") && !isQuantity("10Mm")"#,
            true,
        ),
        (
            r#"quantity("2").isGreaterThan(quantity("1")) && quantity("1").isLessThan(quantity("2"))"#,
            true,
        ),
        (
            r#"quantity("1").compareTo(quantity("2")) == -1 && quantity("2").compareTo(quantity("2000m")) == 0"#,
            true,
        ),
        (
            r#"quantity("1Ki").add(quantity("1Ki")) == quantity("2Ki")"#,
            true,
        ),
        (
            r#"quantity("1").add(2) == quantity("3") && quantity("3").sub(1) == quantity("2")"#,
            true,
        ),
        (r#"quantity("3").sub(quantity("1")) == quantity("2")"#, true),
        (
            r#"quantity("1Ki").asInteger() == 1024 && quantity("1.5").isInteger() == false"#,
            true,
        ),
        (
            r#"quantity("9999999999999999999999999999999999999G").isInteger() == false"#,
            true,
        ),
        (r#"quantity("1.5").asApproximateFloat() == 1.5"#, true),
        (
            r#"sign(quantity("-1")) == -1 && sign(quantity("0")) == 0 && sign(quantity("5m")) == 1"#,
            true,
        ),
        (
            r#"device.capacity["dra.example.com"].memory.compareTo(quantity("40Gi")) >= 0"#,
            true,
        ),
        (
            r#"device.capacity["dra.example.com"].memory.isGreaterThan(quantity("40Gi"))"#,
            false,
        ),
    ];
    for (expression, want) in cases {
        assert_eq!(eval(expression, &d), Ok(want), "{expression}");
    }
    let runtime_errors = [
        (
            r#"quantity("10Mo") == quantity("1")"#,
            "quantities must match the regular expression",
        ),
        (
            r#"quantity("10Mm") == quantity("1")"#,
            "unable to parse quantity's suffix",
        ),
        (
            r#"quantity("1.5").asInteger() == 1"#,
            "cannot convert value to integer",
        ),
        (r#"quantity("1") < quantity("2")"#, ""),
        (
            "isQuantity(1)",
            "found no matching overload for 'isQuantity'",
        ),
    ];
    for (expression, text) in runtime_errors {
        let got = eval(expression, &d);
        assert!(
            matches!(&got, Err(CelError::Runtime(t)) if t.contains(text)),
            "{expression}: {got:?}"
        );
    }
    // `sign` is declared as a global function only.
    assert_eq!(
        eval(r#"quantity("1").sign() == 1"#, &d),
        Err(CelError::Compile("undeclared reference to 'sign'".into()))
    );
}

#[test]
fn semver_library() {
    let d = gpu();
    let cases = [
        (
            r#"semver("1.2.3").major() == 1 && semver("1.2.3").minor() == 2 && semver("1.2.3").patch() == 3"#,
            true,
        ),
        (r#"semver("v01.01", true) == semver("1.1.0")"#, true),
        (
            r#"isSemver("1.0.0") && !isSemver("v1.0.0") && isSemver("v1.0.0", true) && !isSemver("1.0")"#,
            true,
        ),
        (r#"semver("1.0.0+a") == semver("1.0.0+b")"#, true),
        (r#"semver("1.0.0-alpha").isLessThan(semver("1.0.0"))"#, true),
        (
            r#"semver("2.0.0").isGreaterThan(semver("1.9.9")) && semver("1.0.0").compareTo(semver("1.0.0")) == 0"#,
            true,
        ),
        (
            r#"device.attributes["dra.example.com"].version == semver("1.2.3")"#,
            true,
        ),
        (
            r#"device.attributes["dra.example.com"].version.major() == 1"#,
            true,
        ),
    ];
    for (expression, want) in cases {
        assert_eq!(eval(expression, &d), Ok(want), "{expression}");
    }
    let got = eval(r#"semver("v1.0.0") == semver("1.0.0")"#, &d);
    assert!(matches!(&got, Err(CelError::Runtime(_))), "{got:?}");
    let got = eval(r#"isSemver([1, 2, 3])"#, &d);
    assert!(matches!(&got, Err(CelError::Runtime(_))), "{got:?}");
}

#[test]
fn kubernetes_list_and_regex_functions() {
    let d = gpu();
    let cases = [
        ("[1, 2, 3].isSorted() && !['b', 'a'].isSorted() && [1.0, 2.5].isSorted()", true),
        ("[1, 2, 3].sum() == 6 && [1.5, 2.0].sum() == 3.5 && [1u, 2u].sum() == 3u", true),
        ("[3, 1, 2].min() == 1 && [3, 1, 2].max() == 3 && ['a', 'c'].max() == 'c'", true),
        ("[1, 2, 1].indexOf(1) == 0 && [1, 2, 1].lastIndexOf(1) == 2 && [1].indexOf(5) == -1", true),
        ("'abc123'.find('[0-9]+') == '123' && 'abc'.find('[0-9]+') == ''", true),
        ("'a1b2c3'.findAll('[0-9]') == ['1', '2', '3'] && 'a1b2c3'.findAll('[0-9]', 2) == ['1', '2']", true),
        ("'a1b2'.findAll('[0-9]', 0) == [] && 'a1b2'.findAll('[0-9]', -1).size() == 2", true),
        ("'Hello'.lowerAscii() == 'hello' && 'a,b'.split(',') == ['a', 'b'] && ['a', 'b'].join('-') == 'a-b'", true),
        ("[3, 1, 2].sort() == [1, 2, 3] && [1, [2]].flatten() == [1, 2] && lists.range(3) == [0, 1, 2]", true),
        ("sets.contains([1, 2, 3], [2]) && sets.intersects([1], [1, 5]) && sets.equivalent([1, 2], [2, 1, 1])", true),
        (r#"device.attributes["dra.example.com"].ids.max() == 2"#, true),
    ];
    for (expression, want) in cases {
        assert_eq!(eval(expression, &d), Ok(want), "{expression}");
    }
    for (expression, text) in [
        ("[].min() == 1", "min called on empty list"),
        ("[].max() == 1", "max called on empty list"),
        ("'a'.find('(') == ''", "Illegal regex"),
    ] {
        let got = eval(expression, &d);
        assert!(
            matches!(&got, Err(CelError::Runtime(t)) if t.contains(text)),
            "{expression}: {got:?}"
        );
    }
}

#[test]
fn includes_rejects_lists_longer_than_48_values() {
    let values = |n: usize| (0..n).map(|i| format!("value-{i}")).collect::<Vec<_>>();
    let ok = view(
        "d",
        json!({"attributes": {"name": {"strings": values(48)}}}),
    );
    assert_eq!(
        eval(r#"device.attributes["d"].name.includes("value-48")"#, &ok),
        Ok(false)
    );
    assert_eq!(
        eval(r#"device.attributes["d"].name.includes("value-47")"#, &ok),
        Ok(true)
    );
    let long = view(
        "d",
        json!({"attributes": {"name": {"strings": values(49)}}}),
    );
    assert_eq!(
        eval(r#"device.attributes["d"].name.includes("value-49")"#, &long),
        Err(CelError::Runtime(
            "'includes' function cannot be applied to lists longer than 48 values".into()
        ))
    );
    let flag = view("d", json!({"attributes": {"name": {"bool": true}}}));
    assert_eq!(
        eval(r#"device.attributes["d"].name.includes(true)"#, &flag),
        Ok(true)
    );
    assert_eq!(
        eval(r#"device.attributes["d"].name.includes(1)"#, &flag),
        Ok(false)
    );
}
