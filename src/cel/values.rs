//! The CEL value types of the DRA environment that the `cel` crate lacks: `kubernetes.Quantity`,
//! `kubernetes.Semver`, the `device` object and the domain maps that answer an unknown domain with an
//! empty map (upstream's `mapper` with a default value in `cel/compile.go`).

use std::any::Any;
use std::sync::Arc;

use cel::common::traits::{Container, Indexer, Iterable, Iterator as CelIterator, Sizer};
use cel::common::types::{CelMap, Type, MAP_TYPE};
use cel::common::value::{CowVal, StaticVal, Val};
use cel::ExecutionError;

use super::semver::Semver;
use crate::quantity::Quantity;

/// The CEL type of quantities, named as upstream names it.
pub static QUANTITY_TYPE: Type = Type::new_unspecified_type("kubernetes.Quantity");
/// The CEL type of semantic versions.
pub static SEMVER_TYPE: Type = Type::new_unspecified_type("kubernetes.Semver");
/// The CEL type of the `device` variable.
pub static DEVICE_TYPE: Type = Type::new_struct_type("kubernetes.DRADevice");

/// A `kubernetes.Quantity` value; `==` compares by value, as upstream's `Equal` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantityVal(pub Quantity);

impl Val for QuantityVal {
    fn get_type(&self) -> &Type {
        &QUANTITY_TYPE
    }
    fn cel_type() -> &'static Type {
        &QUANTITY_TYPE
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other.downcast_ref::<QuantityVal>() == Some(self)
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for QuantityVal {}

/// A `kubernetes.Semver` value; `==` ignores build metadata, as blang's `EQ` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SemverVal(pub Semver);

impl Val for SemverVal {
    fn get_type(&self) -> &Type {
        &SEMVER_TYPE
    }
    fn cel_type() -> &'static Type {
        &SEMVER_TYPE
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other.downcast_ref::<SemverVal>() == Some(self)
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for SemverVal {}

/// `device.attributes` / `device.capacity`: a map of domains in which every key is "found", an unknown
/// domain reading as an empty map. `in`, size and macros see only the domains that exist.
///
/// It lies inside the device's own allocation rather than behind a pointer of its own: a selector run
/// over many devices then fetches one allocation less from memory per device. Cloning copies the maps,
/// which only an expression that builds a value out of the whole map does.
#[derive(Debug, Clone)]
pub struct DomainMap {
    domains: CelMap<'static>,
    empty: CelMap<'static>,
}

impl DomainMap {
    pub fn new(domains: CelMap<'static>) -> DomainMap {
        DomainMap {
            domains,
            empty: CelMap::default(),
        }
    }
}

impl Val for DomainMap {
    fn get_type(&self) -> &Type {
        &MAP_TYPE
    }
    fn cel_type() -> &'static Type {
        &MAP_TYPE
    }
    fn as_container(&self) -> Option<&dyn Container> {
        Some(self)
    }
    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn as_iterable<'b, 'v>(&'b self) -> Option<&'b (dyn Iterable + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn as_sizer(&self) -> Option<&dyn Sizer> {
        Some(&self.domains)
    }
    fn equals(&self, other: &dyn Val) -> bool {
        match other.downcast_ref::<DomainMap>() {
            Some(other) => self.domains.equals(&other.domains),
            None => self.domains.equals(other),
        }
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for DomainMap {}

impl Container for DomainMap {
    fn contains(&self, value: &dyn Val) -> Result<bool, ExecutionError> {
        self.domains.contains(value)
    }
}

impl Indexer for DomainMap {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        match self.domains.get(idx) {
            Err(ExecutionError::NoSuchKey(_)) => Ok(CowVal::Borrowed(&self.empty)),
            other => other,
        }
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

impl Iterable for DomainMap {
    fn iter<'b, 'v>(&'b self) -> Box<dyn CelIterator<'b, 'v> + 'b>
    where
        Self: 'v,
    {
        self.domains.iter()
    }
}

/// The `device` variable: an object with exactly the fields upstream declares.
#[derive(Debug, Clone)]
pub struct DeviceVal(pub(crate) Arc<DeviceFields>);

#[derive(Debug)]
pub(crate) struct DeviceFields {
    pub driver: cel::common::types::CelString<'static>,
    pub allow_multiple_allocations: cel::common::types::CelBool,
    pub attributes: DomainMap,
    pub capacity: DomainMap,
}

impl Val for DeviceVal {
    fn get_type(&self) -> &Type {
        &DEVICE_TYPE
    }
    fn cel_type() -> &'static Type {
        &DEVICE_TYPE
    }
    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<DeviceVal>()
            .is_some_and(|other| Arc::ptr_eq(&self.0, &other.0))
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for DeviceVal {}

impl Indexer for DeviceVal {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let field = idx
            .downcast_ref::<cel::common::types::CelString>()
            .map(|s| s.inner());
        let fields = &*self.0;
        match field {
            Some("driver") => Ok(CowVal::Borrowed(&fields.driver)),
            Some("attributes") => Ok(CowVal::Borrowed(&fields.attributes)),
            Some("capacity") => Ok(CowVal::Borrowed(&fields.capacity)),
            Some("allowMultipleAllocations") => {
                Ok(CowVal::Borrowed(&fields.allow_multiple_allocations))
            }
            Some(other) => Err(ExecutionError::no_such_key(other)),
            None => Err(ExecutionError::no_such_overload(
                "_[_]",
                vec![
                    DEVICE_TYPE.name().to_owned(),
                    idx.get_type().name().to_owned(),
                ],
            )),
        }
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}
