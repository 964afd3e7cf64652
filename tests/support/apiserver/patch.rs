//! The patch formats of PATCH requests: JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

use serde_json::Value;

/// Applies a JSON merge patch: objects merge key by key, `null` deletes, anything else replaces.
pub(super) fn merge(target: &mut Value, patch: &Value) {
    let Some(patch) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let Some(target) = target.as_object_mut() else {
        return;
    };
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Applies a JSON patch (add, remove, replace, move, copy, test); the error says which operation failed.
pub(super) fn json_patch(doc: &mut Value, ops: &Value) -> Result<(), String> {
    let ops = ops
        .as_array()
        .ok_or("a JSON patch must be an array of operations")?;
    for (index, op) in ops.iter().enumerate() {
        apply_op(doc, op).map_err(|err| format!("json patch operation {index}: {err}"))?;
    }
    Ok(())
}

fn apply_op(doc: &mut Value, op: &Value) -> Result<(), String> {
    let field = |name: &str| {
        op.get(name)
            .and_then(Value::as_str)
            .ok_or(format!("missing \"{name}\""))
    };
    let path = field("path")?;
    let value = || {
        op.get("value")
            .cloned()
            .ok_or("missing \"value\"".to_string())
    };
    match field("op")? {
        "add" => add(doc, path, value()?),
        "remove" => remove(doc, path).map(drop),
        "replace" => {
            remove(doc, path)?;
            add(doc, path, value()?)
        }
        "move" => {
            let moved = remove(doc, field("from")?)?;
            add(doc, path, moved)
        }
        "copy" => {
            let copied = doc
                .pointer(field("from")?)
                .cloned()
                .ok_or("\"from\" does not exist")?;
            add(doc, path, copied)
        }
        "test" => match doc.pointer(path) {
            Some(actual) if *actual == value()? => Ok(()),
            _ => Err(format!("test failed at {path}")),
        },
        other => Err(format!("unknown operation {other:?}")),
    }
}

/// Splits a JSON pointer into its parent pointer and its last token, unescaped.
fn split_pointer(path: &str) -> Result<(&str, String), String> {
    let (parent, last) = path
        .rsplit_once('/')
        .ok_or(format!("invalid path {path:?}"))?;
    Ok((parent, last.replace("~1", "/").replace("~0", "~")))
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), String> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, token) = split_pointer(path)?;
    match doc.pointer_mut(parent) {
        Some(Value::Object(map)) => {
            map.insert(token, value);
            Ok(())
        }
        Some(Value::Array(items)) => {
            let index = if token == "-" {
                items.len()
            } else {
                token.parse().map_err(|_| format!("bad index {token}"))?
            };
            if index > items.len() {
                return Err(format!("index {index} out of range"));
            }
            items.insert(index, value);
            Ok(())
        }
        _ => Err(format!("parent of {path} does not exist")),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, token) = split_pointer(path)?;
    let removed = match doc.pointer_mut(parent) {
        Some(Value::Object(map)) => map.remove(&token),
        Some(Value::Array(items)) => token
            .parse::<usize>()
            .ok()
            .filter(|i| *i < items.len())
            .map(|i| items.remove(i)),
        _ => None,
    };
    removed.ok_or(format!("{path} does not exist"))
}
