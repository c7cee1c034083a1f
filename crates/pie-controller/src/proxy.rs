//! Routing and pass-through. Client requests are parsed only as far as routing
//! needs (prompt, props, session); the body goes to the worker unchanged but for
//! a client key's props and the prompt's token ids (`pie_prompt_tokens`: the
//! tokens routing computed, with the model fingerprint, so the worker does not
//! tokenize again; only under the worker key, only to workers of that
//! fingerprint, never for a native chat resuming a session), and the
//! response streams back unbuffered, with `x-pie-worker` and `x-pie-route`. A
//! worker that refuses the connection, or stays silent past `read_timeout_ms`,
//! is marked down and the next candidate is tried; a stream that breaks or
//! stalls after its first byte ends with an error event. No request waits
//! unbounded: a wait for a slot ends at `max_wait_ms` with 503 and `Retry-After`.
//! Native process ids are made cluster-unique as `WORKER~ID`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use pie_core::auth::{
    authenticate, ApiKey, KeyLimits, Role, ACT_AS_CACHE_SALT, ACT_AS_CLIENT, ACT_AS_ROLE,
};
use pie_core::chat::parse_messages;
use pie_core::wire::{
    PREFILL_FROM_FIELD, PROMPT_TOKENS_FIELD, RESUME_FIELD, SESSION_TURNS_FIELD, STREAM_IDS_FIELD,
};
use pie_core::{PropValue, Props};
use pie_policy::cluster::{record, PriorityQueue, RouteRequest, Stage};
use pie_workload::{TraceInput, TraceRecorder};
use serde_json::{json, Value};
use tokio::sync::oneshot;

use crate::actors::{Actors, DemandGuard};
use crate::clients::ClientsInFlight;
use crate::metrics::{ControllerMetrics, RouteLabels};
use crate::model::RoutingModel;
use crate::native::{self, NativeLaunch};
use crate::registry::{with_worker_key, PromptChains, RegisterLimits, Registry};
use crate::relay::{Placed, Relay, Streams, Whereabouts};
use crate::routing::{decide, Decided, Pipeline};
use crate::trace::TracedRequest;
use crate::whole::Answer;

pub struct Controller {
    pub registry: Registry,
    pub metrics: ControllerMetrics,
    pub pipeline: Pipeline,
    /// `cluster-priority` is in the pipeline: requests wait here when every
    /// worker is at `max_running`.
    pub queueing: AtomicBool,
    pub queue: Mutex<PriorityQueue<oneshot::Sender<SlotTicket>>>,
    /// `[cluster] max_wait_ms`: the longest wait for a slot before 503.
    pub max_wait_ms: AtomicU64,
    /// Requests in flight per client (`queue_order = "fair"` reads them).
    pub clients_in_flight: ClientsInFlight,
    /// Requests woken from the queue that have not yet claimed their slot.
    pub woken: Arc<AtomicUsize>,
    /// The tokenizer and fingerprint routing uses (see `model`): set at
    /// start from `--model`, or from the first worker that answers. The
    /// prompt's ids go to workers reporting the same fingerprint
    /// (`pie_prompt_tokens`).
    pub model: OnceLock<RoutingModel>,
    /// Proxied requests and polls: connect and read timeouts.
    pub http: reqwest::Client,
    /// KV event streams: connect timeout; reads bounded by `kv_idle_timeout`.
    pub kv_http: reqwest::Client,
    pub kv_idle_timeout: Duration,
    pub worker_key: Option<String>,
    /// Client keys (`[server] api_keys`); empty: no authentication.
    pub api_keys: RwLock<Vec<ApiKey>>,
    /// `[cluster] max_registered_workers`.
    pub max_registered_workers: usize,
    /// `[server] trace_file`: routed OpenAI requests are recorded here.
    pub trace: Option<TraceRecorder>,
    /// The cluster actors named in `cluster_policies`, and what they see.
    pub actors: Actors,
    /// Streams in flight that can move to another worker.
    pub streams: Streams,
}

/// The client key that authenticated a request (absent when the controller
/// has no keys: then every caller may do everything).
#[derive(Clone, Debug)]
struct ClientKey {
    name: String,
    role: Role,
    limits: KeyLimits,
}

