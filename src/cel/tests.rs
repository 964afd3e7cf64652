//! The device variable as selectors see it, in the scheduler's environment: domains, attributes and
//! capacity in every access form, unqualified names, missing entries and values that do not convert.
//! Also the helpers the other CEL test files build devices and evaluate with.

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
