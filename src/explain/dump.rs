//! Reading a dump straight into typed objects. A cluster's dump is large (tens of MiB for a thousand
//! GPU nodes) and parsing it dominates `explain --from`, so two shortcuts apply to what kubectl writes:
//! - a `List` is cut into its items, each parsed on its own ([`list_items`]): the YAML parser holds all
//!   events of a document in memory, so one huge document costs far more memory (and page faults)
//!   than many small ones;
//! - objects are not built as generic values first: kubectl writes `apiVersion` and `kind` as an
//!   object's first two keys (its keys are sorted), so the kind is known before the rest, which then
//!   goes straight into the kind's type.
//!
//! Anything else (several documents, keys in another order, as people write them) takes the slower
//! generic route, with the same result.

use std::fmt;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::DynamicObject;
use serde::de::value::MapAccessDeserializer;
use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, IgnoredAny, IntoDeserializer, MapAccess,
    SeqAccess, Visitor,
};
use serde::Deserialize;
use serde_json::Value;

use crate::domains::api::{ComputeDomainPlacement, DomainGroup, DomainObject, KIND as DOMAIN_KIND};

const RESOURCE_API: &str = "resource.k8s.io/v1";

/// One object of a dump, by kind; `Other` keeps the kind of one `explain` does not read.
#[derive(Debug)]
pub(super) enum Object {
    Pod(Box<Pod>),
    Node(Box<Node>),
    Claim(Box<ResourceClaim>),
    Template(Box<ResourceClaimTemplate>),
    Class(Box<DeviceClass>),
    Slice(Box<ResourceSlice>),
    /// A ComputeDomain of either group (`gpu.dra.dev/v1alpha1`, `resource.nvidia.com/v1beta1`).
    Domain(Box<DomainObject>),
    /// Where the controller placed a ComputeDomain (`gpu.dra.dev/v1alpha1`).
    Placement(Box<ComputeDomainPlacement>),
    Other(String),
}

/// The objects of one YAML document or JSON text: a List's items, an array's, or the object itself.
pub(super) struct Document(pub(super) Vec<Object>);

impl<'de> Deserialize<'de> for Document {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Document, D::Error> {
        deserializer.deserialize_any(DocumentVisitor)
    }
}

struct DocumentVisitor;

