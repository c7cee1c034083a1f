//! Generation through the controller. A client request is parsed only as far
//! as routing needs (prompt, props, session); the body goes to the worker
//! unchanged but for a client key's props and the prompt's token ids
//! (`pie_prompt_tokens`: the tokens routing computed, with the model
//! fingerprint, so the worker does not tokenize again; only under the worker
//! key, only to workers of that fingerprint, never for a native chat resuming
//! a session), and the response streams back unbuffered, with `x-pie-worker`
//! and `x-pie-route`. A worker that refuses the connection, or stays silent
//! past `read_timeout_ms`, is marked down and the next candidate is tried; a
//! stream that breaks or stalls after its first byte ends with an error event.
//! No request waits unbounded: a wait for a slot ends at `max_wait_ms` with
//! 503 and `Retry-After`. Native process ids are made cluster-unique as
//! `WORKER~ID`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use pie_core::auth::Role;
use pie_core::chat::parse_messages;
use pie_core::clock::now_ms;
use pie_core::openai_fields::{self, Endpoint};
use pie_core::tools::ToolRequest;
use pie_core::wire::{PREFILL_FROM_FIELD, PROMPT_TOKENS_FIELD, RESUME_FIELD, STREAM_IDS_FIELD};
use pie_core::{PropValue, Props};
use pie_model::ChatEnding;
use pie_policy::cluster::{record, RouteRequest, Stage, WorkerView};
use pie_workload::TraceInput;
use serde_json::{json, Value};

use crate::actors::DemandGuard;
use crate::admission::SlotTicket;
use crate::caller::{acting_as, Acting, ClientKey};
use crate::controller::Controller;
use crate::in_flight::{hold_until_streamed, InFlight};
use crate::metrics::RouteLabels;
use crate::native::{qualify_id, NativeLaunch};
use crate::placed::Placed;
use crate::relay::Relay;
use crate::respond::{retry_later, Refusal};
use crate::routing::{decide, Ask, Decided};
use crate::trace::TracedRequest;
use crate::whole::Answer;
use crate::worker_client::Upstream;

/// `POST /v1/completions`, `/v1/chat/completions` and `/v1/processes`: the
/// request is prepared (parsed as far as routing needs, the client key
/// applied), waits for a slot when the cluster is saturated, is routed, and
/// goes to the chosen worker, then to the others by load when a worker
/// fails before responding.
pub async fn generate(
    State(ctl): State<Arc<Controller>>,
    client: Option<Extension<ClientKey>>,
    method: Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parse_started = Instant::now();
    let request = match Prepared::of(&ctl, client.as_deref(), uri.path(), body) {
        Ok(request) => request,
        Err(refused) => return refused.into_response(),
    };
    let tokenize_s = parse_started.elapsed().as_secs_f64();
    let arrival_ms = now_ms();
    // Waiting in the queue already counts as demand.
    let demand = ctl.actors.track(&request.props);
    let ticket = match (ctl.admission)
        .wait_for_slot(&ctl.registry, &ctl.metrics, &request.props)
        .await
    {
        Ok(ticket) => ticket,
        Err(refused) => return refused,
    };
    let decided = decide(
        &ctl.registry,
        &ctl.pipeline,
        &Ask {
            req: &request.route_request(),
            tokens: &request.tokens,
            salt: request.acting.cache_salt.as_deref(),
            // Under cluster-priority a request goes where a slot is free.
            with_free_slot: ctl.admission.queueing.load(Ordering::Relaxed),
            exclude: &request.exclude,
            place_prefill: true,
        },
    );
    let clock = ProxyClock::start();
    ctl.metrics.observe_part("tokenize", tokenize_s);
    ctl.metrics
        .observe_part("hash", decided.hashing.as_secs_f64());
    ctl.metrics
        .observe_part("route", decided.routing.as_secs_f64());
    let plan = match Plan::of(&ctl, request, decided, arrival_ms) {
        Ok(plan) => plan,
        Err(refused) => return refused.into_response(),
    };
    let mut attempt = Attempt {
        demand,
        ticket,
        clock,
        method,
        headers,
    };
    attempt.run(&ctl, plan).await
}

