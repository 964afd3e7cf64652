//! One device as a selector sees it: converted once, up front, into CEL values (attributes and
//! capacities grouped by domain, versions parsed strictly), as upstream's `DeviceMatches` does, so that
//! evaluating many selectors against it costs no further conversion.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use cel::common::types::{CelBool, CelInt, CelList, CelMap, CelMapKey, CelString};
use cel::common::value::Val;
use k8s_openapi::api::resource::v1::{Device, DeviceAttribute};

use super::semver::Semver;
use super::values::{DeviceFields, DeviceVal, DomainMap, QuantityVal, SemverVal};
use crate::quantity::Quantity;

/// A device prepared for selector evaluation. A device that cannot be converted (a version that does
/// not parse strictly, an attribute with no value, a capacity that is not a quantity) keeps the error,
/// and every evaluation against it fails with it, as in the scheduler.
#[derive(Debug, Clone)]
pub struct DeviceView {
    pub(crate) value: Result<DeviceVal, String>,
}

impl DeviceView {
    /// Converts `device` of a ResourceSlice whose driver is `driver`; names without a domain get the
    /// driver as their domain. `allowMultipleAllocations` reads as the device sets it (false if unset).
    pub fn new(driver: &str, device: &Device) -> DeviceView {
        Self::build(
            driver,
            device,
            device.allow_multiple_allocations.unwrap_or(false),
        )
    }

    /// Like [`DeviceView::new`], but `device.allowMultipleAllocations` always reads false, as with the
    /// scheduler's stable allocator, which does not pass the field on.
    pub fn new_for_stable_allocator(driver: &str, device: &Device) -> DeviceView {
        Self::build(driver, device, false)
    }

    fn build(driver: &str, device: &Device, allow_multiple_allocations: bool) -> DeviceView {
        let value = convert(driver, device).map(|(attributes, capacity)| {
            DeviceVal(Arc::new(DeviceFields {
                driver: shared_name(driver),
                allow_multiple_allocations: CelBool::from(allow_multiple_allocations),
                attributes: DomainMap::new(attributes),
                capacity: DomainMap::new(capacity),
            }))
        });
        DeviceView { value }
    }

    /// The conversion error that every evaluation against this device reports, if any.
    pub fn error(&self) -> Option<&str> {
        self.value.as_ref().err().map(String::as_str)
    }
}

/// At most this many names are shared ([`shared_name`]), of at most this many bytes each (a
/// Kubernetes domain has at most 63, an attribute or capacity id 32).
const SHARED_NAMES: usize = 4096;
const SHARED_NAME_LEN: usize = 64;

static NAMES: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());

/// `name` (a driver, a domain, an attribute or capacity id) as a string that every device with that
/// name shares. A selector run over many devices compares each device's driver and looks up its
/// domain and id in maps, which compare the names: one shared copy of `gpu.dra.dev` or `memory` stays
/// in cache, where a copy per device would be fetched from memory for each device. Shared names are
/// kept for the life of the process, so only so many are shared (under 300 KiB); past that, names are
/// copied per device.
fn shared_name(name: &str) -> CelString<'static> {
    if name.len() <= SHARED_NAME_LEN {
        let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(shared) = names.get(name) {
            return CelString::from(*shared);
        }
        if names.len() < SHARED_NAMES {
            let shared: &'static str = Box::leak(name.into());
            names.insert(shared);
            return CelString::from(shared);
        }
    }
    CelString::from(name.to_owned())
}

type Domains<'a> = HashMap<&'a str, HashMap<CelMapKey<'static>, Box<dyn Val>>>;

/// Splits a qualified name at the first '/' into domain and id; a bare name gets `driver`.
pub(crate) fn split_name<'a>(name: &'a str, driver: &'a str) -> (&'a str, &'a str) {
    match name.split_once('/') {
        Some((domain, id)) => (domain, id),
        None => (driver, name),
    }
}

fn into_map(domains: Domains) -> CelMap<'static> {
    let outer: HashMap<CelMapKey<'static>, Box<dyn Val>> = domains
        .into_iter()
        .map(|(domain, ids)| {
            let inner: Box<dyn Val> = Box::new(CelMap::from(ids));
            (CelMapKey::String(shared_name(domain)), inner)
        })
        .collect();
    CelMap::from(outer)
}

