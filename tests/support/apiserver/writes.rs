//! The write verbs against the store: create (with generated names), update and patch (with the
//! uid and resourceVersion preconditions and the status subresource rules) and delete (with
//! finalizers and the graceful deletion of a bound Pod).

use axum::http::{header, HeaderMap};
use serde_json::{json, Value};

use super::admission::{admit, check_identity, parse_body, stamp_taints};
use super::errors::ApiError;
use super::rest::{stored, Answer, Request};
use super::{
    fill_system_meta, meta, meta_str, now_timestamp, remove_meta, set_meta, EventType, ObjectKey,
    ResourceDef, Shared, Store, Verb,
};

/// Characters of a generated name suffix: the real server's alphabet, without vowels and look-alikes.
const GENERATED_NAME_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
const GENERATED_NAME_SUFFIX_LEN: usize = 5;
/// Prefixes are cut so that a generated name still fits in a DNS label.
const GENERATED_NAME_MAX_PREFIX: usize = 63 - GENERATED_NAME_SUFFIX_LEN;

pub(super) fn create(shared: &Shared, request: &Request, body: &[u8]) -> Answer {
    let obj = parse_body(body)?;
    create_object(shared, request, obj)
}

fn create_object(shared: &Shared, request: &Request, mut obj: Value) -> Answer {
    let def = request.def;
    check_identity(request, &mut obj)?;
    if meta_str(&obj, "resourceVersion").is_some() {
        return Err(ApiError::Internal(
            "resourceVersion should not be set on objects to be created".into(),
        ));
    }
    let mut store = shared.store();
    if meta_str(&obj, "name").is_none() {
        if let Some(prefix) = meta_str(&obj, "generateName").map(str::to_string) {
            let name = loop {
                let candidate = generate_name(&prefix);
                if !store.objects.contains_key(&ObjectKey::new(
                    def,
                    request.namespace.as_deref(),
                    &candidate,
                )) {
                    break candidate;
                }
            };
            set_meta(&mut obj, "name", json!(name));
        }
    }
    if !def.status_on_create {
        if let Some(map) = obj.as_object_mut() {
            map.remove("status");
        }
    }
    for field in [
        "uid",
        "creationTimestamp",
        "generation",
        "deletionTimestamp",
    ] {
        remove_meta(&mut obj, field);
    }
    fill_system_meta(&mut obj);
    stamp_taints(&mut obj, None);
    let obj = admit(shared, request, obj, None)?;
    if store.objects.contains_key(&ObjectKey::of(def, &obj)) {
        let name = meta_str(&obj, "name").unwrap_or_default().to_string();
        return Err(ApiError::AlreadyExists { def, name });
    }
    if request.dry_run() {
        return Ok((201, obj));
    }
    Ok((201, shared.commit(&mut store, def, EventType::Added, obj)))
}

fn generate_name(prefix: &str) -> String {
    let prefix: String = prefix.chars().take(GENERATED_NAME_MAX_PREFIX).collect();
    let suffix: String = (0..GENERATED_NAME_SUFFIX_LEN)
        .map(|_| {
            char::from(GENERATED_NAME_ALPHABET[fastrand::usize(..GENERATED_NAME_ALPHABET.len())])
        })
        .collect();
    prefix + &suffix
}

pub(super) fn update(shared: &Shared, request: &Request, body: &[u8]) -> Answer {
    let obj = parse_body(body)?;
    if !request.def.unconditional_update && meta_str(&obj, "resourceVersion").is_none() {
        // The generic registry's check, before it reads the stored object.
        return Err(ApiError::Invalid {
            def: request.def,
            name: request.name().to_string(),
            errors: vec![super::validation::resource_version_required()],
        });
    }
    let mut store = shared.store();
    let old = stored(&store, request)?;
    write_update(shared, &mut store, request, &old, obj)
}

/// Everything but `metadata.resourceVersion`, to tell a real change from a no-op write.
fn without_version(obj: &Value) -> Value {
    let mut obj = obj.clone();
    remove_meta(&mut obj, "resourceVersion");
    obj
}

