//! The routes a controller and peer workers call (`/v1/internal/...` and
//! `/v1/policies`, role `worker`): state and tokenizer polls, the KV event
//! stream, hand-offs, and KV page transfer (prefetch, persist, retain, pull,
//! push).

use std::convert::Infallible;

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::BroadcastStream;

use super::auth::{cache_salt_of, check_peer_url, Authed};
use super::health::unhealthy;
use super::state::{persist_error, transfer_error, ApiError, ApiJson, AppState};
use crate::process::ProcState;
use crate::runtime::{PersistTo, PullRequest, Runtime};

/// The worker policies in force, when they were loaded, and their state.
pub(super) async fn policies(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let names = rt
        .policy_names
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    Ok(Json(json!({
        "worker_policy": names,
        "loaded_at_ms": rt.policies_loaded_ms.load(std::sync::atomic::Ordering::Relaxed),
        "queued": rt.count_in(ProcState::Queued),
        "running": rt.count_in(ProcState::Running),
        "state": rt.policy_state().await,
    })))
}

/// Health and load for a controller's poll; cheap (no cache contents). An
/// unhealthy engine answers 503 with the reason, as `/health` does, so the
/// controller takes the worker out of routing.
pub(super) async fn worker_state(State(state): State<AppState>) -> Result<Response, ApiError> {
    let rt = state.runtime()?;
    if let Err(reason) = rt.health() {
        return Ok(unhealthy(&reason));
    }
    let (queued, running) = (
        rt.count_in(ProcState::Queued),
        rt.count_in(ProcState::Running),
    );
    Ok(Json(json!({
        "load": queued + running,
        "queued": queued,
        "running": running,
        "max_running": rt.shape.max_running,
        "page_size": rt.shape.page_size,
        "fingerprint": rt.shape.fingerprint,
        "stage": rt.settings.stage,
        "model": rt.settings.model_name,
        "draining": rt.draining(),
        "pool": rt.settings.pool.is_some(),
        "retain_spill": rt.retain_spill(),
    }))
    .into_response())
}

/// The model's tokenizer as data, with the model's fingerprint: what a
/// controller started without `--model` routes with.
pub(super) async fn worker_tokenizer(
    State(state): State<AppState>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    Ok(Json(json!({
        "fingerprint": rt.shape.fingerprint,
        "tokenizer": rt.model.tokenizer_spec,
    })))
}

fn json_event(name: &str, data: &impl serde::Serialize) -> Event {
    let data = serde_json::to_string(data).unwrap_or_default();
    Event::default().event(name).data(data)
}

/// SSE for a controller: a `snapshot` of the prefix index, then a `kv` event per
/// batch of changes. A subscriber too slow to keep up gets a `lagged` event and
/// the stream ends; it reconnects for a fresh snapshot.
pub(super) async fn kv_events(
    State(state): State<AppState>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let rt = state.runtime()?;
    let (snapshot, rx) = rt
        .kv_subscribe()
        .await
        .ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped"))?;
    let after = snapshot.seq;
    let first = json_event("snapshot", &snapshot);
    let batches = BroadcastStream::new(rx)
        .take_while(|r| std::future::ready(r.is_ok()))
        .filter_map(move |r| {
            std::future::ready(
                r.ok()
                    .filter(|b| b.seq > after)
                    .map(|b| json_event("kv", &*b)),
            )
        });
    let events = stream::once(std::future::ready(first))
        .chain(batches)
        .chain(stream::once(std::future::ready(
            Event::default().event("lagged").data("reconnect"),
        )))
        .map(Ok);
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

/// A controller moves a process elsewhere: it stops here after its next
/// token (at once if it is not running yet) and its stream ends with a
/// hand-off (see `Runtime::hand_off`). 409 if it already ended or is being
/// handed off.
pub(super) async fn hand_off(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let p = rt
        .process(&id)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no process `{id}`")))?;
    if !pie_core::inferlet_ref::BUILT_IN.contains(&p.inferlet.as_str()) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "process `{id}` runs the WebAssembly inferlet `{}`, whose state lives in its \
                 guest's memory: it does not move",
                p.inferlet
            ),
        ));
    }
    if !rt.hand_off(&p) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "process `{id}` already ended or is being handed off ({})",
                p.state().as_str()
            ),
        ));
    }
    Ok(Json(json!({"id": id, "handing_off": true})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PrefetchBody {
    /// The worker that holds the pages.
    from: String,
    /// The prefix: its tokens, or its block hashes.
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    #[serde(default)]
    blocks: Option<Vec<u64>>,
}

/// A controller pulls the pages of a prefix that `from` holds (nothing is
/// computed there) into this pool: the first stage of a migration, while the
/// process still runs there, or a copy of a hot prefix (`replicate`, by its
/// block hashes); `{"pages": N}` held here afterwards.
pub(super) async fn kv_prefetch(
    State(state): State<AppState>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<PrefetchBody>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    check_peer_url("from", &body.from)?;
    let chain = prefix_chain(&rt, &auth, body.tokens, body.blocks)?;
    let pages = rt
        .prefetch(&body.from, &chain)
        .await
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, e.to_string()))?;
    Ok(Json(json!({"pages": pages})))
}

