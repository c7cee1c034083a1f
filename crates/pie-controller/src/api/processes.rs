//! The `WORKER~ID` process routes: a native process's record, props, kill,
//! events and messages (to an inferlet's process), forwarded to the worker
//! it runs on now (it may have moved).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use pie_core::auth::Role;
use pie_core::Props;
use serde_json::{json, Value};

use crate::caller::{acting_as, Acting, ClientKey};
use crate::controller::Controller;
use crate::native;
use crate::respond::error;
use crate::streams::Whereabouts;

pub fn routes() -> Router<Arc<Controller>> {
    Router::new()
        .route(
            "/v1/processes/{id}",
            get(on_process).patch(on_process).delete(on_process),
        )
        .route("/v1/processes/{id}/events", get(on_process_events))
        .route(
            "/v1/processes/{id}/messages",
            axum::routing::post(on_process_messages),
        )
}

async fn on_process_messages(
    State(ctl): State<Arc<Controller>>,
    key: Option<Extension<ClientKey>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let acting = acting_as(key.as_deref());
    to_owner(
        &ctl,
        Method::POST,
        &id,
        "/messages",
        &headers,
        &acting,
        body,
    )
    .await
}

async fn on_process(
    State(ctl): State<Arc<Controller>>,
    key: Option<Extension<ClientKey>>,
    method: Method,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if method == Method::PATCH {
        if let Some(refused) = key.as_deref().and_then(|k| outside_limits(k, &body)) {
            return refused;
        }
    }
    let acting = acting_as(key.as_deref());
    to_owner(&ctl, method, &id, "", &headers, &acting, body).await
}

/// A client key's PATCH is bounded by its limits here, as its launch is:
/// the worker gets it with the controller's worker key, whose requests it
/// trusts. A body that is not a props patch is left for the worker to
/// refuse.
fn outside_limits(key: &ClientKey, body: &Bytes) -> Option<Response> {
    if key.role != Role::Client {
        return None;
    }
    let patch: Value = serde_json::from_slice(body).ok()?;
    let refusal = |e: pie_core::PropError| {
        let param = format!("props.{}", e.key);
        let body = pie_core::api_error::error_body(400, &e.to_string(), Some(&param));
        (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
    };
    let mut props = match Props::from_json(&patch["props"]) {
        Ok(props) => props,
        Err(e) => return Some(refusal(e)),
    };
    key.limits.apply(&key.name, &mut props).err().map(refusal)
}

async fn on_process_events(
    State(ctl): State<Arc<Controller>>,
    key: Option<Extension<ClientKey>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let acting = acting_as(key.as_deref());
    to_owner(
        &ctl,
        Method::GET,
        &id,
        "/events",
        &headers,
        &acting,
        Bytes::new(),
    )
    .await
}

/// A `WORKER~ID` process route, forwarded to its worker for the caller: the
/// worker answers 404 for a process the caller does not own. The id is
/// percent-encoded into the upstream path, so it can only name a process.
/// A process this controller moved is found where it runs now (the id the
/// client holds stays valid, and answers name it); a native one's events go
/// on from its new worker (`native::events`); one lost (moving, or with its
/// worker) answers
/// 502 with why. A PATCH of its props reaches the workers it moves to, and
/// one whose `pin` names another serving worker moves it there
/// (`x-pie-relocating` names it). `x-pie-worker` names the worker that
/// answered.
async fn to_owner(
    ctl: &Arc<Controller>,
    method: Method,
    id: &str,
    suffix: &str,
    headers: &HeaderMap,
    acting: &Acting,
    body: Bytes,
) -> Response {
    let Some((origin, origin_local)) = id.split_once('~') else {
        return error(
            StatusCode::NOT_FOUND,
            format!("no process `{id}` (cluster ids look like WORKER~ID)"),
        );
    };
    let (worker, local, replays) = match ctl.streams.current(origin, origin_local) {
        Some(Whereabouts::Lost(why)) => {
            return error(
                StatusCode::BAD_GATEWAY,
                format!("process `{id}` was lost: {why}"),
            )
        }
        Some(Whereabouts::At {
            worker,
            local,
            replays,
        }) => (worker, local, replays),
        None => (origin.to_string(), origin_local.to_string(), false),
    };
    let Some(url) = ctl.registry.url_of(&worker) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("no worker `{worker}` for process `{id}`"),
        );
    };
    let encoded = utf8_percent_encode(&local, NON_ALPHANUMERIC);
    let process_url = format!("{url}/v1/processes/{encoded}{suffix}");
    if suffix == "/events" && replays {
        let origin = (origin.to_string(), origin_local.to_string());
        return native::events(ctl.clone(), origin, (&worker, &local), &process_url, acting).await;
    }
    let patch = method == Method::PATCH;
    let resp = (ctl.worker_client)
        .forward(method, &process_url, headers, acting, body)
        .await
        .unwrap_or_else(|e| error(StatusCode::BAD_GATEWAY, format!("worker `{worker}`: {e}")));
    let mut resp = resp;
    if let Ok(value) = worker.parse() {
        resp.headers_mut().insert("x-pie-worker", value);
    }
    let moved = (worker.as_str(), local.as_str()) != (origin, origin_local);
    if !resp.status().is_success() || !(patch || moved) || !suffix.is_empty() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return error(StatusCode::BAD_GATEWAY, "unreadable worker response");
    };
    let Ok(mut answer) = serde_json::from_slice::<Value>(&bytes) else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    if moved && answer["id"].is_string() {
        answer["id"] = json!(id);
    }
    parts.headers.remove("content-length");
    let serves = |w: &str| ctl.registry.serves(w);
    if let Some(to) = patch
        .then(|| {
            ctl.streams
                .patched(origin, origin_local, &answer["props"], serves)
        })
        .flatten()
    {
        tracing::info!(
            process = id,
            from = worker,
            to,
            "pin changed: moving the stream"
        );
        if let Ok(value) = to.parse() {
            parts.headers.insert("x-pie-relocating", value);
        }
    }
    Response::from_parts(parts, Body::from(answer.to_string()))
}
