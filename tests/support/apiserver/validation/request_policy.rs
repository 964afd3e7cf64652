//! A capacity's `requestPolicy` (DRAConsumableCapacity), as `validateRequestPolicy` and its helpers in
//! Kubernetes' `pkg/apis/resource/validation` check it: only on a device that allows multiple
//! allocations; `validValues` or `validRange`, not both; a `default` with either; the range's `min`,
//! `max` and `default` within the capacity and one another; `min + step` within the capacity (so a
//! capacity of 0 can carry no stepped range), and `default` and `max` on a step from `min`.

use serde_json::{json, Value};

use crate::quantity::Quantity;

use super::{ErrorKind, Errors};

fn nanos(value: Option<&Value>) -> Option<i128> {
    value
        .and_then(Value::as_str)
        .and_then(crate::quantity::parse_nanos)
}

fn text(value: Option<&Value>) -> String {
    value
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// Checks `capacity[<name>].requestPolicy` at `field` (the capacity's path).
pub(super) fn validate_request_policy(
    errors: &mut Errors,
    field: &str,
    capacity: &Value,
    allows_multiple: bool,
) {
    let Some(policy) = capacity.get("requestPolicy").filter(|p| !p.is_null()) else {
        return;
    };
    let path = format!("{field}.requestPolicy");
    if !allows_multiple {
        errors.push(
            ErrorKind::Forbidden,
            &path,
            String::new(),
            "allowMultipleAllocations must be true",
        );
        return;
    }
    let Some(max_capacity) = nanos(capacity.get("value")) else {
        return; // the value's own error is reported by the caller
    };
    let capacity_text = text(capacity.get("value"));
    let values = policy
        .get("validValues")
        .and_then(Value::as_array)
        .filter(|v| !v.is_empty());
    let range = policy.get("validRange").filter(|r| !r.is_null());
    let default = policy.get("default").filter(|d| !d.is_null());
    match (values, range) {
        (Some(_), Some(_)) => errors.push(
            ErrorKind::Forbidden,
            &path,
            String::new(),
            r#"exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time"#,
        ),
        (Some(values), None) => {
            let Some(default) = default else {
                errors.required(&format!("{path}.default"), "required when validValues is defined");
                return;
            };
            valid_values(errors, &format!("{path}.validValues"), default, values, max_capacity, &capacity_text);
        }
        (None, Some(range)) => {
            let Some(default) = default else {
                errors.required(&format!("{path}.default"), "required when validRange is defined");
                return;
            };
            valid_range(errors, &format!("{path}.validRange"), default, range, max_capacity, &capacity_text);
        }
        (None, None) => {}
    }
}

fn valid_values(
    errors: &mut Errors,
    path: &str,
    default: &Value,
    values: &[Value],
    max_capacity: i128,
    capacity_text: &str,
) {
    let parsed: Vec<Option<i128>> = values.iter().map(|v| nanos(Some(v))).collect();
    for i in 1..parsed.len() {
        if let (Some(a), Some(b)) = (parsed[i - 1], parsed[i]) {
            if a > b {
                errors.invalid(
                    &format!("{path}[{i}]"),
                    &values[i],
                    "values must be sorted in ascending order",
                );
            }
        }
    }
    let default_nanos = nanos(Some(default));
    let mut found_default = false;
    let mut seen = std::collections::HashSet::new();
    for (i, value) in parsed.iter().enumerate() {
        let Some(value) = *value else { continue };
        if value > max_capacity {
            errors.invalid(
                &format!("{path}[{i}]"),
                &values[i],
                format!("option is larger than capacity value: {capacity_text}"),
            );
        }
        if Some(value) == default_nanos {
            found_default = true;
        }
        if !seen.insert(value) {
            errors.push(
                ErrorKind::Duplicate,
                &format!("{path}[{i}]"),
                super::render(&values[i]),
                "",
            );
        }
    }
    if !found_default {
        errors.invalid(
            path,
            default,
            "default value is not valid according to the requestPolicy",
        );
    }
}

fn valid_range(
    errors: &mut Errors,
    path: &str,
    default: &Value,
    range: &Value,
    max_capacity: i128,
    capacity_text: &str,
) {
    let Some(min) = nanos(range.get("min")) else {
        errors.required(
            &format!("{path}.min"),
            "required when validRange is defined",
        );
        return;
    };
    let min_text = text(range.get("min"));
    let Some(default_value) = nanos(Some(default)) else {
        return;
    };
    if min > max_capacity {
        errors.invalid(
            &format!("{path}.min"),
            &json!(min_text),
            format!("min is larger than capacity value: {capacity_text}"),
        );
    }
    if default_value < min {
        errors.invalid(
            &format!("{path}.min"),
            default,
            format!("default is less than min: {min_text}"),
        );
    }
    let max = nanos(range.get("max"));
    if let Some(max) = max {
        let max_text = text(range.get("max"));
        if min > max {
            errors.invalid(
                &format!("{path}.max"),
                &json!(min_text),
                format!("min is larger than max: {max_text}"),
            );
        }
        if max > max_capacity {
            errors.invalid(
                &format!("{path}.max"),
                &json!(max_text),
                format!("max is larger than capacity value: {capacity_text}"),
            );
        }
        if default_value > max {
            errors.invalid(
                &format!("{path}.max"),
                default,
                format!("default is more than max: {max_text}"),
            );
        }
    }
    if let Some(step) = nanos(range.get("step")) {
        let step_text = text(range.get("step"));
        if min + step > max_capacity {
            errors.invalid(
                &format!("{path}.step"),
                &json!(step_text),
                format!(
                    "one step {} is larger than capacity value: {capacity_text}",
                    sum(&min_text, &step_text)
                ),
            );
        }
        for (value, shown) in [
            (Some(default_value), default.clone()),
            (max, range.get("max").cloned().unwrap_or(Value::Null)),
        ] {
            let Some(value) = value else { continue };
            if step != 0 && (value - min) % step != 0 {
                errors.invalid(
                    &format!("{path}.step"),
                    &shown,
                    format!(
                        "value is not a multiple of a given step ({step_text}) from ({min_text})"
                    ),
                );
            }
        }
    }
}

/// `min + step` as the API server prints the sum of two quantities.
fn sum(a: &str, b: &str) -> String {
    match (Quantity::parse(a), Quantity::parse(b)) {
        (Ok(a), Ok(b)) => a.add(&b).to_string(),
        _ => format!("{a} + {b}"),
    }
}
