//! Why a request failed, and the `kind: Status` answer the real server sends for each reason: code,
//! reason, message and details, in a response body or a watch ERROR event.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};

use super::validation::{self, FieldError};
use super::ResourceDef;

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
                Some(json!({"name": name, "group": def.group, "kind": def.path_plural()}))
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

    pub(super) fn response(&self) -> Response {
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

pub(super) fn json_response(code: u16, body: &Value) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
