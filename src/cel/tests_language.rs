//! The CEL language around the device variable: a selector's result must be bool, references must be
//! declared, `cel.bind` and the macros behave as in cel-go (errors absorbed by `||` and `&&`), and
//! `references` names the device lookups an expression makes, for `selectors check`.

use super::tests::{eval, gpu};
use super::{CelError, Selector};

#[test]
fn result_must_be_bool() {
    let d = gpu();
    for (expression, t) in [
        ("1", "int"),
        ("'a'", "string"),
        ("2.5", "double"),
        ("null", "null_type"),
        ("device.driver", "string"),
        (r#"quantity("1")"#, "kubernetes.Quantity"),
    ] {
        assert_eq!(
            eval(expression, &d),
            Err(CelError::Compile(format!(
                "must evaluate to bool or the unknown type, not {t}"
            ))),
            "{expression}"
        );
    }
    assert_eq!(
        eval(r#"device.attributes["dra.example.com"].count"#, &d),
        Err(CelError::Runtime(
            "CEL result of type int could not be converted to bool".into()
        ))
    );
}

#[test]
fn undeclared_references_are_compile_errors() {
    let d = gpu();
    for (expression, name) in [
        ("noSuchVar", "noSuchVar"),
        ("noSuchFunc(1)", "noSuchFunc"),
        ("device.driver.noSuchMethod()", "noSuchMethod"),
        ("[1].all(x, y > 0)", "y"),
        ("__tick(true)", "__tick"),
        ("timestamp('2020-01-01T00:00:00Z') != null", "timestamp"),
    ] {
        assert_eq!(
            eval(expression, &d),
            Err(CelError::Compile(format!(
                "undeclared reference to '{name}'"
            ))),
            "{expression}"
        );
    }
    // Comprehension and bind variables are declared in their bodies only.
    assert_eq!(
        eval("[1, 2].all(x, x > 0) && [3].exists(y, y == 3)", &d),
        Ok(true)
    );
    assert_eq!(eval("cel.bind(v, 2, v * v == 4)", &d), Ok(true));
    assert!(matches!(
        eval("cel.bind(v, 2, v == 2) && v == 2", &d),
        Err(CelError::Compile(_))
    ));
    assert_eq!(eval("type(1) == int", &d), Ok(true));
}

#[test]
fn bind_nests_and_shadows() {
    let d = gpu();
    assert_eq!(
        eval("cel.bind(a, 1, cel.bind(b, a + 1, a + b == 3))", &d),
        Ok(true)
    );
    assert_eq!(eval("cel.bind(a, 1, cel.bind(a, 5, a == 5))", &d), Ok(true));
    assert!(matches!(
        eval("cel.bind(1, 2, true)", &d),
        Err(CelError::Compile(_))
    ));
}

#[test]
fn macros_in_and_error_absorption() {
    let d = gpu();
    let cases = [
        ("[1, 2, 3].map(x, x * 2) == [2, 4, 6]", true),
        ("[1, 2, 3].filter(x, x > 1).size() == 2", true),
        ("[1, 2, 3].exists_one(x, x == 2)", true),
        ("[1, 2, 3].all(x, x > 0)", true),
        ("[1, 2, 3].exists(x, x > 5)", false),
        ("2 in [1, 2]", true),
        ("'k' in {'k': 1}", true),
        (
            r#"device.attributes["dra.example.com"].missing || true"#,
            true,
        ),
        (
            r#"device.attributes["dra.example.com"].missing && false"#,
            false,
        ),
        (r#"[0, 1].exists(x, 1 / x == 1)"#, true),
        (
            r#"'abc'.contains('b') && 'abc'.startsWith('a') && 'abc'.endsWith('c')"#,
            true,
        ),
    ];
    for (expression, want) in cases {
        assert_eq!(eval(expression, &d), Ok(want), "{expression}");
    }
    assert!(matches!(
        eval("[0, 1].all(x, 1 / x == 1)", &d),
        Err(CelError::Runtime(_))
    ));
}

/// The lookups `selectors check` compares with the published names, written as `map domain/name`.
fn references(expression: &str) -> Vec<String> {
    Selector::compile(expression)
        .expect("compiles")
        .references()
        .iter()
        .map(|r| {
            let map = match r.map {
                super::DeviceMap::Attributes => "attributes",
                super::DeviceMap::Capacity => "capacity",
            };
            format!("{map} {}/{}", r.domain, r.name.as_deref().unwrap_or("*"))
        })
        .collect()
}

#[test]
fn references_name_the_domains_and_names_looked_up_in_every_access_form() {
    let cases: &[(&str, &[&str])] = &[
        (
            r#"device.attributes["gpu.dra.dev"].productName == "x""#,
            &[
                "attributes gpu.dra.dev/*",
                "attributes gpu.dra.dev/productName",
            ],
        ),
        (
            r#"device.capacity["gpu.dra.dev"]["memory"].compareTo(quantity("1Gi")) > 0"#,
            &["capacity gpu.dra.dev/*", "capacity gpu.dra.dev/memory"],
        ),
        (
            r#"has(device.attributes["a.dev"].x) && device.attributes["a.dev"].?y.orValue(1) == 1"#,
            &[
                "attributes a.dev/*",
                "attributes a.dev/x",
                "attributes a.dev/y",
            ],
        ),
        (
            r#"device.attributes[?"a.dev"][?"x"].hasValue() || "y" in device.capacity["b.dev"]"#,
            &[
                "attributes a.dev/*",
                "attributes a.dev/x",
                "capacity b.dev/*",
                "capacity b.dev/y",
            ],
        ),
        // Inside a macro, and a key that is computed, not literal: only the domain.
        (
            r#"["x"].all(k, device.attributes["a.dev"][k] == 1)"#,
            &["attributes a.dev/*"],
        ),
        // A comprehension variable named `device` is not the device.
        (
            r#"[{"attributes": {"a.dev": {"x": 1}}}].all(device, device.attributes["a.dev"].x == 1)"#,
            &[],
        ),
        (r#"device.driver == "gpu.dra.dev""#, &[]),
    ];
    for (expression, want) in cases {
        assert_eq!(references(expression), *want, "{expression}");
    }
}
