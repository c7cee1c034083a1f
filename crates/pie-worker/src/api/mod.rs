//! The HTTP API: the router and its layers (auth, body limit).
//!
//! Layers, bottom to top: `state` (AppState, ApiError, the ApiJson
//! extractor), then `auth` and `args`, then the handlers by concern
//! (`health`, `processes`, `openai`, `internal`, `admin`); this file only
//! routes. Handlers are thin: they check the request and call the runtime.

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::get;
use axum::Router;

pub mod args;
pub mod auth;
mod logprobs;
pub mod openai;
pub mod state;

mod admin;
mod best_of;
mod health;
mod inferlets;
mod internal;
mod processes;
mod response_format;
mod tools;

use admin::{admin_drain, admin_reload, kv_forget_persisted};
use health::{health, livez, metrics};
use inferlets::{delete_inferlet, list_inferlets, upload_inferlet};
use internal::{
    hand_off, kv_events, kv_persist, kv_prefetch, kv_pull, kv_push, policies, retain_spill,
    worker_state, worker_tokenizer,
};
use processes::{
    get_process, kill_process, launch_process, list_processes, patch_process, process_events,
    send_message,
};
use state::{ApiError, AppState};

/// Every route, behind the auth middleware and the body limit.
pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    let router = Router::new()
        .route("/health", get(health))
        .route("/livez", get(livez))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(openai::models))
        .route("/v1/completions", axum::routing::post(openai::completions))
        .route(
            "/v1/chat/completions",
            axum::routing::post(openai::chat_completions),
        )
        .route("/v1/processes", get(list_processes).post(launch_process))
        .route(
            "/v1/processes/{id}",
            get(get_process).patch(patch_process).delete(kill_process),
        )
        .route("/v1/processes/{id}/events", get(process_events))
        .route(
            "/v1/processes/{id}/messages",
            axum::routing::post(send_message),
        )
        .route(
            "/v1/inferlets",
            get(list_inferlets)
                .post(upload_inferlet)
                .layer(DefaultBodyLimit::max(state.inferlets.max_upload_bytes())),
        )
        .route(
            "/v1/inferlets/{reference}",
            axum::routing::delete(delete_inferlet),
        )
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
    let router = router.route("/v1/admin/fault", axum::routing::post(admin::inject_fault));
    router
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .layer(middleware::from_fn_with_state(state.clone(), auth::auth))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}