/// The role a controller route needs.
fn required_role(path: &str) -> Role {
    match path {
        "/v1/cluster/register"
        | "/v1/cluster/deregister"
        | "/v1/cluster/actions"
        | "/v1/cluster/scale" => Role::Worker,
        p if p.starts_with("/v1/admin/") || p.starts_with("/v1/cluster/sessions/") => Role::Admin,
        _ => Role::Client,
    }
}

/// With client keys configured, every route but /health needs one (401 JSON),
/// and the route's role (403 naming it).
async fn auth(State(ctl): State<Shared>, mut req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let key = {
        let keys = ctl.api_keys.read().unwrap_or_else(|e| e.into_inner());
        if keys.is_empty() || path == "/health" {
            None
        } else {
            let header = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok());
            match authenticate(&keys, header) {
                Ok(k) => Some(ClientKey {
                    name: k.name.clone(),
                    role: k.role,
                    limits: k.limits.clone(),
                }),
                Err(e) => return error(StatusCode::UNAUTHORIZED, e.to_string()),
            }
        }
    };
    if let Some(key) = key {
        if let Err(message) = key.role.may_call(required_role(&path), &key.name, &path) {
            return error(StatusCode::FORBIDDEN, message);
        }
        req.extensions_mut().insert(key);
    }
    next.run(req).await
}

/// Who a forwarded request is for, as the worker learns it from the
/// `x-pie-client` headers (it trusts them from the controller's worker key).
#[derive(Clone)]
pub(crate) struct Acting {
    client: String,
    role: Role,
    pub cache_salt: Option<String>,
}

impl Acting {
    /// `req` with the act-as headers.
    pub fn apply(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let req = req
            .header(ACT_AS_CLIENT, &self.client)
            .header(ACT_AS_ROLE, self.role.as_str());
        match &self.cache_salt {
            Some(salt) => req.header(ACT_AS_CACHE_SALT, salt),
            None => req,
        }
    }
}

/// Without client keys the controller is open: its callers act as admin.
fn acting_as(key: &Option<Extension<ClientKey>>) -> Acting {
    match key {
        Some(Extension(k)) => Acting {
            client: k.name.clone(),
            role: k.role,
            cache_salt: k.limits.cache_salt.clone(),
        },
        None => Acting {
            client: "anonymous".to_string(),
            role: Role::Admin,
            cache_salt: None,
        },
    }
}

impl Controller {
    /// Add (or update) a worker from the config; a new one gets a KV event
    /// follower.
    pub fn add_worker(self: &Arc<Self>, name: &str, url: &str, group: Option<String>) {
        let limits = RegisterLimits {
            max_registered: self.max_registered_workers,
            may_rebind: true,
        };
        if let Ok(Some(slot)) = self.registry.register(name, url, group, None, limits) {
            self.follow_kv_events(slot);
        }
    }

    /// Start following a new worker's KV event stream.
    fn follow_kv_events(self: &Arc<Self>, slot: usize) {
        let ctl = self.clone();
        tokio::spawn(async move {
            crate::kv_sync::follow(&ctl.registry, &ctl.kv_stream(), slot, &ctl.metrics).await
        });
    }

