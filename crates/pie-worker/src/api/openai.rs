//! OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`,
//! `/v1/models` (with the model's `vocab_size`, so token-id clients such as
//! `pie bench` can stay inside the vocabulary). Every body field passes
//! `pie_core::openai_fields` first (a typo or an unserved value is a 400
//! naming it); Pie's extras: `props` (object), `session` (string), `top_k`,
//! `ignore_eos`.
//! A client that disconnects kills its process (its pages are released).

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::stream::{self, Stream, StreamExt};
use pie_core::chat::OpenAiMessage;
use pie_core::openai_fields::{self, Endpoint};
use pie_core::tools::{ToolFormat, ToolOutput, ToolRequest};
use pie_core::wire::{HANDOFF_COMMENT, PROCESS_COMMENT, TOKEN_IDS_KEY};
use pie_core::{PropValue, Props};
use pie_model::ChatEnding;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::args::{props_of, GenArgs, PromptArg};
use super::auth::{
    cache_salt_of, client_of, trusted_prefill_from, trusted_prompt_tokens, trusted_resume,
    trusted_stream_ids, Authed,
};
use super::best_of::{self, echo_text, CompletionExtras};
use super::logprobs::{self, Scored};
use super::response_format::checked_options;
use super::state::{ApiError, ApiJson, AppState};
use super::tools;
use crate::process::{ProcEvent, ProcState, Process, Usage};
use crate::runtime::{GenOptions, Inferlet, PromptTokens, Resume, Runtime};
use pie_core::clock::now_ms;

/// Kills the process when the request that owns it goes away unfinished.
struct KillOnDrop {
    rt: Arc<Runtime>,
    process: Arc<Process>,
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if !self.process.state().is_final() {
            self.rt.kill(&self.process);
        }
    }
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields every OpenAI request shares.
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    props: Option<Value>,
    session: Option<String>,
    /// A controller's token ids for the prompt (see `auth::trusted_prompt_tokens`).
    pie_prompt_tokens: Option<PromptTokens>,
    /// The prefill worker a controller chose (see `auth::trusted_prefill_from`).
    pie_prefill_from: Option<String>,
    /// A controller resumes a process that ran elsewhere (see `auth::trusted_resume`).
    pie_resume: Option<Resume>,
    /// A controller asks for each chunk's token id (see `auth::trusted_stream_ids`).
    pie_stream_ids: Option<bool>,
    /// Choices: one process each, over the one prompt.
    n: Option<usize>,
    #[serde(flatten)]
    gen: GenArgs,
}

#[derive(Deserialize)]
pub struct CompletionRequest {
    prompt: PromptArg,
    /// Each token's logprob and this many alternatives'.
    logprobs: Option<usize>,
    best_of: Option<usize>,
    echo: Option<bool>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
pub struct ChatRequest {
    messages: Vec<OpenAiMessage>,
    max_completion_tokens: Option<usize>,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    #[serde(default)]
    tools: Value,
    #[serde(default)]
    tool_choice: Value,
    #[serde(default)]
    parallel_tool_calls: Value,
    /// vLLM's and SGLang's: how the prompt ends (`pie_model::ChatEnding`).
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    #[serde(flatten)]
    common: Common,
}

/// What differs between the completion and chat response shapes.
#[derive(Clone, Copy)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn id(self, process: &str) -> String {
        match self {
            Kind::Completion => format!("cmpl-{process}"),
            Kind::Chat => format!("chatcmpl-{process}"),
        }
    }

    fn choice(
        self,
        index: usize,
        text: &str,
        finish_reason: Option<&str>,
        chunk: bool,
        logprobs: Value,
    ) -> Value {
        match (self, chunk) {
            (Kind::Completion, _) => {
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
            }
            (Kind::Chat, false) => {
                json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish_reason})
            }
            (Kind::Chat, true) if finish_reason.is_some() => {
                json!({"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": finish_reason})
            }
            (Kind::Chat, true) => {
                json!({"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": null})
            }
        }
    }
}

