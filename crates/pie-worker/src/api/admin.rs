//! The admin routes (`/v1/admin/...`, role `admin`): reload, drain, delete
//! persisted pages, and (`fault-injection` builds) inject a fault.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
#[cfg(feature = "fault-injection")]
use serde::Deserialize;
use serde_json::{json, Value};

use super::state::{persist_error, ApiError, ApiJson, AppState};
use crate::runtime::Forget;
#[cfg(feature = "fault-injection")]
use crate::supervisor::Fault;

#[cfg(feature = "fault-injection")]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FaultBody {
    fault: Fault,
    /// For `slow-transfer` and `slow-steps`: the pause before each page
    /// sent, or each engine step.
    #[serde(default)]
    delay_ms: u64,
}

/// `fault-injection` builds only: `{"fault": "panic" | "stall"}` makes the
/// engine thread panic, or stop making progress while work is pending;
/// `{"fault": "slow-transfer", "delay_ms": N}` pauses before each KV page
/// sent to a peer; `{"fault": "slow-steps", "delay_ms": N}` before each
/// engine step.
#[cfg(feature = "fault-injection")]
pub(super) async fn inject_fault(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<FaultBody>,
) -> Result<Json<Value>, ApiError> {
    state.runtime()?.inject_fault(body.fault, body.delay_ms);
    Ok(Json(json!({"injected": body.fault})))
}

/// Reload the configuration, as SIGHUP does (see [`crate::reload`]).
pub(super) async fn admin_reload(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    state.reload().map(Json).map_err(|e| {
        ApiError::bad_request(format!(
            "config reload refused, the running configuration stays: {e}"
        ))
    })
}

/// Begin a drain (as SIGTERM does): no new processes, `/health` 503
/// `draining`; the worker exits once its processes are gone (finished, or
/// moved by a controller) or after `[server] drain_timeout_ms`. 202 with
/// the processes left; again while draining is the same.
pub(super) async fn admin_drain(State(state): State<AppState>) -> Result<Response, ApiError> {
    let rt = state.runtime()?;
    if rt.start_drain() {
        tracing::info!(processes = rt.live_processes(), "drain requested");
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"draining": true, "processes": rt.live_processes()})),
    )
        .into_response())
}

/// Delete persisted pages: `{"tokens": [...]}` (a prefix's),
/// `{"older_than_ms": N}` (unused that long; 0: all); `{"deleted": N}`.
pub(super) async fn kv_forget_persisted(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Forget>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    if body.tokens.is_none() && body.older_than_ms.is_none() {
        return Err(ApiError::bad_request("give `tokens` or `older_than_ms`"));
    }
    let deleted = rt.forget_persisted(&body).map_err(persist_error)?;
    Ok(Json(json!({ "deleted": deleted })))
}
