//! Kubernetes objects from files for `gpu-dra selectors`: YAML or JSON, one or more documents, a `List`
//! (or a bare array, as `gpu-dra devices -o json` prints) of items. Errors name the file, the document
//! (and item) and what was wrong, so a user can find the line to fix.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate, ResourceSlice,
};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

use super::allocator::{Candidate, InUse};
use crate::quantity::Quantity;

const API_VERSION: &str = "resource.k8s.io/v1";

#[derive(Debug, Error)]
pub enum InputError {
    // The cause is in the message, not a `source`, so a printed chain does not repeat it.
    #[error("{}: cannot read: {error}", .file.display())]
    Read {
        file: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: {at}: {message}", .file.display())]
    Invalid {
        file: PathBuf,
        at: Position,
        message: String,
    },
    #[error("{}: no {expected} in the file", .file.display())]
    Empty { file: PathBuf, expected: String },
}

/// Where in a file an object sits: the document (1-based) and, in a List or array, the item (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub document: usize,
    pub item: Option<usize>,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "document {}", self.document)?;
        if let Some(item) = self.item {
            write!(f, ", item {item}")?;
        }
        Ok(())
    }
}

/// A ResourceClaim (or the claim a ResourceClaimTemplate stamps out), named `namespace/name`.
#[derive(Debug, Clone)]
pub struct NamedClaim {
    pub name: String,
    pub spec: ResourceClaimSpec,
}

/// Every object in the file, with its position; empty documents are skipped and Lists flattened.
pub fn load_objects(path: &Path) -> Result<Vec<(Position, Value)>, InputError> {
    let text = std::fs::read_to_string(path).map_err(|error| InputError::Read {
        file: path.to_path_buf(),
        error,
    })?;
    parse_objects(path, &text)
}

fn parse_objects(path: &Path, text: &str) -> Result<Vec<(Position, Value)>, InputError> {
    let mut objects = Vec::new();
    // YAML is a superset of JSON, so one parser reads both.
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let at = Position {
            document: index + 1,
            item: None,
        };
        let value = Value::deserialize(document).map_err(|e| InputError::Invalid {
            file: path.to_path_buf(),
            at,
            message: format!("not valid YAML or JSON: {e}"),
        })?;
        let items = match value {
            Value::Null => continue,
            Value::Array(items) => items,
            Value::Object(ref map)
                if map
                    .get("kind")
                    .and_then(Value::as_str)
                    .is_some_and(|kind| kind.ends_with("List")) =>
            {
                match map.get("items") {
                    Some(Value::Array(items)) => items.clone(),
                    Some(Value::Null) | None => Vec::new(),
                    Some(_) => {
                        return Err(InputError::Invalid {
                            file: path.to_path_buf(),
                            at,
                            message: "items of the List is not an array".into(),
                        })
                    }
                }
            }
            other => {
                objects.push((at, other));
                continue;
            }
        };
        for (item, value) in items.into_iter().enumerate() {
            let at = Position {
                document: index + 1,
                item: Some(item + 1),
            };
            objects.push((at, value));
        }
    }
    Ok(objects)
}

/// Deserializes objects of `kind` (resource.k8s.io/v1); another kind or API version is an error.
fn typed<T: DeserializeOwned>(
    path: &Path,
    kinds: &[&str],
    objects: Vec<(Position, Value)>,
) -> Result<Vec<(Position, String, T)>, InputError> {
    let mut result = Vec::new();
    for (at, mut value) in objects {
        let invalid = |message: String| InputError::Invalid {
            file: path.to_path_buf(),
            at,
            message,
        };
        let Some(map) = value.as_object_mut() else {
            return Err(invalid(format!(
                "expected an object of kind {}",
                kinds.join(" or ")
            )));
        };
        let kind = match map.get("kind") {
            Some(Value::String(kind)) => kind.clone(),
            Some(_) => return Err(invalid("kind is not a string".into())),
            None => {
                return Err(invalid(format!(
                    "kind missing (expected {})",
                    kinds.join(" or ")
                )))
            }
        };
        if !kinds.contains(&kind.as_str()) {
            return Err(invalid(format!(
                "kind {kind}, expected {}",
                kinds.join(" or ")
            )));
        }
        match map.get("apiVersion") {
            Some(Value::String(version)) if version == API_VERSION => {}
            None => {
                map.insert("apiVersion".into(), Value::String(API_VERSION.into()));
            }
            Some(other) => {
                return Err(invalid(format!(
                    "{kind} apiVersion {other}: only {API_VERSION} is supported"
                )))
            }
        }
        let object =
            serde_json::from_value(value).map_err(|e| invalid(format!("invalid {kind}: {e}")))?;
        result.push((at, kind, object));
    }
    Ok(result)
}

