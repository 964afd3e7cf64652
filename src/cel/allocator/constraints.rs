//! `matchAttribute` and `distinctAttribute` constraints of a claim: the attribute values of the devices
//! picked for the requests each constraint covers, checked as each device is added.

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute};

use super::pools::Entry;
use super::request::Alternative;

#[derive(Debug, Clone)]
pub(super) enum ConstraintKind {
    Match(String),
    Distinct(String),
}

/// A constraint with the attribute values of the devices picked for it so far.
#[derive(Debug, Clone)]
pub(super) struct ConstraintState {
    pub(super) kind: ConstraintKind,
    /// Requests (`req` or `req/sub`) it applies to; empty means all.
    pub(super) requests: Vec<String>,
    pub(super) values: Vec<AttributeValue>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum AttributeValue {
    Int(i64),
    Bool(bool),
    String(String),
    Version(String),
}

impl ConstraintState {
    fn applies(&self, alternative: &Alternative) -> bool {
        self.requests.is_empty()
            || self
                .requests
                .iter()
                .any(|name| *name == alternative.base || *name == alternative.label)
    }

    /// Records the device if it keeps the constraint satisfied.
    pub(super) fn add(&mut self, alternative: &Alternative, entry: &Entry) -> bool {
        if !self.applies(alternative) {
            return true;
        }
        let name = match &self.kind {
            ConstraintKind::Match(name) | ConstraintKind::Distinct(name) => name,
        };
        // A device without the attribute (or with a list value) cannot take part.
        let Some(value) = lookup_attribute(&entry.device, &entry.candidate.driver, name)
            .and_then(attribute_value)
        else {
            return false;
        };
        let fits = match &self.kind {
            ConstraintKind::Match(_) => self.values.first().is_none_or(|first| *first == value),
            ConstraintKind::Distinct(_) => !self.values.contains(&value),
        };
        if fits {
            self.values.push(value);
        }
        fits
    }

    /// Forgets the device most recently added for `alternative`.
    pub(super) fn remove(&mut self, alternative: &Alternative) {
        if self.applies(alternative) {
            self.values.pop();
        }
    }

    pub(super) fn describe(&self) -> String {
        let (kind, name) = match &self.kind {
            ConstraintKind::Match(name) => ("matchAttribute", name),
            ConstraintKind::Distinct(name) => ("distinctAttribute", name),
        };
        if self.requests.is_empty() {
            format!("{kind} {name}")
        } else {
            format!("{kind} {name} over {}", self.requests.join(", "))
        }
    }
}

/// A fully qualified attribute: exact key first, then the bare name when the domain is the driver's.
fn lookup_attribute<'a>(
    device: &'a Device,
    driver: &str,
    name: &str,
) -> Option<&'a DeviceAttribute> {
    let attributes = device.attributes.as_ref()?;
    if let Some(found) = attributes.get(name) {
        return Some(found);
    }
    let (domain, id) = name.split_once('/')?;
    if domain != driver {
        return None;
    }
    attributes.get(id)
}

fn attribute_value(attribute: &DeviceAttribute) -> Option<AttributeValue> {
    if let Some(value) = attribute.int {
        Some(AttributeValue::Int(value))
    } else if let Some(value) = attribute.bool {
        Some(AttributeValue::Bool(value))
    } else if let Some(value) = &attribute.string {
        Some(AttributeValue::String(value.clone()))
    } else {
        attribute.version.clone().map(AttributeValue::Version)
    }
}
