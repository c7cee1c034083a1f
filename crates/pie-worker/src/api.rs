//! The HTTP API: routes, auth, errors in OpenAI's JSON shape, and the native
//! process routes. The OpenAI-compatible routes are in [`crate::openai`].

use std::convert::Infallible;
use std::sync::{Arc, OnceLock, RwLock};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use pie_core::{PropError, PropValue, Props};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::BroadcastStream;

use crate::config::ApiKey;
use crate::process::{ProcEvent, ProcState, Process};
use crate::runtime::{
    Forget, GenOptions, Inferlet, LaunchError, PersistError, PersistTo, Prompt, PromptTokens,
    PullRequest, Resume, Runtime, ServeError, PROMPT_TOKENS_FIELD, RESUME_FIELD, STREAM_IDS_FIELD,
};
use pie_core::auth::{Caller, KeyLimits, Role, ACT_AS_CACHE_SALT, ACT_AS_CLIENT, ACT_AS_ROLE};

/// Shared server state: the runtime appears once the model has loaded.
#[derive(Clone)]
pub struct AppState {
    pub runtime: Arc<OnceLock<Arc<Runtime>>>,
    pub api_keys: Arc<RwLock<Vec<ApiKey>>>,
    pub reloader: crate::serve::Reloader,
    /// The configuration in force (updated by reloads).
    pub config: Arc<RwLock<crate::config::Config>>,
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
            LaunchError::Overloaded(_) => ApiError {
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

/// The API key that authenticated a request (absent when no keys are configured).
#[derive(Clone, Debug)]
pub struct Authed {
    pub name: String,
    pub role: Role,
    pub limits: KeyLimits,
    /// A worker key's request made for a client (a controller forwarding):
    /// that client's name and role, from the `x-pie-client` headers.
    pub acting_for: Option<(String, Role)>,
    /// Whose cached KV the request may share: a client key's own salt, or
    /// the one a controller forwards for its client.
    pub cache_salt: Option<String>,
}

/// The role a route needs, by its path.
fn required_role(path: &str) -> Role {
    if path.starts_with("/v1/admin/") {
        Role::Admin
    } else if path.starts_with("/v1/internal/") || path == "/v1/policies" {
        Role::Worker
    } else {
        Role::Client
    }
}

async fn auth(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    match authenticate_request(&state, &req) {
        Ok(Some(authed)) => {
            req.extensions_mut().insert(authed);
        }
        Ok(None) => {}
        Err(refused) => return refused.into_response(),
    }
    next.run(req).await
}

/// Who sent `req`, checked against the keys and the route's role (under the
/// keys' read lock: the key list is not copied per request). None when no
/// keys are configured, and for `/health`.
fn authenticate_request(state: &AppState, req: &Request) -> Result<Option<Authed>, ApiError> {
    let keys = state.api_keys.read().unwrap_or_else(|e| e.into_inner());
    let path = req.uri().path();
    if keys.is_empty() || path == "/health" || path == "/livez" {
        return Ok(None);
    }
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let key = pie_core::auth::authenticate(&keys, header)
        .map_err(|e| ApiError::new(StatusCode::UNAUTHORIZED, e.to_string()))?;
    key.role
        .may_call(required_role(path), &key.name, path)
        .map_err(|message| ApiError::new(StatusCode::FORBIDDEN, message))?;
    let acting_for = (key.role == Role::Worker)
        .then(|| acting_for(req.headers()))
        .flatten();
    let cache_salt = match key.role {
        Role::Client => key.limits.cache_salt.clone(),
        Role::Worker => header_text(req.headers(), ACT_AS_CACHE_SALT),
        Role::Admin => None,
    };
    Ok(Some(Authed {
        name: key.name.clone(),
        role: key.role,
        limits: key.limits.clone(),
        acting_for,
        cache_salt,
    }))
}

/// The client a controller says it acts for; its role defaults to `client`.
fn acting_for(headers: &axum::http::HeaderMap) -> Option<(String, Role)> {
    let client = header_text(headers, ACT_AS_CLIENT)?;
    let role = header_text(headers, ACT_AS_ROLE)
        .as_deref()
        .and_then(Role::parse)
        .filter(|r| *r != Role::Worker)
        .unwrap_or(Role::Client);
    Some((client, role))
}

fn header_text(headers: &axum::http::HeaderMap, name: &str) -> Option<String> {
    Some(headers.get(name)?.to_str().ok()?.to_string())
}

/// The cache salt a request's pages chain from (see [`Authed::cache_salt`]).
pub fn cache_salt_of(auth: &Option<Extension<Authed>>) -> Option<String> {
    auth.as_ref().and_then(|Extension(a)| a.cache_salt.clone())
}

/// Who is asking, for ownership: a worker key acting for a client is that client.
pub fn caller_of(auth: &Option<Extension<Authed>>) -> Caller {
    match auth {
        None => Caller::Open,
        Some(Extension(a)) => match &a.acting_for {
            Some((client, role)) => Caller::Key {
                name: client.clone(),
                role: *role,
            },
            None => Caller::Key {
                name: a.name.clone(),
                role: a.role,
            },
        },
    }
}

/// The forwarded `pie_prompt_tokens` a request may use. The rule: only a
/// `worker`-role key (a controller, which tokenized the request's own text)
/// may send them; from a `client` or `admin` key they are refused with 400
/// naming the field (a client wanting ids sends a token-id `prompt`, which is
/// what the output is then reported against; ids beside a text `prompt`
/// could differ from it). A worker without keys cannot tell a controller from
/// a client, so it ignores them and tokenizes the text itself.
pub fn trusted_prompt_tokens(
    auth: &Option<Extension<Authed>>,
    field: Option<PromptTokens>,
) -> Result<Option<PromptTokens>, ApiError> {
    controller_field(auth, PROMPT_TOKENS_FIELD, field, false)
}

/// The request field naming the prefill worker a controller chose.
pub use pie_core::wire::PREFILL_FROM_FIELD;
use pie_core::wire::SESSION_TURNS_FIELD;

/// `pie_prefill_from`: the URL of the worker a controller's `disaggregate`
/// chose to prefill the prompt; this worker pulls the pages from it. Refused
/// (400) from a `client` or `admin` key; without keys it is taken (such a
/// worker answers its internal routes to anyone as well). Must be an http(s)
/// URL.
pub fn trusted_prefill_from(
    auth: &Option<Extension<Authed>>,
    field: Option<String>,
) -> Result<Option<String>, ApiError> {
    let url = controller_field(auth, PREFILL_FROM_FIELD, field, true)?;
    if let Some(u) = &url {
        check_peer_url(PREFILL_FROM_FIELD, u)?;
    }
    Ok(url)
}

/// A peer worker's URL in field `name`: http(s), or a 400 naming the field.
fn check_peer_url(name: &str, url: &str) -> Result<(), ApiError> {
    let scheme = reqwest::Url::parse(url).map(|p| p.scheme().to_string());
    if matches!(scheme.as_deref(), Ok("http" | "https")) {
        Ok(())
    } else {
        Err(
            ApiError::bad_request(format!("{name} must be an http(s) URL, got `{url}`"))
                .param(name),
        )
    }
}

/// `pie_resume`: the process ran on another worker and goes on here (see
/// [`Resume`]); from a `worker` key only (400 from others); without keys it
/// is taken (such a worker trusts every caller, as with `pie_prefill_from`).
/// Its ids are checked against the vocabulary at launch, its `from` like
/// `pie_prefill_from`.
pub fn trusted_resume(
    auth: &Option<Extension<Authed>>,
    field: Option<Resume>,
) -> Result<Option<Resume>, ApiError> {
    let resume = controller_field(auth, RESUME_FIELD, field, true)?;
    if let Some(from) = resume.as_ref().and_then(|r| r.from.as_deref()) {
        check_peer_url(RESUME_FIELD, from)?;
    }
    Ok(resume)
}

/// `pie_stream_ids`: each streamed chunk carries its token id, so that a
/// controller can resume the stream elsewhere; from a `worker` key only
/// (taken without keys).
pub fn trusted_stream_ids(
    auth: &Option<Extension<Authed>>,
    field: Option<bool>,
) -> Result<bool, ApiError> {
    Ok(controller_field(auth, STREAM_IDS_FIELD, field, true)?.unwrap_or(false))
}

/// A field only a controller may set: taken from a `worker` key, refused
/// with 400 naming it from any other key; without keys, taken or ignored as
/// `taken_without_keys` says.
fn controller_field<T>(
    auth: &Option<Extension<Authed>>,
    name: &str,
    field: Option<T>,
    taken_without_keys: bool,
) -> Result<Option<T>, ApiError> {
    match (auth, field) {
        (_, None) => Ok(None),
        (None, Some(v)) => Ok(taken_without_keys.then_some(v)),
        (Some(Extension(a)), Some(v)) if a.role == Role::Worker => Ok(Some(v)),
        (Some(Extension(a)), Some(_)) => Err(ApiError::bad_request(format!(
            "{name} is accepted only from a worker-role key (a controller); key `{}` has role `{}`",
            a.name,
            a.role.as_str()
        ))
        .param(name)),
    }
}

/// The client a new process belongs to, with its props checked against the
/// key's limits: a client key is its own client; a worker key (a controller)
/// names the client it forwards in the `client` prop, after applying that
/// client's limits; with no keys configured the `client` prop names it. With
/// keys, the `client` prop is set to the client, so policies and views agree.
pub fn client_of(auth: &Option<Extension<Authed>>, props: &mut Props) -> Result<String, ApiError> {
    let client = resolve_client(auth, props)?;
    if auth.is_some() {
        props.set("client", PropValue::Str(client.clone()))?;
    }
    Ok(client)
}

fn resolve_client(auth: &Option<Extension<Authed>>, props: &mut Props) -> Result<String, ApiError> {
    let Some(Extension(a)) = auth else {
        return Ok(props.str("client").unwrap_or("anonymous").to_string());
    };
    match (a.role, &a.acting_for) {
        (Role::Worker, acting) => {
            let acting = acting.as_ref().map(|(client, _)| client.as_str());
            Ok(props
                .str("client")
                .or(acting)
                .unwrap_or(&a.name)
                .to_string())
        }
        (Role::Client, _) => {
            a.limits.apply(&a.name, props)?;
            Ok(a.name.clone())
        }
        (Role::Admin, _) => Ok(a.name.clone()),
    }
}

pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    let router = Router::new()
        .route("/health", get(health))
        .route("/livez", get(livez))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(crate::openai::models))
        .route(
            "/v1/completions",
            axum::routing::post(crate::openai::completions),
        )
        .route(
            "/v1/chat/completions",
            axum::routing::post(crate::openai::chat_completions),
        )
        .route("/v1/processes", get(list_processes).post(launch_process))
        .route(
            "/v1/processes/{id}",
            get(get_process).patch(patch_process).delete(kill_process),
        )
        .route("/v1/processes/{id}/events", get(process_events))
        .route("/v1/policies", get(policies))
        .route("/v1/admin/reload", axum::routing::post(admin_reload))
        .route("/v1/admin/drain", axum::routing::post(admin_drain))
        .route(
            "/v1/internal/processes/{id}/handoff",
            axum::routing::post(hand_off),
        )
        .route("/v1/internal/kv/prefetch", axum::routing::post(kv_prefetch))
        .route("/v1/internal/kv/persist", axum::routing::post(kv_persist))
        .route("/v1/internal/retain", axum::routing::post(retain_spill))
        .route(
            "/v1/admin/kv/persisted/delete",
            axum::routing::post(kv_forget_persisted),
        )
        .route("/v1/internal/kv/pull", axum::routing::post(kv_pull))
        .route("/v1/internal/kv/push", axum::routing::post(kv_push))
        .route("/v1/internal/state", get(worker_state))
        .route("/v1/internal/tokenizer", get(worker_tokenizer))
        .route("/v1/internal/kv-events", get(kv_events));
    #[cfg(feature = "fault-injection")]
    let router = router.route("/v1/admin/fault", axum::routing::post(inject_fault));
    router
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

/// Readiness: 200 `ok`; 503 while the model loads, 503 `draining` once a
/// drain began, and 503 `unhealthy` with the reason when the engine panicked
/// or stalls (see `supervisor`).
async fn health(State(state): State<AppState>) -> Response {
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
async fn livez(State(state): State<AppState>) -> Response {
    match state.runtime.get().map(|rt| rt.health()) {
        Some(Err(reason)) => unhealthy(&reason),
        _ => Json(json!({"status": "live"})).into_response(),
    }
}

fn unhealthy(reason: &str) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "unhealthy", "reason": reason})),
    )
        .into_response()
}