/// An OpenAI request's body, its fields checked by the rule both binaries
/// share ([`pie_core::openai_fields`]) before it is read.
fn checked_body<T: DeserializeOwned>(endpoint: Endpoint, body: Value) -> Result<T, ApiError> {
    let Some(fields) = body.as_object() else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    openai_fields::check(endpoint, fields)
        .map_err(|e| ApiError::bad_request(e.message).param(&e.param))?;
    // As axum's JSON extractor answers a body of the wrong shape.
    serde_json::from_value(body).map_err(|e| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("invalid request: {e}"),
        )
    })
}

pub async fn models(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    Ok(Json(
        json!({"object": "list", "data": [{"id": rt.settings.model_name, "object": "model", "created": 0, "owned_by": "pie", "vocab_size": rt.model.config.vocab}]}),
    ))
}

pub async fn completions(
    State(state): State<AppState>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = checked_body(Endpoint::Completions, body)?;
    let prompt = req.prompt.into_prompt()?;
    let mut common = req.common;
    common.gen.max_tokens = common.gen.max_tokens.or(Some(16));
    let scores = req
        .logprobs
        .map(|k| checked_top("logprobs", k))
        .transpose()?;
    let extras = CompletionExtras {
        best_of: req.best_of,
        echo: req.echo.unwrap_or(false),
    };
    serve(
        state,
        auth,
        Inferlet::TextCompletion { prompt },
        common,
        (Kind::Completion, scores, extras),
        None,
    )
    .await
}

pub async fn chat_completions(
    State(state): State<AppState>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = checked_body(Endpoint::Chat, body)?;
    let tools = tools::tool_request(&req.tools, &req.tool_choice, &req.parallel_tool_calls)?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").param("messages"));
    }
    let messages = req
        .messages
        .into_iter()
        .map(OpenAiMessage::into_chat)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::bad_request(e).param("messages"))?;
    let ending = ChatEnding::of(
        req.add_generation_prompt,
        req.continue_final_message,
        &messages,
    )
    .map_err(|e| ApiError::bad_request(e).param("continue_final_message"))?;
    let mut common = req.common;
    common.gen.max_tokens = common.gen.max_tokens.or(req.max_completion_tokens);
    let scores = match (req.logprobs, req.top_logprobs) {
        (Some(true), top) => Some(checked_top("top_logprobs", top.unwrap_or(0))?),
        (_, Some(k)) if k > 0 => {
            return Err(
                ApiError::bad_request("top_logprobs needs logprobs: true").param("top_logprobs")
            )
        }
        _ => None,
    };
    // OpenAI clients send the whole conversation each turn: no server-side history.
    serve(
        state,
        auth,
        Inferlet::Chat {
            messages,
            resume_session: false,
            tools: tools.clone(),
            ending,
        },
        common,
        (Kind::Chat, scores, CompletionExtras::default()),
        tools,
    )
    .await
}

/// The most alternatives a token's logprobs may list (`logprobs`,
/// `top_logprobs`; OpenAI's chat limit).
const MAX_TOP_LOGPROBS: usize = 20;

fn checked_top(field: &str, k: usize) -> Result<usize, ApiError> {
    if k > MAX_TOP_LOGPROBS {
        return Err(ApiError::bad_request(format!(
            "{field} must be 0 to {MAX_TOP_LOGPROBS}, got {k}"
        ))
        .param(field));
    }
    Ok(k)
}

