//! The pool's HTTP API:
//!
//! - `POST /v1/internal/kv/pull` (a worker's `PullRequest`): the leading
//!   pages of the prompt (or of its `blocks`) the pool holds, as a page stream in the puller's format
//!   (none: an empty stream); a pool cannot prefill (400).
//! - `POST /v1/internal/kv/push`: a `PushHeader` frame (tokens, or the
//!   block hashes themselves; `pin` for a soft pin, `keep_ms` for one that
//!   ends: `retain-all`'s spills), then a page stream; each
//!   page is checked against the chain and kept; `{"pages": N}`.
//! - `POST /v1/admin/pages/delete`: `{"format", "tokens", "cache_salt"?}` (a
//!   prefix's pages) or `{"older_than_ms": N}`; `{"deleted": N}`.
//! - `GET /v1/internal/kv-events?fingerprint=N` (server-sent events, as a
//!   worker's): a `snapshot` of every block held (memory or disk) for pages
//!   of that model, then `kv` batches of blocks stored and removed, numbered
//!   per subscriber; a subscriber too slow gets `lagged` and reconnects. A
//!   controller follows it to count pool hits.
//! - `GET /health`, `GET /metrics`.
//!
//! With keys configured, every route but `/health` needs one: role `worker`
//! for the internal routes, `admin` for deletes (403 naming the role).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use pie_core::auth::{authenticate, ApiKey, Role};
use pie_core::hash::chain_from;
use pie_core::{BlockHash, KvEventBatch, KvSnapshot};
use pie_kv::stream::{
    frame_length, Checked, FrameReader, PullRequest, PushHeader, StreamCheck, StreamHeader,
    END_FRAME, MAX_PUSH_HEADER_BYTES,
};
use pie_kv::transfer::PageFormat;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::store::{Change, Page, PageStore, Pin};

/// Batches of changes a slow subscriber may fall behind by.
const EVENT_BACKLOG: usize = 1024;

pub struct Pool {
    store: Arc<Mutex<PageStore>>,
    keys: Vec<ApiKey>,
    /// The store's changes, published under its lock (so a snapshot taken
    /// under it and the batches after it never overlap or miss).
    events: broadcast::Sender<Arc<Vec<Change>>>,
}

impl Pool {
    pub fn new(store: PageStore, keys: Vec<ApiKey>) -> Self {
        Self {
            store: Arc::new(Mutex::new(store)),
            keys,
            events: broadcast::channel(EVENT_BACKLOG).0,
        }
    }

    /// `work` on the store, on a blocking thread (its disk tier does I/O);
    /// the changes it made are published.
    pub async fn with_store<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut PageStore) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let (store, events) = (self.store.clone(), self.events.clone());
        tokio::task::spawn_blocking(move || {
            let mut store = store.lock().unwrap_or_else(|e| e.into_inner());
            let out = work(&mut store);
            let changes = store.take_changes();
            if !changes.is_empty() {
                let _ = events.send(Arc::new(changes));
            }
            out
        })
        .await
        .map_err(|e| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("store task failed: {e}"),
            )
        })
    }
}

type Shared = Arc<Pool>;

pub fn router(pool: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/internal/kv/pull", post(pull))
        .route("/v1/internal/kv/push", post(push))
        .route("/v1/internal/kv-events", get(kv_events))
        .route("/v1/admin/pages/delete", post(delete))
        .layer(middleware::from_fn_with_state(pool.clone(), auth))
        .with_state(pool)
}

/// An error answer: the status and the OpenAI-shaped body both binaries use.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = pie_core::api_error::error_body(self.status.as_u16(), &self.message, None);
        (self.status, Json(body)).into_response()
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> ApiError {
    ApiError {
        status,
        message: message.into(),
    }
}

async fn auth(State(pool): State<Shared>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    if pool.keys.is_empty() || path == "/health" {
        return next.run(req).await;
    }
    let header = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    let key = match authenticate(&pool.keys, header) {
        Ok(k) => k,
        Err(e) => return error(StatusCode::UNAUTHORIZED, e.to_string()).into_response(),
    };
    let need = if path.starts_with("/v1/admin/") {
        Role::Admin
    } else {
        Role::Worker
    };
    if let Err(message) = key.role.may_call(need, &key.name, &path) {
        return error(StatusCode::FORBIDDEN, message).into_response();
    }
    next.run(req).await
}