    /// How KV event streams are read: the KV client, the worker key, the
    /// idle timeout.
    fn kv_stream(&self) -> crate::kv_sync::Stream<'_> {
        crate::kv_sync::Stream {
            http: &self.kv_http,
            key: self.worker_key.as_deref(),
            idle_timeout: self.kv_idle_timeout,
        }
    }

    /// Follow the shared pool's KV events (`[cluster] pool`).
    pub fn follow_pool(self: &Arc<Self>, pool: String) {
        let ctl = self.clone();
        tokio::spawn(async move {
            crate::kv_sync::follow_pool(&ctl.registry, &ctl.kv_stream(), &pool, &ctl.metrics).await
        });
    }

    /// Wake as many waiting requests as there are free running slots not yet
    /// promised to a woken request (all of them when queueing is off).
    pub fn release_waiters(&self) {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.retain(|tx| !tx.is_closed());
        let mut free = if self.queueing.load(Ordering::Relaxed) {
            self.registry
                .free_slots()
                .saturating_sub(self.woken.load(Ordering::SeqCst))
        } else {
            usize::MAX
        };
        while free > 0 {
            let Some(tx) = queue.pop(|client| self.clients_in_flight.count(client)) else {
                break;
            };
            // A ticket refused by a waiter that left is dropped, and un-counts itself.
            if tx.send(SlotTicket::new(&self.woken)).is_ok() {
                free -= 1;
            }
        }
        self.metrics.queued.set(queue.len() as i64);
    }

    /// Wait for a running slot when the cluster is saturated (or others wait);
    /// Err is the refusal when `max_queued` are already waiting.
    async fn wait_for_slot(&self, props: &Props) -> Result<Option<SlotTicket>, Response> {
        if !self.queueing.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let rx = {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            if queue.is_empty() && !self.registry.saturated() {
                return Ok(None);
            }
            let (tx, rx) = oneshot::channel();
            if let Err(r) = queue.push(props, tx) {
                self.metrics.queue_full.inc();
                return Err(retry_later(StatusCode::TOO_MANY_REQUESTS, r.message));
            }
            self.metrics.queued.set(queue.len() as i64);
            rx
        };
        // A slot may have freed between the check and the push.
        self.release_waiters();
        let max_wait_ms = self.max_wait_ms.load(Ordering::Relaxed);
        match tokio::time::timeout(Duration::from_millis(max_wait_ms), rx).await {
            Ok(Ok(ticket)) => Ok(Some(ticket)),
            Ok(Err(_)) => Err(retry_later(
                StatusCode::SERVICE_UNAVAILABLE,
                "the controller is shutting down",
            )),
            Err(_) => {
                self.metrics.wait_timeouts.inc();
                // Our sender is closed now: take it out of the queue's count.
                self.release_waiters();
                Err(retry_later(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("no worker had a free slot within max_wait_ms = {max_wait_ms}"),
                ))
            }
        }
    }
}

/// A woken request's claim on a free slot, counted in `Controller::woken`
/// until it is dropped (once the request holds its slot, or if it never
/// arrives), so concurrent wake-ups cannot promise one slot twice.
pub struct SlotTicket(Arc<AtomicUsize>);

impl SlotTicket {
    fn new(woken: &Arc<AtomicUsize>) -> Self {
        woken.fetch_add(1, Ordering::SeqCst);
        Self(woken.clone())
    }
}

impl Drop for SlotTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request occupying a running slot on `worker` until its response body is
/// dropped (fully streamed or abandoned by the client); then it is traced.
pub(crate) struct InFlight {
    ctl: Arc<Controller>,
    worker: String,
    /// Whose request it is (counted in `Controller::clients_in_flight`).
    client: String,
    pub traced: Option<TracedRequest>,
    /// The request as the actors' demand, until it finishes.
    pub demand: Option<DemandGuard>,
}

impl InFlight {
    fn begin(ctl: &Arc<Controller>, worker: &str, client: &str) -> Self {
        ctl.registry.count_started(worker);
        ctl.clients_in_flight.started(client);
        Self {
            ctl: ctl.clone(),
            worker: worker.to_string(),
            client: client.to_string(),
            traced: None,
            demand: None,
        }
    }
}

impl InFlight {
    /// The request's stream went on on `worker`.
    pub fn moved_to(&mut self, worker: &str) {
        self.ctl.registry.count_finished(&self.worker);
        self.ctl.registry.count_started(worker);
        self.worker = worker.to_string();
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.ctl.registry.count_finished(&self.worker);
        self.ctl.clients_in_flight.finished(&self.client);
        self.ctl.release_waiters();
        if let (Some(recorder), Some(t)) = (&self.ctl.trace, self.traced.take()) {
            let output = t.output_length();
            if let Err(e) = recorder.record(t.input, output, &t.props) {
                tracing::warn!("server.trace_file: cannot write: {e}");
            }
        }
    }
}

/// `resp` with its body holding `slot` until the body is dropped.
fn hold_until_streamed(resp: Response, mut slot: InFlight) -> Response {
    resp.map(|body| {
        Body::from_stream(body.into_data_stream().map(move |chunk| {
            if let (Some(t), Ok(bytes)) = (&mut slot.traced, &chunk) {
                t.observe(bytes);
            }
            chunk
        }))
    })
}

type Shared = Arc<Controller>;

pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = pie_core::api_error::error_body(status.as_u16(), &message.into(), None);
    (status, Json(body)).into_response()
}

/// A refusal the client should retry (429, 502, 503): with `Retry-After: 1`.
fn retry_later(status: StatusCode, message: impl Into<String>) -> Response {
    let mut resp = error(status, message);
    resp.headers_mut()
        .insert("retry-after", HeaderValue::from_static("1"));
    resp
}

