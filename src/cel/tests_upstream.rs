//! The cases of upstream's `cel/compile_test.go` that apply, as one table, so that a case added
//! upstream is easy to compare and copy.

use serde_json::json;

use super::tests::{eval, gpu, view};
use super::{CelError, DeviceView};

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