/// A generation request as the workers get it, and what routing needs.
struct Prepared {
    path: String,
    json: Value,
    /// The body for the workers (re-serialized when the controller changed it).
    body: Bytes,
    tokens: Vec<u32>,
    props: Props,
    forwardable: bool,
    acting: Acting,
    /// A non-streamed answer, gathered from a stream so that it can move.
    whole: Option<Answer>,
    /// A streamed OpenAI generation the controller can move (`relay`).
    movable: bool,
    /// Workers it must not go to: a launch of an inferlet installed through
    /// the controller goes only to the workers that hold it.
    exclude: Vec<String>,
}

impl Prepared {
    /// Errors are the 400 to answer.
    fn of(
        ctl: &Controller,
        client: Option<&ClientKey>,
        path: &str,
        body: Bytes,
    ) -> Result<Self, Refusal> {
        let bad = Refusal::bad_request;
        let mut json: Value =
            serde_json::from_slice(&body).map_err(|e| bad(format!("body is not JSON: {e}")))?;
        refuse_controller_fields(&json).map_err(bad)?;
        check_openai_fields(path, &json)?;
        let RouteInputs {
            tokens,
            mut props,
            forwardable,
        } = route_inputs(ctl, path, &json).map_err(bad)?;
        // The authenticated client is who the workers' fair share counts.
        if let Some(key) = client {
            apply_client_key(&mut props, &mut json, key).map_err(bad)?;
        }
        let whole = Answer::of(path, &json).filter(|_| !tokens.is_empty() && gatherable(&json));
        if whole.is_some() {
            Answer::stream_instead(&mut json);
        }
        let movable = movable(path, &json, &tokens);
        let launches_native = path == "/v1/processes";
        let exclude = match json["inferlet"].as_str().filter(|_| launches_native) {
            Some(reference) => lacking_workers(ctl, reference)?,
            None => Vec::new(),
        };
        if movable || launches_native {
            json[STREAM_IDS_FIELD] = json!(true);
        }
        let body = if client.is_some() || movable || launches_native {
            Bytes::from(serde_json::to_vec(&json).map_err(|e| bad(e.to_string()))?)
        } else {
            body
        };
        Ok(Self {
            path: path.to_string(),
            json,
            body,
            tokens,
            props,
            forwardable,
            acting: acting_as(client),
            whole,
            movable,
            exclude,
        })
    }

    fn route_request(&self) -> RouteRequest<'_> {
        RouteRequest {
            props: &self.props,
            prompt_tokens: self.tokens.len(),
        }
    }

    fn launches_native(&self) -> bool {
        self.path == "/v1/processes"
    }
}

/// The workers that do not hold `reference`, an inferlet installed through
/// the controller (none for any other); a 503 when no worker holds it yet.
fn lacking_workers(ctl: &Controller, reference: &str) -> Result<Vec<String>, Refusal> {
    if !ctl.installs.knows(reference) {
        return Ok(Vec::new());
    }
    let workers: Vec<String> = (ctl.registry.endpoints().into_iter())
        .map(|(name, _)| name)
        .collect();
    let lacking = ctl.installs.lacking(reference, &workers);
    if !lacking.is_empty() && lacking.len() == workers.len() {
        return Err(Refusal {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!("inferlet `{reference}` is not installed on any worker yet"),
            retry: true,
            param: Some("inferlet".into()),
        });
    }
    Ok(lacking)
}

/// An OpenAI route's fields, by the rule the workers apply too
/// ([`pie_core::openai_fields`]): refused here before any worker is asked.
fn check_openai_fields(path: &str, json: &Value) -> Result<(), Refusal> {
    let endpoint = match path {
        "/v1/completions" => Endpoint::Completions,
        "/v1/chat/completions" => Endpoint::Chat,
        _ => return Ok(()),
    };
    let fields = json
        .as_object()
        .ok_or_else(|| Refusal::bad_request("the request body must be a JSON object"))?;
    openai_fields::check(endpoint, fields).map_err(Refusal::field)
}

