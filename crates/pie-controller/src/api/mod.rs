//! The controller's HTTP API: the routes, the client-key check in front of
//! them ([`router`]), and the operations routes (health, metrics, models).
//! Handlers are thin: they parse, call the flows and the state below, and
//! answer. Generation is `generate`, the cluster's own routes `cluster`, and
//! the `WORKER~ID` process routes `processes`.

mod cluster;
mod generate;
mod inferlets;
mod processes;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use pie_core::auth::{authenticate, Role};
use serde_json::json;

use crate::caller::{acting_as, ClientKey};
use crate::controller::Controller;
use crate::registry::PromptChains;
use crate::respond::error;
use generate::generate;

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
async fn auth(State(ctl): State<Arc<Controller>>, mut req: Request, next: Next) -> Response {
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

/// Every route of the controller, behind the client-key check.
pub fn router(ctl: Arc<Controller>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate))
        .route("/v1/processes", post(generate))
        .merge(cluster::routes())
        .merge(inferlets::routes())
        .merge(processes::routes())
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route") })
        .layer(middleware::from_fn_with_state(ctl.clone(), auth))
        .with_state(ctl)
}

async fn health(State(ctl): State<Arc<Controller>>) -> Response {
    let healthy = ctl.registry.snapshot().iter().filter(|w| w.healthy).count();
    let status = if healthy > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({"status": if healthy > 0 { "ok" } else { "no healthy worker" }, "healthy_workers": healthy}))).into_response()
}

async fn metrics(State(ctl): State<Arc<Controller>>) -> Response {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ctl.metrics.encode(),
    )
        .into_response()
}

async fn models(
    State(ctl): State<Arc<Controller>>,
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
    ctl.worker_client
        .forward(
            Method::GET,
            &format!("{url}/v1/models"),
            &headers,
            &acting_as(key.as_deref()),
            Bytes::new(),
        )
        .await
        .unwrap_or_else(|e| error(StatusCode::BAD_GATEWAY, e))
}
