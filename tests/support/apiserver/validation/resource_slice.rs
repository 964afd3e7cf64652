//! The `resource.k8s.io/v1` ResourceSlice rules and limits of each Kubernetes version: driver, pool and
//! placement, devices with their attributes, capacities, taints and counter consumption, and shared
//! counter sets; the driver, node and pool name cannot change.

use std::collections::HashSet;

use serde_json::{json, Map, Value};

use super::formats::{
    dns_label, dns_subdomain, is_dns_subdomain, is_label_value, is_quantity, is_semver, label_key,
    qualified_name, DNS_SUBDOMAIN_MSG, LABEL_NAME_MSG, QUANTITY_MSG, SEMVER_MSG,
};
use super::request_policy::validate_request_policy;
use super::{immutable, render, ErrorKind, Errors, ServerVersion};

const DRIVER_NAME_MAX: usize = 63;
const POOL_NAME_MAX: usize = 253;
const DEVICES_MAX: usize = 128;
const DEVICES_MAX_WITH_TAINTS_OR_COUNTERS: usize = 64;
const ATTRIBUTES_AND_CAPACITIES_MAX: usize = 32;
const ATTRIBUTE_VALUE_MAX: usize = 64;
const BINDING_CONDITIONS_MAX: usize = 4;
const COUNTERS_PER_SET_MAX: usize = 32;
const COUNTER_SETS_MAX: usize = 8;
const CONSUMES_COUNTERS_MAX: usize = 2;
/// `ResourceSliceMaxDeviceCountersPerSlice` (1.34): counters consumed by all devices of one slice.
const DEVICE_COUNTERS_PER_SLICE_MAX_1_34: usize = 1024;

const ONE_PLACEMENT: &str =
    "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required";