/// Only the controller speaks for a prompt's ids, where its prefill runs,
/// what it resumes from and whether its tokens' ids are streamed (its worker
/// key vouches): a client's own would be trusted by the workers.
fn refuse_controller_fields(json: &Value) -> Result<(), String> {
    let fields = [
        PROMPT_TOKENS_FIELD,
        PREFILL_FROM_FIELD,
        RESUME_FIELD,
        STREAM_IDS_FIELD,
    ];
    match fields.into_iter().find(|field| json.get(field).is_some()) {
        Some(field) => Err(format!("{field} is set by the controller only")),
        None => Ok(()),
    }
}

/// A routed request: the workers to try, in order, and the bodies they get.
struct Plan {
    request: Prepared,
    views: Vec<(WorkerView, String)>,
    /// The chosen worker first, then the rest by load.
    order: Vec<usize>,
    /// Why the chosen worker (`x-pie-route`).
    reason: String,
    /// A movable stream's body for the workers it may move to.
    resume_body: Option<Value>,
    /// A native process the controller follows, to move it (see `native`).
    native_body: Option<Value>,
    /// The body with the prompt's ids, for workers of that fingerprint.
    ids_for: Option<(u64, Bytes)>,
    traced: Option<TracedRequest>,
}

impl Plan {
    /// Errors are the refusal to answer.
    fn of(
        ctl: &Controller,
        mut request: Prepared,
        decided: Decided,
        arrival_ms: u64,
    ) -> Result<Self, Refusal> {
        let Decided { views, choice, .. } = decided;
        let (chosen, reason, placement) = choice.map_err(|r| {
            let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            Refusal {
                status,
                message: r.message,
                retry: status == StatusCode::SERVICE_UNAVAILABLE,
                param: None,
            }
        })?;
        let resume_body = request.movable.then(|| resume_body(ctl, &request));
        let reason = match &placement {
            None => reason,
            Some(p) => {
                if let Some(w) = p.remote_worker() {
                    let (json, body) =
                        with_prefill_from(std::mem::take(&mut request.json), &views[w].1)
                            .map_err(Refusal::bad_request)?;
                    request.json = json;
                    request.body = body;
                }
                format!("disaggregate: {}; {reason}", p.reason())
            }
        };
        // Native processes have no response to read an output length from.
        let traced = (ctl.trace.is_some() && !request.launches_native()).then(|| TracedRequest {
            input: TraceInput::of(&request.tokens, arrival_ms),
            props: request.props.clone(),
        });
        let native_body = request.launches_native().then(|| request.json.clone());
        // The prompt's ids for workers of our model, when a worker key vouches
        // for them (workers without keys would ignore them).
        let ids_for = match (ctl.routing_model(), &ctl.worker_client.key) {
            (Some(m), Some(_)) if request.forwardable => {
                with_prompt_tokens(request.json.clone(), m.fingerprint, &request.tokens)
                    .map(|b| (m.fingerprint, b))
            }
            _ => None,
        };
        let order = candidates(&views, chosen);
        Ok(Self {
            request,
            views,
            order,
            reason,
            resume_body,
            native_body,
            ids_for,
            traced,
        })
    }

    /// The body for worker `name`: with the prompt's ids if it is of their
    /// model.
    fn body_for(&self, ctl: &Controller, name: &str) -> Bytes {
        match &self.ids_for {
            Some((fingerprint, with_ids))
                if ctl.registry.fingerprint_of(name) == Some(*fingerprint) =>
            {
                with_ids.clone()
            }
            _ => self.request.body.clone(),
        }
    }
}

