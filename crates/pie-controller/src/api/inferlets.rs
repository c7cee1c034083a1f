//! Inferlets installed through the controller: `POST /v1/inferlets?name=
//! &version=` (an admin key when keys are set) stores the component on the
//! controller's disk and installs it on every healthy worker at once; the
//! answer says per worker what happened (`installed`, `failed: ...`, or
//! `pending` for one that is down: it gets it when it is back, as does a
//! worker that joins later). A component every worker refuses (not a
//! component, a refused import) is a 400 with the first refusal and is not
//! kept. `GET /v1/inferlets` lists the set and each worker's state.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use pie_core::auth::Role;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::caller::ClientKey;
use crate::controller::Controller;
use crate::install_sync::install;
use crate::respond::error;

/// The largest component the controller takes.
pub const MAX_UPLOAD_BYTES: usize = 64 << 20;

pub fn routes() -> Router<Arc<Controller>> {
    Router::new().route(
        "/v1/inferlets",
        get(list)
            .post(upload)
            .layer(DefaultBodyLimit::max(MAX_UPLOAD_BYTES)),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UploadQuery {
    name: String,
    version: Option<String>,
}

async fn list(State(ctl): State<Arc<Controller>>) -> Json<Value> {
    Json(ctl.installs.view())
}

async fn upload(
    State(ctl): State<Arc<Controller>>,
    key: Option<Extension<ClientKey>>,
    Query(query): Query<UploadQuery>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            let why = format!("the component is larger than {MAX_UPLOAD_BYTES} bytes");
            return error(StatusCode::PAYLOAD_TOO_LARGE, why);
        }
        Err(e) => return error(e.status(), e.body_text()),
    };
    if let Some(Extension(k)) = &key {
        if k.role != Role::Admin {
            let why = format!(
                "key `{}` may not install inferlets: it needs role `admin`",
                k.name
            );
            return error(StatusCode::FORBIDDEN, why);
        }
    }
    let entry = match ctl
        .installs
        .add(&query.name, query.version.as_deref(), &body)
    {
        Ok(entry) => entry,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let workers = ctl.registry.snapshot();
    let tries = (workers.iter().filter(|w| w.healthy)).map(|w| {
        let (ctl, entry) = (ctl.clone(), entry.clone());
        let (name, url) = (w.name.clone(), w.url.clone());
        async move { (name, install(&ctl, &url, &entry).await) }
    });
    let results = futures_util::future::join_all(tries).await;
    if !results.is_empty()
        && results
            .iter()
            .all(|(_, r)| r.as_ref().is_err_and(|f| f.refused))
    {
        if let Err(e) = ctl.installs.remove(&entry) {
            tracing::warn!(
                error = e,
                "a refused inferlet was not taken out of the manifest"
            );
        }
        let why = results[0].1.as_ref().err().map_or("", |f| &f.why);
        return error(
            StatusCode::BAD_REQUEST,
            format!("every worker refused it: {why}"),
        );
    }
    let mut per_worker = Map::new();
    for w in workers.iter().filter(|w| !w.healthy) {
        per_worker.insert(w.name.clone(), json!("pending"));
    }
    for (name, result) in results {
        per_worker.insert(
            name.clone(),
            json!(match &result {
                Ok(()) => "installed".to_string(),
                Err(f) => format!("failed: {}", f.why),
            }),
        );
        ctl.installs
            .record(&name, &entry, result.map_err(|f| f.why));
    }
    let answer = json!({"name": entry.name, "version": entry.version,
        "sha256": entry.sha256, "bytes": entry.bytes, "workers": per_worker});
    (StatusCode::CREATED, Json(answer)).into_response()
}