fn missing(path: &Path, at: Position, kind: &str, field: &str) -> InputError {
    InputError::Invalid {
        file: path.to_path_buf(),
        at,
        message: format!("invalid {kind}: {field} is missing or empty"),
    }
}

fn non_empty<T>(path: &Path, expected: &str, items: Vec<T>) -> Result<Vec<T>, InputError> {
    if items.is_empty() {
        return Err(InputError::Empty {
            file: path.to_path_buf(),
            expected: expected.to_string(),
        });
    }
    Ok(items)
}

/// The DeviceClasses in `path` (at least one).
pub fn load_device_classes(path: &Path) -> Result<Vec<DeviceClass>, InputError> {
    let mut classes = Vec::new();
    for (at, _, class) in typed::<DeviceClass>(path, &["DeviceClass"], load_objects(path)?)? {
        if class
            .metadata
            .name
            .as_deref()
            .unwrap_or_default()
            .is_empty()
        {
            return Err(missing(path, at, "DeviceClass", "metadata.name"));
        }
        classes.push(class);
    }
    non_empty(path, "DeviceClass", classes)
}

/// The ResourceClaims in `path` (at least one). A ResourceClaimTemplate counts as the claim it
/// creates, named after the template.
pub fn load_claims(path: &Path) -> Result<Vec<NamedClaim>, InputError> {
    let kinds = ["ResourceClaim", "ResourceClaimTemplate"];
    let mut claims = Vec::new();
    for (at, value) in load_objects(path)? {
        // Checked as a plain value first, to learn which of the two kinds it is.
        let Some((_, kind, value)) = typed::<Value>(path, &kinds, vec![(at, value)])?.pop() else {
            continue;
        };
        let decoded = if kind == "ResourceClaim" {
            serde_json::from_value::<ResourceClaim>(value).map(|c| c.spec.map(|s| (c.metadata, s)))
        } else {
            serde_json::from_value::<ResourceClaimTemplate>(value)
                .map(|t| t.spec.and_then(|spec| spec.spec).map(|s| (t.metadata, s)))
        };
        let invalid = |message: String| InputError::Invalid {
            file: path.to_path_buf(),
            at,
            message,
        };
        let (metadata, spec) = decoded
            .map_err(|e| invalid(format!("invalid {kind}: {e}")))?
            .ok_or_else(|| invalid(format!("{kind} has no spec")))?;
        let name = format!(
            "{}/{}",
            metadata.namespace.as_deref().unwrap_or("default"),
            metadata
                .name
                .or(metadata.generate_name)
                .unwrap_or_else(|| format!("({at})"))
        );
        claims.push(NamedClaim { name, spec });
    }
    non_empty(path, "ResourceClaim", claims)
}

/// The ResourceSlices in `path` (at least one).
pub fn load_slices(path: &Path) -> Result<Vec<ResourceSlice>, InputError> {
    non_empty(path, "ResourceSlice", load_slices_allow_empty(path)?)
}

/// The ResourceSlices in `path`, which may hold none: a cluster without slices is a valid state, in
/// which nothing can be allocated.
pub fn load_slices_allow_empty(path: &Path) -> Result<Vec<ResourceSlice>, InputError> {
    let mut slices = Vec::new();
    for (at, _, slice) in typed::<ResourceSlice>(path, &["ResourceSlice"], load_objects(path)?)? {
        // k8s-openapi fills missing required fields with defaults; these would mislead the allocator.
        if slice.spec.driver.is_empty() {
            return Err(missing(path, at, "ResourceSlice", "spec.driver"));
        }
        if slice.spec.pool.name.is_empty() {
            return Err(missing(path, at, "ResourceSlice", "spec.pool.name"));
        }
        slices.push(slice);
    }
    Ok(slices)
}

