//! Upstream validation of the objects the double stores: name formats for every kind and the
//! `resource.k8s.io/v1` ResourceSlice rules and limits of the configured Kubernetes version, reported as
//! field errors with the real server's paths and wording (`spec.devices[3].name: Invalid value: ...`).
//! Here: the field errors, the rules for every kind and for Events; the formats (names, labels,
//! quantities, versions) are in `formats`, the ResourceSlice rules in `resource_slice`.

mod formats;
mod request_policy;
mod resource_slice;

use serde_json::{json, Value};

use super::{meta, ResourceDef, ServerVersion};
use formats::{
    dns_label, dns_subdomain, is_label_value, label_key, DNS_LABEL_MAX, LABEL_VALUE_MSG,
};
use resource_slice::validate_slice;

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

/// What the server says to an update without `metadata.resourceVersion` of a kind that allows no
/// unconditional update.
pub(super) fn resource_version_required() -> FieldError {
    FieldError {
        kind: ErrorKind::Invalid,
        field: "metadata.resourceVersion".into(),
        value: "0".into(),
        detail: "must be specified for an update".into(),
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
        ("leases", _) => validate_lease(obj, &mut errors),
        _ => {}
    }
    errors.0
}

/// The rules of coordination.k8s.io/v1 Leases (`ValidateLeaseSpec`) that a leader elector can get
/// wrong; the coordinated election's `strategy` and `preferredHolder` are only checked to go together.
fn validate_lease(obj: &Value, errors: &mut Errors) {
    let spec = obj.get("spec").unwrap_or(&Value::Null);
    if let Some(seconds) = spec.get("leaseDurationSeconds").filter(|v| !v.is_null()) {
        if seconds.as_i64().is_none_or(|s| s <= 0) {
            errors.invalid(
                "spec.leaseDurationSeconds",
                seconds,
                "must be greater than 0",
            );
        }
    }
    if let Some(transitions) = spec.get("leaseTransitions").filter(|v| !v.is_null()) {
        if transitions.as_i64().is_none_or(|t| t < 0) {
            errors.invalid(
                "spec.leaseTransitions",
                transitions,
                "must be greater than or equal to 0",
            );
        }
    }
    let set = |field: &str| {
        spec.get(field)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
    };
    if set("preferredHolder") && !set("strategy") {
        errors.forbidden(
            "spec.preferredHolder",
            "may only be specified if `strategy` is defined",
        );
    }
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

fn immutable(errors: &mut Errors, field: &str, new: Option<&Value>, old: Option<&Value>) {
    if new != old {
        errors.invalid(field, new.unwrap_or(&Value::Null), "field is immutable");
    }
}