/// `(kind, scores, extras)`: the response's shape, how many alternatives
/// each token's logprobs list (None: no logprobs), `best_of` and `echo`;
/// `tools`: the tools a chat offers.
async fn serve(
    state: AppState,
    auth: Option<Extension<Authed>>,
    inferlet: Inferlet,
    mut common: Common,
    (kind, scores, extras): (Kind, Option<usize>, CompletionExtras),
    tools: Option<ToolRequest>,
) -> Result<Response, ApiError> {
    let rt = state.runtime()?;
    if let Some(model) = &common.model {
        if *model != rt.settings.model_name {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "model `{model}` not found; this worker serves `{}`",
                    rt.settings.model_name
                ),
            )
            .param("model"));
        }
    }
    let mut props = request_props(&common)?;
    let opts = GenOptions {
        cache_salt: cache_salt_of(&auth),
        prefill_from: trusted_prefill_from(&auth, common.pie_prefill_from.take())?,
        resume: trusted_resume(&auth, common.pie_resume.take())?,
        logprobs: scores,
        ..checked_options(&rt, &common.gen, 1.0).await?
    };
    let relay = Relay {
        token_ids: trusted_stream_ids(&auth, common.pie_stream_ids.take())?,
        resumed: opts.resume.is_some(),
    };
    let opts = match &tools {
        Some(_) if relay.token_ids || opts.resume.is_some() => {
            return Err(ApiError::bad_request(
                "tools are not relayed or resumed by a controller (the calls are read from the whole answer)",
            )
            .param("tools"))
        }
        Some(request) => tools::constrained(&rt, request, opts).await?,
        None => opts,
    };
    let choices = checked_choices(common.n, relay, &opts)?;
    let candidates = best_of::candidates(extras.best_of, choices, common.stream, MAX_CHOICES)?;
    let echo = echo_text(&rt.model, &inferlet, extras, scores)?;
    let opts = GenOptions {
        // The best are the likeliest per token: every candidate is scored.
        logprobs: opts.logprobs.or((candidates > choices).then_some(0)),
        ..opts
    };
    let pretokenized = trusted_prompt_tokens(&auth, common.pie_prompt_tokens.take())?;
    let client = client_of(&auth, &mut props)?;
    let mut launched = Vec::with_capacity(candidates);
    for index in 0..candidates {
        let mut opts = opts.clone();
        // Each choice its own draws: seed + its index.
        opts.sampling.seed = opts.sampling.seed.map(|s| s.wrapping_add(index as u64));
        let (process, events) = rt.launch(
            inferlet.clone(),
            opts,
            props.clone(),
            client.clone(),
            pretokenized.clone(),
        )?;
        let guard = KillOnDrop {
            rt: rt.clone(),
            process,
        };
        launched.push((guard, events));
    }
    let meta = Meta {
        id: kind.id(&launched[0].0.process.id),
        model: rt.settings.model_name.clone(),
        created: now_ms() / 1000,
        kind,
        scored_by: scores.map(|_| rt.model.clone()),
        echo: echo.filter(|_| !relay.resumed),
        choices,
        tools: tools.map(|_| rt.model.tokenizer.tool_format()),
    };
    if common.stream {
        let include_usage = common.stream_options.unwrap_or_default().include_usage;
        Ok(stream_response(meta, launched, include_usage, relay).into_response())
    } else {
        whole_response(meta, launched).await
    }
}

/// The most choices one request may ask for (`n`).
const MAX_CHOICES: usize = 16;

/// `n`, checked: 1 to [`MAX_CHOICES`]; more than one only for a request a
/// controller neither follows nor resumes (it moves one stream at a time).
fn checked_choices(n: Option<usize>, relay: Relay, opts: &GenOptions) -> Result<usize, ApiError> {
    let n = n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(
            ApiError::bad_request(format!("n must be 1 to {MAX_CHOICES}, got {n}")).param("n"),
        );
    }
    if n > 1 && (relay.token_ids || opts.resume.is_some()) {
        return Err(ApiError::bad_request(
            "n above 1 is not relayed or resumed by a controller (it moves one stream)",
        )
        .param("n"));
    }
    Ok(n)
}

/// The processes of one request's choices, in order, each killed when the
/// request goes away unfinished.
type Launched = Vec<(KillOnDrop, crate::runtime::ProcEvents)>;

