//! The API's shared state and the error every handler answers with:
//! [`AppState`] (the runtime once the model has loaded, the keys, the
//! configuration in force), [`ApiError`] in OpenAI's JSON shape with the
//! runtime's errors mapped to HTTP statuses, and the [`ApiJson`] extractor
//! whose rejections are ApiErrors.

use std::sync::{Arc, OnceLock, RwLock};

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use pie_core::PropError;
use serde_json::Value;

use crate::config::{ApiKey, Config};
use crate::inferlets::{InferletError, Inferlets, RegistryError};
use crate::reload::{self, Reloader};
use crate::runtime::{LaunchError, PersistError, Runtime, ServeError};

/// Shared server state: the runtime appears once the model has loaded.
#[derive(Clone)]
pub struct AppState {
    pub runtime: Arc<OnceLock<Arc<Runtime>>>,
    pub api_keys: Arc<RwLock<Vec<ApiKey>>>,
    pub reloader: Reloader,
    /// The configuration in force (updated by reloads).
    pub config: Arc<RwLock<Config>>,
    /// Installed WebAssembly inferlets and the instances running them.
    pub inferlets: Arc<Inferlets>,
}

impl AppState {
    pub fn runtime(&self) -> Result<Arc<Runtime>, ApiError> {
        self.runtime.get().cloned().ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model is still loading",
            )
        })
    }

    /// Apply a fresh configuration (see [`reload::reload`]); refused while
    /// the model is still loading.
    pub fn reload(&self) -> Result<Value, String> {
        let Some(rt) = self.runtime.get() else {
            return Err("the model is still loading".into());
        };
        reload::reload(rt, &self.reloader, &self.config, &self.api_keys)
    }
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = pie_core::api_error::error_body(
            self.status.as_u16(),
            &self.message,
            self.param.as_deref(),
        );
        let mut resp = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

impl From<PropError> for ApiError {
    fn from(e: PropError) -> Self {
        ApiError::bad_request(e.to_string()).param(&format!("props.{}", e.key))
    }
}

impl From<LaunchError> for ApiError {
    fn from(e: LaunchError) -> Self {
        match e {
            LaunchError::Overloaded(_) | LaunchError::OverShare { .. } => ApiError {
                retry_after: Some(1),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            },
            LaunchError::BadRequest(m) => ApiError::bad_request(m),
            LaunchError::Unhealthy(_) | LaunchError::Draining => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
        }
    }
}

impl From<InferletError> for ApiError {
    fn from(e: InferletError) -> Self {
        match e {
            InferletError::Launch(e) => e.into(),
            InferletError::Registry(e) => e.into(),
        }
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        let status = match e {
            RegistryError::Invalid(_) => StatusCode::BAD_REQUEST,
            RegistryError::NotFound(_) => StatusCode::NOT_FOUND,
            RegistryError::Forbidden(_) => StatusCode::FORBIDDEN,
            RegistryError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            RegistryError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string())
    }
}

/// `Json` whose rejections (bad JSON, wrong fields, body too large) are ApiErrors.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

fn json_rejection(rejection: JsonRejection) -> ApiError {
    let status = rejection.status();
    let message = match status {
        StatusCode::PAYLOAD_TOO_LARGE => {
            "request body is larger than the server's limit (server.max_body_bytes)".to_string()
        }
        _ => rejection.body_text(),
    };
    ApiError::new(status, message)
}

/// A persist or retain error's HTTP status.
pub(super) fn persist_error(e: PersistError) -> ApiError {
    let status = match e {
        PersistError::NoStore | PersistError::NoDisk | PersistError::NoPool => StatusCode::CONFLICT,
        PersistError::Disk(pie_kv::disk::DiskError::OverBudget { .. }) => {
            StatusCode::INSUFFICIENT_STORAGE
        }
        PersistError::Pool { .. } => StatusCode::BAD_GATEWAY,
        PersistError::Disk(_) | PersistError::Engine(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::new(status, e.to_string())
}

/// A page transfer error's HTTP status.
pub(super) fn transfer_error(e: ServeError) -> ApiError {
    let message = e.to_string();
    match e {
        ServeError::Handshake(_) => ApiError::new(StatusCode::CONFLICT, message),
        ServeError::BadTokens(_) => ApiError::bad_request(message).param("tokens"),
        ServeError::Refused { .. } => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, message),
        ServeError::Prefill(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message),
    }
}