/// A movable stream's body for the workers it may move to: with the prompt's
/// ids where the worker key vouches for them.
fn resume_body(ctl: &Controller, request: &Prepared) -> Value {
    match ctl.routing_model() {
        Some(m) if request.forwardable && ctl.worker_client.key.is_some() => {
            let mut b = request.json.clone();
            b[PROMPT_TOKENS_FIELD] = json!({"fingerprint": m.fingerprint, "ids": request.tokens});
            b
        }
        _ => request.json.clone(),
    }
}

/// The chosen worker first, then the rest by load, for connection failures
/// (prefill-stage workers only ever prefill for others).
fn candidates(views: &[(WorkerView, String)], chosen: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..views.len())
        .filter(|&i| i != chosen && views[i].0.stage != Stage::Prefill)
        .collect();
    order.sort_by_key(|&i| views[i].0.load);
    order.insert(0, chosen);
    order
}

/// The controller's own time in the proxy, without its waits on workers.
struct ProxyClock {
    spent: f64,
    from: Instant,
}

impl ProxyClock {
    fn start() -> Self {
        Self {
            spent: 0.0,
            from: Instant::now(),
        }
    }

    /// A wait on a worker begins.
    fn pause(&mut self) {
        self.spent += self.from.elapsed().as_secs_f64();
    }

    /// The wait ended.
    fn resume(&mut self) {
        self.from = Instant::now();
    }
}

/// Sending a plan to its candidates, one after another.
struct Attempt {
    demand: Option<DemandGuard>,
    ticket: Option<SlotTicket>,
    clock: ProxyClock,
    method: Method,
    headers: HeaderMap,
}

impl Attempt {
    async fn run(&mut self, ctl: &Arc<Controller>, mut plan: Plan) -> Response {
        let order = std::mem::take(&mut plan.order);
        let candidates = order.len();
        let charged_prompt =
            (ctl.admission).charge_prompt(&plan.request.props, plan.request.tokens.len());
        for (attempt, i) in order.into_iter().enumerate() {
            let (name, url) = (plan.views[i].0.name.clone(), plan.views[i].1.clone());
            let slot = InFlight::begin(ctl, &name, &plan.request.props, charged_prompt);
            drop(self.ticket.take());
            if let Some(d) = &self.demand {
                d.placed(&name);
            }
            let body = plan.body_for(ctl, &name);
            self.clock.pause();
            let sent = (ctl.worker_client)
                .send(
                    self.method.clone(),
                    &format!("{url}{}", plan.request.path),
                    &self.headers,
                    &plan.request.acting,
                    body,
                )
                .await;
            let started = match sent {
                Ok(upstream) => upstream.first_bytes().await,
                Err(e) => Err(e),
            };
            self.clock.resume();
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
                    tracing::debug!(worker = name, status = %upstream.status, "worker refused; trying the next");
                }
                Ok(upstream) => {
                    let why = if attempt == 0 {
                        plan.reason.clone()
                    } else {
                        ctl.metrics.retries.inc();
                        format!("retry after a failed or silent worker: {name}")
                    };
                    let to = (name, url);
                    return self
                        .answered(ctl, &mut plan, upstream, slot, to, &why)
                        .await;
                }
                Err(e) => {
                    tracing::warn!(
                        worker = name,
                        error = e,
                        "worker failed before responding; trying the next"
                    );
                    ctl.registry.mark_down(&name);
                }
            }
        }
        retry_later(
            StatusCode::BAD_GATEWAY,
            "every candidate worker failed before responding",
        )
    }

    /// Worker `to` (name, URL) answered: relay its answer (movable, a
    /// followed native process, or plain), count and record the routing.
    async fn answered(
        &mut self,
        ctl: &Arc<Controller>,
        plan: &mut Plan,
        upstream: Upstream,
        mut slot: InFlight,
        (worker, url): (String, String),
        why: &str,
    ) -> Response {
        slot.traced = plan.traced.take();
        slot.demand = self.demand.take();
        let ok = upstream.status.is_success();
        let bodies = (plan.resume_body.take(), plan.native_body.take());
        let request = &plan.request;
        let placed = |body, slot| Placed {
            ctl: ctl.clone(),
            acting: request.acting.clone(),
            body,
            prompt: request.tokens.clone(),
            props: request.props.clone(),
            worker: worker.clone(),
            url: url.clone(),
            slot,
        };
        let mut native = None;
        let mut resp = match bodies {
            (Some(body), _) if ok => {
                let relay = Relay {
                    placed: placed(body, slot),
                    path: request.path.clone(),
                    headers: self.headers.clone(),
                };
                upstream.relay_with(|body| relay.into_body(body))
            }
            (None, Some(body)) if ok => {
                native = Some(NativeLaunch {
                    placed: placed(body, slot),
                    local: String::new(),
                    turns: None,
                });
                upstream.into_response()
            }
            _ => hold_until_streamed(upstream.into_response(), slot),
        };
        count_routed(ctl, &worker, why, &plan.request.route_request());
        let h = resp.headers_mut();
        h.insert(
            "x-pie-worker",
            HeaderValue::from_str(&worker).unwrap_or(HeaderValue::from_static("?")),
        );
        h.insert(
            "x-pie-route",
            HeaderValue::from_str(why).unwrap_or(HeaderValue::from_static("?")),
        );
        let resp = if plan.request.launches_native() {
            qualify_id(resp, &worker, native).await
        } else {
            resp
        };
        self.clock.pause();
        ctl.metrics.observe_part("proxy", self.clock.spent);
        match plan.request.whole.take() {
            Some(answer) => answer.gather(resp).await,
            None => resp,
        }
    }
}