/// The shared tail of update and patch: preconditions, the status subresource rules, validation, commit.
fn write_update(
    shared: &Shared,
    store: &mut Store,
    request: &Request,
    old: &Value,
    mut new: Value,
) -> Answer {
    let def = request.def;
    check_identity(request, &mut new)?;
    match meta_str(&new, "name") {
        Some(name) if name != request.name() => {
            return Err(ApiError::BadRequest(format!(
                "the name of the object ({name}) does not match the name on the URL ({})",
                request.name()
            )))
        }
        Some(_) => {}
        None => set_meta(&mut new, "name", json!(request.name())),
    }
    check_preconditions(
        request,
        old,
        meta_str(&new, "uid"),
        meta_str(&new, "resourceVersion"),
    )?;
    let mut next = if request.status {
        with_status_of(old, &new)
    } else {
        new
    };
    if def.status_subresource && !request.status {
        next = with_status_of(&next, old);
    }
    for field in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
    ] {
        match meta(old, field) {
            Some(value) => set_meta(&mut next, field, value.clone()),
            None => remove_meta(&mut next, field),
        }
    }
    if spec_of(&next) != spec_of(old) {
        let generation = meta(old, "generation").and_then(Value::as_i64).unwrap_or(0);
        set_meta(&mut next, "generation", json!(generation + 1));
    }
    stamp_taints(&mut next, Some(old));
    let next = admit(shared, request, next, Some(old))?;
    if without_version(&next) == without_version(old) || request.dry_run() {
        return Ok((200, if request.dry_run() { next } else { old.clone() }));
    }
    let finalized = meta(&next, "deletionTimestamp").is_some()
        && meta(&next, "finalizers")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty);
    let kind = if finalized {
        EventType::Deleted
    } else {
        EventType::Modified
    };
    Ok((200, shared.commit(store, def, kind, next)))
}

/// Everything outside `metadata` and `status`: what bumps `metadata.generation` when it changes.
fn spec_of(obj: &Value) -> Value {
    let mut obj = obj.clone();
    if let Some(map) = obj.as_object_mut() {
        for field in ["metadata", "status", "apiVersion", "kind"] {
            map.remove(field);
        }
    }
    obj
}

/// `base` with the `status` of `source` (or none).
fn with_status_of(base: &Value, source: &Value) -> Value {
    let mut out = base.clone();
    if let Some(map) = out.as_object_mut() {
        match source.get("status") {
            Some(status) => map.insert("status".into(), status.clone()),
            None => map.remove("status"),
        };
    }
    out
}

fn conflict(request: &Request, detail: &str) -> ApiError {
    ApiError::Conflict {
        def: request.def,
        name: request.name().to_string(),
        detail: detail.to_string(),
    }
}

/// The uid and resourceVersion preconditions of update, patch and delete.
fn check_preconditions(
    request: &Request,
    old: &Value,
    uid: Option<&str>,
    version: Option<&str>,
) -> Result<(), ApiError> {
    let old_uid = meta_str(old, "uid").unwrap_or_default();
    let old_version = meta_str(old, "resourceVersion").unwrap_or_default();
    if let Some(uid) = uid.filter(|uid| *uid != old_uid) {
        return Err(conflict(
            request,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {old_uid}"
            ),
        ));
    }
    if version.is_some_and(|v| v != old_version) {
        let detail = if request.verb == Verb::Delete {
            format!(
                "Precondition failed: ResourceVersion in precondition: {}, ResourceVersion in object meta: {old_version}",
                version.unwrap_or_default()
            )
        } else {
            "the object has been modified; please apply your changes to the latest version and try again".into()
        };
        return Err(conflict(request, &detail));
    }
    Ok(())
}

pub(super) fn patch(
    shared: &Shared,
    request: &Request,
    headers: &HeaderMap,
    body: &[u8],
) -> Answer {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::trim)
        .unwrap_or_default();
    let patch: Value = serde_json::from_slice(body)
        .map_err(|err| ApiError::BadRequest(format!("error decoding patch: {err}")))?;
    let apply = content_type == "application/apply-patch+yaml";
    if apply
        && request
            .query
            .get("fieldManager")
            .is_none_or(String::is_empty)
    {
        return Err(ApiError::BadRequest(
            "fieldManager: Required value: is required for apply patch".into(),
        ));
    }
    let mut store = shared.store();
    let old = match (stored(&store, request), apply) {
        (Ok(old), _) => old,
        // Server-side apply creates what does not exist.
        (Err(ApiError::NotFound { .. }), true) if !request.status => {
            let mut obj = patch;
            if meta_str(&obj, "name").is_none() {
                set_meta(&mut obj, "name", json!(request.name()));
            }
            drop(store);
            return create_object(shared, request, obj);
        }
        (Err(err), _) => return Err(err),
    };
    let mut patched = old.clone();
    match content_type {
        // Strategic merge and apply are approximated by a JSON merge patch: the lists in these types are
        // atomic, so replacing them whole is what the real server does too.
        "application/merge-patch+json"
        | "application/strategic-merge-patch+json"
        | "application/apply-patch+yaml" => super::patch::merge(&mut patched, &patch),
        "application/json-patch+json" => {
            super::patch::json_patch(&mut patched, &patch).map_err(ApiError::BadRequest)?
        }
        _ => return Err(ApiError::UnsupportedMediaType),
    }
    write_update(shared, &mut store, request, &old, patched)
}

