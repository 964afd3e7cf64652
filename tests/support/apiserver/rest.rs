//! The HTTP side of the API server double: maps Kubernetes REST paths and methods to verbs, applies
//! injected latency and faults, runs each verb against the store with the real server's preconditions,
//! and answers with JSON objects, lists or `kind: Status` errors.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

use super::selectors::Selection;
use super::validation::{self, FieldError};
use super::{
    fill_system_meta, fill_type_meta, lock, meta, meta_str, now_timestamp, remove_meta,
    resource_def, set_meta, EventType, ObjectKey, RequestRecord, ResourceDef, Shared, Store, Verb,
};

/// Characters of a generated name suffix: the real server's alphabet, without vowels and look-alikes.
const GENERATED_NAME_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
const GENERATED_NAME_SUFFIX_LEN: usize = 5;
/// Prefixes are cut so that a generated name still fits in a DNS label.
const GENERATED_NAME_MAX_PREFIX: usize = 63 - GENERATED_NAME_SUFFIX_LEN;

/// Why a request failed; each variant becomes the `Status` the real server sends for it.
#[derive(Debug, thiserror::Error)]
pub(super) enum ApiError {
    #[error("{} \"{name}\" not found", .def.qualified_plural())]
    NotFound {
        def: &'static ResourceDef,
        name: String,
    },
    #[error("the server could not find the requested resource")]
    NoRoute,
    #[error("{} \"{name}\" already exists", .def.qualified_plural())]
    AlreadyExists {
        def: &'static ResourceDef,
        name: String,
    },
    #[error("Operation cannot be fulfilled on {} \"{name}\": {detail}", .def.qualified_plural())]
    Conflict {
        def: &'static ResourceDef,
        name: String,
        detail: String,
    },
    #[error("{} \"{name}\" is invalid: {}", .def.qualified_kind(), validation::join(.errors))]
    Invalid {
        def: &'static ResourceDef,
        name: String,
        errors: Vec<FieldError>,
    },
    #[error("{0}")]
    BadRequest(String),
    #[error("the server does not allow this method on the requested resource")]
    MethodNotAllowed,
    #[error("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml")]
    UnsupportedMediaType,
    #[error("{0}")]
    Internal(String),
    #[error("too old resource version: {requested} ({oldest})")]
    Gone { requested: u64, oldest: u64 },
    #[error("injected fault: {code}")]
    Injected { code: u16 },
}

impl ApiError {
    fn code(&self) -> u16 {
        match self {
            ApiError::NotFound { .. } | ApiError::NoRoute => 404,
            ApiError::AlreadyExists { .. } | ApiError::Conflict { .. } => 409,
            ApiError::Invalid { .. } => 422,
            ApiError::BadRequest(_) => 400,
            ApiError::MethodNotAllowed => 405,
            ApiError::UnsupportedMediaType => 415,
            ApiError::Internal(_) => 500,
            ApiError::Gone { .. } => 410,
            ApiError::Injected { code } => *code,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            ApiError::Injected { code } => reason_for_code(*code),
            ApiError::Gone { .. } => "Expired",
            ApiError::AlreadyExists { .. } => "AlreadyExists",
            other => reason_for_code(other.code()),
        }
    }

    fn details(&self) -> Option<Value> {
        match self {
            ApiError::NotFound { def, name }
            | ApiError::AlreadyExists { def, name }
            | ApiError::Conflict { def, name, .. } => {
                Some(json!({"name": name, "group": def.group, "kind": def.plural}))
            }
            ApiError::Invalid { def, name, errors } => Some(json!({
                "name": name,
                "group": def.group,
                "kind": def.kind,
                "causes": errors.iter().map(FieldError::cause).collect::<Vec<_>>(),
            })),
            _ => None,
        }
    }

    /// The `kind: Status` object for this error, as in a response body or a watch ERROR event.
    pub(super) fn status(&self) -> Value {
        let message = match self {
            ApiError::Injected { code } => injected_message(*code),
            other => other.to_string(),
        };
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": self.reason(),
            "code": self.code(),
        });
        if let (Some(details), Some(map)) = (self.details(), status.as_object_mut()) {
            map.insert("details".into(), details);
        }
        status
    }

    fn response(&self) -> Response {
        let mut response = json_response(self.code(), &self.status());
        if self.code() == 429 {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

fn reason_for_code(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        409 => "Conflict",
        410 => "Gone",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    }
}

fn injected_message(code: u16) -> String {
    match code {
        409 => {
            "Operation cannot be fulfilled: the object has been modified (injected fault)".into()
        }
        429 => {
            "the server has received too many requests and has asked us to try again later".into()
        }
        503 => "the server is currently unable to handle the request".into(),
        504 => "the server was unable to return a response in the time allotted".into(),
        code => format!("Internal error occurred: injected fault ({code})"),
    }
}

fn json_response(code: u16, body: &Value) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

pub(super) fn router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(handle).with_state(shared)
}

