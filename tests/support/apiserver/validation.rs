//! Upstream validation of the objects the double stores: name formats for every kind and the
//! `resource.k8s.io/v1` ResourceSlice rules and limits of the configured Kubernetes version, reported as
//! field errors with the real server's paths and wording (`spec.devices[3].name: Invalid value: ...`).

use std::collections::HashSet;

use serde_json::{json, Map, Value};

use super::{meta, ResourceDef, ServerVersion};

const DNS_LABEL_MAX: usize = 63;
const DNS_SUBDOMAIN_MAX: usize = 253;
const DRIVER_NAME_MAX: usize = 63;
const POOL_NAME_MAX: usize = 253;
const DEVICES_MAX: usize = 128;
const DEVICES_MAX_WITH_TAINTS_OR_COUNTERS: usize = 64;
const ATTRIBUTES_AND_CAPACITIES_MAX: usize = 32;
const ID_MAX: usize = 32;
const DOMAIN_MAX: usize = 63;
const ATTRIBUTE_VALUE_MAX: usize = 64;
const BINDING_CONDITIONS_MAX: usize = 4;
const COUNTERS_PER_SET_MAX: usize = 32;
const COUNTER_SETS_MAX: usize = 8;
const CONSUMES_COUNTERS_MAX: usize = 2;

const DNS_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const C_IDENTIFIER_MSG: &str = "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is '[A-Za-z_][A-Za-z0-9_]*')";
const LABEL_NAME_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const QUANTITY_MSG: &str =
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'";
const SEMVER_MSG: &str = "must be a string compatible with semver.org spec 2.0.0";
const ONE_PLACEMENT: &str =
    "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ErrorKind {
    Invalid,
    Required,
    Duplicate,
    TooMany,
    TooLong,
    NotSupported,
    Forbidden,
}

/// One rejected field, as `k8s.io/apimachinery/pkg/util/validation/field.Error`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct FieldError {
    kind: ErrorKind,
    field: String,
    /// The rendered bad value (strings quoted), where the message shows one.
    value: String,
    detail: String,
}

impl FieldError {
    /// The message without the field path: `Invalid value: "x": detail`.
    fn body(&self) -> String {
        let with_detail = |head: String| {
            if self.detail.is_empty() {
                head
            } else {
                format!("{head}: {}", self.detail)
            }
        };
        match self.kind {
            ErrorKind::Invalid => with_detail(format!("Invalid value: {}", self.value)),
            ErrorKind::Required => with_detail("Required value".into()),
            ErrorKind::Duplicate => format!("Duplicate value: {}", self.value),
            ErrorKind::TooMany => with_detail(format!("Too many: {}", self.value)),
            ErrorKind::TooLong => with_detail("Too long".into()),
            ErrorKind::NotSupported => with_detail(format!("Unsupported value: {}", self.value)),
            ErrorKind::Forbidden => with_detail("Forbidden".into()),
        }
    }

    fn reason(&self) -> &'static str {
        match self.kind {
            ErrorKind::Invalid => "FieldValueInvalid",
            ErrorKind::Required => "FieldValueRequired",
            ErrorKind::Duplicate => "FieldValueDuplicate",
            ErrorKind::TooMany => "FieldValueTooMany",
            ErrorKind::TooLong => "FieldValueTooLong",
            ErrorKind::NotSupported => "FieldValueNotSupported",
            ErrorKind::Forbidden => "FieldValueForbidden",
        }
    }

    /// The `details.causes` entry of the Invalid status.
    pub(super) fn cause(&self) -> Value {
        json!({"reason": self.reason(), "message": self.body(), "field": self.field})
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.body())
    }
}

/// The errors as the real server lists them in a message: one alone, several in brackets.
pub(super) fn join(errors: &[FieldError]) -> String {
    let parts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    match parts.as_slice() {
        [one] => one.clone(),
        _ => format!("[{}]", parts.join(", ")),
    }
}

fn render(value: &Value) -> String {
    value.to_string()
}

/// Collects field errors while walking an object.
#[derive(Default)]
struct Errors(Vec<FieldError>);

impl Errors {
    fn push(&mut self, kind: ErrorKind, field: &str, value: String, detail: impl Into<String>) {
        self.0.push(FieldError {
            kind,
            field: field.to_string(),
            value,
            detail: detail.into(),
        });
    }

    fn invalid(&mut self, field: &str, value: &Value, detail: impl Into<String>) {
        self.push(ErrorKind::Invalid, field, render(value), detail);
    }

    fn required(&mut self, field: &str, detail: impl Into<String>) {
        self.push(ErrorKind::Required, field, String::new(), detail);
    }

    fn too_many(&mut self, field: &str, actual: usize, max: usize) {
        self.push(
            ErrorKind::TooMany,
            field,
            actual.to_string(),
            format!("must have at most {max} items"),
        );
    }

