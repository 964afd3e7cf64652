//! What the server does to an object on its way into the store, on every create, update and patch:
//! checks kind, apiVersion and namespace against the URL, drops the fields of disabled gates,
//! validates by the upstream rules, decodes as the typed object and stamps device taints.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

use super::errors::ApiError;
use super::rest::Request;
use super::validation;
use super::{fill_type_meta, meta_str, now_timestamp, remove_meta, set_meta, Shared};

pub(super) fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|err| {
        ApiError::BadRequest(format!(
            "couldn't get version/kind; json parse error: {err}"
        ))
    })?;
    if !value.is_object() {
        return Err(ApiError::BadRequest(
            "the request body must be a JSON object".into(),
        ));
    }
    Ok(value)
}

/// Checks kind and apiVersion (when given) and the namespace against the URL, then fills them in.
pub(super) fn check_identity(request: &Request, obj: &mut Value) -> Result<(), ApiError> {
    let def = request.def;
    if let Some(api_version) = obj
        .get("apiVersion")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
    {
        if api_version != def.api_version() {
            return Err(ApiError::BadRequest(format!(
                "the API version in the data ({api_version}) does not match the expected API version ({})",
                def.api_version()
            )));
        }
    }
    if let Some(kind) = obj
        .get("kind")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
    {
        if kind != def.kind {
            return Err(ApiError::BadRequest(format!(
                "the kind in the data ({kind}) does not match {}",
                def.kind
            )));
        }
    }
    fill_type_meta(def, obj);
    if def.namespaced {
        let url_namespace = request.namespace.clone().unwrap_or_default();
        match meta_str(obj, "namespace") {
            Some(ns) if ns != url_namespace => {
                return Err(ApiError::BadRequest(
                    "the namespace of the provided object does not match the namespace sent on the request".into(),
                ))
            }
            Some(_) => {}
            None => set_meta(obj, "namespace", json!(url_namespace)),
        }
    } else {
        remove_meta(obj, "namespace");
    }
    Ok(())
}

/// Validates by the upstream rules, then decodes into the typed object as the real server does, which
/// rejects wrong types and drops unknown fields.
pub(super) fn admit(
    shared: &Shared,
    request: &Request,
    mut obj: Value,
    old: Option<&Value>,
) -> Result<Value, ApiError> {
    let def = request.def;
    // Before validation, as the registry strategy's PrepareForCreate/PrepareForUpdate.
    super::gates::drop_disabled_fields(&shared.feature_gates(), def, &mut obj, old);
    let errors = validation::validate(shared.version(), def, &obj, old);
    if !errors.is_empty() {
        let name = meta_str(&obj, "name").unwrap_or_default().to_string();
        return Err(ApiError::Invalid { def, name, errors });
    }
    let decoded = match def.plural {
        "nodes" => roundtrip::<k8s_openapi::api::core::v1::Node>(obj),
        "resourceslices" => roundtrip::<k8s_openapi::api::resource::v1::ResourceSlice>(obj),
        "resourceclaims" => roundtrip::<k8s_openapi::api::resource::v1::ResourceClaim>(obj),
        "deviceclasses" => roundtrip::<k8s_openapi::api::resource::v1::DeviceClass>(obj),
        "resourceclaimtemplates" => {
            roundtrip::<k8s_openapi::api::resource::v1::ResourceClaimTemplate>(obj)
        }
        "pods" => roundtrip::<k8s_openapi::api::core::v1::Pod>(obj),
        "deployments" => roundtrip::<k8s_openapi::api::apps::v1::Deployment>(obj),
        "leases" => roundtrip::<k8s_openapi::api::coordination::v1::Lease>(obj),
        _ => Ok(obj),
    };
    decoded.map_err(|err| {
        ApiError::BadRequest(format!(
            "{kind} in version \"{version}\" cannot be handled as a {kind}: {err}",
            kind = def.kind,
            version = def.version
        ))
    })
}

fn roundtrip<T: DeserializeOwned + Serialize>(obj: Value) -> Result<Value, serde_json::Error> {
    let typed: T = serde_json::from_value(obj)?;
    serde_json::to_value(typed)
}

/// Gives device taints without `timeAdded` the current time, as the server does; a taint that was already
/// there keeps its time.
pub(super) fn stamp_taints(obj: &mut Value, old: Option<&Value>) {
    let old_taints: Vec<&Value> = old
        .and_then(|old| old.pointer("/spec/devices")?.as_array())
        .into_iter()
        .flatten()
        .filter_map(|device| device.get("taints")?.as_array())
        .flatten()
        .collect();
    let Some(devices) = obj
        .pointer_mut("/spec/devices")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for taint in devices
        .iter_mut()
        .filter_map(|d| d.get_mut("taints")?.as_array_mut())
        .flatten()
    {
        let Some(map) = taint.as_object_mut() else {
            continue;
        };
        if map.get("timeAdded").is_some_and(|t| !t.is_null()) {
            continue;
        }
        let same = |t: &&Value| {
            ["key", "value", "effect"]
                .iter()
                .all(|f| t.get(f) == map.get(*f))
        };
        let time = old_taints
            .iter()
            .find(|t| same(t))
            .and_then(|t| t.get("timeAdded"))
            .cloned();
        map.insert(
            "timeAdded".into(),
            time.unwrap_or_else(|| json!(now_timestamp())),
        );
    }
}