impl<'de> Visitor<'de> for DocumentVisitor {
    type Value = Document;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Kubernetes object or a List of them")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Document, E> {
        Ok(Document(Vec::new()))
    }

    fn visit_none<E: de::Error>(self) -> Result<Document, E> {
        Ok(Document(Vec::new()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Document, A::Error> {
        Items.visit_seq(seq).map(Document)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Document, A::Error> {
        object_or_list(map, true).map(Document)
    }
}

/// The items of a dump in kubectl's `-o yaml` form: one document, a top-level `items:` whose entries
/// start with `- ` at the first column and continue on indented (or empty) lines, and a top-level
/// `kind: ...List`. Each item comes with its first line (1-based) and its text, itself a YAML sequence
/// of one entry. `None` when the text does not have that form.
pub(super) fn list_items(text: &str) -> Option<Vec<(usize, &str)>> {
    let (mut items, mut current) = (Vec::new(), None);
    let (mut in_items, mut list_kind, mut offset) = (false, false, 0);
    for (index, line) in text.split_inclusive('\n').enumerate() {
        let start = offset;
        offset += line.len();
        let body = line.trim_end_matches(['\n', '\r']);
        if body.is_empty() || body.starts_with(' ') {
            continue;
        }
        if let Some((first, from)) = current.take() {
            items.push((first, &text[from..start]));
        }
        if body.starts_with("- ") {
            if !in_items {
                return None;
            }
            current = Some((index + 1, start));
            continue;
        }
        // A top-level key; anything else (documents, comments, flow or block forms) is not kubectl's.
        let key = body.split_once(':')?.0;
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric()) {
            return None;
        }
        in_items = body == "items:";
        if key == "kind" {
            list_kind = body.ends_with("List");
        }
    }
    if let Some((first, from)) = current {
        items.push((first, &text[from..]));
    }
    list_kind.then_some(items)
}

/// A List's `items` (errors name the item: serde_yaml as `items[3]`, both parsers by line).
pub(super) struct Items;

impl<'de> DeserializeSeed<'de> for Items {
    type Value = Vec<Object>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<Object>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Items {
    type Value = Vec<Object>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of Kubernetes objects")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Vec<Object>, E> {
        Ok(Vec::new())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Object>, A::Error> {
        let mut objects = Vec::new();
        while let Some(object) = seq.next_element_seed(Item(objects.len() + 1))? {
            objects.push(object);
        }
        Ok(objects)
    }
}

struct Item(usize);

impl<'de> DeserializeSeed<'de> for Item {
    type Value = Object;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Object, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Item {
    type Value = Object;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "item {}: a Kubernetes object", self.0)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object, A::Error> {
        let item = self.0;
        let mut objects = object_or_list(map, false)?;
        objects
            .pop()
            .ok_or_else(|| de::Error::custom(format!("item {item}: not an object")))
    }
}

/// An object whose first keys are `apiVersion` and `kind` goes straight into its type; a List's
/// `items` (which kubectl writes before `kind`) are read item by item; anything else is read
/// generically first.
fn object_or_list<'de, A: MapAccess<'de>>(mut map: A, top: bool) -> Result<Vec<Object>, A::Error> {
    let mut read: Vec<(String, Value)> = Vec::new();
    let first: Option<String> = map.next_key()?;
    let Some(first) = first else {
        return Err(de::Error::custom(
            "kind missing: expected a Kubernetes object",
        ));
    };
    if first == "items" && top {
        return list(map, read);
    }
    if first != "apiVersion" {
        return generic(map, read, first, top);
    }
    let api_version: String = map.next_value()?;
    read.push((first, Value::String(api_version.clone())));
    let second: Option<String> = map.next_key()?;
    match second {
        None => generic_done(read, top),
        Some(key) if key == "items" && top => list(map, read),
        Some(key) if key == "kind" => {
            let kind: String = map.next_value()?;
            typed(map, api_version, kind).map(|o| vec![o])
        }
        Some(key) => generic(map, read, key, top),
    }
}

/// The rest of a List after its `items`: `kind` must say List.
fn list<'de, A: MapAccess<'de>>(
    mut map: A,
    read: Vec<(String, Value)>,
) -> Result<Vec<Object>, A::Error> {
    let items = map.next_value_seed(Items)?;
    let mut kind = read
        .iter()
        .find(|(k, _)| k == "kind")
        .and_then(|(_, v)| v.as_str().map(str::to_string));
    while let Some(key) = map.next_key::<String>()? {
        if key == "kind" {
            kind = Some(map.next_value()?);
        } else {
            map.next_value::<IgnoredAny>()?;
        }
    }
    match kind {
        Some(kind) if kind.ends_with("List") => Ok(items),
        other => Err(de::Error::custom(format!(
            "items in an object of kind {}, not a List",
            other.as_deref().unwrap_or("(none)")
        ))),
    }
}

/// Reads the rest of the object as a generic value (`key`'s value is next), then types it.
fn generic<'de, A: MapAccess<'de>>(
    mut map: A,
    mut read: Vec<(String, Value)>,
    key: String,
    top: bool,
) -> Result<Vec<Object>, A::Error> {
    let value: Value = map.next_value()?;
    read.push((key, value));
    while let Some((key, value)) = map.next_entry::<String, Value>()? {
        read.push((key, value));
    }
    generic_done(read, top)
}

fn generic_done<E: de::Error>(read: Vec<(String, Value)>, top: bool) -> Result<Vec<Object>, E> {
    let value = Value::Object(read.into_iter().collect());
    let is_list = value
        .get("kind")
        .and_then(Value::as_str)
        .is_some_and(|kind| kind.ends_with("List"));
    if top && is_list {
        let items = match value.get("items") {
            Some(Value::Array(items)) => items.clone(),
            Some(Value::Null) | None => Vec::new(),
            Some(_) => return Err(E::custom("items of the List is not an array")),
        };
        return items
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                from_value(item).map_err(|e| E::custom(format!("item {}: {e}", i + 1)))
            })
            .collect();
    }
    from_value(value).map(|o| vec![o]).map_err(E::custom)
}

/// One object given as a generic value.
pub(super) fn from_value(value: Value) -> Result<Object, String> {
    let kind = value
        .get("kind")
        .and_then(Value::as_str)
        .ok_or("kind missing: expected a Kubernetes object")?
        .to_string();
    let api_version = value
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    typed(Whole(value), api_version, kind).map_err(|e: serde_json::Error| e.to_string())
}

/// The object of `kind` from what is left of `from`, its `apiVersion` checked.
fn typed<'de, F, E>(from: F, api_version: String, kind: String) -> Result<Object, E>
where
    F: Rest<'de, E>,
    E: de::Error,
{
    if kind == DOMAIN_KIND {
        return domain(from, api_version, kind);
    }
    if kind == "ComputeDomainPlacement" && api_version == "gpu.dra.dev/v1alpha1" {
        return from
            .read(&api_version, &kind)
            .map(Object::Placement)
            .map_err(|e| E::custom(format!("invalid {kind}: {e}")));
    }
    let expected = match kind.as_str() {
        "Pod" | "Node" => "v1",
        "ResourceClaim" | "ResourceClaimTemplate" | "DeviceClass" | "ResourceSlice" => RESOURCE_API,
        _ => {
            from.skip()?;
            return Ok(Object::Other(kind));
        }
    };
    if api_version != expected {
        let hint = if expected == RESOURCE_API {
            "only resource.k8s.io/v1 is supported (Kubernetes 1.34 and later serve it)".to_string()
        } else {
            format!("expected {expected}")
        };
        return Err(E::custom(format!(
            "{kind} apiVersion {api_version:?}: {hint}"
        )));
    }
    let invalid = |e: E| E::custom(format!("invalid {kind}: {e}"));
    Ok(match kind.as_str() {
        "Pod" => Object::Pod(from.read(&api_version, &kind).map_err(invalid)?),
        "Node" => Object::Node(from.read(&api_version, &kind).map_err(invalid)?),
        "ResourceClaim" => Object::Claim(from.read(&api_version, &kind).map_err(invalid)?),
        "ResourceClaimTemplate" => {
            Object::Template(from.read(&api_version, &kind).map_err(invalid)?)
        }
        "DeviceClass" => Object::Class(from.read(&api_version, &kind).map_err(invalid)?),
        _ => {
            let slice: Box<ResourceSlice> = from.read(&api_version, &kind).map_err(invalid)?;
            // k8s-openapi fills missing required fields with defaults; these would mislead.
            if slice.spec.driver.is_empty() || slice.spec.pool.name.is_empty() {
                return Err(E::custom(
                    "ResourceSlice without spec.driver or spec.pool.name",
                ));
            }
            Object::Slice(slice)
        }
    })
}

/// A ComputeDomain of one of the groups the driver serves; one of another group is not ours to read
/// (counted among the ignored kinds, under its apiVersion).
fn domain<'de, F, E>(from: F, api_version: String, kind: String) -> Result<Object, E>
where
    F: Rest<'de, E>,
    E: de::Error,
{
    let group = [DomainGroup::Ours, DomainGroup::Nvidia]
        .into_iter()
        .find(|group| group.api_resource().api_version == api_version);
    let Some(group) = group else {
        from.skip()?;
        return Ok(Object::Other(format!("{kind} ({api_version})")));
    };
    let object: Box<DynamicObject> = from
        .read(&api_version, &kind)
        .map_err(|e| E::custom(format!("invalid {kind}: {e}")))?;
    DomainObject::from_dynamic(group, &object)
        .map(|domain| Object::Domain(Box::new(domain)))
        .map_err(E::custom)
}

/// What an object is read from once its kind is known: the rest of a map, or a whole value.
trait Rest<'de, E> {
    fn read<T: DeserializeOwned>(self, api_version: &str, kind: &str) -> Result<Box<T>, E>;
    fn skip(self) -> Result<(), E>;
}