fn as_array(value: Option<&Value>) -> &[Value] {
    value
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

fn as_map(value: Option<&Value>) -> Option<&Map<String, Value>> {
    value.and_then(Value::as_object)
}

fn is_true(value: Option<&Value>) -> bool {
    value.and_then(Value::as_bool).unwrap_or(false)
}

pub(super) fn validate_slice(
    version: ServerVersion,
    obj: &Value,
    old: Option<&Value>,
    errors: &mut Errors,
) {
    let empty = json!({});
    let spec = obj.get("spec").unwrap_or(&empty);
    validate_driver(errors, spec.get("driver"));
    validate_pool(errors, spec.get("pool").unwrap_or(&empty));
    validate_placement(errors, spec);
    let devices = as_array(spec.get("devices"));
    validate_devices(
        version,
        errors,
        devices,
        is_true(spec.get("perDeviceNodeSelection")),
    );
    validate_shared_counters(
        version,
        errors,
        as_array(spec.get("sharedCounters")),
        !devices.is_empty(),
    );
    if let Some(old) = old {
        for (field, pointer) in [
            ("spec.driver", "/spec/driver"),
            ("spec.nodeName", "/spec/nodeName"),
            ("spec.pool.name", "/spec/pool/name"),
        ] {
            immutable(errors, field, obj.pointer(pointer), old.pointer(pointer));
        }
    }
}

fn validate_driver(errors: &mut Errors, driver: Option<&Value>) {
    let driver = driver.and_then(Value::as_str).unwrap_or_default();
    if driver.is_empty() {
        errors.required("spec.driver", "");
        return;
    }
    if driver.len() > DRIVER_NAME_MAX {
        errors.too_long("spec.driver", DRIVER_NAME_MAX);
    }
    // Upstream compares the lower-cased name, so upper case letters pass.
    if !is_dns_subdomain(&driver.to_lowercase()) {
        errors.invalid("spec.driver", &json!(driver), DNS_SUBDOMAIN_MSG);
    }
}

fn validate_pool(errors: &mut Errors, pool: &Value) {
    let name = pool.get("name").and_then(Value::as_str).unwrap_or_default();
    if name.is_empty() {
        errors.required("spec.pool.name", "");
    } else {
        if name.len() > POOL_NAME_MAX {
            errors.too_long("spec.pool.name", POOL_NAME_MAX);
        }
        for part in name.split('/') {
            if !is_dns_subdomain(part) {
                errors.invalid("spec.pool.name", &json!(part), DNS_SUBDOMAIN_MSG);
            }
        }
    }
    let count = pool
        .get("resourceSliceCount")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    if count <= 0 {
        errors.invalid(
            "spec.pool.resourceSliceCount",
            &json!(count),
            "must be greater than zero",
        );
    }
    let generation = pool.get("generation").and_then(Value::as_i64).unwrap_or(0);
    if generation < 0 {
        errors.invalid(
            "spec.pool.generation",
            &json!(generation),
            "must be greater than or equal to zero",
        );
    }
}

/// Exactly one of nodeName, nodeSelector, allNodes and perDeviceNodeSelection.
fn validate_placement(errors: &mut Errors, spec: &Value) {
    let mut set = Vec::new();
    if let Some(node_name) = spec.get("nodeName").filter(|v| !v.is_null()) {
        set.push("nodeName");
        dns_subdomain(
            errors,
            "spec.nodeName",
            node_name.as_str().unwrap_or_default(),
        );
    }
    if let Some(selector) = spec.get("nodeSelector").filter(|v| !v.is_null()) {
        set.push("nodeSelector");
        let terms = as_array(selector.get("nodeSelectorTerms"));
        if terms.len() != 1 {
            errors.invalid(
                "spec.nodeSelector.nodeSelectorTerms",
                &Value::Array(terms.to_vec()),
                "must have exactly one node selector term",
            );
        }
    }
    if is_true(spec.get("allNodes")) {
        set.push("allNodes");
    }
    if is_true(spec.get("perDeviceNodeSelection")) {
        set.push("perDeviceNodeSelection");
    }
    match set.len() {
        0 => errors.required("spec", ONE_PLACEMENT),
        1 => {}
        _ => errors.invalid(
            "spec",
            &json!(set),
            format!("{ONE_PLACEMENT}, but multiple fields are set"),
        ),
    }
}

fn validate_devices(
    version: ServerVersion,
    errors: &mut Errors,
    devices: &[Value],
    per_device_placement: bool,
) {
    let advanced = devices.iter().any(|d| {
        !as_array(d.get("taints")).is_empty() || !as_array(d.get("consumesCounters")).is_empty()
    });
    let max = if version >= ServerVersion::V1_35 && advanced {
        DEVICES_MAX_WITH_TAINTS_OR_COUNTERS
    } else {
        DEVICES_MAX
    };
    if devices.len() > max {
        errors.too_many("spec.devices", devices.len(), max);
    }
    if version < ServerVersion::V1_35 {
        let consumed = counters_in(
            devices
                .iter()
                .flat_map(|d| as_array(d.get("consumesCounters"))),
        );
        if consumed > DEVICE_COUNTERS_PER_SLICE_MAX_1_34 {
            errors.invalid(
                "spec.devices",
                &json!(consumed),
                format!("the total number of counters in devices must not exceed {DEVICE_COUNTERS_PER_SLICE_MAX_1_34}"),
            );
        }
    }
    let mut names = HashSet::new();
    for (index, device) in devices.iter().enumerate() {
        let path = format!("spec.devices[{index}]");
        let name = device
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if name.is_empty() {
            errors.required(&format!("{path}.name"), "");
        } else {
            dns_label(errors, &format!("{path}.name"), name);
            if !names.insert(name) {
                errors.push(ErrorKind::Duplicate, &path, render(&json!(name)), "");
            }
        }
        validate_device(version, errors, &path, device, per_device_placement);
    }
}

fn validate_device(
    version: ServerVersion,
    errors: &mut Errors,
    path: &str,
    device: &Value,
    per_device_placement: bool,
) {
    let attributes = as_map(device.get("attributes"));
    let capacity = as_map(device.get("capacity"));
    let combined = attributes.map_or(0, Map::len) + capacity.map_or(0, Map::len);
    if combined > ATTRIBUTES_AND_CAPACITIES_MAX {
        errors.invalid(
            path,
            &json!(combined),
            format!("the total number of attributes and capacities must not exceed {ATTRIBUTES_AND_CAPACITIES_MAX}"),
        );
    }
    for (name, attribute) in attributes.into_iter().flatten() {
        let field = format!("{path}.attributes[{name}]");
        qualified_name(errors, &field, name);
        validate_attribute(version, errors, &field, attribute);
    }
    for (name, capacity) in capacity.into_iter().flatten() {
        let field = format!("{path}.capacity[{name}]");
        qualified_name(errors, &field, name);
        let value = capacity
            .get("value")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !is_quantity(value) {
            errors.invalid(&format!("{field}.value"), &json!(value), QUANTITY_MSG);
        }
        let allows_multiple = is_true(device.get("allowMultipleAllocations"));
        validate_request_policy(errors, &field, capacity, allows_multiple);
    }
    validate_taints(version, errors, path, as_array(device.get("taints")));
    validate_consumed_counters(
        version,
        errors,
        path,
        as_array(device.get("consumesCounters")),
    );
    for list in ["bindingConditions", "bindingFailureConditions"] {
        let count = as_array(device.get(list)).len();
        if count > BINDING_CONDITIONS_MAX {
            errors.too_many(&format!("{path}.{list}"), count, BINDING_CONDITIONS_MAX);
        }
    }
    validate_device_placement(errors, path, device, per_device_placement);
}

fn validate_attribute(version: ServerVersion, errors: &mut Errors, field: &str, attribute: &Value) {
    let mut kinds = vec!["int", "bool", "string", "version"];
    if version >= ServerVersion::V1_36 {
        kinds.extend(["ints", "bools", "strings", "versions"]);
    }
    let set = kinds
        .iter()
        .filter(|k| attribute.get(**k).is_some_and(|v| !v.is_null()))
        .count();
    match set {
        0 => errors.required(field, "exactly one value must be specified"),
        1 => {}
        _ => errors.invalid(field, attribute, "exactly one value must be specified"),
    }
    if let Some(text) = attribute.get("string").and_then(Value::as_str) {
        if text.len() > ATTRIBUTE_VALUE_MAX {
            errors.too_long(&format!("{field}.string"), ATTRIBUTE_VALUE_MAX);
        }
    }
    if let Some(semver) = attribute.get("version").and_then(Value::as_str) {
        if !is_semver(semver) {
            errors.invalid(&format!("{field}.version"), &json!(semver), SEMVER_MSG);
        }
        if semver.len() > ATTRIBUTE_VALUE_MAX {
            errors.too_long(&format!("{field}.version"), ATTRIBUTE_VALUE_MAX);
        }
    }
}

fn validate_taints(version: ServerVersion, errors: &mut Errors, path: &str, taints: &[Value]) {
    let max = if version >= ServerVersion::V1_35 {
        16
    } else {
        4
    };
    if taints.len() > max {
        errors.too_many(&format!("{path}.taints"), taints.len(), max);
    }
    let effects: &[&str] = if version >= ServerVersion::V1_35 {
        &["NoExecute", "NoSchedule", "None"]
    } else {
        &["NoExecute", "NoSchedule"]
    };
    for (index, taint) in taints.iter().enumerate() {
        let field = format!("{path}.taints[{index}]");
        label_key(
            errors,
            &format!("{field}.key"),
            taint.get("key").and_then(Value::as_str).unwrap_or_default(),
        );
        let value = taint
            .get("value")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !is_label_value(value) {
            errors.invalid(
                &format!("{field}.value"),
                &json!(value),
                LABEL_NAME_MSG.replacen("name part ", "", 1),
            );
        }
        match taint
            .get("effect")
            .and_then(Value::as_str)
            .unwrap_or_default()
        {
            "" => errors.required(&format!("{field}.effect"), ""),
            effect if effects.contains(&effect) => {}
            effect => {
                let supported: Vec<String> = effects.iter().map(|e| render(&json!(e))).collect();
                errors.push(
                    ErrorKind::NotSupported,
                    &format!("{field}.effect"),
                    render(&json!(effect)),
                    format!("supported values: {}", supported.join(", ")),
                );
            }
        }
    }
}

fn validate_consumed_counters(
    version: ServerVersion,
    errors: &mut Errors,
    path: &str,
    consumptions: &[Value],
) {
    let field = format!("{path}.consumesCounters");
    let total = counters_in(consumptions);
    if version >= ServerVersion::V1_35 {
        if consumptions.len() > CONSUMES_COUNTERS_MAX {
            errors.too_many(&field, consumptions.len(), CONSUMES_COUNTERS_MAX);
        }
    } else if total > COUNTERS_PER_SET_MAX {
        errors.too_many(&field, total, COUNTERS_PER_SET_MAX);
    }
    for (index, consumption) in consumptions.iter().enumerate() {
        let item = format!("{field}[{index}]");
        match consumption
            .get("counterSet")
            .and_then(Value::as_str)
            .unwrap_or_default()
        {
            "" => errors.required(&format!("{item}.counterSet"), ""),
            name => dns_label(errors, &format!("{item}.counterSet"), name),
        }
        validate_counters(
            errors,
            &format!("{item}.counters"),
            consumption.get("counters"),
        );
    }
}

/// How many counters `entries` (counter sets, or the counter consumptions of devices) name in all.
fn counters_in<'a>(entries: impl IntoIterator<Item = &'a Value>) -> usize {
    entries
        .into_iter()
        .map(|entry| as_map(entry.get("counters")).map_or(0, Map::len))
        .sum()
}