async fn health(State(pool): State<Shared>) -> Result<Json<Value>, ApiError> {
    let (pages, bytes, disk_pages) = pool.with_store(|s| s.sizes()).await?;
    Ok(Json(
        json!({"status": "ok", "pages": pages, "bytes": bytes, "disk_pages": disk_pages}),
    ))
}

async fn metrics(State(pool): State<Shared>) -> Result<Response, ApiError> {
    let text = pool.with_store(|s| crate::metrics::encode_store(s)).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// A prompt's chain as the puller or pusher computes it.
fn chain_of(format: &PageFormat, tokens: &[u32], salt: Option<&str>) -> Vec<BlockHash> {
    chain_from(
        format.fingerprint.salted_root(salt),
        tokens,
        format.layout.page_size,
    )
}

/// The chain a pull or push names: its `blocks` as given, else its tokens'.
fn named_chain(
    format: &PageFormat,
    blocks: Option<&[u64]>,
    tokens: &[u32],
    salt: Option<&str>,
) -> Vec<BlockHash> {
    match blocks {
        Some(blocks) => blocks.iter().copied().map(BlockHash).collect(),
        None => chain_of(format, tokens, salt),
    }
}

async fn pull(State(pool): State<Shared>, body: axum::body::Bytes) -> Result<Response, ApiError> {
    let req: PullRequest = serde_json::from_slice(&body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("pull request: {e}")))?;
    if req.prefill {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "a pool holds pages; it cannot prefill",
        ));
    }
    if req.format.layout.page_size == 0 {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "format.layout.page_size: must be positive",
        ));
    }
    let chain = named_chain(
        &req.format,
        req.blocks.as_deref(),
        &req.tokens,
        req.cache_salt.as_deref(),
    );
    let format = req.format;
    let pages = pool.with_store(move |s| s.leading(format, &chain)).await?;
    let chunks = stream_chunks(
        format,
        pages.into_iter().skip(req.skip_pages),
        req.max_bytes,
    );
    let body = Body::from_stream(futures_util::stream::iter(
        chunks.into_iter().map(Ok::<_, std::io::Error>),
    ));
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

/// A page stream of `pages` in `format`, ended before `max_bytes` would be
/// passed.
fn stream_chunks(
    format: PageFormat,
    pages: impl Iterator<Item = Page>,
    max_bytes: u64,
) -> Vec<Vec<u8>> {
    let mut out = vec![StreamHeader::new(format).frame()];
    let mut sent = 0u64;
    for page in pages {
        sent += page.len() as u64;
        if sent > max_bytes {
            break;
        }
        out.push(frame_length(page.len()).to_vec());
        out.push(page.as_ref().clone());
    }
    out.push(END_FRAME.to_vec());
    out
}

/// Read a push: its header, the stream's header (the pages' format), then
/// every page, checked against the chain and kept.
async fn push(State(pool): State<Shared>, body: Body) -> Result<Json<Value>, ApiError> {
    let bad = |m: String| error(StatusCode::BAD_REQUEST, m);
    let mut body = body.into_data_stream();
    let mut frames = FrameReader::new(MAX_PUSH_HEADER_BYTES);
    let header: PushHeader = next_frame(&mut body, &mut frames)
        .await
        .map_err(&bad)?
        .ok_or_else(|| bad("empty push".into()))
        .and_then(|f| serde_json::from_slice(&f).map_err(|e| bad(format!("push header: {e}"))))?;
    let stream_header = next_frame(&mut body, &mut frames)
        .await
        .map_err(&bad)?
        .ok_or_else(|| bad("no stream header".into()))?;
    let format = serde_json::from_slice::<StreamHeader>(&stream_header)
        .map_err(|e| bad(format!("stream header: {e}")))?
        .format;
    if format.layout.page_size == 0 {
        return Err(bad("format.layout.page_size: must be positive".into()));
    }
    let chain = named_chain(
        &format,
        header.blocks.as_deref(),
        &header.tokens,
        header.cache_salt.as_deref(),
    );
    let pin = Pin::of(header.pin, header.keep_ms, SystemTime::now());
    let mut check = StreamCheck::new(format, chain.clone(), 0);
    check.frame(stream_header).map_err(|e| bad(e.to_string()))?;
    frames.set_max_frame(check.max_frame());
    let refused = |kept: usize, why: String| {
        error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("push refused after {kept} pages: {why}"),
        )
    };
    let mut kept = 0usize;
    loop {
        let Some(f) = next_frame(&mut body, &mut frames)
            .await
            .map_err(|e| refused(kept, e))?
        else {
            return Err(refused(
                kept,
                "stream ended before its end frame (torn)".into(),
            ));
        };
        match check.frame(f).map_err(|e| refused(kept, e.to_string()))? {
            Checked::Page(at, bytes) => {
                let hash = chain[at];
                pool.with_store(move |s| s.put(format, hash, bytes, pin))
                    .await?
                    .map_err(|e| refused(kept, e.to_string()))?;
                kept += 1;
            }
            Checked::End => return Ok(Json(json!({ "pages": kept }))),
            Checked::Header => {}
        }
    }
}

