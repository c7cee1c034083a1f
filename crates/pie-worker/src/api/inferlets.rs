//! The inferlet routes (`/v1/inferlets...`): upload a component, list the
//! installed ones, delete one. Installed inferlets are the operator's: any
//! client may launch them (`POST /v1/processes`), only an `admin` key or a
//! client key with `upload_inferlets` may change them.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::Authed;
use super::state::{ApiError, AppState};
use crate::inferlets::registry::{Quota, Uploader};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct UploadQuery {
    name: String,
    version: Option<String>,
}

/// May the caller change what is installed (no keys configured: anyone).
fn check_may_install(auth: &Option<Extension<Authed>>) -> Result<(), ApiError> {
    match auth {
        None => Ok(()),
        // A controller (a worker-role key) hands on what it installed.
        Some(Extension(a)) if a.role.is_internal() || a.limits.upload_inferlets => Ok(()),
        Some(Extension(a)) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "key `{}` may not install or delete inferlets: it needs role `admin` (or \
                 `worker`, a controller's) or the limit `upload_inferlets = true`",
                a.name
            ),
        )),
    }
}

/// Who changes what is installed: a key (none without keys); a client
/// key's quota, from its limits.
fn uploader(auth: &Option<Extension<Authed>>) -> Option<Uploader> {
    let Extension(a) = auth.as_ref()?;
    let quota = (a.role == pie_core::auth::Role::Client).then_some(Quota {
        max_inferlets: a.limits.max_inferlets,
        max_bytes: a.limits.max_inferlet_bytes,
    });
    Some(Uploader {
        key: a.name.clone(),
        quota,
    })
}

/// `POST /v1/inferlets?name=NAME[&version=VERSION]`, the component's bytes
/// as the body: validated and compiled before it is stored.
pub(super) async fn upload_inferlet(
    State(state): State<AppState>,
    Query(query): Query<UploadQuery>,
    auth: Option<Extension<Authed>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    check_may_install(&auth)?;
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            e.status(),
            format!(
                "the component is larger than [runtime.inferlets] max_upload ({} bytes)",
                state.inferlets.max_upload_bytes()
            ),
        ),
        status => ApiError::new(status, e.body_text()),
    })?;
    let inferlets = state.inferlets.clone();
    let uploader = uploader(&auth);
    let installed = tokio::task::spawn_blocking(move || {
        let version = query.version.as_deref();
        (inferlets.registry).install(&query.name, version, &body, uploader.as_ref())
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    Ok((StatusCode::CREATED, Json(json!(installed))).into_response())
}

/// `GET /v1/inferlets`: every installed version, and how many components
/// were compiled or loaded compiled since start.
pub(super) async fn list_inferlets(State(state): State<AppState>) -> Json<Value> {
    let i = &state.inferlets;
    Json(json!({
        "inferlets": i.registry.list(),
        "built_in": crate::inferlets::registry::BUILT_IN,
        "compiles": i.registry.compiles.load(std::sync::atomic::Ordering::Relaxed),
        "cache_loads": i.registry.cache_loads.load(std::sync::atomic::Ordering::Relaxed),
        "live_instances": i.live_instances(),
    }))
}

/// `DELETE /v1/inferlets/{NAME[@VERSION]}`: 409 while a process of it runs.
pub(super) async fn delete_inferlet(
    State(state): State<AppState>,
    Path(reference): Path<String>,
    auth: Option<Extension<Authed>>,
) -> Result<Json<Value>, ApiError> {
    check_may_install(&auth)?;
    let target = state.inferlets.registry.find(&reference)?;
    if let Some(rt) = state.runtime.get() {
        let prefix = format!("{}@", target.name);
        let running = rt.processes().into_iter().find(|p| {
            !p.state().is_final()
                && p.inferlet.starts_with(&prefix)
                && (reference == target.name || p.inferlet == reference)
        });
        if let Some(p) = running {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!(
                    "process {} of `{}` is running; kill it or wait",
                    p.id, p.inferlet
                ),
            ));
        }
    }
    let removed = (state.inferlets.registry).remove(&reference, uploader(&auth).as_ref())?;
    Ok(Json(json!({ "removed": removed })))
}