impl<'de, A: MapAccess<'de>> Rest<'de, A::Error> for A {
    fn read<T: DeserializeOwned>(self, api_version: &str, kind: &str) -> Result<Box<T>, A::Error> {
        let map = Prefixed {
            read: vec![
                ("apiVersion", api_version.to_string()),
                ("kind", kind.to_string()),
            ]
            .into_iter(),
            value: None,
            rest: self,
        };
        T::deserialize(MapAccessDeserializer::new(map)).map(Box::new)
    }

    fn skip(mut self) -> Result<(), A::Error> {
        while self.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

/// An object read generically first.
struct Whole(Value);

impl<'de> Rest<'de, serde_json::Error> for Whole {
    fn read<T: DeserializeOwned>(self, _: &str, _: &str) -> Result<Box<T>, serde_json::Error> {
        serde_json::from_value(self.0).map(Box::new)
    }

    fn skip(self) -> Result<(), serde_json::Error> {
        Ok(())
    }
}

/// A map whose first entries (`apiVersion`, `kind`) were read already: they are handed out again
/// before the rest.
struct Prefixed<A> {
    read: std::vec::IntoIter<(&'static str, String)>,
    value: Option<String>,
    rest: A,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Prefixed<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        if let Some((key, value)) = self.read.next() {
            self.value = Some(value);
            return seed
                .deserialize(IntoDeserializer::<A::Error>::into_deserializer(key))
                .map(Some);
        }
        self.rest.next_key_seed(seed)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        match self.value.take() {
            Some(value) => seed.deserialize(IntoDeserializer::<A::Error>::into_deserializer(value)),
            None => self.rest.next_value_seed(seed),
        }
    }
}