/// One parsed request: which objects, which verb, and the query parameters.
pub(super) struct Request {
    pub(super) def: &'static ResourceDef,
    pub(super) namespace: Option<String>,
    pub(super) name: Option<String>,
    pub(super) status: bool,
    pub(super) verb: Verb,
    pub(super) query: HashMap<String, String>,
}

impl Request {
    fn parse(method: &Method, uri: &Uri) -> Result<Request, ApiError> {
        let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
        let (group, version, rest) = match segments.as_slice() {
            ["api", version, rest @ ..] => ("", *version, rest),
            ["apis", group, version, rest @ ..] => (*group, *version, rest),
            _ => return Err(ApiError::NoRoute),
        };
        let (namespace, rest) = match rest {
            ["namespaces", namespace, rest @ ..] if !rest.is_empty() => {
                (Some(namespace.to_string()), rest)
            }
            _ => (None, rest),
        };
        let (plural, name, subresource) = match rest {
            [plural] => (*plural, None, None),
            [plural, name] => (*plural, Some(name.to_string()), None),
            [plural, name, sub] => (*plural, Some(name.to_string()), Some(*sub)),
            _ => return Err(ApiError::NoRoute),
        };
        let def = resource_def(plural)
            .filter(|def| def.group == group && def.version == version)
            .ok_or(ApiError::NoRoute)?;
        let scoped_right = if def.namespaced {
            namespace.is_some() || name.is_none()
        } else {
            namespace.is_none()
        };
        let status = match subresource {
            None => false,
            Some("status") if def.status_subresource => true,
            Some(_) => return Err(ApiError::NoRoute),
        };
        if !scoped_right {
            return Err(ApiError::NoRoute);
        }
        let query = Query::<HashMap<String, String>>::try_from_uri(uri)
            .map(|Query(query)| query)
            .map_err(|err| ApiError::BadRequest(err.to_string()))?;
        let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
        let verb = match (method.as_str(), name.is_some()) {
            ("GET", true) => Verb::Get,
            ("GET", false) if watch => Verb::Watch,
            ("GET", false) => Verb::List,
            ("POST", false) if !status => Verb::Create,
            ("PUT", true) => Verb::Update,
            ("PATCH", true) => Verb::Patch,
            ("DELETE", true) if !status => Verb::Delete,
            _ => return Err(ApiError::MethodNotAllowed),
        };
        Ok(Request {
            def,
            namespace,
            name,
            status,
            verb,
            query,
        })
    }

    /// The resource as requests are recorded and faults matched: `resourceclaims/status` for the subresource.
    fn resource_label(&self) -> String {
        if self.status {
            format!("{}/status", self.def.plural)
        } else {
            self.def.plural.to_string()
        }
    }

    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or_default()
    }

    fn key(&self) -> ObjectKey {
        ObjectKey::new(self.def, self.namespace.as_deref(), self.name())
    }

    fn dry_run(&self) -> bool {
        self.query.get("dryRun").is_some_and(|v| v == "All")
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if uri.path() == "/version" {
        shared.record(RequestRecord {
            verb: Verb::Get,
            resource: "version".into(),
            namespace: None,
            name: None,
            code: 200,
            dry_run: false,
            body_bytes: 0,
        });
        return json_response(200, &version_info(&shared));
    }
    if uri.path() == "/apis/authentication.k8s.io/v1/selfsubjectreviews" {
        return self_subject_review(&shared, &method, &headers, body.len()).await;
    }
    let request = match Request::parse(&method, &uri) {
        Ok(request) => request,
        Err(err) => return err.response(),
    };
    if shared.unserved(request.def.plural) {
        shared.record(RequestRecord {
            verb: request.verb,
            resource: request.resource_label(),
            namespace: request.namespace.clone(),
            name: request.name.clone(),
            code: 404,
            dry_run: request.dry_run(),
            body_bytes: body.len(),
        });
        // What kube-apiserver's mux answers for an API group it does not serve (a CRD alone in its
        // group and not applied): plain text, not a Status.
        return (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "404 page not found\n",
        )
            .into_response();
    }
    let latency = shared.latency();
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    shared
        .hangs
        .hold_if_hung(
            request.verb,
            &request.resource_label(),
            request.name.as_deref(),
            shared.shutdown.clone(),
        )
        .await;
    let response = match shared.take_fault(request.verb, &request.resource_label()) {
        Some(code) => ApiError::Injected { code }.response(),
        None => serve(&shared, &request, &headers, &body),
    };
    shared.record(RequestRecord {
        verb: request.verb,
        resource: request.resource_label(),
        namespace: request.namespace.clone(),
        name: request.name.clone(),
        code: response.status().as_u16(),
        dry_run: request.dry_run(),
        body_bytes: body.len(),
    });
    response
}