pub(super) fn delete(shared: &Shared, request: &Request, body: &[u8]) -> Answer {
    let options: Value = if body.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        serde_json::from_slice(body)
            .map_err(|err| ApiError::BadRequest(format!("invalid DeleteOptions: {err}")))?
    };
    let mut store = shared.store();
    let old = store
        .objects
        .get(&request.key())
        .cloned()
        .ok_or_else(|| ApiError::NotFound {
            def: request.def,
            name: request.name().to_string(),
        })?;
    let precondition = |field: &str| {
        options
            .pointer(&format!("/preconditions/{field}"))
            .and_then(Value::as_str)
    };
    check_preconditions(
        request,
        &old,
        precondition("uid"),
        precondition("resourceVersion"),
    )?;
    let dry_run = request.dry_run()
        || options
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|v| v.iter().any(|d| d == "All"));
    let has_finalizers = meta(&old, "finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty());
    // A Pod bound to a node is deleted gracefully, as the real server's pod strategy does: it gets a
    // deletionTimestamp and stays until its kubelet has ended the containers and deletes it with a
    // grace period of 0 (or someone forces that).
    if let Some(grace) = graceful_pod_deletion(request.def, &old, &options) {
        if dry_run {
            return Ok((200, old));
        }
        if meta(&old, "deletionTimestamp").is_some() {
            return Ok((200, old));
        }
        let mut marked = old;
        set_meta(&mut marked, "deletionTimestamp", json!(now_timestamp()));
        set_meta(&mut marked, "deletionGracePeriodSeconds", json!(grace));
        return Ok((
            200,
            shared.commit(&mut store, request.def, EventType::Modified, marked),
        ));
    }
    if has_finalizers {
        // The object stays until its finalizers are removed; the real server answers with it.
        if meta(&old, "deletionTimestamp").is_some() || dry_run {
            return Ok((200, old));
        }
        let mut marked = old;
        set_meta(&mut marked, "deletionTimestamp", json!(now_timestamp()));
        set_meta(&mut marked, "deletionGracePeriodSeconds", json!(0));
        return Ok((
            200,
            shared.commit(&mut store, request.def, EventType::Modified, marked),
        ));
    }
    if !dry_run {
        shared.commit(&mut store, request.def, EventType::Deleted, old.clone());
    }
    Ok((
        200,
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {
                "name": request.name(),
                "group": request.def.group,
                "kind": request.def.path_plural(),
                "uid": meta_str(&old, "uid").unwrap_or_default(),
            },
        }),
    ))
}

/// The grace period of a Pod's deletion when it is graceful: the Pod is bound to a node, has not
/// finished, and the request does not ask for 0 (the options' `gracePeriodSeconds`, else the Pod's
/// `terminationGracePeriodSeconds`, else 30).
fn graceful_pod_deletion(def: &ResourceDef, pod: &Value, options: &Value) -> Option<i64> {
    if def.plural != "pods" {
        return None;
    }
    let bound = pod
        .pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty());
    let finished = matches!(
        pod.pointer("/status/phase").and_then(Value::as_str),
        Some("Succeeded" | "Failed")
    );
    let grace = options
        .get("gracePeriodSeconds")
        .and_then(Value::as_i64)
        .or_else(|| {
            pod.pointer("/spec/terminationGracePeriodSeconds")
                .and_then(Value::as_i64)
        })
        .unwrap_or(30);
    (bound && !finished && grace > 0).then_some(grace)
}