/// One request's usage: the prompt once, every choice's completion.
fn with_choice(total: Option<Usage>, choice: Usage) -> Usage {
    match total {
        None => choice,
        Some(t) => Usage::new(
            t.prompt_tokens,
            t.completion_tokens + choice.completion_tokens,
            t.prompt_tokens_details.cached_tokens,
        ),
    }
}

fn request_props(common: &Common) -> Result<Props, ApiError> {
    let mut props = props_of(common.props.as_ref())?;
    if let Some(session) = &common.session {
        props
            .set("session", PropValue::Str(session.clone()))
            .map_err(|e| ApiError::from(e).param("session"))?;
    }
    Ok(props)
}

/// What a controller asked of a stream so that it can move it.
#[derive(Clone, Copy)]
struct Relay {
    /// Every token's chunk carries `pie_token_ids` (empty text included),
    /// the stream opens with a `pie-process ID` comment, and a hand-off ends
    /// it with a `pie-handoff` comment.
    token_ids: bool,
    /// The process goes on from another worker: the client has its opening.
    resumed: bool,
}

struct Meta {
    id: String,
    model: String,
    created: u64,
    kind: Kind,
    /// The model whose tokenizer spells the tokens, when logprobs were asked.
    scored_by: Option<Arc<pie_model::Model>>,
    /// The prompt's text before each choice's (`echo`).
    echo: Option<String>,
    /// How many choices the answer has (of more candidates, `best_of`).
    choices: usize,
    /// The format the answer's tool calls are read in, when tools were offered.
    tools: Option<ToolFormat>,
}

impl Meta {
    fn body(&self, chunk: bool, choices: Value, usage: Option<Usage>) -> Value {
        let mut v = json!({"id": self.id, "object": self.kind.object(chunk), "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = json!(u);
        }
        v
    }

    /// A choice's `logprobs`: null unless asked for.
    fn logprobs(&self, scored: &[Scored]) -> Value {
        match (&self.scored_by, self.kind) {
            (None, _) => Value::Null,
            (Some(m), Kind::Chat) => logprobs::chat(&m.tokenizer, scored),
            (Some(m), Kind::Completion) => logprobs::completion(&m.tokenizer, scored),
        }
    }
}

fn failure(state: ProcState, error: Option<String>) -> ApiError {
    match state {
        ProcState::Killed => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the process was killed")
        }
        ProcState::Migrated => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the process was handed off to another worker",
        ),
        _ => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            error.unwrap_or_else(|| "generation failed".into()),
        ),
    }
}

async fn whole_response(meta: Meta, launched: Launched) -> Result<Response, ApiError> {
    let answers = launched.into_iter().map(|(guard, events)| async move {
        let answer = gather(events).await;
        drop(guard);
        answer
    });
    let gathered: Vec<Gathered> = (futures_util::future::join_all(answers).await)
        .into_iter()
        .collect::<Result<_, _>>()?;
    let usage = (gathered.iter()).fold(None, |total, g| Some(with_choice(total, g.usage)));
    let scores: Vec<Vec<f32>> = (gathered.iter())
        .map(|g| g.scored.iter().map(|s| s.logprobs.logprob).collect())
        .collect();
    let order = match gathered.len() > meta.choices {
        true => best_of::best(&scores, meta.choices),
        false => (0..gathered.len()).collect(),
    };
    let echo = meta.echo.as_deref().unwrap_or_default();
    let choices: Vec<Value> = (order.iter().enumerate())
        .map(|(index, &i)| {
            let g = &gathered[i];
            let text = format!("{echo}{}", g.text);
            let logprobs = meta.logprobs(&g.scored);
            let choice = (meta.kind).choice(index, &text, g.finish_reason, false, logprobs);
            match meta.tools {
                Some(format) => with_tool_calls(&meta.id, choice, format, &text),
                None => choice,
            }
        })
        .collect();
    Ok(Json(meta.body(false, json!(choices), usage)).into_response())
}