fn validate_counters(errors: &mut Errors, field: &str, counters: Option<&Value>) {
    let counters = as_map(counters);
    let count = counters.map_or(0, Map::len);
    if count > COUNTERS_PER_SET_MAX {
        errors.too_many(field, count, COUNTERS_PER_SET_MAX);
    }
    for (name, counter) in counters.into_iter().flatten() {
        dns_label(errors, &format!("{field}[{name}]"), name);
        let value = counter
            .get("value")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !is_quantity(value) {
            errors.invalid(
                &format!("{field}[{name}].value"),
                &json!(value),
                QUANTITY_MSG,
            );
        }
    }
}

fn validate_device_placement(
    errors: &mut Errors,
    path: &str,
    device: &Value,
    per_device_placement: bool,
) {
    let set = [
        device.get("nodeName").is_some_and(|v| !v.is_null()),
        device.get("nodeSelector").is_some_and(|v| !v.is_null()),
        is_true(device.get("allNodes")),
    ]
    .into_iter()
    .filter(|set| *set)
    .count();
    const ONE: &str = "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` is set to true in the ResourceSlice spec";
    match (per_device_placement, set) {
        (true, 0) => errors.required(path, ONE),
        (true, 1) | (false, 0) => {}
        (true, _) => errors.invalid(path, &json!(set), ONE),
        (false, _) => errors.invalid(
            path,
            &json!(set),
            "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
        ),
    }
}