/// Which prefix to persist: its block hashes (the controller's
/// `persist-prefix`) or its tokens.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PersistBody {
    #[serde(default)]
    blocks: Option<Vec<u64>>,
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    /// `disk`, `pool` or (by default) whichever of the two the worker has.
    #[serde(default)]
    to: PersistTo,
}

/// Write a prefix's pages to this worker's disk tier and/or push them to its
/// pool (see `runtime::persist`): what was written, already there, held,
/// evicted, pooled; 409 when the worker has neither (or not the one `to`
/// names).
pub(super) async fn kv_persist(
    State(state): State<AppState>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<PersistBody>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let chain = prefix_chain(&rt, &auth, body.tokens, body.blocks)?;
    let done = rt.persist(chain, body.to).await.map_err(persist_error)?;
    Ok(Json(json!(done)))
}

/// Where retained sessions evicted early go (`retain-all`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RetainBody {
    /// `pool`, `disk`, `any` (the pool if the worker has one, else its
    /// disk), or null: dropped, as without `retain-all`.
    spill: Option<PersistTo>,
}

/// The controller's `retain-all` (see `runtime::spill`): 409 naming the
/// setting this worker lacks for the tier asked; the answer says whether
/// keep-session is on (without it nothing is retained, so nothing spills).
pub(super) async fn retain_spill(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<RetainBody>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    rt.set_retain_spill(body.spill).map_err(persist_error)?;
    let keep_session = rt.keeps_sessions();
    if body.spill.is_some() && !keep_session {
        tracing::warn!("retain-all asked to spill retained sessions, but keep-session is off: nothing is retained");
    }
    Ok(Json(
        json!({"spill": body.spill, "keep_session": keep_session}),
    ))
}

/// A prefix named by its tokens (under the caller's cache salt) or by its
/// block hashes, as its chain.
fn prefix_chain(
    rt: &Runtime,
    auth: &Option<Extension<Authed>>,
    tokens: Option<Vec<u32>>,
    blocks: Option<Vec<u64>>,
) -> Result<Vec<pie_core::BlockHash>, ApiError> {
    match (tokens, blocks) {
        (Some(tokens), None) => {
            rt.check_tokens(&tokens).map_err(transfer_error)?;
            Ok(rt.chain(&tokens, cache_salt_of(auth).as_deref()))
        }
        (None, Some(blocks)) => Ok(blocks.into_iter().map(pie_core::BlockHash).collect()),
        _ => Err(ApiError::bad_request(
            "give exactly one of `tokens` and `blocks`",
        )),
    }
}

/// A peer pulls KV pages (see `runtime::transfer`): a page stream, 409
/// when the page formats differ, 400 for bad tokens.
pub(super) async fn kv_pull(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<PullRequest>,
) -> Result<Response, ApiError> {
    let rt = state.runtime()?;
    let stream = rt.serve_pull(body).await.map_err(transfer_error)?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], stream).into_response())
}

/// A peer pushes KV pages (see `runtime::transfer`): `{"pages": N}`, the
/// prompt's leading pages held now; 422 naming the refusal (the whole pages
/// before it are kept), 400 for a bad header.
pub(super) async fn kv_push(
    State(state): State<AppState>,
    body: axum::body::Body,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let pages = rt.receive_push(body).await.map_err(transfer_error)?;
    Ok(Json(json!({"pages": pages})))
}