/// A whole chat `choice` whose `text` is read in `format`: its calls in
/// `message.tool_calls` (the text outside them the content, null when
/// blank) and `finish_reason: "tool_calls"`.
fn with_tool_calls(id: &str, mut choice: Value, format: ToolFormat, text: &str) -> Value {
    let mut output = ToolOutput::new(format);
    let streamed = output.push(text);
    let (rest, calls) = output.finish();
    let content = format!("{streamed}{rest}");
    if calls.is_empty() {
        choice["message"]["content"] = json!(content);
        return choice;
    }
    let index = choice["index"].as_u64().unwrap_or(0) as usize;
    let blank = content.trim().is_empty();
    choice["message"]["content"] = if blank { Value::Null } else { json!(content) };
    choice["message"]["tool_calls"] = tools::calls_json(id, index, &calls, false);
    choice["finish_reason"] = json!("tool_calls");
    choice
}

/// One choice, whole.
struct Gathered {
    text: String,
    finish_reason: Option<&'static str>,
    usage: Usage,
    scored: Vec<Scored>,
}

/// One choice's whole text, finish reason, usage and scored tokens.
async fn gather(events: impl Stream<Item = ProcEvent>) -> Result<Gathered, ApiError> {
    let mut text = String::new();
    let mut scored = Vec::new();
    let mut events = std::pin::pin!(events);
    while let Some(e) = events.next().await {
        match e {
            ProcEvent::Text {
                text: t,
                token,
                logprobs,
            } => {
                if let (Some(token), Some(logprobs)) = (token, logprobs) {
                    let offset = text.len();
                    scored.push(Scored {
                        token,
                        logprobs,
                        offset,
                    });
                }
                text.push_str(&t);
            }
            // Only built-ins answer here: they emit neither.
            ProcEvent::Json(_) | ProcEvent::Props(_) => {}
            ProcEvent::Done {
                state: ProcState::Finished,
                finish_reason,
                usage,
                ..
            } => {
                return Ok(Gathered {
                    text,
                    finish_reason,
                    usage,
                    scored,
                })
            }
            ProcEvent::Done { state, error, .. } => return Err(failure(state, error)),
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the process ended without a result",
    ))
}

fn stream_response(
    meta: Meta,
    launched: Launched,
    include_usage: bool,
    relay: Relay,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let (guards, events): (Vec<KillOnDrop>, Vec<_>) = launched.into_iter().unzip();
    let mut opening = Vec::new();
    if relay.token_ids {
        opening
            .push(Event::default().comment(format!("{PROCESS_COMMENT} {}", guards[0].process.id)));
    }
    if matches!(meta.kind, Kind::Chat) && !relay.resumed {
        for index in 0..guards.len() {
            opening.push(data(meta.body(true, json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]), None)));
        }
    }
    if let Some(echo) = &meta.echo {
        for index in 0..guards.len() {
            let choice = meta.kind.choice(index, echo, None, true, Value::Null);
            opening.push(data(meta.body(true, json!([choice]), None)));
        }
    }
    let mut tally = Tally {
        left: guards.len(),
        usage: None,
        text_lens: vec![0; guards.len()],
        outputs: (0..guards.len())
            .map(|_| meta.tools.map(ToolOutput::new))
            .collect(),
    };
    let merged = stream::select_all(
        events
            .into_iter()
            .enumerate()
            .map(|(index, events)| events.map(move |e| (index, e)).boxed()),
    );
    let body = merged.flat_map(move |(index, e)| {
        stream::iter(chunk_events(
            &meta,
            &mut tally,
            index,
            e,
            include_usage,
            relay,
        ))
    });
    let done = stream::once(async move {
        drop(guards);
        Event::default().data("[DONE]")
    });
    Sse::new(stream::iter(opening).chain(body).chain(done).map(Ok)).keep_alive(KeepAlive::default())
}