    fn too_long(&mut self, field: &str, max: usize) {
        self.push(
            ErrorKind::TooLong,
            field,
            String::new(),
            format!("may not be more than {max} bytes"),
        );
    }

    fn forbidden(&mut self, field: &str, detail: impl Into<String>) {
        self.push(ErrorKind::Forbidden, field, String::new(), detail);
    }
}

/// Validates an object about to be stored; `old` is the stored object on update.
pub(super) fn validate(
    version: ServerVersion,
    def: &ResourceDef,
    obj: &Value,
    old: Option<&Value>,
) -> Vec<FieldError> {
    let mut errors = Errors::default();
    validate_meta(def, obj, &mut errors);
    match (def.plural, old) {
        ("resourceslices", old) => validate_slice(version, obj, old, &mut errors),
        ("resourceclaims", Some(old)) => {
            immutable(&mut errors, "spec", obj.get("spec"), old.get("spec"))
        }
        ("events", _) => validate_event(obj, &mut errors),
        _ => {}
    }
    errors.0
}

/// The rules of events.k8s.io/v1 that a reporter can get wrong (`ValidateEventCreate`).
fn validate_event(obj: &Value, errors: &mut Errors) {
    for field in [
        "reportingController",
        "reportingInstance",
        "action",
        "reason",
    ] {
        match obj.get(field).and_then(Value::as_str) {
            None | Some("") => errors.required(field, ""),
            Some(text) if text.len() > 128 => errors.too_long(field, 128),
            Some(_) => {}
        }
    }
    if obj.get("eventTime").is_none() {
        errors.required("eventTime", "");
    }
    match obj.get("type").and_then(Value::as_str) {
        Some("Normal" | "Warning") => {}
        _ => errors.invalid(
            "type",
            obj.get("type").unwrap_or(&Value::Null),
            "must be Normal or Warning",
        ),
    }
    if obj.get("note").and_then(Value::as_str).map_or(0, str::len) > 1024 {
        errors.too_long("note", 1024);
    }
}

fn validate_meta(def: &ResourceDef, obj: &Value, errors: &mut Errors) {
    match meta(obj, "name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
    {
        None => errors.required("metadata.name", "name or generateName is required"),
        Some(name) => dns_subdomain(errors, "metadata.name", name),
    }
    if def.namespaced {
        match meta(obj, "namespace")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            None => errors.required("metadata.namespace", ""),
            Some(namespace) => dns_label(errors, "metadata.namespace", namespace),
        }
    }
    // ValidateLabels, for every kind: a qualified key and a label value (a JSON string, or decoding fails).
    if let Some(labels) = meta(obj, "labels").and_then(Value::as_object) {
        for (key, value) in labels {
            label_key(errors, "metadata.labels", key);
            match value.as_str() {
                Some(text) if text.len() > DNS_LABEL_MAX => errors.invalid(
                    "metadata.labels",
                    value,
                    "must be no more than 63 characters",
                ),
                Some(text) if !is_label_value(text) => {
                    errors.invalid("metadata.labels", value, LABEL_VALUE_MSG)
                }
                _ => {}
            }
        }
    }
}

fn is_dns_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !bytes.is_empty()
        && bytes.first().is_some_and(alnum)
        && bytes.last().is_some_and(alnum)
        && bytes.iter().all(|b| alnum(b) || *b == b'-')
}

fn is_dns_subdomain(s: &str) -> bool {
    s.split('.').all(is_dns_label)
}

fn dns_label(errors: &mut Errors, field: &str, value: &str) {
    if value.len() > DNS_LABEL_MAX {
        errors.invalid(
            field,
            &json!(value),
            format!("must be no more than {DNS_LABEL_MAX} characters"),
        );
    }
    if !is_dns_label(value) {
        errors.invalid(field, &json!(value), DNS_LABEL_MSG);
    }
}

fn dns_subdomain(errors: &mut Errors, field: &str, value: &str) {
    if value.len() > DNS_SUBDOMAIN_MAX {
        errors.invalid(
            field,
            &json!(value),
            format!("must be no more than {DNS_SUBDOMAIN_MAX} characters"),
        );
    }
    if !is_dns_subdomain(value) {
        errors.invalid(field, &json!(value), DNS_SUBDOMAIN_MSG);
    }
}

