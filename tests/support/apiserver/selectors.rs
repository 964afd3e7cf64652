//! Field and label selectors of list and watch requests, with the fields each resource supports; an
//! unsupported field is an error, as on the real server, so that a selector typo fails in tests too.

use std::collections::HashMap;

use serde_json::Value;

use super::{meta_str, ResourceDef};

/// Which objects a list or watch returns: namespace, field selector, label selector.
#[derive(Debug, Default)]
pub(super) struct Selection {
    namespace: Option<String>,
    fields: Vec<FieldRequirement>,
    labels: Vec<LabelRequirement>,
    def: Option<&'static ResourceDef>,
}

#[derive(Debug)]
struct FieldRequirement {
    field: String,
    value: String,
    equal: bool,
}

#[derive(Debug)]
enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

impl Selection {
    /// Reads `fieldSelector` and `labelSelector`; the error is the message of a 400 BadRequest.
    pub(super) fn parse(
        def: &'static ResourceDef,
        namespace: Option<String>,
        query: &HashMap<String, String>,
    ) -> Result<Selection, String> {
        let fields = match query.get("fieldSelector") {
            Some(selector) => parse_fields(def, selector)?,
            None => Vec::new(),
        };
        let labels = match query.get("labelSelector") {
            Some(selector) => parse_labels(selector)?,
            None => Vec::new(),
        };
        Ok(Selection {
            namespace,
            fields,
            labels,
            def: Some(def),
        })
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        if let Some(namespace) = &self.namespace {
            if meta_str(obj, "namespace") != Some(namespace.as_str()) {
                return false;
            }
        }
        let Some(def) = self.def else { return true };
        let fields_match = self.fields.iter().all(|req| {
            let actual = field_value(def, obj, &req.field).unwrap_or_default();
            (actual == req.value) == req.equal
        });
        fields_match && self.labels.iter().all(|req| req.matches(obj))
    }
}

/// The value of a selectable field (`""` when unset), or `None` when the resource does not support it.
fn field_value(def: &ResourceDef, obj: &Value, field: &str) -> Option<String> {
    let text = |pointer: &str| {
        obj.pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    match (def.plural, field) {
        (_, "metadata.name") => Some(text("/metadata/name")),
        (_, "metadata.namespace") => Some(text("/metadata/namespace")),
        ("resourceslices", "spec.nodeName") => Some(text("/spec/nodeName")),
        ("resourceslices", "spec.driver") => Some(text("/spec/driver")),
        // The pod fields the real server indexes for selectors that the plugin and kubelet use.
        ("pods", "spec.nodeName") => Some(text("/spec/nodeName")),
        ("pods", "status.phase") => Some(text("/status/phase")),
        ("resourceslices", "spec.pool.name") => Some(text("/spec/pool/name")),
        ("nodes", "spec.unschedulable") => Some(
            obj.pointer("/spec/unschedulable")
                .and_then(Value::as_bool)
                .unwrap_or(false)
                .to_string(),
        ),
        _ => None,
    }
}

fn parse_fields(def: &ResourceDef, selector: &str) -> Result<Vec<FieldRequirement>, String> {
    let mut requirements = Vec::new();
    for term in selector.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (field, value, equal) = if let Some((f, v)) = term.split_once("!=") {
            (f, v, false)
        } else if let Some((f, v)) = term.split_once("==") {
            (f, v, true)
        } else if let Some((f, v)) = term.split_once('=') {
            (f, v, true)
        } else {
            return Err(format!(
                "invalid selector: '{selector}'; can't understand '{term}'"
            ));
        };
        let field = field.trim();
        if field_value(def, &Value::Null, field).is_none() {
            return Err(format!("field label not supported: {field}"));
        }
        requirements.push(FieldRequirement {
            field: field.to_string(),
            value: value.trim().to_string(),
            equal,
        });
    }
    Ok(requirements)
}

/// Splits on commas outside parentheses, so that `env in (a,b),tier` gives two terms.
fn split_terms(selector: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_labels(selector: &str) -> Result<Vec<LabelRequirement>, String> {
    split_terms(selector)
        .into_iter()
        .map(parse_label_term)
        .collect()
}

fn parse_label_term(term: &str) -> Result<LabelRequirement, String> {
    let invalid =
        || format!("unable to parse requirement: found '{term}', expected a label selector term");
    let set = |key: &str, rest: &str| -> Result<(String, Vec<String>), String> {
        let values = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .ok_or_else(invalid)?;
        let values = values
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect();
        Ok((key.trim().to_string(), values))
    };
    if let Some(key) = term.strip_prefix('!') {
        return Ok(LabelRequirement::NotExists(key.trim().to_string()));
    }
    if let Some((key, rest)) = term.split_once(" notin ") {
        let (key, values) = set(key, rest)?;
        return Ok(LabelRequirement::NotIn(key, values));
    }
    if let Some((key, rest)) = term.split_once(" in ") {
        let (key, values) = set(key, rest)?;
        return Ok(LabelRequirement::In(key, values));
    }
    let pair = |k: &str, v: &str| (k.trim().to_string(), v.trim().to_string());
    if let Some((k, v)) = term.split_once("!=") {
        let (k, v) = pair(k, v);
        return Ok(LabelRequirement::NotEquals(k, v));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        let (k, v) = pair(k, v);
        return Ok(LabelRequirement::Equals(k, v));
    }
    if term.contains(|c: char| c.is_whitespace() || "()<>".contains(c)) {
        return Err(invalid());
    }
    Ok(LabelRequirement::Exists(term.to_string()))
}

impl LabelRequirement {
    fn matches(&self, obj: &Value) -> bool {
        let label = |key: &str| {
            obj.pointer("/metadata/labels")
                .and_then(|l| l.get(key))
                .and_then(Value::as_str)
        };
        match self {
            LabelRequirement::Equals(k, v) => label(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => label(k) != Some(v.as_str()),
            LabelRequirement::In(k, values) => {
                label(k).is_some_and(|l| values.iter().any(|v| v == l))
            }
            LabelRequirement::NotIn(k, values) => {
                label(k).is_none_or(|l| values.iter().all(|v| v != l))
            }
            LabelRequirement::Exists(k) => label(k).is_some(),
            LabelRequirement::NotExists(k) => label(k).is_none(),
        }
    }
}