/// `kubectl auth whoami`: not stored, answered from the request's token (see [`super::identity`]), with
/// the latency and faults (resource `selfsubjectreviews`) that tests inject.
async fn self_subject_review(
    shared: &Shared,
    method: &Method,
    headers: &HeaderMap,
    body_bytes: usize,
) -> Response {
    const RESOURCE: &str = "selfsubjectreviews";
    if method != Method::POST {
        return ApiError::MethodNotAllowed.response();
    }
    let latency = shared.latency();
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let (code, body) = match shared.take_fault(Verb::Create, RESOURCE) {
        Some(code) => {
            let error = ApiError::Injected { code };
            (code, error.status())
        }
        None => {
            let authorization = headers
                .get(header::AUTHORIZATION)
                .and_then(|value| value.to_str().ok());
            super::identity::self_subject_review(&lock(&shared.tokens), authorization)
        }
    };
    shared.record(RequestRecord {
        verb: Verb::Create,
        resource: RESOURCE.into(),
        namespace: None,
        name: None,
        code,
        dry_run: false,
        body_bytes,
    });
    json_response(code, &body)
}

fn serve(shared: &Arc<Shared>, request: &Request, headers: &HeaderMap, body: &[u8]) -> Response {
    let result = match request.verb {
        Verb::Watch => {
            return super::watches::respond(shared.clone(), request)
                .unwrap_or_else(|err| err.response())
        }
        Verb::Get => get(shared, request),
        Verb::List => list(shared, request),
        Verb::Create => create(shared, request, body),
        Verb::Update => update(shared, request, body),
        Verb::Patch => patch(shared, request, headers, body),
        Verb::Delete => delete(shared, request, body),
    };
    match result {
        Ok((code, body)) => json_response(code, &body),
        Err(err) => err.response(),
    }
}

fn version_info(shared: &Shared) -> Value {
    let minor = shared.version().minor();
    json!({
        "major": "1",
        "minor": minor.to_string(),
        "gitVersion": format!("v1.{minor}.0"),
        "platform": "linux/amd64",
    })
}

type Answer = Result<(u16, Value), ApiError>;

fn get(shared: &Shared, request: &Request) -> Answer {
    Ok((200, stored(&shared.store(), request)?))
}

fn stored(store: &Store, request: &Request) -> Result<Value, ApiError> {
    store
        .objects
        .get(&request.key())
        .cloned()
        .ok_or_else(|| ApiError::NotFound {
            def: request.def,
            name: request.name().to_string(),
        })
}

/// Lists in one page: `limit` is honoured as "everything fits", so no `continue` token is ever returned.
fn list(shared: &Shared, request: &Request) -> Answer {
    let selection = Selection::parse(request.def, request.namespace.clone(), &request.query)
        .map_err(ApiError::BadRequest)?;
    let store = shared.store();
    let items: Vec<Value> = store
        .objects
        .iter()
        .filter(|(key, obj)| key.resource == request.def.plural && selection.matches(obj))
        .map(|(_, obj)| obj.clone())
        .collect();
    Ok((
        200,
        json!({
            "kind": format!("{}List", request.def.kind),
            "apiVersion": request.def.api_version(),
            "metadata": {"resourceVersion": store.revision.to_string()},
            "items": items,
        }),
    ))
}

fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
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
fn check_identity(request: &Request, obj: &mut Value) -> Result<(), ApiError> {
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
fn admit(
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

fn create(shared: &Shared, request: &Request, body: &[u8]) -> Answer {
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

/// Gives device taints without `timeAdded` the current time, as the server does; a taint that was already
/// there keeps its time.
fn stamp_taints(obj: &mut Value, old: Option<&Value>) {
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

fn update(shared: &Shared, request: &Request, body: &[u8]) -> Answer {
    let obj = parse_body(body)?;
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

fn patch(shared: &Shared, request: &Request, headers: &HeaderMap, body: &[u8]) -> Answer {
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

fn delete(shared: &Shared, request: &Request, body: &[u8]) -> Answer {
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
                "kind": request.def.plural,
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
