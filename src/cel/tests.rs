//! Selector semantics in the scheduler's environment, including the cases of upstream's
//! `cel/compile_test.go` that apply.

use k8s_openapi::api::resource::v1::Device;
use serde_json::json;

use super::{CelError, DeviceView, Selector};

pub(super) fn view(driver: &str, device: serde_json::Value) -> DeviceView {
    let mut device = device;
    device["name"] = json!("dev-0");
    let device: Device = serde_json::from_value(device).expect("test device JSON");
    DeviceView::new(driver, &device)
}

pub(super) fn eval(expression: &str, device: &DeviceView) -> Result<bool, CelError> {
    Selector::compile(expression)?.matches(device)
}

#[derive(Debug, Clone, Copy)]
enum Want {
    Match(bool),
    CompileError(&'static str),
    RuntimeError(&'static str),
}

fn check(name: &str, expression: &str, device: &DeviceView, want: Want) {
    let got = eval(expression, device);
    match (&want, &got) {
        (Want::Match(w), Ok(g)) if w == g => {}
        (Want::CompileError(w), Err(CelError::Compile(g))) if g.contains(w) => {}
        (Want::RuntimeError(w), Err(CelError::Runtime(g))) if g.contains(w) => {}
        _ => panic!("{name}: `{expression}`: want {want:?}, got {got:?}"),
    }
}

pub(super) fn gpu() -> DeviceView {
    view(
        "dra.example.com",
        json!({
            "attributes": {
                "name": {"string": "fish"},
                "count": {"int": 3},
                "ready": {"bool": true},
                "version": {"version": "1.2.3+build.5"},
                "names": {"strings": ["a", "b"]},
                "ids": {"ints": [1, 2]},
                "versions": {"versions": ["1.0.0", "2.0.0"]},
                "services": {"string": "some_example_value"},
                "other.example.com/name": {"string": "bird"},
                "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"}
            },
            "capacity": {
                "memory": {"value": "40Gi"},
                "name": {"value": "1Mi"}
            },
            "allowMultipleAllocations": true
        }),
    )
}

#[test]
fn upstream_compile_test_cases() {
    use Want::*;
    let empty = view("", json!({}));
    let d = gpu();
    let cases: &[(&str, &str, &DeviceView, Want)] = &[
        ("true", "true", &empty, Match(true)),
        ("false", "false", &empty, Match(false)),
        ("syntax-error", "?!", &empty, CompileError("Syntax error")),
        (
            "type-error",
            "1",
            &empty,
            CompileError("must evaluate to bool or the unknown type, not int"),
        ),
        (
            "runtime-error",
            r#"device.attributes["no-such-domain"].noSuchAttr.isGreaterThan(quantity("0"))"#,
            &empty,
            RuntimeError("no such key: noSuchAttr"),
        ),
        (
            "runtime-error-lookup-identifier",
            r#"device.attributes["no-such-domain"]["noSuchAttr"].isGreaterThan(quantity("0"))"#,
            &empty,
            RuntimeError("no such key: noSuchAttr"),
        ),
        (
            "domain-check-negative",
            r#""no-such-domain" in device.attributes"#,
            &empty,
            Match(false),
        ),
        (
            "domain-check-positive",
            r#""dra.example.com" in device.attributes"#,
            &d,
            Match(true),
        ),
        (
            "empty-driver-name",
            r#"device.driver == """#,
            &empty,
            Match(true),
        ),
        (
            "real-driver-name",
            r#"device.driver == "dra.example.com""#,
            &d,
            Match(true),
        ),
        (
            "driver-name-qualifier",
            r#"device.attributes["dra.example.com"].name == "fish""#,
            &d,
            Match(true),
        ),
        (
            "index-form",
            r#"device.attributes["dra.example.com"]["name"] == "fish""#,
            &d,
            Match(true),
        ),
        (
            "bind",
            r#"cel.bind(dra, device.attributes["dra.example.com"], dra.name == "fish")"#,
            &d,
            Match(true),
        ),
        (
            "other-domain",
            r#"device.attributes["other.example.com"].name == "bird""#,
            &d,
            Match(true),
        ),
        (
            "int",
            r#"device.attributes["dra.example.com"].count > 0"#,
            &d,
            Match(true),
        ),
        (
            "bool",
            r#"device.attributes["dra.example.com"].ready"#,
            &d,
            Match(true),
        ),
        (
            "macro-over-scalar",
            r#"device.attributes["dra.example.com"].count.exists(x, x > 0)"#,
            &d,
            RuntimeError("iterable"),
        ),
        (
            "list-result",
            r#"device.attributes["dra.example.com"].names"#,
            &d,
            RuntimeError("CEL result of type list could not be converted to bool"),
        ),
        (
            "list-size",
            r#"device.attributes["dra.example.com"].names.size() == 2"#,
            &d,
            Match(true),
        ),
        (
            "list-exists",
            r#"device.attributes["dra.example.com"].ids.exists(x, x > 1)"#,
            &d,
            Match(true),
        ),
        (
            "list-all",
            r#"device.attributes["dra.example.com"].names.all(x, x != "")"#,
            &d,
            Match(true),
        ),
        (
            "versions-all",
            r#"device.attributes["dra.example.com"].versions.all(x, x.isGreaterThan(semver("0.0.1")))"#,
            &d,
            Match(true),
        ),
        (
            "in-list",
            r#"1 in device.attributes["dra.example.com"].ids"#,
            &d,
            Match(true),
        ),
        (
            "version",
            r#"device.attributes["dra.example.com"].version.isGreaterThan(semver("0.0.1"))"#,
            &d,
            Match(true),
        ),
        (
            "version-normalized",
            r#"device.attributes["dra.example.com"].version.isGreaterThan(semver("v0.0.1", true)) && isSemver("v1.0.0", true)"#,
            &d,
            Match(true),
        ),
        (
            "quantity",
            r#"device.capacity["dra.example.com"].name.isGreaterThan(quantity("1Ki"))"#,
            &d,
            Match(true),
        ),
        (
            "check-positive",
            r#""name" in device.capacity["dra.example.com"] && device.capacity["dra.example.com"].name.isGreaterThan(quantity("1Ki"))"#,
            &d,
            Match(true),
        ),
        (
            "check-negative",
            r#"!("name" in device.capacity["no-such-domain"]) || device.capacity["no-such-domain"].name.isGreaterThan(quantity("1Ki"))"#,
            &d,
            Match(true),
        ),
        (
            "check_attribute_domains",
            r#"device.attributes.exists_one(x, x == "dra.example.com")"#,
            &d,
            Match(true),
        ),
        (
            "check_attribute_ids",
            r#"device.attributes["dra.example.com"].exists_one(x, x == "services")"#,
            &d,
            Match(true),
        ),
        (
            "split_attribute",
            r#"device.attributes["dra.example.com"].services.split("example").size() >= 2"#,
            &d,
            Match(true),
        ),
        (
            "regexp_attribute",
            r#"device.attributes["dra.example.com"].services.matches("[^a]?val")"#,
            &d,
            Match(true),
        ),
        (
            "check_capacity_domains",
            r#"device.capacity.exists_one(x, x == "dra.example.com")"#,
            &d,
            Match(true),
        ),
        (
            "check_capacity_ids",
            r#"device.capacity["dra.example.com"].exists_one(x, x == "memory")"#,
            &d,
            Match(true),
        ),
        (
            "allow-multiple",
            "device.allowMultipleAllocations == true",
            &d,
            Match(true),
        ),
        (
            "allow-multiple-unset",
            "device.allowMultipleAllocations == false",
            &empty,
            Match(true),
        ),
        (
            "includes-scalar",
            r#"device.attributes["dra.example.com"].name.includes("fish")"#,
            &d,
            Match(true),
        ),
        (
            "includes-list",
            r#"device.attributes["dra.example.com"].ids.includes(2)"#,
            &d,
            Match(true),
        ),
        (
            "includes-list-miss",
            r#"device.attributes["dra.example.com"].ids.includes(3)"#,
            &d,
            Match(false),
        ),
        (
            "includes-version",
            r#"device.attributes["dra.example.com"].versions.includes(semver("2.0.0"))"#,
            &d,
            Match(true),
        ),
    ];
    for (name, expression, device, want) in cases {
        check(name, expression, device, *want);
    }
}

#[test]
fn all_access_forms_of_upstream_all_case() {
    let d = view(
        "dra.example.com",
        json!({
            "attributes": {
                "bool": {"bool": true}, "int": {"int": 1}, "string": {"string": "fish"},
                "version": {"version": "1.0.0"}
            },
            "capacity": {"quantity": {"value": "1Mi"}}
        }),
    );
    let expression = r#"
device.capacity["dra.example.com"].quantity.isGreaterThan(quantity("1Ki")) &&
device.attributes["dra.example.com"].bool &&
device.attributes["dra.example.com"].int > 0 &&
device.attributes["dra.example.com"].string == "fish" &&
device.attributes["dra.example.com"].version.isGreaterThan(semver("0.0.1")) &&
device.capacity["dra.example.com"]["quantity"].isGreaterThan(quantity("1Ki")) &&
device.attributes["dra.example.com"]["bool"] &&
device.attributes["dra.example.com"]["int"] > 0 &&
device.attributes["dra.example.com"]["string"] == "fish" &&
device.attributes["dra.example.com"]["version"].isGreaterThan(semver("0.0.1"))
"#;
    assert_eq!(eval(expression, &d), Ok(true));
}

#[test]
fn unknown_device_field_is_a_compile_error() {
    let d = gpu();
    for expression in [
        "device.name == \"x\"",
        "has(device.pool)",
        "device.attribute.size() > 0",
    ] {
        let field = expression.split(['.', ' ', ')']).nth(1).unwrap_or_default();
        assert_eq!(
            eval(expression, &d),
            Err(CelError::Compile(format!("undefined field '{field}'"))),
            "{expression}"
        );
    }
}

#[test]
fn unknown_domain_is_an_empty_map() {
    let d = gpu();
    assert_eq!(
        eval(r#"device.attributes["nope"].size() == 0"#, &d),
        Ok(true)
    );
    assert_eq!(
        eval(r#"has(device.attributes.nope)"#, &d),
        Ok(true),
        "upstream quirk"
    );
    assert_eq!(eval(r#"has(device.attributes["nope"].x)"#, &d), Ok(false));
    assert_eq!(eval(r#""nope" in device.attributes"#, &d), Ok(false));
    assert_eq!(eval(r#"device.attributes.size() == 3"#, &d), Ok(true));
    assert_eq!(
        eval(
            r#"device.attributes.all(d, d in ["dra.example.com", "other.example.com", "resource.kubernetes.io"])"#,
            &d
        ),
        Ok(true)
    );
    assert_eq!(eval(r#"device.capacity["nope"].size() == 0"#, &d), Ok(true));
}

#[test]
fn missing_attribute_is_a_runtime_error_with_the_hint() {
    let d = gpu();
    let err = eval(r#"device.attributes["dra.example.com"].missing == 1"#, &d);
    assert_eq!(
        err,
        Err(CelError::Runtime(
            "no such key: missing. consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has() for optional fields".into()
        ))
    );
    let err = eval(
        r#"device.capacity["dra.example.com"]["missing"].isInteger()"#,
        &d,
    );
    assert!(
        matches!(err, Err(CelError::Runtime(ref t)) if t.starts_with("no such key: missing")),
        "{err:?}"
    );
}

#[test]
fn has_and_optional_chaining_guard_missing_attributes() {
    let d = gpu();
    let dom = r#"device.attributes["dra.example.com"]"#;
    assert_eq!(eval(&format!("has({dom}.name)"), &d), Ok(true));
    assert_eq!(eval(&format!("has({dom}.missing)"), &d), Ok(false));
    assert_eq!(
        eval(&format!("!has({dom}.missing) || {dom}.missing"), &d),
        Ok(true)
    );
    assert_eq!(
        eval(&format!("{dom}.?missing.orValue(false)"), &d),
        Ok(false)
    );
    assert_eq!(eval(&format!("{dom}.?count.orValue(0) == 3"), &d), Ok(true));
    assert_eq!(
        eval(&format!(r#"{dom}[?"count"].hasValue()"#), &d),
        Ok(true)
    );
    assert_eq!(
        eval(r#"device.attributes["nope"].?x.orValue(true)"#, &d),
        Ok(true)
    );
    assert_eq!(
        eval(
            "optional.of(1).value() == 1 && !optional.none().hasValue()",
            &d
        ),
        Ok(true)
    );
}

#[test]
fn unqualified_names_get_the_driver_domain_and_split_at_the_first_slash() {
    let d = view(
        "gpu.dra.dev",
        json!({"attributes": {"a/b/c": {"int": 1}, "model": {"string": "x"}}}),
    );
    assert_eq!(eval(r#"device.attributes["a"]["b/c"] == 1"#, &d), Ok(true));
    assert_eq!(
        eval(r#"device.attributes["gpu.dra.dev"].model == "x""#, &d),
        Ok(true)
    );
    assert_eq!(eval(r#""gpu.dra.dev" in device.attributes"#, &d), Ok(true));
    let nameless = view("", json!({"attributes": {"model": {"string": "x"}}}));
    assert_eq!(
        eval(r#"device.attributes[""].model == "x""#, &nameless),
        Ok(true)
    );
}

#[test]
fn conversion_errors_fail_every_evaluation() {
    let bad_version = view(
        "gpu.dra.dev",
        json!({"attributes": {"driverVersion": {"version": "v1.0"}}}),
    );
    let err = eval("true", &bad_version);
    assert!(
        matches!(&err, Err(CelError::Runtime(t)) if t.starts_with("attribute driverVersion: parse semantic version: ")),
        "{err:?}"
    );
    let no_value = view("gpu.dra.dev", json!({"attributes": {"empty": {}}}));
    assert_eq!(
        eval("true", &no_value),
        Err(CelError::Runtime(
            "attribute empty: unsupported attribute value".into()
        ))
    );
    let bad_quantity = view(
        "gpu.dra.dev",
        json!({"capacity": {"memory": {"value": "10Mo"}}}),
    );
    assert!(
        matches!(eval("true", &bad_quantity), Err(CelError::Runtime(t)) if t.starts_with("capacity memory: "))
    );
    assert!(bad_quantity.error().is_some());
}

#[test]
fn stable_allocator_view_reads_allow_multiple_allocations_as_false() {
    let device: Device =
        serde_json::from_value(json!({"name": "d", "allowMultipleAllocations": true}))
            .expect("device JSON");
    let stable = DeviceView::new_for_stable_allocator("x", &device);
    assert_eq!(eval("device.allowMultipleAllocations", &stable), Ok(false));
    assert_eq!(
        eval(
            "device.allowMultipleAllocations",
            &DeviceView::new("x", &device)
        ),
        Ok(true)
    );
}

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

#[test]
fn names_longer_than_the_shared_ones_still_match() {
    let domain = format!("{}.example.com", "d".repeat(60));
    let d = view(
        &domain,
        json!({"attributes": {"model": {"string": "x"}}, "capacity": {"memory": {"value": "1Gi"}}}),
    );
    let expression = format!(
        r#"device.driver == "{domain}" && device.attributes["{domain}"].model == "x" && device.capacity["{domain}"].memory == quantity("1Gi")"#
    );
    assert_eq!(eval(&expression, &d), Ok(true));
}
