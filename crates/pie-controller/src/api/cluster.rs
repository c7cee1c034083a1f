//! The cluster's own routes: its view (`GET /v1/cluster`, less for client
//! keys), workers registering and leaving, the actors' log and scale hints,
//! and relocating a session's streams.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use pie_core::auth::Role;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::caller::{acting_as, ClientKey};
use crate::controller::Controller;
use crate::registry::RegisterLimits;
use crate::respond::error;

pub fn routes() -> Router<Arc<Controller>> {
    Router::new()
        .route("/v1/cluster", get(cluster))
        .route("/v1/cluster/register", post(register))
        .route("/v1/cluster/deregister", post(deregister))
        .route("/v1/cluster/actions", get(actions))
        .route("/v1/cluster/scale", get(scale))
        .route("/v1/cluster/sessions/{session}/relocate", post(relocate))
}

async fn cluster(
    State(ctl): State<Arc<Controller>>,
    key: Option<Extension<ClientKey>>,
) -> Json<Value> {
    if matches!(&key, Some(Extension(k)) if k.role == Role::Client) {
        return Json(client_view_of_cluster(&ctl));
    }
    let (names, sessions) = {
        let pipeline = ctl.pipeline.lock().unwrap_or_else(|e| e.into_inner());
        let names: Vec<&str> = pipeline.iter().map(|p| p.name()).collect();
        let sessions: usize = pipeline.iter().filter_map(|p| p.sessions()).sum();
        (names, sessions)
    };
    let queued = ctl.admission.queued();
    let index_entries = ctl.registry.with_index(|i, _| i.entries());
    Json(json!({
        "workers": ctl.registry.snapshot(),
        "cluster_policies": names,
        "actors": ctl.actors.summary(),
        "cluster_priority": ctl.admission.queueing.load(Ordering::Relaxed),
        "sessions": sessions,
        "queued": queued,
        "clients_in_flight": ctl.admission.clients_in_flight.clients(),
        "client_service": ctl.admission.service_summary(),
        "index_entries": index_entries,
        "pending_blocks": ctl.registry.pending_blocks(),
        "pool_blocks": ctl.registry.pool_blocks(),
    }))
}

/// What a client key sees of the cluster: workers' health and load, not their
/// addresses, sessions, actors or cache contents.
fn client_view_of_cluster(ctl: &Controller) -> Value {
    let workers: Vec<Value> = ctl
        .registry
        .snapshot()
        .iter()
        .map(|w| json!({"name": w.name, "healthy": w.healthy, "load": w.load}))
        .collect();
    json!({"workers": workers})
}

/// Longest worker name registration accepts.
const MAX_WORKER_NAME: usize = 64;

/// A registration's body, checked: a worker name usable in `WORKER~ID` ids and
/// an http(s) URL.
fn registration(body: &Value) -> Result<(String, String, Option<String>), String> {
    let group = match &body["group"] {
        Value::Null => None,
        Value::String(g) if !g.is_empty() => Some(g.clone()),
        _ => return Err("register: `group` must be a non-empty string".into()),
    };
    let usage = "register needs {\"name\": ..., \"url\": \"http://...\"} (optional \"group\")";
    let (Some(name), Some(url)) = (body["name"].as_str(), body["url"].as_str()) else {
        return Err(usage.into());
    };
    let name_ok = !name.is_empty()
        && name.len() <= MAX_WORKER_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if !name_ok {
        return Err(format!(
            "register: `name` must be 1 to {MAX_WORKER_NAME} characters of a-z, A-Z, 0-9, `-`, `_`, `.`"
        ));
    }
    match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.has_host() => {}
        _ => {
            return Err(format!(
                "register: `url` must be an http(s) URL, got `{url}`"
            ))
        }
    }
    Ok((name.to_string(), url.to_string(), group))
}

/// Registration (a worker's heartbeat): the name is bound to the key that
/// first registered it.
async fn register(
    State(ctl): State<Arc<Controller>>,
    key: Option<Extension<ClientKey>>,
    Json(body): Json<Value>,
) -> Response {
    let (name, url, group) = match registration(&body) {
        Ok(r) => r,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let by = acting_as(key.as_deref());
    let limits = RegisterLimits {
        max_registered: ctl.max_registered_workers,
        may_rebind: by.role == Role::Admin && key.is_some(),
    };
    match ctl
        .registry
        .register(&name, &url, group, Some(&by.client), limits)
    {
        Ok(new_slot) => {
            if let Some(slot) = new_slot {
                ctl.follow_kv_events(slot);
            }
            Json(json!({"registered": name})).into_response()
        }
        Err(message) => error(StatusCode::FORBIDDEN, message),
    }
}

/// `POST /v1/cluster/deregister {"name"}`: a registered worker leaves (a
/// drained worker says so before it exits); the key that registered it, or
/// an admin. 404 for an unknown name, 403 for another key's worker.
async fn deregister(
    State(ctl): State<Arc<Controller>>,
    key: Option<Extension<ClientKey>>,
    Json(body): Json<Value>,
) -> Response {
    let Some(name) = body["name"].as_str() else {
        return error(StatusCode::BAD_REQUEST, "`name` (a string) is required");
    };
    let by = acting_as(key.as_deref());
    let admin = by.role == Role::Admin && key.is_some();
    match ctl.registry.deregister(name, &by.client, admin) {
        Ok(()) => {
            tracing::info!(worker = name, "deregistered");
            Json(json!({"deregistered": name})).into_response()
        }
        Err(message) if message.starts_with("no registered") => {
            error(StatusCode::NOT_FOUND, message)
        }
        Err(message) => error(StatusCode::FORBIDDEN, message),
    }
}

/// `GET /v1/cluster/actions` (newest first).
async fn actions(State(ctl): State<Arc<Controller>>) -> Json<Value> {
    Json(ctl.actors.actions_view())
}

/// `GET /v1/cluster/scale`.
async fn scale(State(ctl): State<Arc<Controller>>) -> Json<Value> {
    Json(ctl.actors.scale_view())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RelocateBody {
    worker: String,
}

/// `POST /v1/cluster/sessions/{session}/relocate {"worker": NAME}` (admin):
/// the session's streams in flight move to that worker, live (prefetch,
/// hand-off, pull). 202 with how many were asked to move; 404 when the worker
/// does not serve or no stream of the session is in flight.
async fn relocate(
    State(ctl): State<Arc<Controller>>,
    Path(session): Path<String>,
    body: Result<Json<RelocateBody>, JsonRejection>,
) -> Response {
    let Json(RelocateBody { worker }) = match body {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    if !ctl.registry.serves(&worker) {
        return error(
            StatusCode::NOT_FOUND,
            format!("worker `{worker}` is not a serving worker of this cluster"),
        );
    }
    match ctl.streams.move_session(&session, &worker) {
        0 => error(
            StatusCode::NOT_FOUND,
            format!("no stream of session `{session}` is in flight off `{worker}`"),
        ),
        moving => (
            StatusCode::ACCEPTED,
            Json(json!({"session": session, "worker": worker, "moving": moving})),
        )
            .into_response(),
    }
}