fn convert(driver: &str, device: &Device) -> Result<(CelMap<'static>, CelMap<'static>), String> {
    let mut attributes = Domains::new();
    // Sorted so that the error reported for a device with several bad attributes is stable.
    let mut names: Vec<_> = device.attributes.iter().flatten().collect();
    names.sort_by(|a, b| a.0.cmp(b.0));
    for (name, attribute) in names {
        let value =
            attribute_value(attribute).map_err(|cause| format!("attribute {name}: {cause}"))?;
        let (domain, id) = split_name(name, driver);
        attributes
            .entry(domain)
            .or_default()
            .insert(CelMapKey::String(shared_name(id)), value);
    }
    let mut capacity = Domains::new();
    let mut names: Vec<_> = device.capacity.iter().flatten().collect();
    names.sort_by(|a, b| a.0.cmp(b.0));
    for (name, cap) in names {
        let quantity = Quantity::parse(&cap.value.0)
            .map_err(|cause| format!("capacity {name}: parse quantity: {cause}"))?;
        let (domain, id) = split_name(name, driver);
        capacity.entry(domain).or_default().insert(
            CelMapKey::String(shared_name(id)),
            Box::new(QuantityVal(quantity)),
        );
    }
    Ok((into_map(attributes), into_map(capacity)))
}

fn version(text: &str) -> Result<Box<dyn Val>, String> {
    Semver::parse(text)
        .map(|v| Box::new(SemverVal(v)) as Box<dyn Val>)
        .map_err(|cause| format!("parse semantic version: {cause}"))
}

fn list(items: Vec<Box<dyn Val>>) -> Box<dyn Val> {
    Box::new(CelList::from(items))
}

/// The CEL value of one attribute, checking the fields in upstream's order (lists first).
fn attribute_value(attribute: &DeviceAttribute) -> Result<Box<dyn Val>, String> {
    if let Some(values) = &attribute.ints {
        return Ok(list(
            values
                .iter()
                .map(|v| Box::new(CelInt::from(*v)) as Box<dyn Val>)
                .collect(),
        ));
    }
    if let Some(values) = &attribute.bools {
        return Ok(list(
            values
                .iter()
                .map(|v| Box::new(CelBool::from(*v)) as Box<dyn Val>)
                .collect(),
        ));
    }
    if let Some(values) = &attribute.strings {
        return Ok(list(
            values
                .iter()
                .map(|v| Box::new(CelString::from(v.clone())) as Box<dyn Val>)
                .collect(),
        ));
    }
    if let Some(values) = &attribute.versions {
        let items: Result<Vec<_>, _> = values.iter().map(|v| version(v)).collect();
        return Ok(list(items?));
    }
    if let Some(v) = attribute.int {
        return Ok(Box::new(CelInt::from(v)));
    }
    if let Some(v) = attribute.bool {
        return Ok(Box::new(CelBool::from(v)));
    }
    if let Some(v) = &attribute.string {
        return Ok(Box::new(CelString::from(v.clone())));
    }
    if let Some(v) = &attribute.version {
        return version(v);
    }
    Err("unsupported attribute value".to_owned())
}

#[cfg(test)]
mod tests {
    use super::shared_name;

    #[test]
    fn short_names_are_shared_and_long_ones_copied() {
        // A second string with the same text, as each device's copy of its driver is.
        let text = format!("{}.dev", "gpu.dra");
        let (a, b) = (shared_name("gpu.dra.dev"), shared_name(&text));
        assert_eq!(a.inner(), "gpu.dra.dev");
        assert!(std::ptr::eq(a.inner(), b.inner()), "one shared copy");
        let long = "x".repeat(super::SHARED_NAME_LEN + 1);
        let (a, b) = (shared_name(&long), shared_name(&long));
        assert_eq!(a.inner(), long);
        assert!(!std::ptr::eq(a.inner(), b.inner()), "a copy each");
    }
}