/// One `--in-use` entry, in the shape of an allocation result: a device another claim holds whole, or
/// with `shareID` a share of it that consumes `consumedCapacity`. Other fields of a result are ignored,
/// so results can be copied from claims; an admin-access one holds nothing, as in the scheduler.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct InUseEntry {
    #[serde(flatten)]
    device: Candidate,
    #[serde(default, rename = "shareID")]
    share_id: Option<String>,
    #[serde(default)]
    consumed_capacity: BTreeMap<String, String>,
    #[serde(default)]
    admin_access: bool,
}

/// What other claims hold: `[{"driver", "pool", "device", "shareID"?, "consumedCapacity"?}]` (YAML or
/// JSON; may be empty).
pub fn load_in_use(path: &Path) -> Result<InUse, InputError> {
    let mut in_use = InUse::default();
    for (at, value) in load_objects(path)? {
        let invalid = |message: String| InputError::Invalid {
            file: path.to_path_buf(),
            at,
            message,
        };
        let entry: InUseEntry = serde_json::from_value(value).map_err(|e| {
            invalid(format!(
                "expected {{\"driver\", \"pool\", \"device\"}} and optionally \"shareID\" and \"consumedCapacity\": {e}"
            ))
        })?;
        if entry.admin_access {
            continue;
        }
        if entry.share_id.is_none() {
            if !entry.consumed_capacity.is_empty() {
                return Err(invalid(
                    "consumedCapacity needs a shareID (an entry without one holds the device whole)"
                        .into(),
                ));
            }
            in_use.devices.insert(entry.device);
            continue;
        }
        let mut consumed = BTreeMap::new();
        for (name, text) in entry.consumed_capacity {
            let quantity = Quantity::parse(&text).map_err(|e| {
                invalid(format!(
                    "consumedCapacity[{name}]: {text:?} is not a quantity: {e}"
                ))
            })?;
            consumed.insert(name, quantity);
        }
        in_use.add_share(entry.device, consumed);
    }
    Ok(in_use)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), text).expect("write");
        file
    }

    const CLASS: &str = "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: gpu}\nspec:\n  selectors:\n  - cel: {expression: 'device.driver == \"gpu.dra.dev\"'}\n";

    #[test]
    fn documents_lists_and_json_are_read() {
        let two = file(&format!(
            "---\n{CLASS}---\n{}",
            CLASS.replace("name: gpu", "name: mig")
        ));
        let names: Vec<_> = load_device_classes(two.path())
            .expect("two classes")
            .into_iter()
            .filter_map(|c| c.metadata.name)
            .collect();
        assert_eq!(names, ["gpu", "mig"]);

        let list = file(
            r#"{"apiVersion": "v1", "kind": "List", "items": [{"kind": "DeviceClass", "metadata": {"name": "a"}, "spec": {}}]}"#,
        );
        assert_eq!(load_device_classes(list.path()).expect("list").len(), 1);
        let array = file(r#"[{"kind": "DeviceClass", "metadata": {"name": "a"}, "spec": {}}]"#);
        assert_eq!(load_device_classes(array.path()).expect("array").len(), 1);
    }

    #[test]
    fn errors_name_file_document_and_cause() {
        let wrong_kind = file(&format!(
            "{CLASS}---\nkind: ResourceClaim\nmetadata: {{name: c}}\nspec: {{}}\n"
        ));
        let error = load_device_classes(wrong_kind.path())
            .expect_err("wrong kind")
            .to_string();
        assert!(
            error.starts_with(&wrong_kind.path().display().to_string()),
            "{error}"
        );
        assert!(
            error.contains("document 2: kind ResourceClaim, expected DeviceClass"),
            "{error}"
        );

        let broken = file("kind: DeviceClass\nmetadata: [\n");
        let error = load_device_classes(broken.path())
            .expect_err("bad YAML")
            .to_string();
        assert!(
            error.contains("document 1: not valid YAML or JSON"),
            "{error}"
        );

        let missing = file("kind: ResourceSlice\nmetadata: {name: s}\nspec: {pool: {name: p, generation: 1, resourceSliceCount: 1}}\n");
        let error = load_slices(missing.path())
            .expect_err("no driver")
            .to_string();
        assert!(
            error.contains("invalid ResourceSlice: spec.driver is missing"),
            "{error}"
        );

        let version = file(&CLASS.replace("resource.k8s.io/v1", "resource.k8s.io/v1beta1"));
        let error = load_device_classes(version.path())
            .expect_err("v1beta1")
            .to_string();
        assert!(error.contains("only resource.k8s.io/v1"), "{error}");

        let nothing = file("---\n");
        let error = load_device_classes(nothing.path())
            .expect_err("empty")
            .to_string();
        assert!(error.contains("no DeviceClass"), "{error}");

        let error = load_slices(Path::new("/no/such/file.yaml"))
            .expect_err("missing")
            .to_string();
        assert!(
            error.starts_with("/no/such/file.yaml: cannot read"),
            "{error}"
        );
    }

    #[test]
    fn claims_and_templates() {
        let claims = file(
            "kind: ResourceClaim\nmetadata: {name: one, namespace: ml}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {deviceClassName: gpu}\n---\nkind: ResourceClaimTemplate\nmetadata: {name: tmpl}\nspec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n        exactly: {deviceClassName: gpu}\n",
        );
        let names: Vec<_> = load_claims(claims.path())
            .expect("claims")
            .into_iter()
            .map(|c| c.name)
            .collect();
        assert_eq!(names, ["ml/one", "default/tmpl"]);
    }

    #[test]
    fn in_use_lists() {
        let list = file(r#"[{"driver": "gpu.dra.dev", "pool": "node-a", "device": "gpu-0"}]"#);
        let in_use = load_in_use(list.path()).expect("in use");
        assert_eq!(in_use.devices.len(), 1);
        assert!(in_use.shares.is_empty());
        let bad = file(r#"[{"driver": "gpu.dra.dev", "device": "gpu-0"}]"#);
        let error = load_in_use(bad.path()).expect_err("no pool").to_string();
        assert!(
            error.contains("document 1, item 1") && error.contains("pool"),
            "{error}"
        );
        let empty = file("[]");
        assert_eq!(
            load_in_use(empty.path()).expect("empty is fine"),
            InUse::default()
        );
    }

    #[test]
    fn in_use_shares_sum_their_consumed_capacity_per_device() {
        let gpu = |share: &str, memory: &str| {
            format!(
                r#"{{"request": "r", "driver": "gpu.dra.dev", "pool": "node-a", "device": "gpu-0",
                    "shareID": "{share}", "consumedCapacity": {{"memory": "{memory}"}}}}"#
            )
        };
        let admin = r#"{"driver": "gpu.dra.dev", "pool": "node-a", "device": "gpu-1", "adminAccess": true}"#;
        let list = file(&format!(
            "[{}, {}, {admin}]",
            gpu("a", "40Gi"),
            gpu("b", "30Gi")
        ));
        let in_use = load_in_use(list.path()).expect("in use");
        assert!(
            in_use.devices.is_empty(),
            "shares and admin access hold no device whole"
        );
        let (device, consumed) = in_use.shares.iter().next().expect("one shared device");
        assert_eq!(device.device, "gpu-0");
        assert_eq!(consumed["memory"], Quantity::parse("70Gi").unwrap());

        let orphan = file(
            r#"[{"driver": "d", "pool": "p", "device": "x", "consumedCapacity": {"memory": "1Gi"}}]"#,
        );
        let error = load_in_use(orphan.path())
            .expect_err("no shareID")
            .to_string();
        assert!(
            error.contains("consumedCapacity needs a shareID"),
            "{error}"
        );
        let bad = file(&format!("[{}]", gpu("a", "lots")));
        let error = load_in_use(bad.path())
            .expect_err("not a quantity")
            .to_string();
        assert!(
            error.contains("consumedCapacity[memory]: \"lots\""),
            "{error}"
        );
    }
}