fn is_c_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// An attribute or capacity name: a C identifier, optionally prefixed by a domain and `/`.
fn qualified_name(errors: &mut Errors, field: &str, name: &str) {
    let c_identifier = |errors: &mut Errors, id: &str| {
        if id.len() > ID_MAX {
            errors.too_long(field, ID_MAX);
        }
        if !is_c_identifier(id) {
            errors.invalid(field, &json!(id), C_IDENTIFIER_MSG);
        }
    };
    let parts: Vec<&str> = name.split('/').collect();
    match parts.as_slice() {
        [""] => errors.required(field, "name required"),
        [id] => c_identifier(errors, id),
        [domain, id] => {
            if domain.is_empty() {
                errors.required(field, "the domain must not be empty");
            } else {
                if domain.len() > DOMAIN_MAX {
                    errors.too_long(field, DOMAIN_MAX);
                }
                if !is_dns_subdomain(domain) {
                    errors.invalid(field, &json!(domain), DNS_SUBDOMAIN_MSG);
                }
            }
            if id.is_empty() {
                errors.required(field, "the name must not be empty");
            } else {
                c_identifier(errors, id);
            }
        }
        _ => errors.invalid(
            field,
            &json!(name),
            "must be either a C identifier or a domain followed by a slash and a C identifier",
        ),
    }
}

/// A label-style key (taint keys): optional DNS-subdomain prefix and `/`, then a name of ≤ 63 characters.
fn label_key(errors: &mut Errors, field: &str, key: &str) {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() || prefix.len() > DNS_SUBDOMAIN_MAX || !is_dns_subdomain(prefix) {
            errors.invalid(
                field,
                &json!(key),
                format!("prefix part {DNS_SUBDOMAIN_MSG}"),
            );
        }
    }
    if name.is_empty() {
        errors.invalid(field, &json!(key), "name part must be non-empty");
    } else if name.len() > DNS_LABEL_MAX {
        errors.invalid(
            field,
            &json!(key),
            "name part must be no more than 63 characters",
        );
    } else if !is_label_value(name) {
        errors.invalid(field, &json!(key), LABEL_NAME_MSG);
    }
}

/// A label value: empty, or ≤ 63 alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric.
fn is_label_value(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    s.is_empty()
        || (s.len() <= DNS_LABEL_MAX
            && s.starts_with(alnum)
            && s.ends_with(alnum)
            && s.chars().all(|c| alnum(c) || "-_.".contains(c)))
}

/// A Kubernetes quantity: a signed decimal number and an optional binary, decimal-SI or exponent suffix.
pub(super) fn is_quantity(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let number_len = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(number_len);
    let digits = number.chars().filter(char::is_ascii_digit).count();
    if digits == 0 || number.matches('.').count() > 1 {
        return false;
    }
    const SUFFIXES: [&str; 16] = [
        "", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E",
    ];
    if SUFFIXES.contains(&suffix) {
        return true;
    }
    let Some(exponent) = suffix.strip_prefix(['e', 'E']) else {
        return false;
    };
    let exponent = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
    !exponent.is_empty() && exponent.chars().all(|c| c.is_ascii_digit())
}

/// Strict semantic versioning 2.0.0: `MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD]`, no leading zeros.
pub(super) fn is_semver(s: &str) -> bool {
    let numeric = |p: &str| {
        !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) && (p == "0" || !p.starts_with('0'))
    };
    let ident = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    let (rest, build) = match s.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let core: Vec<&str> = core.split('.').collect();
    let pre_ok = pre.is_none_or(|pre| {
        pre.split('.')
            .all(|p| ident(p) && (!p.chars().all(|c| c.is_ascii_digit()) || numeric(p)))
    });
    core.len() == 3
        && core.iter().all(|p| numeric(p))
        && pre_ok
        && build.is_none_or(|b| b.split('.').all(ident))
}

fn immutable(errors: &mut Errors, field: &str, new: Option<&Value>, old: Option<&Value>) {
    if new != old {
        errors.invalid(field, new.unwrap_or(&Value::Null), "field is immutable");
    }
}

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

fn validate_slice(version: ServerVersion, obj: &Value, old: Option<&Value>, errors: &mut Errors) {
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
    let total: usize = consumptions
        .iter()
        .map(|c| as_map(c.get("counters")).map_or(0, Map::len))
        .sum();
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
        let total: usize = sets
            .iter()
            .map(|s| as_map(s.get("counters")).map_or(0, Map::len))
            .sum();
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

#[cfg(test)]
mod tests {
    use super::{is_quantity, is_semver};

    #[test]
    fn quantities() {
        for good in [
            "0", "1", "80Gi", "1.5", "-2", "+3k", "100m", "1e3", "2E-2", ".5", "7Ei",
        ] {
            assert!(is_quantity(good), "{good}");
        }
        for bad in ["", "Gi", "1.2.3", "1GB", "1e", "abc", "1 Gi", "1Gi2"] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }

    #[test]
    fn semvers() {
        for good in [
            "1.2.3",
            "0.0.0",
            "10.20.30",
            "1.0.0-alpha.1",
            "1.0.0-0.3.7",
            "1.0.0+build.5",
            "1.2.3-rc-1+x",
        ] {
            assert!(is_semver(good), "{good}");
        }
        for bad in [
            "1.2",
            "v1.2.3",
            "01.2.3",
            "1.2.3-",
            "1.2.3-01",
            "1.2.3+",
            "1.2.3.4",
            "1.2.3-a..b",
            "580.95.05",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
    }
}
