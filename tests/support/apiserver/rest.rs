//! The HTTP side of the API server double: maps Kubernetes REST paths and methods to verbs, applies
//! injected latency and faults, runs each verb against the store (reads here, writes in `writes`)
//! and answers with JSON objects, lists or `kind: Status` errors (`errors`).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};

use super::errors::{json_response, ApiError};
use super::selectors::Selection;
use super::writes::{create, delete, patch, update};
use super::{lock, ObjectKey, RequestRecord, ResourceDef, Shared, Store, Verb};

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
        let def = super::resources::routed_def(group, version, plural).ok_or(ApiError::NoRoute)?;
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

    pub(super) fn name(&self) -> &str {
        self.name.as_deref().unwrap_or_default()
    }

    pub(super) fn key(&self) -> ObjectKey {
        ObjectKey::new(self.def, self.namespace.as_deref(), self.name())
    }

    pub(super) fn dry_run(&self) -> bool {
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

pub(super) type Answer = Result<(u16, Value), ApiError>;

fn get(shared: &Shared, request: &Request) -> Answer {
    Ok((200, stored(&shared.store(), request)?))
}

pub(super) fn stored(store: &Store, request: &Request) -> Result<Value, ApiError> {
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
