//! The store behind the double: objects by key, the global resourceVersion, the history that watches
//! resume from, and the metadata the server owns. [`ApiHandle`] lets other doubles write to it
//! without HTTP, as a controller or the kubelet would.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, MutexGuard};

use serde_json::{json, Value};

use super::{hook_resource, lock, ResourceDef, Shared};

/// How many watch events the server keeps for watches that resume from a resourceVersion; an older
/// resourceVersion gets `410 Gone`, as after an etcd compaction.
const HISTORY_LIMIT: usize = 10_000;

/// Where an object lives: resource, namespace ("" when cluster-scoped), name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct ObjectKey {
    pub(super) resource: &'static str,
    pub(super) namespace: String,
    pub(super) name: String,
}

impl ObjectKey {
    pub(super) fn new(def: &ResourceDef, namespace: Option<&str>, name: &str) -> Self {
        let namespace = if def.namespaced {
            namespace.unwrap_or("default")
        } else {
            ""
        };
        ObjectKey {
            resource: def.plural,
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }

    pub(super) fn of(def: &ResourceDef, obj: &Value) -> Self {
        ObjectKey::new(
            def,
            meta_str(obj, "namespace"),
            meta_str(obj, "name").unwrap_or_default(),
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change to the store, kept for watches. `previous` lets a filtered watch turn a change that moves
/// an object into or out of its selection into ADDED or DELETED, as the real server does.
#[derive(Debug)]
pub(super) struct StoreEvent {
    pub(super) revision: u64,
    pub(super) resource: &'static str,
    pub(super) kind: EventType,
    pub(super) object: Value,
    pub(super) previous: Option<Value>,
}

/// The objects, the global resourceVersion counter and the recent history of changes.
#[derive(Default)]
pub(super) struct Store {
    pub(super) revision: u64,
    pub(super) objects: BTreeMap<ObjectKey, Value>,
    pub(super) history: VecDeque<Arc<StoreEvent>>,
    /// The newest revision whose event is no longer in `history`.
    pub(super) compacted_through: u64,
}

impl Shared {
    pub(super) fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    /// Stores `obj` (or removes it for `Deleted`) under a new resourceVersion and tells the watches.
    /// Returns the object as stored.
    pub(super) fn commit(
        &self,
        store: &mut Store,
        def: &'static ResourceDef,
        kind: EventType,
        mut obj: Value,
    ) -> Value {
        store.revision += 1;
        let revision = store.revision;
        set_meta(&mut obj, "resourceVersion", json!(revision.to_string()));
        let key = ObjectKey::of(def, &obj);
        let previous = match kind {
            EventType::Deleted => store.objects.remove(&key),
            EventType::Added | EventType::Modified => store.objects.insert(key, obj.clone()),
        };
        let event = Arc::new(StoreEvent {
            revision,
            resource: def.plural,
            kind,
            object: obj.clone(),
            previous: if kind == EventType::Modified {
                previous
            } else {
                None
            },
        });
        store.history.push_back(event.clone());
        while store.history.len() > HISTORY_LIMIT {
            if let Some(dropped) = store.history.pop_front() {
                store.compacted_through = dropped.revision;
            }
        }
        // Nobody watching is fine: the event stays in the history.
        let _ = self.events.send(event);
        obj
    }
}

pub(super) fn meta<'a>(obj: &'a Value, field: &str) -> Option<&'a Value> {
    obj.get("metadata")?.get(field)
}

/// A non-empty string field of `metadata`.
pub(super) fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    meta(obj, field)?.as_str().filter(|s| !s.is_empty())
}

/// Sets a `metadata` field, creating `metadata` if the object has none. Non-objects are left alone
/// (request bodies are checked to be objects before this is called).
pub(super) fn set_meta(obj: &mut Value, field: &str, value: Value) {
    if let Some(map) = obj.as_object_mut() {
        let metadata = map.entry("metadata").or_insert_with(|| json!({}));
        if !metadata.is_object() {
            *metadata = json!({});
        }
        if let Some(metadata) = metadata.as_object_mut() {
            metadata.insert(field.to_string(), value);
        }
    }
}

pub(super) fn remove_meta(obj: &mut Value, field: &str) {
    if let Some(metadata) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata.remove(field);
    }
}

pub(super) fn fill_type_meta(def: &ResourceDef, obj: &mut Value) {
    if let Some(map) = obj.as_object_mut() {
        map.insert("apiVersion".into(), json!(def.api_version()));
        map.insert("kind".into(), json!(def.kind));
    }
}

/// Gives a new object the fields the server owns: uid, creationTimestamp, generation.
pub(super) fn fill_system_meta(obj: &mut Value) {
    if meta_str(obj, "uid").is_none() {
        set_meta(obj, "uid", json!(uuid::Uuid::new_v4().to_string()));
    }
    if meta_str(obj, "creationTimestamp").is_none() {
        set_meta(obj, "creationTimestamp", json!(now_timestamp()));
    }
    if meta(obj, "generation").and_then(Value::as_i64).is_none() {
        set_meta(obj, "generation", json!(1));
    }
}

/// The stored objects of a running [`ApiServer`](super::ApiServer), shared with the doubles of other
/// components.
#[derive(Clone)]
pub struct ApiHandle {
    pub(super) shared: Arc<Shared>,
}

impl ApiHandle {
    /// Creates or replaces an object without validation, as a controller or the kubelet would have written
    /// it. Fills kind, apiVersion, uid, creationTimestamp and generation where missing; bumps the
    /// resourceVersion and notifies watches. Returns the stored object.
    pub fn insert(&self, resource: &str, mut obj: Value) -> Value {
        let def = hook_resource(resource);
        fill_type_meta(def, &mut obj);
        if def.namespaced && meta_str(&obj, "namespace").is_none() {
            set_meta(&mut obj, "namespace", json!("default"));
        }
        let mut store = self.shared.store();
        let existing = store.objects.get(&ObjectKey::of(def, &obj)).cloned();
        let kind = match &existing {
            Some(old) => {
                for field in ["uid", "creationTimestamp"] {
                    if let (None, Some(value)) = (meta(&obj, field), meta(old, field)) {
                        set_meta(&mut obj, field, value.clone());
                    }
                }
                EventType::Modified
            }
            None => EventType::Added,
        };
        fill_system_meta(&mut obj);
        self.shared.commit(&mut store, def, kind, obj)
    }

    /// One stored object.
    pub fn get(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let key = ObjectKey::new(hook_resource(resource), namespace, name);
        self.shared.store().objects.get(&key).cloned()
    }

    /// All stored objects of a resource, in namespace/name order.
    pub fn list(&self, resource: &str) -> Vec<Value> {
        let def = hook_resource(resource);
        let store = self.shared.store();
        store
            .objects
            .iter()
            .filter(|(key, _)| key.resource == def.plural)
            .map(|(_, obj)| obj.clone())
            .collect()
    }

    /// Deletes an object at once (finalizers ignored), notifying watches. Returns what was stored.
    pub fn remove(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let def = hook_resource(resource);
        let mut store = self.shared.store();
        let obj = store
            .objects
            .get(&ObjectKey::new(def, namespace, name))?
            .clone();
        Some(self.shared.commit(&mut store, def, EventType::Deleted, obj))
    }
}

/// The current time as Kubernetes writes a `metav1.Time`: RFC 3339 in UTC, whole seconds.
pub(super) fn now_timestamp() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}