/// The end of a streamed choice read for tool calls: the text held back,
/// then the calls, each in full; the finish reason, `tool_calls` if any.
fn tool_chunks(
    meta: &Meta,
    index: usize,
    output: ToolOutput,
    finish_reason: Option<&'static str>,
) -> (Vec<Event>, Option<&'static str>) {
    let (rest, calls) = output.finish();
    let mut chunks = Vec::new();
    if !rest.is_empty() {
        let choice = meta.kind.choice(index, &rest, None, true, Value::Null);
        chunks.push(data(meta.body(true, json!([choice]), None)));
    }
    if calls.is_empty() {
        return (chunks, finish_reason);
    }
    let delta = json!({"tool_calls": tools::calls_json(&meta.id, index, &calls, true)});
    let choice = json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null});
    chunks.push(data(meta.body(true, json!([choice]), None)));
    (chunks, Some("tool_calls"))
}

fn data(v: Value) -> Event {
    Event::default().data(v.to_string())
}

/// Choices still going, the usage of those done, the length of each
/// choice's text so far (its next token's `text_offset`), and each one's
/// answer read for tool calls (when tools were offered).
struct Tally {
    left: usize,
    usage: Option<Usage>,
    text_lens: Vec<usize>,
    outputs: Vec<Option<ToolOutput>>,
}

/// What choice `index`'s event `e` sends: its text chunk, its finish (and,
/// after the last choice's, the request's usage), or an error event.
fn chunk_events(
    meta: &Meta,
    tally: &mut Tally,
    index: usize,
    e: ProcEvent,
    include_usage: bool,
    relay: Relay,
) -> Vec<Event> {
    let choice = |text: &str, finish: Option<&str>, logprobs: Value| {
        json!([meta.kind.choice(index, text, finish, true, logprobs)])
    };
    match e {
        ProcEvent::Text {
            text,
            token,
            logprobs,
        } => {
            let offset = tally.text_lens[index];
            tally.text_lens[index] += text.len();
            let text = match &mut tally.outputs[index] {
                Some(output) => output.push(&text),
                None => text,
            };
            let scored = token.zip(logprobs).map(|(token, logprobs)| Scored {
                token,
                logprobs,
                offset,
            });
            let logprobs = match &scored {
                Some(s) => meta.logprobs(std::slice::from_ref(s)),
                None => Value::Null,
            };
            match token {
                Some(t) if relay.token_ids => {
                    let mut chunk = meta.body(true, choice(&text, None, logprobs), None);
                    chunk[TOKEN_IDS_KEY] = json!([t]);
                    vec![data(chunk)]
                }
                // A token's logprobs go out even when it made no text yet.
                _ if text.is_empty() && logprobs.is_null() => Vec::new(),
                _ => vec![data(meta.body(true, choice(&text, None, logprobs), None))],
            }
        }
        ProcEvent::Json(_) | ProcEvent::Props(_) => Vec::new(),
        ProcEvent::Done {
            state: ProcState::Migrated,
            ..
        } if relay.token_ids => vec![Event::default().comment(HANDOFF_COMMENT)],
        ProcEvent::Done {
            state: ProcState::Finished,
            finish_reason,
            usage,
            ..
        } => {
            let (mut v, finish_reason) = match tally.outputs[index].take() {
                Some(output) => tool_chunks(meta, index, output, finish_reason),
                None => (Vec::new(), finish_reason),
            };
            v.push(data(meta.body(
                true,
                choice("", finish_reason, Value::Null),
                None,
            )));
            tally.left -= 1;
            tally.usage = Some(with_choice(tally.usage, usage));
            match tally.usage.filter(|_| tally.left == 0) {
                Some(usage) if include_usage => {
                    v.push(data(meta.body(true, json!([]), Some(usage))))
                }
                // SSE clients skip comments; a controller reads the count from it.
                Some(usage) => {
                    v.push(Event::default().comment(format!("pie-usage {}", json!(usage))))
                }
                None => {}
            }
            v
        }
        ProcEvent::Done { state, error, .. } => {
            let e = failure(state, error);
            vec![data(pie_core::api_error::error_body(
                e.status.as_u16(),
                &e.message,
                None,
            ))]
        }
    }
}
