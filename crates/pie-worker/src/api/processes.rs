//! The native process routes (`/v1/processes...`): launch a built-in
//! inferlet, list, read, patch props, kill, and follow a process's events.
//! A caller sees only its own processes (another's are 404, as if absent).

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::stream::{Stream, StreamExt};
use pie_model::ChatEnding;
use serde::Deserialize;
use serde_json::{json, Value};

use super::args::{props_of, GenArgs, PromptArg, GEN_FIELDS};
use super::auth::{
    cache_salt_of, caller_of, client_limits, client_of, trusted_prefill_from,
    trusted_prompt_tokens, trusted_resume, trusted_stream_ids, Authed,
};
use super::response_format::checked_options;
use super::state::{ApiError, ApiJson, AppState};
use crate::inbox::InboxError;
use crate::inferlets::{InferletError, InferletLaunch, RegistryError};
use crate::process::{ProcEvent, ProcState, Process};
use crate::runtime::{GenOptions, Inferlet, PromptTokens, Resume, Runtime};
use pie_core::wire::SESSION_TURNS_FIELD;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LaunchBody {
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

/// `args` of `inferlet`, whose input is the field `input`: any other key
/// than it and the sampling fields is refused by name.
fn parse_args<T: serde::de::DeserializeOwned>(
    inferlet: &str,
    input: &str,
    args: Value,
) -> Result<T, ApiError> {
    let unknown = args.as_object().and_then(|a| {
        a.keys()
            .find(|k| *k != input && !GEN_FIELDS.contains(&k.as_str()))
    });
    if let Some(key) = unknown {
        return Err(ApiError::bad_request(format!(
            "args of `{inferlet}`: unknown field `{key}` (it takes `{input}` and {})",
            GEN_FIELDS.join(", ")
        ))
        .param(&format!("args.{key}")));
    }
    serde_json::from_value(args)
        .map_err(|e| ApiError::bad_request(format!("args of `{inferlet}`: {e}")).param("args"))
}

pub(super) async fn launch_process(
    State(state): State<AppState>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<LaunchBody>,
) -> Result<Response, ApiError> {
    let rt = state.runtime()?;
    let mut props = props_of(body.props.as_ref())?;
    let (inferlet, opts) = match body.inferlet.as_str() {
        "text-completion" => {
            let a: TextArgs = parse_args(&body.inferlet, "prompt", body.args)?;
            (
                Inferlet::TextCompletion {
                    prompt: a.prompt.into_prompt()?,
                },
                checked_options(&rt, &a.gen, 0.0).await?,
            )
        }
        "chat" => {
            let a: ChatArgs = parse_args(&body.inferlet, "messages", body.args)?;
            (
                Inferlet::Chat {
                    messages: a.messages,
                    resume_session: true,
                    tools: None,
                    ending: ChatEnding::GenerationPrompt,
                },
                checked_options(&rt, &a.gen, 0.0).await?,
            )
        }
        _ => return launch_installed(&state, &rt, auth, body, props),
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

/// A process of an installed (uploaded) inferlet: its `args` go to the
/// guest as they are. A controller's hints for a built-in's prompt
/// (`pie_prompt_tokens`, `pie_prefill_from`) do not apply and are ignored;
/// a resume cannot be honoured (a guest's state lives here) and is refused.
fn launch_installed(
    state: &AppState,
    rt: &Arc<Runtime>,
    auth: Option<Extension<Authed>>,
    body: LaunchBody,
    mut props: pie_core::Props,
) -> Result<Response, ApiError> {
    if body.pie_resume.is_some() {
        return Err(ApiError::bad_request(
            "pie_resume: a WebAssembly inferlet's process cannot resume on another worker",
        )
        .param("pie_resume"));
    }
    let client = client_of(&auth, &mut props)?;
    let key = client_limits(&auth);
    let launch = InferletLaunch {
        reference: body.inferlet,
        args: body.args,
        props,
        client,
        key,
        cache_salt: cache_salt_of(&auth),
    };
    let process = state.inferlets.launch(rt, launch).map_err(|e| match e {
        InferletError::Registry(RegistryError::NotFound(name)) => ApiError::bad_request(format!(
            "unknown inferlet `{name}` (built in: text-completion, chat; installed: see GET /v1/inferlets)"
        ))
        .param("inferlet"),
        e => e.into(),
    })?;
    Ok((StatusCode::CREATED, Json(json!({"id": process.id}))).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MessageBody {
    message: String,
}

/// `POST /v1/processes/{id}/messages`: a message to an inferlet process
/// (its owner only); 429 with `Retry-After` while too many wait for it.
pub(super) async fn send_message(
    State(state): State<AppState>,
    Path(id): Path<String>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<MessageBody>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let p = find(&rt, &id, &auth)?;
    let Some(inbox) = p.inbox().filter(|_| !p.state().is_final()) else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "process {id} takes no messages ({}, {})",
                p.inferlet,
                p.state().as_str()
            ),
        ));
    };
    match inbox.try_send(body.message) {
        Ok(()) => Ok(Json(json!({"id": p.id, "queued": true}))),
        Err(e @ (InboxError::TooMany(_) | InboxError::TooLarge { .. })) => Err(ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("process {id} cannot take this message: {e}"),
            )
        }),
        Err(InboxError::Closed) => Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("process {id} has ended"),
        )),
    }
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
pub(super) struct ListQuery {
    state: Option<String>,
    /// Processes per page (default 100, at most `MAX_PAGE`).
    limit: Option<usize>,
    /// The last id of the previous page: this page starts after it.
    after: Option<String>,
}

/// The caller's processes, oldest first, a page at a time (OpenAI's list shape:
/// `has_more`, `first_id`, `last_id`; pass `after=LAST_ID` for the next page).
pub(super) async fn list_processes(
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

pub(super) async fn get_process(
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
pub(super) struct PatchBody {
    props: serde_json::Map<String, Value>,
}

pub(super) async fn patch_process(
    State(state): State<AppState>,
    Path(id): Path<String>,
    auth: Option<Extension<Authed>>,
    ApiJson(body): ApiJson<PatchBody>,
) -> Result<Json<Value>, ApiError> {
    let rt = state.runtime()?;
    let p = find(&rt, &id, &auth)?;
    // A client key's own limits bound what it patches, as at launch.
    let limits = client_limits(&auth);
    let limits = limits.as_ref().map(|(who, limits)| (who.as_str(), limits));
    let props = rt.patch_props(&p, &body.props, limits)?;
    Ok(Json(json!({"id": p.id, "props": props})))
}

pub(super) async fn kill_process(
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
pub(super) struct EventsQuery {
    pie_stream_ids: Option<bool>,
}

/// SSE: `text` events with output (the output so far first), then one `status`
/// event with the final state and usage.
pub(super) async fn process_events(
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
        ProcEvent::Text { text, token, .. } => {
            let mut data = json!({"text": text});
            if ids {
                data["token"] = json!(token);
            }
            Event::default().event("text").data(data.to_string())
        }
        ProcEvent::Json(json) => Event::default().event("json").data(&*json),
        ProcEvent::Props(props) => Event::default()
            .event("props")
            .data(format!("{{\"props\":{props}}}")),
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