fn validate_shared_counters(
    version: ServerVersion,
    errors: &mut Errors,
    sets: &[Value],
    has_devices: bool,
) {
    if version >= ServerVersion::V1_35 {
        if has_devices && !sets.is_empty() {
            errors.forbidden("spec.sharedCounters", "may not be set together with `devices`; publish counter sets in their own ResourceSlice of the pool");
        }
        if sets.len() > COUNTER_SETS_MAX {
            errors.too_many("spec.sharedCounters", sets.len(), COUNTER_SETS_MAX);
        }
    } else {
        let total = counters_in(sets);
        if total > COUNTERS_PER_SET_MAX {
            errors.invalid(
                "spec.sharedCounters",
                &json!(total),
                format!(
                    "the total number of shared counters must not exceed {COUNTERS_PER_SET_MAX}"
                ),
            );
        }
    }
    let mut names = HashSet::new();
    for (index, set) in sets.iter().enumerate() {
        let path = format!("spec.sharedCounters[{index}]");
        match set.get("name").and_then(Value::as_str).unwrap_or_default() {
            "" => errors.required(&format!("{path}.name"), ""),
            name => {
                dns_label(errors, &format!("{path}.name"), name);
                if !names.insert(name) {
                    errors.push(ErrorKind::Duplicate, &path, render(&json!(name)), "");
                }
            }
        }
        validate_counters(errors, &format!("{path}.counters"), set.get("counters"));
    }
}
