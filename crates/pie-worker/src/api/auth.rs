//! Who is calling: the auth middleware (API keys and the role each route
//! needs), the caller's identity for ownership and KV sharing, and the rule
//! for the fields only a controller (a `worker`-role key) may send
//! (`pie_prompt_tokens`, `pie_prefill_from`, `pie_resume`, `pie_stream_ids`).

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use pie_core::auth::{
    Caller, KeyLimits, Role, ACT_AS_CACHE_SALT, ACT_AS_CLIENT, ACT_AS_LIMITS, ACT_AS_ROLE,
};
use pie_core::{PropValue, Props};

use super::state::{ApiError, AppState};
use crate::runtime::{PromptTokens, Resume, PROMPT_TOKENS_FIELD, RESUME_FIELD, STREAM_IDS_FIELD};

/// The API key that authenticated a request (absent when no keys are configured).
#[derive(Clone, Debug)]
pub struct Authed {
    pub name: String,
    pub role: Role,
    pub limits: KeyLimits,
    /// A worker key's request made for a client (a controller forwarding):
    /// that client's name and role, from the `x-pie-client` headers.
    pub acting_for: Option<(String, Role)>,
    /// The limits of the client key a controller acts for (its
    /// `x-pie-client-limits`), when that key is a client key.
    pub acting_limits: Option<KeyLimits>,
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

/// The auth middleware: a request's [`Authed`] key, or its refusal.
pub(super) async fn auth(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
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
    let acting_limits = acting_for
        .as_ref()
        .filter(|(_, role)| *role == Role::Client)
        .and_then(|_| header_text(req.headers(), ACT_AS_LIMITS))
        .and_then(|json| serde_json::from_str(&json).ok());
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
        acting_limits,
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

/// The client key whose limits bound what a request sets: the caller's own
/// client key, or the client key a controller acts for; None for admin and
/// worker keys (and without keys).
pub fn client_limits(auth: &Option<Extension<Authed>>) -> Option<(String, KeyLimits)> {
    let Extension(a) = auth.as_ref()?;
    match (&a.acting_for, &a.acting_limits) {
        (Some((client, _)), Some(limits)) => Some((client.clone(), limits.clone())),
        (None, _) if a.role == Role::Client => Some((a.name.clone(), a.limits.clone())),
        _ => None,
    }
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
pub(super) fn check_peer_url(name: &str, url: &str) -> Result<(), ApiError> {
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