/// The next whole frame of `body`; None when it ends.
async fn next_frame<S, B, E>(
    body: &mut S,
    frames: &mut FrameReader,
) -> Result<Option<Vec<u8>>, String>
where
    S: futures_util::Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    loop {
        if let Some(f) = frames.next_frame().map_err(|e| e.to_string())? {
            return Ok(Some(f));
        }
        match body.next().await {
            Some(Ok(chunk)) => frames.push(chunk.as_ref()),
            Some(Err(e)) => return Err(format!("torn: {e}")),
            None => return Ok(None),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    fingerprint: u64,
}

fn json_event(name: &str, data: &impl serde::Serialize) -> Event {
    Event::default()
        .event(name)
        .data(serde_json::to_string(data).unwrap_or_default())
}

/// The KV events of the pages of one model (see the module docs).
async fn kv_events(
    State(pool): State<Shared>,
    query: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let Query(EventsQuery { fingerprint }) =
        query.map_err(|e| error(StatusCode::BAD_REQUEST, e.body_text()))?;
    let events = pool.events.clone();
    let (held, rx) = pool
        .with_store(move |s| (s.held(fingerprint), events.subscribe()))
        .await?;
    let snapshot = KvSnapshot {
        seq: 0,
        fingerprint,
        page_size: 0,
        hashes: held,
        persisted: Vec::new(),
    };
    let first = json_event("snapshot", &snapshot);
    let batches = futures_util::stream::unfold(Some((rx, 0u64)), move |state| async move {
        let (mut rx, seq) = state?;
        loop {
            match rx.recv().await {
                Ok(changes) => {
                    let mine = changes
                        .iter()
                        .filter(|c| c.fingerprint == fingerprint)
                        .map(|c| (c.hash.0, c.stored));
                    let batch = KvEventBatch::from_changes(seq + 1, mine);
                    if !(batch.stored.is_empty() && batch.removed.is_empty()) {
                        return Some((json_event("kv", &batch), Some((rx, seq + 1))));
                    }
                }
                // Behind: the follower resubscribes for a fresh snapshot.
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    return Some((Event::default().event("lagged").data("reconnect"), None));
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    let events = futures_util::stream::once(std::future::ready(first))
        .chain(batches)
        .map(Ok);
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Delete {
    #[serde(default)]
    format: Option<PageFormat>,
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    older_than_ms: Option<u64>,
}

async fn delete(
    State(pool): State<Shared>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let d: Delete = serde_json::from_slice(&body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("delete: {e}")))?;
    let deleted = match (d.format, d.tokens, d.older_than_ms) {
        (Some(format), Some(tokens), None) => {
            let chain = chain_of(&format, &tokens, d.cache_salt.as_deref());
            pool.with_store(move |s| s.remove_chain(format, &chain))
                .await?
        }
        (None, None, Some(ms)) => {
            pool.with_store(move |s| {
                s.remove_older_than(Duration::from_millis(ms), SystemTime::now())
            })
            .await?
        }
        _ => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "give `format` and `tokens` (a prefix's pages), or `older_than_ms`",
            ))
        }
    };
    Ok(Json(json!({ "deleted": deleted })))
}
