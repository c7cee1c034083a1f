//! What the two flows that move work share (a relayed stream, `relay`, and a
//! followed native process, `native`): the request as placed ([`Placed`]),
//! where it resumes, and the bookkeeping of a move ([`Moved`]).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use pie_core::clock::now_ms;
use pie_core::Props;
use pie_policy::cluster::{record, RouteRequest};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::caller::Acting;
use crate::controller::Controller;
use crate::in_flight::InFlight;
use crate::routing::resume_target;
use crate::streams::{Move, Placement, Reason};

/// The most workers one move tries before the stream or process is lost.
pub const MAX_TARGETS: usize = 4;
/// The most moves of one stream or process (a loop of failures ends).
pub const MAX_RESUMES: usize = 8;

/// Where a stream or process resumes, one worker (name, URL) at a time:
/// `target` (a move's named worker) first, then what routing chooses, never
/// a worker tried (nor the one it ran on), at most [`MAX_TARGETS`]. The one
/// order of relayed streams and followed native processes alike.
pub struct ResumeTargets {
    tried: Vec<String>,
    target: Option<(String, String)>,
}

impl ResumeTargets {
    /// The next worker to try after `tokens` (prompt and output so far).
    pub fn next(&mut self, placed: &Placed, tokens: &[u32]) -> Option<(String, String)> {
        if self.tried.len() > MAX_TARGETS {
            return None;
        }
        let next = (self.target.take()).or_else(|| placed.resume_target(tokens, &self.tried))?;
        self.tried.push(next.0.clone());
        Some(next)
    }
}

/// A request the controller placed on a worker and may move: what every
/// worker it goes to gets, and where it runs now. A relayed stream
/// ([`Relay`]) and a followed native process (`native::NativeLaunch`) both
/// start from one.
pub struct Placed {
    pub ctl: Arc<Controller>,
    pub acting: Acting,
    /// The body as the workers get it: with `pie_stream_ids` (and
    /// `pie_prompt_tokens` where the worker key vouches), without
    /// `pie_prefill_from`.
    pub body: Value,
    /// The prompt's ids as the workers see them (empty when unknown).
    pub prompt: Vec<u32>,
    pub props: Props,
    pub worker: String,
    pub url: String,
    pub slot: InFlight,
}

impl Placed {
    /// The URL of the worker move `m` goes to; None (the move counted
    /// failed) when that is where it runs or a worker the registry lacks.
    pub fn move_target(&self, m: &Move) -> Option<String> {
        let target = (m.to != self.worker)
            .then(|| self.ctl.registry.url_of(&m.to))
            .flatten();
        if target.is_none() {
            tracing::warn!(
                worker = self.worker,
                to = m.to,
                "no worker to move to; it stays"
            );
            count_move_failure(&self.ctl, m.reason);
        }
        target
    }
}

/// A response body of the bytes a task sends on `rx`, ending when it drops
/// its sender.
pub fn channel_body(rx: mpsc::Receiver<Bytes>) -> Body {
    Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx))
    }))
}

/// A move for `reason` that ended with the stream or process lost.
pub fn count_move_failure(ctl: &Controller, reason: Reason) {
    ctl.metrics
        .move_failures
        .get_or_create(&reason.label())
        .inc();
}

/// A stream or native process `id` that went on from worker `from` on `to`.
pub struct Moved<'a> {
    pub id: u64,
    pub from: &'a str,
    pub to: &'a str,
    pub reason: Reason,
    pub props: &'a Props,
    /// Prompt and generated tokens.
    pub prompt: usize,
    pub generated: usize,
}

impl Moved<'_> {
    /// Count the move: metrics, the request's in-flight slot and demand, the
    /// registry of streams, and the routing pipeline (session-affinity
    /// follows the session).
    pub fn count(&self, ctl: &Controller, slot: &mut InFlight) {
        tracing::info!(from = self.from, to = self.to, tokens = self.generated, reason = ?self.reason, "moved");
        ctl.metrics.moved.get_or_create(&self.reason.label()).inc();
        slot.moved_to(self.to);
        if let Some(demand) = &slot.demand {
            demand.placed(self.to);
        }
        ctl.streams.now_on(self.id, self.to);
        let req = RouteRequest {
            props: self.props,
            prompt_tokens: self.prompt + self.generated,
        };
        let mut pipeline = ctl.pipeline.lock().unwrap_or_else(|e| e.into_inner());
        record(&mut pipeline, now_ms(), &req, self.to);
    }
}

impl Placed {
    /// Where the stream table records it.
    pub fn placement(&self) -> Placement {
        Placement {
            worker: self.worker.clone(),
            session: self.props.str("session").map(str::to_string),
            process: self.slot.demand.as_ref().map(|d| d.process_id()),
        }
    }

    /// Take the props the stream table holds for it (a PATCH may have
    /// changed them since it was placed): routing and the next worker see them.
    pub fn refresh_props(&mut self, id: u64) {
        if let Some(props) = self.ctl.streams.props_of(id) {
            if let Ok(parsed) = Props::from_json(&props) {
                self.props = parsed;
            }
            self.body["props"] = props;
        }
    }

    /// The workers to resume on, in order (see [`ResumeTargets`]).
    pub fn resume_targets(&self, target: Option<String>) -> ResumeTargets {
        ResumeTargets {
            tried: vec![self.worker.clone()],
            target: target.and_then(|name| self.ctl.registry.url_of(&name).map(|url| (name, url))),
        }
    }

    /// A worker to resume on after `tokens` (prompt and output so far), not
    /// one of `tried`: see [`resume_target`].
    pub fn resume_target(&self, tokens: &[u32], tried: &[String]) -> Option<(String, String)> {
        let ctl = &self.ctl;
        let salt = self.acting.cache_salt.as_deref();
        resume_target(
            &ctl.registry,
            &ctl.pipeline,
            tokens,
            &self.props,
            salt,
            tried,
        )
    }

    /// POST `body` to a worker's internal route for this stream's client.
    pub fn post(
        &self,
        url: String,
        body: Value,
    ) -> BoxFuture<'static, Result<(StatusCode, Value), String>> {
        self.ctl
            .worker_client
            .clone()
            .post(url, self.acting.clone(), body)
            .boxed()
    }
}
