//! Probes and metrics: `/health` (readiness), `/livez` (liveness),
//! `/metrics` (OpenMetrics text).

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::state::{ApiError, AppState};

/// Readiness: 200 `ok`; 503 while the model loads, 503 `draining` once a
/// drain began, and 503 `unhealthy` with the reason when the engine panicked
/// or stalls (see `supervisor`).
pub(super) async fn health(State(state): State<AppState>) -> Response {
    match state.runtime.get() {
        Some(rt) => match rt.health() {
            Ok(()) if rt.draining() => (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"status": "draining", "processes": rt.live_processes()})),
            )
                .into_response(),
            Ok(()) => Json(json!({"status": "ok"})).into_response(),
            Err(reason) => unhealthy(&reason),
        },
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

/// Liveness: 200 while loading, serving or draining (a draining worker must
/// not be restarted mid-drain); 503 only when the engine is unhealthy, which
/// a restart cures.
pub(super) async fn livez(State(state): State<AppState>) -> Response {
    match state.runtime.get().map(|rt| rt.health()) {
        Some(Err(reason)) => unhealthy(&reason),
        _ => Json(json!({"status": "live"})).into_response(),
    }
}

pub(super) fn unhealthy(reason: &str) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "unhealthy", "reason": reason})),
    )
        .into_response()
}

pub(super) async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let rt = state.runtime()?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        rt.metrics_text(),
    )
        .into_response())
}