#[cfg(feature = "fault-injection")]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultBody {
    fault: crate::supervisor::Fault,
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
async fn inject_fault(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<FaultBody>,
) -> Result<Json<Value>, ApiError> {
    state.runtime()?.inject_fault(body.fault, body.delay_ms);
    Ok(Json(json!({"injected": body.fault})))
}

async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
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

async fn policies(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
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
async fn worker_state(State(state): State<AppState>) -> Result<Response, ApiError> {
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
async fn worker_tokenizer(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
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
async fn kv_events(
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

async fn admin_reload(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    crate::serve::reload(&state).map(Json).map_err(|e| {
        ApiError::bad_request(format!(
            "config reload refused, the running configuration stays: {e}"
        ))
    })
}

/// Begin a drain (as SIGTERM does): no new processes, `/health` 503
/// `draining`; the worker exits once its processes are gone (finished, or
/// moved by a controller) or after `[server] drain_timeout_ms`. 202 with
/// the processes left; again while draining is the same.
async fn admin_drain(State(state): State<AppState>) -> Result<Response, ApiError> {
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

/// A controller moves a process elsewhere: it stops here after its next
/// token (at once if it is not running yet) and its stream ends with a
/// hand-off (see `Runtime::hand_off`). 409 if it already ended or is being
/// handed off.
async fn hand_off(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let p = rt
        .process(&id)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no process `{id}`")))?;
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
struct PrefetchBody {
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
async fn kv_prefetch(
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
struct PersistBody {
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
async fn kv_persist(
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
struct RetainBody {
    /// `pool`, `disk`, `any` (the pool if the worker has one, else its
    /// disk), or null: dropped, as without `retain-all`.
    spill: Option<PersistTo>,
}

/// The controller's `retain-all` (see `runtime::spill`): 409 naming the
/// setting this worker lacks for the tier asked; the answer says whether
/// keep-session is on (without it nothing is retained, so nothing spills).
async fn retain_spill(
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

/// Delete persisted pages: `{"tokens": [...]}` (a prefix's),
/// `{"older_than_ms": N}` (unused that long; 0: all); `{"deleted": N}`.
async fn kv_forget_persisted(
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

fn persist_error(e: PersistError) -> ApiError {
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

/// A peer pulls KV pages (see `runtime::transfer`): a page stream, 409
/// when the page formats differ, 400 for bad tokens.
async fn kv_pull(
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
async fn kv_push(
    State(state): State<AppState>,
    body: axum::body::Body,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let pages = rt.receive_push(body).await.map_err(transfer_error)?;
    Ok(Json(json!({"pages": pages})))
}

fn transfer_error(e: ServeError) -> ApiError {
    let message = e.to_string();
    match e {
        ServeError::Handshake(_) => ApiError::new(StatusCode::CONFLICT, message),
        ServeError::BadTokens(_) => ApiError::bad_request(message).param("tokens"),
        ServeError::Refused { .. } => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, message),
        ServeError::Prefill(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message),
    }
}

/// Sampling and length arguments shared by every way of starting generation.
#[derive(Debug, Default, Deserialize)]
pub struct GenArgs {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub stop: Option<StopArg>,
    #[serde(default)]
    pub ignore_eos: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopArg {
    One(String),
    Many(Vec<String>),
}

impl GenArgs {
    /// Checked options; `default_temperature` differs between OpenAI (1) and native (0).
    pub fn options(&self, default_temperature: f32) -> Result<GenOptions, ApiError> {
        let temperature = self.temperature.unwrap_or(default_temperature);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad_request(format!(
                "temperature must be between 0 and 2, got {temperature}"
            ))
            .param("temperature"));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(
                ApiError::bad_request(format!("top_p must be in (0, 1], got {top_p}"))
                    .param("top_p"),
            );
        }
        if self.max_tokens == Some(0) {
            return Err(ApiError::bad_request("max_tokens must be at least 1").param("max_tokens"));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopArg::One(s)) => vec![s.clone()],
            Some(StopArg::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return Err(ApiError::bad_request("at most 4 stop sequences").param("stop"));
        }
        Ok(GenOptions {
            max_tokens: self.max_tokens,
            sampling: pie_model::SamplingParams {
                temperature,
                top_k: self.top_k.unwrap_or(0),
                top_p,
                seed: self.seed,
            },
            stop,
            ignore_eos: self.ignore_eos,
            prefill_from: None,
            cache_salt: None,
            resume: None,
        })
    }
}

/// `prompt`: a string, a one-string array, or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum PromptArg {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

impl PromptArg {
    pub fn into_prompt(self) -> Result<Prompt, ApiError> {
        match self {
            PromptArg::Text(t) => Ok(Prompt::Text(t)),
            PromptArg::Texts(mut v) if v.len() == 1 => Ok(Prompt::Text(v.remove(0))),
            PromptArg::Texts(_) => Err(ApiError::bad_request(
                "prompt arrays must hold exactly one string",
            )
            .param("prompt")),
            PromptArg::Tokens(ids) => Ok(Prompt::Tokens(ids)),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LaunchBody {
    inferlet: String,
    #[serde(default)]
    args: Value,
    #[serde(default)]
    props: Option<Value>,
    /// See [`trusted_prompt_tokens`].
    #[serde(default)]
    pie_prompt_tokens: Option<PromptTokens>,
    /// See [`trusted_prefill_from`].
    #[serde(default)]
    pie_prefill_from: Option<String>,
    /// See [`trusted_resume`]; a native process replays what it generated
    /// elsewhere into its record (see [`Resume::replay`]).
    #[serde(default)]
    pie_resume: Option<Resume>,
    /// A controller that follows the process (see [`trusted_stream_ids`]):
    /// the answer of a chat resuming a session carries the session's
    /// earlier turns (`pie_session_turns`), so that it can move.
    #[serde(default)]
    pie_stream_ids: Option<bool>,
}

#[derive(Deserialize)]
struct TextArgs {
    prompt: PromptArg,
    #[serde(flatten)]
    gen: GenArgs,
}

#[derive(Deserialize)]
struct ChatArgs {
    messages: Vec<pie_model::ChatMessage>,
    #[serde(flatten)]
    gen: GenArgs,
}

fn parse_args<T: serde::de::DeserializeOwned>(inferlet: &str, args: Value) -> Result<T, ApiError> {
    serde_json::from_value(args)
        .map_err(|e| ApiError::bad_request(format!("args of `{inferlet}`: {e}")).param("args"))
}

pub fn props_of(value: Option<&Value>) -> Result<Props, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(Props::new()),
        Some(v) => Ok(Props::from_json(v)?),
    }
}

async fn launch_process(
    State(state): State<AppState>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<LaunchBody>,
) -> Result<Response, ApiError> {
    let rt = state.runtime()?;
    let mut props = props_of(body.props.as_ref())?;
    let (inferlet, opts) = match body.inferlet.as_str() {
        "text-completion" => {
            let a: TextArgs = parse_args(&body.inferlet, body.args)?;
            (
                Inferlet::TextCompletion {
                    prompt: a.prompt.into_prompt()?,
                },
                a.gen.options(0.0)?,
            )
        }
        "chat" => {
            let a: ChatArgs = parse_args(&body.inferlet, body.args)?;
            (
                Inferlet::Chat {
                    messages: a.messages,
                    resume_session: true,
                },
                a.gen.options(0.0)?,
            )
        }
        other => {
            return Err(ApiError::bad_request(format!(
                "unknown inferlet `{other}` (built in: text-completion, chat)"
            ))
            .param("inferlet"))
        }
    };
    let pretokenized = trusted_prompt_tokens(&auth, body.pie_prompt_tokens)?;
    let client = client_of(&auth, &mut props)?;
    let opts = GenOptions {
        cache_salt: cache_salt_of(&auth),
        prefill_from: trusted_prefill_from(&auth, body.pie_prefill_from)?,
        resume: trusted_resume(&auth, body.pie_resume)?.map(|r| Resume { replay: true, ..r }),
        ..opts
    };
    let followed = trusted_stream_ids(&auth, body.pie_stream_ids)?;
    let (process, _) = rt.launch(inferlet, opts, props, client, pretokenized)?;
    let mut answer = json!({"id": process.id});
    if let Some(turns) = process.earlier_turns().filter(|_| followed) {
        answer[SESSION_TURNS_FIELD] = json!(turns);
    }
    Ok((StatusCode::CREATED, Json(answer)).into_response())
}

/// The process `id` if the caller may see it: another client's process is as
/// absent as one that never existed (404 either way).
fn find(
    rt: &Runtime,
    id: &str,
    auth: &Option<Extension<Authed>>,
) -> Result<Arc<Process>, ApiError> {
    let caller = caller_of(auth);
    rt.process(id)
        .filter(|p| caller.may_access(&p.client))
        .ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, format!("no process `{id}`")).param("id")
        })
}

/// Most processes one page of `GET /v1/processes` holds.
const MAX_PAGE: usize = 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    state: Option<String>,
    /// Processes per page (default 100, at most `MAX_PAGE`).
    limit: Option<usize>,
    /// The last id of the previous page: this page starts after it.
    after: Option<String>,
}

/// The caller's processes, oldest first, a page at a time (OpenAI's list shape:
/// `has_more`, `first_id`, `last_id`; pass `after=LAST_ID` for the next page).
async fn list_processes(
    State(state): State<AppState>,
    auth: Option<Extension<Authed>>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let filter = match q.state.as_deref() {
        None => None,
        Some(s) => Some(ProcState::parse(s).ok_or_else(|| {
            ApiError::bad_request(format!(
                "unknown state `{s}` (queued, running, finished, failed, killed)"
            ))
            .param("state")
        })?),
    };
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(
            ApiError::bad_request(format!("limit must be 1 to {MAX_PAGE}, got {limit}"))
                .param("limit"),
        );
    }
    let caller = caller_of(&auth);
    let visible: Vec<Arc<Process>> = rt
        .processes()
        .into_iter()
        .filter(|p| caller.may_access(&p.client))
        .filter(|p| filter.is_none_or(|f| p.state() == f))
        .collect();
    let start = match &q.after {
        None => 0,
        Some(after) => {
            visible.iter().position(|p| p.id == *after).ok_or_else(|| {
                ApiError::bad_request(format!("after: no process `{after}` in this list"))
                    .param("after")
            })? + 1
        }
    };
    let page = &visible[start..(start + limit).min(visible.len())];
    let data: Vec<Value> = page
        .iter()
        .map(|p| serde_json::to_value(p.view()).unwrap_or(Value::Null))
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "has_more": start + page.len() < visible.len(),
        "first_id": page.first().map(|p| &p.id),
        "last_id": page.last().map(|p| &p.id),
    })))
}

async fn get_process(
    State(state): State<AppState>,
    Path(id): Path<String>,
    auth: Option<Extension<Authed>>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let p = find(&rt, &id, &auth)?;
    Ok(Json(serde_json::to_value(p.view()).unwrap_or(Value::Null)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchBody {
    props: serde_json::Map<String, Value>,
}

async fn patch_process(
    State(state): State<AppState>,
    Path(id): Path<String>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<PatchBody>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let p = find(&rt, &id, &auth)?;
    let props = rt.patch_props(&p, &body.props)?;
    Ok(Json(json!({"id": p.id, "props": props})))
}

async fn kill_process(
    State(state): State<AppState>,
    Path(id): Path<String>,
    auth: Option<Extension<Authed>>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let p = find(&rt, &id, &auth)?;
    let killed = rt.kill(&p);
    Ok(Json(
        json!({"id": p.id, "killed": killed, "state": p.state()}),
    ))
}

/// `GET /v1/processes/{id}/events` query: `pie_stream_ids` (a controller,
/// see [`trusted_stream_ids`]) adds each text event's token id (`token`), so
/// that the controller can resume the process elsewhere.
#[derive(Deserialize)]
struct EventsQuery {
    pie_stream_ids: Option<bool>,
}

/// SSE: `text` events with output (the output so far first), then one `status`
/// event with the final state and usage.
async fn process_events(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
    auth: Option<Extension<Authed>>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let rt = state.runtime()?;
    let p = find(&rt, &id, &auth)?;
    let ids = trusted_stream_ids(&auth, query.pie_stream_ids)?;
    let events = p.events().map(move |e| native_event(e, ids));
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

fn native_event(e: ProcEvent, ids: bool) -> Result<Event, Infallible> {
    Ok(match e {
        ProcEvent::Text { text, token } => {
            let mut data = json!({"text": text});
            if ids {
                data["token"] = json!(token);
            }
            Event::default().event("text").data(data.to_string())
        }
        ProcEvent::Done {
            state,
            finish_reason,
            usage,
            error,
        } => Event::default().event("status").data(
            json!({"state": state, "finish_reason": finish_reason, "usage": usage, "error": error})
                .to_string(),
        ),
    })
}
