//! The actors at work: every `[cluster] actor_tick_ms` (and at once when
//! events arrive) the actors see a snapshot and return records; each record is
//! executed (a worker asked over HTTP, a stream moved, a hint published) and
//! logged, and a failed one goes back to the actors as `ActionFailed`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use pie_core::clock::now_ms;
use pie_core::BlockHash;
use pie_policy::cluster::Action;
use serde_json::{json, Value};

use crate::actors::Outcome;
use crate::controller::Controller;

/// The request that carries out `action` on a worker, for the actions
/// workers execute: `persist-prefix` (`POST /v1/internal/kv/persist`; a worker
/// without a disk or pool says so), `copy-prefix` (the target's `POST
/// /v1/internal/kv/prefetch` from the source: nothing is computed, and the
/// target's KV events announce the pages), `copy-prefix-to-pool` (the source's
/// persist with `to = "pool"`), `retain-spill` (`POST /v1/internal/retain`:
/// a worker without the tier says so). None for other actions; an error when a worker
/// named is unknown.
fn worker_ask(
    ctl: &Controller,
    action: &Action,
) -> Option<Result<reqwest::RequestBuilder, String>> {
    let url = |w: &str| ctl.registry.url_of(w).ok_or(format!("no worker `{w}`"));
    let (worker, path, body) = match action {
        Action::PersistPrefix { blocks, worker } => (
            url(worker),
            "/v1/internal/kv/persist",
            Ok(json!({ "blocks": hashes(blocks) })),
        ),
        Action::CopyPrefix { blocks, from, to } => (
            url(to),
            "/v1/internal/kv/prefetch",
            url(from).map(|from| json!({ "from": from, "blocks": hashes(blocks) })),
        ),
        Action::CopyPrefixToPool { blocks, from } => (
            url(from),
            "/v1/internal/kv/persist",
            Ok(json!({ "blocks": hashes(blocks), "to": "pool" })),
        ),
        Action::RetainSpill { worker, to } => (
            url(worker),
            "/v1/internal/retain",
            Ok(json!({ "spill": to })),
        ),
        _ => return None,
    };
    Some(worker.and_then(|worker| {
        let body = body?;
        Ok(ctl
            .worker_client
            .request(Method::POST, &format!("{worker}{path}"))
            .json(&body))
    }))
}

fn hashes(blocks: &[BlockHash]) -> Vec<u64> {
    blocks.iter().map(|b| b.0).collect()
}

/// Send a worker's ask and read its answer as the action's outcome (logged
/// too): executed with what the worker did, or failed with why not.
async fn answer_of(req: reqwest::RequestBuilder, kind: &'static str) -> Outcome {
    let failed = |error: String| {
        tracing::warn!(kind, "{error}");
        Outcome::Failed { error }
    };
    match req.send().await {
        Ok(resp) if resp.status().is_success() => {
            let done: Value = resp.json().await.unwrap_or_default();
            tracing::info!(kind, %done, "done");
            Outcome::Executed
        }
        Ok(resp) => {
            let status = resp.status();
            let why = resp.text().await.unwrap_or_default();
            failed(format!("the worker answered {status}: {why}"))
        }
        Err(e) => failed(format!("the worker did not answer: {e}")),
    }
}

/// Tick the actors every `[cluster] actor_tick_ms` (re-read after a reload),
/// and hand them events as they come.
pub async fn run(ctl: Arc<Controller>) {
    let mut next = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {
                step(&ctl, true);
                let every = Duration::from_millis(ctl.actors.tick_ms.load(Ordering::Relaxed));
                next = tokio::time::Instant::now() + every;
            }
            _ = ctl.actors.wake.notified() => step(&ctl, false),
        }
    }
}

/// Queued events, then (when `tick`) a tick; every record executed and logged.
fn step(ctl: &Arc<Controller>, tick: bool) {
    let actors = &ctl.actors;
    let cluster = || (ctl.registry.snapshot(), ctl.registry.hot_prefixes());
    for record in actors.decide(tick, cluster, now_ms()) {
        let ask = match record.dry_run {
            true => None,
            false => worker_ask(ctl, &record.action),
        };
        let outcome = match &ask {
            Some(Ok(_)) => Outcome::Sent,
            Some(Err(error)) => Outcome::Failed {
                error: error.clone(),
            },
            None => actors.execute(&ctl.metrics, &ctl.streams, &record),
        };
        let (kind, action) = (record.action.kind(), record.action.clone());
        let id = actors.record(&ctl.metrics, record, outcome);
        if let Some(Ok(req)) = ask {
            let ctl = ctl.clone();
            tokio::spawn(async move {
                let outcome = answer_of(req, kind).await;
                ctl.actors.settle(id, action, outcome);
            });
        }
    }
}