/// A request routed to `worker` for `why`: counted, and recorded in the
/// pipeline (session-affinity remembers the session).
fn count_routed(ctl: &Controller, worker: &str, why: &str, req: &RouteRequest) {
    ctl.registry.count_routed(worker);
    let policy = why.split(':').next().unwrap_or_default().to_string();
    ctl.metrics
        .routed
        .get_or_create(&RouteLabels {
            worker: worker.to_string(),
            policy,
        })
        .inc();
    record(
        &mut ctl.pipeline.lock().unwrap_or_else(|e| e.into_inner()),
        now_ms(),
        req,
        worker,
    );
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
        // Offered tools are in the prompt the worker renders.
        let tools = match args.as_object() {
            Some(fields) if !native => ToolRequest::from_body(fields).map_err(|e| e.message)?,
            _ => None,
        };
        let ending = match native {
            true => ChatEnding::GenerationPrompt,
            false => ChatEnding::of(
                args["add_generation_prompt"].as_bool(),
                args["continue_final_message"].as_bool(),
                &messages,
            )?,
        };
        let tokens = tk
            .apply_chat_template_ending(&messages, tools.as_ref(), ending)
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

/// A streamed OpenAI generation of one choice whose prompt tokens the
/// controller knows (a non-streamed one is streamed to the workers:
/// `whole`): the controller can resume it elsewhere (see `relay`). Several
/// choices (`n`) are several processes: they stay where they start.
fn movable(path: &str, json: &Value, tokens: &[u32]) -> bool {
    matches!(path, "/v1/completions" | "/v1/chat/completions")
        && json["stream"].as_bool() == Some(true)
        && !tokens.is_empty()
        && one_choice(json)
}

/// One choice of one candidate (`best_of` above 1 picks among several at
/// the end, so it is neither streamed to the workers nor moved), read as
/// text: a worker reads tool calls from a whole answer, so a chat offering
/// tools stays where it starts and is answered as its worker answers.
fn one_choice(json: &Value) -> bool {
    json["n"].as_u64().unwrap_or(1) <= 1
        && json["best_of"].as_u64().unwrap_or(1) <= 1
        && !offers_tools(json)
}

fn offers_tools(json: &Value) -> bool {
    json["tools"].as_array().is_some_and(|t| !t.is_empty()) && json["tool_choice"] != "none"
}

/// What `whole` gathers from a stream: one choice's text, without logprobs.
fn gatherable(json: &Value) -> bool {
    one_choice(json) && matches!(json["logprobs"], Value::Null | Value::Bool(false))
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