/// Unix milliseconds: the clock routing decisions and actors read.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub fn router(ctl: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/cluster", get(cluster))
        .route("/metrics", get(metrics))
        .route("/v1/cluster/register", post(register))
        .route("/v1/cluster/deregister", post(deregister))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate))
        .route("/v1/processes", post(generate))
        .route(
            "/v1/processes/{id}",
            get(on_process).patch(on_process).delete(on_process),
        )
        .route("/v1/processes/{id}/events", get(on_process_events))
        .merge(crate::actors::routes())
        .merge(crate::relay::routes())
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route") })
        .layer(middleware::from_fn_with_state(ctl.clone(), auth))
        .with_state(ctl)
}

async fn health(State(ctl): State<Shared>) -> Response {
    let healthy = ctl.registry.snapshot().iter().filter(|w| w.healthy).count();
    let status = if healthy > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({"status": if healthy > 0 { "ok" } else { "no healthy worker" }, "healthy_workers": healthy}))).into_response()
}

async fn metrics(State(ctl): State<Shared>) -> Response {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ctl.metrics.encode(),
    )
        .into_response()
}

async fn cluster(State(ctl): State<Shared>, key: Option<Extension<ClientKey>>) -> Json<Value> {
    if matches!(&key, Some(Extension(k)) if k.role == Role::Client) {
        return Json(client_view_of_cluster(&ctl));
    }
    let (names, sessions) = {
        let pipeline = ctl.pipeline.lock().unwrap_or_else(|e| e.into_inner());
        let names: Vec<&str> = pipeline.iter().map(|p| p.name()).collect();
        let sessions: usize = pipeline.iter().filter_map(|p| p.sessions()).sum();
        (names, sessions)
    };
    let queued = ctl.queue.lock().unwrap_or_else(|e| e.into_inner()).len();
    let index_entries = ctl.registry.with_index(|i, _| i.entries());
    Json(json!({
        "workers": ctl.registry.snapshot(),
        "cluster_policies": names,
        "actors": ctl.actors.summary(),
        "cluster_priority": ctl.queueing.load(Ordering::Relaxed),
        "sessions": sessions,
        "queued": queued,
        "clients_in_flight": ctl.clients_in_flight.clients(),
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
    State(ctl): State<Shared>,
    key: Option<Extension<ClientKey>>,
    Json(body): Json<Value>,
) -> Response {
    let (name, url, group) = match registration(&body) {
        Ok(r) => r,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let by = acting_as(&key);
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
    State(ctl): State<Shared>,
    key: Option<Extension<ClientKey>>,
    Json(body): Json<Value>,
) -> Response {
    let Some(name) = body["name"].as_str() else {
        return error(StatusCode::BAD_REQUEST, "`name` (a string) is required");
    };
    let by = acting_as(&key);
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

async fn models(
    State(ctl): State<Shared>,
    key: Option<Extension<ClientKey>>,
    headers: HeaderMap,
) -> Response {
    let Some((_, url)) = ctl
        .registry
        .views(&PromptChains::default(), false)
        .into_iter()
        .next()
    else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "no healthy worker");
    };
    forward(
        &ctl,
        Method::GET,
        &format!("{url}/v1/models"),
        &headers,
        &acting_as(&key),
        Bytes::new(),
    )
    .await
    .unwrap_or_else(|e| error(StatusCode::BAD_GATEWAY, e))
}

/// A client key's request props checked against its limits (the key's weight
/// filled in) and its `client` prop set, then written back into the body the
/// workers get: they trust these props from the controller's worker key.
fn apply_client_key(props: &mut Props, json: &mut Value, key: &ClientKey) -> Result<(), String> {
    if key.role == Role::Client {
        key.limits
            .apply(&key.name, props)
            .map_err(|e| e.to_string())?;
    }
    props
        .set("client", PropValue::Str(key.name.clone()))
        .map_err(|e| e.to_string())?;
    let Some(obj) = json.as_object_mut() else {
        return Err("the body must be a JSON object".into());
    };
    obj.insert(
        "props".into(),
        serde_json::to_value(&*props).map_err(|e| e.to_string())?,
    );
    Ok(())
}

/// What routing needs from a generation request.
struct RouteInputs {
    /// The prompt's tokens (empty without a tokenizer).
    tokens: Vec<u32>,
    props: Props,
    /// `tokens` came from tokenizing text here (not sent as ids), and a
    /// worker can use them as they are: not a native chat resuming a session,
    /// whose earlier turns only the worker knows.
    forwardable: bool,
}

/// What routing needs from a generation request: its prompt tokens and props.
/// Errors are messages for a 400.
fn route_inputs(ctl: &Controller, path: &str, body: &Value) -> Result<RouteInputs, String> {
    let props_json = &body["props"];
    let mut props = if props_json.is_null() {
        Props::new()
    } else {
        Props::from_json(props_json).map_err(|e| e.to_string())?
    };
    if let Some(session) = body["session"].as_str() {
        props
            .set("session", PropValue::Str(session.into()))
            .map_err(|e| e.to_string())?;
    }
    let native = path == "/v1/processes";
    let args = if native { &body["args"] } else { body };
    let Some(tk) = ctl.routing_model().map(|m| &m.tokenizer) else {
        return Ok(RouteInputs {
            tokens: Vec::new(),
            props,
            forwardable: false,
        });
    };
    let (tokens, forwardable) = if let Some(messages) = args.get("messages") {
        let messages = parse_messages(messages)?;
        let tokens = tk
            .apply_chat_template(&messages)
            .and_then(|t| tk.encode(&t))
            .unwrap_or_default();
        // The native chat inferlet prepends a session's earlier turns.
        let resumes = native && props.str("session").is_some();
        (tokens, !resumes)
    } else {
        match &args["prompt"] {
            Value::String(s) => (tk.encode(s).unwrap_or_default(), true),
            Value::Array(a) => (
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|t| t as u32)
                    .collect(),
                false,
            ),
            _ => (Vec::new(), false),
        }
    };
    Ok(RouteInputs {
        forwardable: forwardable && !tokens.is_empty(),
        tokens,
        props,
    })
}

/// A streamed OpenAI generation whose prompt tokens the controller knows
/// (a non-streamed one is streamed to the workers: `whole`): the controller
/// can resume it elsewhere (see `relay`).
fn movable(path: &str, json: &Value, tokens: &[u32]) -> bool {
    matches!(path, "/v1/completions" | "/v1/chat/completions")
        && json["stream"].as_bool() == Some(true)
        && !tokens.is_empty()
}

/// `json` with the controller's prompt ids for a worker of model
/// `fingerprint`, serialized (the field is top-level for the OpenAI routes and
/// native processes alike).
/// The body for the decode worker of a disaggregated request: it pulls the
/// prompt's pages from `prefill_url` (`pie_prefill_from`).
fn with_prefill_from(mut json: Value, prefill_url: &str) -> Result<(Value, Bytes), String> {
    json.as_object_mut()
        .ok_or("the body is not a JSON object")?
        .insert(PREFILL_FROM_FIELD.into(), json!(prefill_url));
    let body = serde_json::to_vec(&json).map_err(|e| e.to_string())?;
    Ok((json, Bytes::from(body)))
}

fn with_prompt_tokens(mut json: Value, fingerprint: u64, ids: &[u32]) -> Option<Bytes> {
    json.as_object_mut()?.insert(
        PROMPT_TOKENS_FIELD.into(),
        json!({"fingerprint": fingerprint, "ids": ids}),
    );
    serde_json::to_vec(&json).ok().map(Bytes::from)
}

async fn generate(
    State(ctl): State<Shared>,
    client: Option<Extension<ClientKey>>,
    method: Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    let parse_started = Instant::now();
    let mut json: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("body is not JSON: {e}")),
    };
    // Only the controller speaks for a prompt's ids, where its prefill runs,
    // what it resumes from and whether its tokens' ids are streamed (its
    // worker key vouches): a client's own would be trusted by the workers.
    for field in [
        PROMPT_TOKENS_FIELD,
        PREFILL_FROM_FIELD,
        RESUME_FIELD,
        STREAM_IDS_FIELD,
    ] {
        if json.get(field).is_some() {
            return error(
                StatusCode::BAD_REQUEST,
                format!("{field} is set by the controller only"),
            );
        }
    }
    let acting = acting_as(&client);
    let RouteInputs {
        tokens,
        mut props,
        forwardable,
    } = match route_inputs(&ctl, &path, &json) {
        Ok(v) => v,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    // The authenticated client is who the workers' fair share counts.
    if let Some(Extension(key)) = &client {
        if let Err(message) = apply_client_key(&mut props, &mut json, key) {
            return error(StatusCode::BAD_REQUEST, message);
        }
    }
    // A non-streamed answer is gathered from a stream, so that it can move.
    let whole = Answer::of(&path, &json).filter(|_| !tokens.is_empty());
    if whole.is_some() {
        Answer::stream_instead(&mut json);
    }
    let movable = movable(&path, &json, &tokens);
    let launches_native = path == "/v1/processes";
    if movable || launches_native {
        json[STREAM_IDS_FIELD] = json!(true);
    }
    let body = if client.is_some() || movable || launches_native {
        match serde_json::to_vec(&json) {
            Ok(body) => Bytes::from(body),
            Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
        }
    } else {
        body
    };
    let tokenize_s = parse_started.elapsed().as_secs_f64();
    let arrival_ms = now_ms();
    // Waiting in the queue already counts as demand.
    let mut demand = ctl.actors.track(&props);
    let mut ticket = match ctl.wait_for_slot(&props).await {
        Ok(ticket) => ticket,
        Err(refused) => return refused,
    };
    // Under cluster-priority a request goes where a slot is free.
    let req = RouteRequest {
        props: &props,
        prompt_tokens: tokens.len(),
    };
    let Decided {
        views,
        choice: decision,
        hashing,
        routing,
    } = decide(
        &ctl.registry,
        &ctl.pipeline,
        &req,
        &tokens,
        acting.cache_salt.as_deref(),
        ctl.queueing.load(Ordering::Relaxed),
    );
    let decided = Instant::now();
    ctl.metrics.observe_part("tokenize", tokenize_s);
    ctl.metrics.observe_part("hash", hashing.as_secs_f64());
    ctl.metrics.observe_part("route", routing.as_secs_f64());
    // The controller's own time in the proxy, without its waits on workers.
    let mut proxy_s = 0.0;
    let mut proxy_from = decided;
    let (chosen, reason, placement) = match decision {
        Ok(d) => d,
        Err(r) => {
            let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            return if status == StatusCode::SERVICE_UNAVAILABLE {
                retry_later(status, r.message)
            } else {
                error(status, r.message)
            };
        }
    };
    // A movable stream's body for the workers it may move to.
    let mut resume_body = movable.then(|| match ctl.routing_model() {
        Some(m) if forwardable && ctl.worker_key.is_some() => {
            let mut b = json.clone();
            b[PROMPT_TOKENS_FIELD] = json!({"fingerprint": m.fingerprint, "ids": tokens});
            b
        }
        _ => json.clone(),
    });
    let (reason, json, body) = match &placement {
        None => (reason, json, body),
        Some(p) => {
            let why = format!("disaggregate: {}; {reason}", p.reason());
            match p.remote_worker() {
                None => (why, json, body),
                Some(w) => match with_prefill_from(json, &views[w].1) {
                    Ok((json, body)) => (why, json, body),
                    Err(message) => return error(StatusCode::BAD_REQUEST, message),
                },
            }
        }
    };
    // Native processes have no response to read an output length from.
    let mut traced = (ctl.trace.is_some() && path != "/v1/processes")
        .then(|| TracedRequest::new(TraceInput::of(&tokens, arrival_ms), props.clone()));
    // A native process the controller follows, to move it (see `native`).
    let mut native_body = launches_native.then(|| json.clone());
    // The prompt's ids for workers of our model, when a worker key vouches
    // for them (workers without keys would ignore them).
    let ids_for = match (ctl.routing_model().map(|m| m.fingerprint), &ctl.worker_key) {
        (Some(fingerprint), Some(_)) if forwardable => {
            with_prompt_tokens(json, fingerprint, &tokens).map(|b| (fingerprint, b))
        }
        _ => None,
    };
    // The chosen worker first, then the rest by load, for connection failures
    // (prefill-stage workers only ever prefill for others).
    let mut order: Vec<usize> = (0..views.len())
        .filter(|&i| i != chosen && views[i].0.stage != Stage::Prefill)
        .collect();
    order.sort_by_key(|&i| views[i].0.load);
    order.insert(0, chosen);
    let candidates = order.len();
    let mut native = None;
    for (attempt, i) in order.into_iter().enumerate() {
        let (view, url) = &views[i];
        let why = if attempt == 0 {
            reason.clone()
        } else {
            format!("retry after a failed or silent worker: {}", view.name)
        };
        let client = props.str("client").unwrap_or("anonymous");
        let mut slot = InFlight::begin(&ctl, &view.name, client);
        drop(ticket.take());
        if let Some(d) = &demand {
            d.placed(&view.name);
        }
        let body = match &ids_for {
            Some((fingerprint, with_ids))
                if ctl.registry.fingerprint_of(&view.name) == Some(*fingerprint) =>
            {
                with_ids.clone()
            }
            _ => body.clone(),
        };
        proxy_s += proxy_from.elapsed().as_secs_f64();
        let sent = send(
            &ctl,
            method.clone(),
            &format!("{url}{path}"),
            &headers,
            &acting,
            body,
        )
        .await;
        let started = match sent {
            Ok(upstream) => upstream.first_bytes().await,
            Err(e) => Err(e),
        };
        proxy_from = Instant::now();
        match started {
            // A worker whose own queue is full (its 429) is no free slot, and
            // one that began draining (503) takes nothing: the next
            // candidate may.
            Ok(upstream)
                if matches!(
                    upstream.status,
                    StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
                ) && attempt + 1 < candidates =>
            {
                tracing::debug!(worker = view.name, status = %upstream.status, "worker refused; trying the next");
            }
            Ok(upstream) => {
                slot.traced = traced.take();
                slot.demand = demand.take();
                let placed = |body, slot| Placed {
                    ctl: ctl.clone(),
                    acting,
                    body,
                    prompt: tokens.clone(),
                    props: props.clone(),
                    worker: view.name.clone(),
                    url: url.clone(),
                    slot,
                };
                let mut resp = match resume_body.take() {
                    Some(body) if upstream.status.is_success() => upstream.into_movable(Relay {
                        placed: placed(body, slot),
                        path: path.clone(),
                        headers: headers.clone(),
                    }),
                    _ => match native_body.take() {
                        Some(body) if upstream.status.is_success() => {
                            native = Some(NativeLaunch {
                                placed: placed(body, slot),
                                local: String::new(),
                                turns: None,
                            });
                            upstream.into_response()
                        }
                        _ => hold_until_streamed(upstream.into_response(), slot),
                    },
                };
                ctl.registry.count_routed(&view.name);
                let policy = why.split(':').next().unwrap_or_default().to_string();
                ctl.metrics
                    .routed
                    .get_or_create(&RouteLabels {
                        worker: view.name.clone(),
                        policy,
                    })
                    .inc();
                if attempt > 0 {
                    ctl.metrics.retries.inc();
                }
                record(
                    &mut ctl.pipeline.lock().unwrap_or_else(|e| e.into_inner()),
                    now_ms(),
                    &req,
                    &view.name,
                );
                let h = resp.headers_mut();
                h.insert(
                    "x-pie-worker",
                    HeaderValue::from_str(&view.name).unwrap_or(HeaderValue::from_static("?")),
                );
                h.insert(
                    "x-pie-route",
                    HeaderValue::from_str(&why).unwrap_or(HeaderValue::from_static("?")),
                );
                let resp = if path == "/v1/processes" {
                    qualify_id(resp, &view.name, native.take()).await
                } else {
                    resp
                };
                proxy_s += proxy_from.elapsed().as_secs_f64();
                ctl.metrics.observe_part("proxy", proxy_s);
                return match whole {
                    Some(answer) => answer.gather(resp).await,
                    None => resp,
                };
            }
            Err(e) => {
                tracing::warn!(
                    worker = view.name,
                    error = e,
                    "worker failed before responding; trying the next"
                );
                ctl.registry.mark_down(&view.name);
            }
        }
    }
    retry_later(
        StatusCode::BAD_GATEWAY,
        "every candidate worker failed before responding",
    )
}

/// A worker request's failure, naming the timeout that ended it.
pub(crate) fn describe(e: &reqwest::Error) -> String {
    if e.is_connect() && e.is_timeout() {
        format!("no connection within connect_timeout_ms ({e})")
    } else if e.is_timeout() {
        format!("silent past read_timeout_ms ({e})")
    } else {
        e.to_string()
    }
}

/// A worker's response before its body is relayed.
pub(crate) struct Upstream {
    pub status: StatusCode,
    /// The worker's headers the client needs (`content-type`, `retry-after`).
    relayed: HeaderMap,
    pub body: futures_util::stream::BoxStream<'static, reqwest::Result<Bytes>>,
}

/// Send one request to a worker; Err only when no response arrived at all.
pub(crate) async fn send(
    ctl: &Controller,
    method: Method,
    url: &str,
    headers: &HeaderMap,
    acting: &Acting,
    body: Bytes,
) -> Result<Upstream, String> {
    let mut req = acting.apply(ctl.http.request(method, url)).body(body);
    if let Some(ct) = headers.get("content-type") {
        req = req.header("content-type", ct);
    }
    let req = with_worker_key(req, ctl.worker_key.as_deref());
    let resp = req.send().await.map_err(|e| describe(&e))?;
    let relayed = ["content-type", "retry-after"]
        .into_iter()
        .filter_map(|name| Some((name.parse().ok()?, resp.headers().get(name)?.clone())))
        .collect();
    Ok(Upstream {
        status: resp.status(),
        relayed,
        body: resp.bytes_stream().boxed(),
    })
}

impl Upstream {
    /// Wait for the first bytes of the body: a worker that dies before sending
    /// any (e.g. while the request waited in its queue) is an Err, so the
    /// request can still go elsewhere; nothing has reached the client yet.
    pub async fn first_bytes(mut self) -> Result<Self, String> {
        match self.body.next().await {
            Some(Ok(first)) => {
                self.body = futures_util::stream::once(async move { Ok(first) })
                    .chain(self.body)
                    .boxed();
                Ok(self)
            }
            Some(Err(e)) => Err(format!(
                "the worker failed before responding: {}",
                describe(&e)
            )),
            None => {
                self.body = futures_util::stream::empty().boxed();
                Ok(self)
            }
        }
    }

    /// Relay a movable stream (see `relay`).
    fn into_movable(self, relay: Relay) -> Response {
        let mut out = Response::new(relay.into_body(self.body));
        *out.status_mut() = self.status;
        out.headers_mut().extend(self.relayed);
        out
    }

    /// Relay unbuffered; a stream that breaks or stalls midway ends with an
    /// error event (and ends there: a stalled body would time out again).
    pub(crate) fn into_response(self) -> Response {
        let stream = self.body.scan(false, |broken, chunk| {
            let out = match chunk {
                _ if *broken => None,
                Ok(b) => Some(b),
                Err(e) => {
                    *broken = true;
                    let message = format!("the worker's stream broke: {}", describe(&e));
                    let event = pie_core::api_error::error_body(502, &message, None);
                    Some(Bytes::from(format!("data: {event}\n\n")))
                }
            };
            std::future::ready(out.map(Ok::<Bytes, std::convert::Infallible>))
        });
        let mut out = Response::new(Body::from_stream(stream));
        *out.status_mut() = self.status;
        out.headers_mut().extend(self.relayed);
        out
    }
}

async fn forward(
    ctl: &Controller,
    method: Method,
    url: &str,
    headers: &HeaderMap,
    acting: &Acting,
    body: Bytes,
) -> Result<Response, String> {
    send(ctl, method, url, headers, acting, body)
        .await
        .map(Upstream::into_response)
}

/// `{"id": "proc-3"}` from worker w1 becomes `{"id": "w1~proc-3"}`; a
/// `launch` the controller follows from then on (see `native`).
async fn qualify_id(resp: Response, worker: &str, launch: Option<NativeLaunch>) -> Response {
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return error(StatusCode::BAD_GATEWAY, "unreadable worker response");
    };
    let mut v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let turns = v
        .as_object_mut()
        .and_then(|o| o.remove(SESSION_TURNS_FIELD));
    if let Some(id) = v["id"].as_str() {
        let launch = launch.map(|launch| NativeLaunch {
            local: id.to_string(),
            turns,
            ..launch
        });
        if let Some(launch) = launch.filter(NativeLaunch::movable) {
            launch.follow();
        }
        v["id"] = json!(format!("{worker}~{id}"));
    }
    parts.headers.remove("content-length");
    Response::from_parts(parts, Body::from(v.to_string()))
}

async fn on_process(
    State(ctl): State<Shared>,
    key: Option<Extension<ClientKey>>,
    method: Method,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let acting = acting_as(&key);
    to_owner(&ctl, method, &id, "", &headers, &acting, body).await
}

async fn on_process_events(
    State(ctl): State<Shared>,
    key: Option<Extension<ClientKey>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let acting = acting_as(&key);
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
/// on from its new worker (`native::events`); one lost while moving answers
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
                format!("process `{id}` was lost while moving: {why}"),
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
    let resp = forward(ctl, method, &process_url, headers, acting, body)
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
