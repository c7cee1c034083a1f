//! Streams the controller can move between workers. A streamed OpenAI
//! generation is relayed event by event; each token's chunk carries its id
//! (`pie_stream_ids`, stripped here), so the controller knows exactly which
//! tokens the client has. When the worker's stream breaks (the worker died),
//! the request goes to another worker with `pie_resume` (the tokens sent so
//! far): greedy and seeded sampling continue as they would have and the
//! client sees every token once, with no error. A live move (a draining
//! worker, a relocation, a rebalance) copies the pages in two stages: the
//! target prefetches what the source holds while the source keeps decoding;
//! then, one token short of a page boundary, the source is asked to hand the
//! process off, stops after that token, and the target pulls only the pages
//! that came after (see [`Phase`]).
//!
//! Invariants: the client's chunks keep the first worker's `id` and
//! `created`; a move that fails before the hand-off leaves the process where
//! it was; after a hand-off or a break the stream goes on elsewhere or ends
//! with an error event, never silently.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt};
use pie_core::wire::{HANDOFF_COMMENT, PROCESS_COMMENT, RESUME_FIELD, TOKEN_IDS_KEY};
use pie_core::Props;
use pie_policy::cluster::{record, route, RouteRequest, Stage};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};

use crate::metrics::MoveLabels;
use crate::proxy::{describe, error, now_ms, send, Acting, Controller, InFlight};
use crate::registry::with_worker_key;

/// Workers tried for one resume before the stream ends with an error.
const MAX_TARGETS: usize = 4;
/// Resumes of one stream (a stream moved this often is failing, not moving).
const MAX_RESUMES: usize = 8;

/// Why a stream moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Drain,
    Relocate,
    Rebalance,
    Crash,
}

impl Reason {
    pub(crate) fn label(self) -> MoveLabels {
        MoveLabels {
            reason: match self {
                Reason::Drain => "drain",
                Reason::Relocate => "relocate",
                Reason::Rebalance => "rebalance",
                Reason::Crash => "crash",
            },
        }
    }
}

/// A request to move one stream to worker `to`.
#[derive(Clone, Debug)]
pub struct Move {
    pub to: String,
    pub reason: Reason,
}

/// The movable streams and native processes in flight, by the
/// controller's number for them, and where the ones that moved ended.
#[derive(Default)]
pub struct Streams {
    next: AtomicU64,
    live: Mutex<Table>,
    ended: Mutex<Ended>,
    /// Woken whenever a stream's whereabouts change (it named its process
    /// on a worker, or ended), so a reader waiting for a move need not poll.
    changed: Notify,
}

/// The streams in flight, and each one's number by the id its client holds.
#[derive(Default)]
struct Table {
    live: HashMap<u64, Live>,
    by_origin: HashMap<(String, String), u64>,
}

impl Table {
    fn by_origin(&mut self, worker: &str, local: &str) -> Option<&mut Live> {
        let id = self
            .by_origin
            .get(&(worker.to_string(), local.to_string()))?;
        self.live.get_mut(id)
    }
}

/// Where a process that moved ended up, by the id its client holds; the
/// newest `ENDED_KEPT` (a client reads a finished process's record later).
#[derive(Default)]
struct Ended {
    at: HashMap<(String, String), Whereabouts>,
    order: VecDeque<(String, String)>,
}

/// Processes that moved whose whereabouts are kept after they end.
const ENDED_KEPT: usize = 65_536;

/// Where the process a client knows by its first worker and id is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Whereabouts {
    At {
        worker: String,
        local: String,
        /// A native process: its record on `worker` holds its whole output
        /// (see `native`), so its events line up with the first worker's.
        replays: bool,
    },
    /// It could not go on anywhere: why.
    Lost(String),
}

struct Live {
    worker: String,
    session: Option<String>,
    /// Its id in the actors' snapshot (`request-N`), when actors run.
    process: Option<String>,
    moves: mpsc::UnboundedSender<Move>,
    /// The first worker and the process id it named: the id the client
    /// holds (`WORKER~ID`, its chunks' `id`), valid across moves.
    origin: Option<(String, String)>,
    /// Its process id on `worker`.
    local: Option<String>,
    /// Its props as last changed through the controller (a PATCH): the
    /// workers it moves to get these.
    props: Option<Value>,
    /// A native process (see [`Whereabouts::At`]).
    replays: bool,
}

impl Streams {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Register a placed stream (or a native process: `replays`); its
    /// moves arrive on the receiver.
    pub(crate) fn add(
        &self,
        placed: &Placed,
        replays: bool,
    ) -> (u64, mpsc::UnboundedReceiver<Move>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (moves, rx) = mpsc::unbounded_channel();
        let live = Live {
            worker: placed.worker.clone(),
            session: placed.props.str("session").map(str::to_string),
            process: placed.slot.demand.as_ref().map(|d| d.process_id()),
            moves,
            origin: None,
            local: None,
            props: None,
            replays,
        };
        self.lock().live.insert(id, live);
        (id, rx)
    }

    /// Stream `id` moved to `worker` (which names its process next).
    pub(crate) fn now_on(&self, id: u64, worker: &str) {
        if let Some(l) = self.lock().live.get_mut(&id) {
            l.worker = worker.to_string();
            l.local = None;
        }
    }

    /// Stream `id` ended; `lost` says why when it could not go on. Where a
    /// stream that moved (or was lost) ended is kept for its id.
    pub(crate) fn remove(&self, id: u64, lost: Option<String>) {
        let mut table = self.lock();
        let Some(l) = table.live.remove(&id) else {
            return;
        };
        let Some(origin) = l.origin else { return };
        table.by_origin.remove(&origin);
        drop(table);
        let at = match (lost, l.local) {
            (Some(why), _) => Whereabouts::Lost(why),
            (None, Some(local)) if (&l.worker, &local) != (&origin.0, &origin.1) => {
                Whereabouts::At {
                    worker: l.worker,
                    local,
                    replays: l.replays,
                }
            }
            _ => return,
        };
        let mut ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        if ended.at.insert(origin.clone(), at).is_none() {
            ended.order.push_back(origin);
        }
        if ended.order.len() > ENDED_KEPT {
            if let Some(oldest) = ended.order.pop_front() {
                ended.at.remove(&oldest);
            }
        }
        drop(ended);
        self.changed.notify_waiters();
    }

    /// Stream `id`'s worker named its process `local`.
    pub(crate) fn named(&self, id: u64, local: &str) {
        let mut table = self.lock();
        let Some(l) = table.live.get_mut(&id) else {
            return;
        };
        l.local = Some(local.to_string());
        if l.origin.is_none() {
            let origin = (l.worker.clone(), local.to_string());
            l.origin = Some(origin.clone());
            table.by_origin.insert(origin, id);
        }
        drop(table);
        self.changed.notify_waiters();
    }

    /// Wait until `look` finds something (Some) or `limit` passes (None),
    /// looking again whenever a stream's whereabouts change.
    pub(crate) async fn wait_for<T>(
        &self,
        limit: Duration,
        mut look: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before looking, so a change in between still wakes it.
            changed.as_mut().enable();
            if let Some(found) = look() {
                return Some(found);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return None;
            }
        }
    }

    pub(crate) fn props_of(&self, id: u64) -> Option<Value> {
        self.lock().live.get(&id).and_then(|l| l.props.clone())
    }

    /// Where the stream the client knows as `worker~local` runs now, or
    /// ended after moving (None: neither, or between two workers).
    pub fn current(&self, worker: &str, local: &str) -> Option<Whereabouts> {
        if let Some(l) = self.lock().by_origin(worker, local) {
            return Some(Whereabouts::At {
                worker: l.worker.clone(),
                local: l.local.clone()?,
                replays: l.replays,
            });
        }
        let ended = self.ended.lock().unwrap_or_else(|e| e.into_inner());
        ended
            .at
            .get(&(worker.to_string(), local.to_string()))
            .cloned()
    }

    /// The stream the client knows as `worker~local` has the props `props`
    /// now (a PATCH): the workers it moves to get them, and when its `pin`
    /// names a worker it is not on that `serves`, it moves there (a
    /// relocation). Returns that worker.
    pub fn patched(
        &self,
        worker: &str,
        local: &str,
        props: &Value,
        serves: impl Fn(&str) -> bool,
    ) -> Option<String> {
        let mut table = self.lock();
        let l = table.by_origin(worker, local)?;
        l.props = Some(props.clone());
        let pin = props["pin"]
            .as_str()
            .filter(|&pin| pin != l.worker && serves(pin))?;
        let asked = Move {
            to: pin.to_string(),
            reason: Reason::Relocate,
        };
        l.moves.send(asked).ok().map(|()| pin.to_string())
    }

    /// Ask the streams of `session` to move to `to`; returns how many.
    pub fn move_session(&self, session: &str, to: &str) -> usize {
        self.ask(
            |l| l.session.as_deref() == Some(session) && l.worker != to,
            to,
            Reason::Relocate,
        )
    }

    /// Ask the stream of the actors' process `process` to move to `to`;
    /// false if no such stream is in flight.
    pub fn move_process(&self, process: &str, to: &str, reason: Reason) -> bool {
        self.ask(
            |l| l.process.as_deref() == Some(process) && l.worker != to,
            to,
            reason,
        ) > 0
    }

    fn ask(&self, which: impl Fn(&Live) -> bool, to: &str, reason: Reason) -> usize {
        self.lock()
            .live
            .values()
            .filter(|l| which(l))
            .filter(|l| {
                l.moves
                    .send(Move {
                        to: to.to_string(),
                        reason,
                    })
                    .is_ok()
            })
            .count()
    }
}

/// A request the controller placed on a worker and may move: what every
/// worker it goes to gets, and where it runs now. A relayed stream
/// ([`Relay`]) and a followed native process (`native::NativeLaunch`) both
/// start from one.
pub(crate) struct Placed {
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

/// A movable stream's request, as every worker gets it.
pub(crate) struct Relay {
    pub placed: Placed,
    pub path: String,
    pub headers: HeaderMap,
}

/// What one SSE event of a worker's stream means here.
enum Event {
    Forward(Bytes),
    Skip,
    Done(Bytes),
    HandedOff,
}

/// A live move under way.
struct Migration {
    reason: Reason,
    target: String,
    /// The prefetch under way, if one is.
    stage: Option<BoxFuture<'static, Result<(), String>>>,
    phase: Phase,
}

/// Where a live move stops the source. The bulk of the pages is copied
/// while the source decodes; then the hand-off is asked for when the source
/// is one token short of filling a page, and the source stops after that
/// token, between two steps: its KV then ends exactly at a page boundary,
/// the target pulls the pages since the bulk and computes one token (about
/// one decode step) before the client sees the next.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Bulk,
    /// Bulk copied; waiting for the source to near a page boundary.
    AwaitPage,
    /// Asked; waiting for the source's stream to end with the hand-off.
    HandedOff,
}

/// What the relay loop waits on next.
enum Step {
    Chunk(Option<reqwest::Result<Bytes>>),
    Move(Option<Move>),
    Staged(Result<(), String>),
}

impl Relay {
    /// Relay `upstream` (the first worker's answer, first bytes included) to
    /// the client, moving it when asked or when it breaks.
    pub fn into_body(self, upstream: BoxStream<'static, reqwest::Result<Bytes>>) -> Body {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let ctl = self.placed.ctl.clone();
        let (id, moves) = ctl.streams.add(&self.placed, false);
        tokio::spawn(async move {
            let mut run = Run {
                relay: self,
                generated: Vec::new(),
                process: None,
                first: None,
                last_token: Instant::now(),
                paused: None,
                resumes: 0,
                stream_id: id,
            };
            run.relay(upstream, tx, moves).await;
            ctl.streams.remove(id, None);
        });
        channel_body(rx)
    }
}

/// A response body of the bytes a task sends on `rx`, ending when it drops
/// its sender.
pub(crate) fn channel_body(rx: mpsc::Receiver<Bytes>) -> Body {
    Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx))
    }))
}

struct Run {
    relay: Relay,
    /// Every token id the client has, in order.
    generated: Vec<u32>,
    /// The process's id on the current worker.
    process: Option<String>,
    /// `id` and `created` of the first worker's chunks.
    first: Option<(Value, Value)>,
    last_token: Instant,
    /// Set from a resume to the first token after it.
    paused: Option<Reason>,
    resumes: usize,
    stream_id: u64,
}

impl Run {
    async fn relay(
        &mut self,
        mut upstream: BoxStream<'static, reqwest::Result<Bytes>>,
        out: mpsc::Sender<Bytes>,
        mut moves: mpsc::UnboundedReceiver<Move>,
    ) {
        let mut buf: Vec<u8> = Vec::new();
        let mut migration: Option<Migration> = None;
        loop {
            let mut broke = None;
            let step = tokio::select! {
                chunk = upstream.next() => Step::Chunk(chunk),
                m = moves.recv() => Step::Move(m),
                staged = stage(&mut migration) => Step::Staged(staged),
            };
            let resume = match step {
                Step::Chunk(Some(Ok(bytes))) => {
                    buf.extend_from_slice(&bytes);
                    match self.forward_events(&mut buf, &out).await {
                        Flow::Go => {
                            if let Some(m) = &mut migration {
                                if let Err(e) = self.on_token(m).await {
                                    self.abandon(m, &e);
                                    migration = None;
                                }
                            }
                            continue;
                        }
                        Flow::End => return,
                        Flow::HandedOff => {
                            let source = self.relay.placed.url.clone();
                            let (reason, target) = match migration.take() {
                                Some(m) => (m.reason, Some(m.target)),
                                None => (Reason::Drain, None),
                            };
                            (reason, target, Some(source))
                        }
                    }
                }
                Step::Chunk(broken) => {
                    let cause = match broken {
                        Some(Err(e)) => describe(&e),
                        _ => "it ended early".into(),
                    };
                    let message = format!("the worker's stream broke: {cause}");
                    // A worker that did not name its process sends no ids:
                    // what the client has is unknown, so it cannot resume.
                    if self.process.is_none() {
                        let _ = out.send(error_event(&message)).await;
                        return;
                    }
                    tracing::warn!(
                        worker = self.relay.placed.worker,
                        cause,
                        "the worker's stream broke; resuming it elsewhere"
                    );
                    self.relay
                        .placed
                        .ctl
                        .registry
                        .mark_down(&self.relay.placed.worker);
                    broke = Some(message);
                    let target = migration.take().map(|m| m.target);
                    (Reason::Crash, target, None)
                }
                Step::Move(None) => continue,
                Step::Move(Some(m)) => {
                    if migration.is_none() {
                        migration = self.begin_move(m);
                    }
                    continue;
                }
                Step::Staged(result) => {
                    let Some(m) = &mut migration else { continue };
                    let handed = match result {
                        Ok(()) if self.page_size() > 0 => {
                            m.phase = Phase::AwaitPage;
                            Ok(())
                        }
                        Ok(()) => {
                            m.phase = Phase::HandedOff;
                            self.hand_off().await
                        }
                        Err(e) => Err(e),
                    };
                    if let Err(e) = handed {
                        self.abandon(m, &e);
                        migration = None;
                    }
                    continue;
                }
            };
            buf.clear();
            let (reason, target, source) = resume;
            match self.resume(reason, target, source).await {
                Ok(next) => upstream = next,
                Err(why) => {
                    self.count_failure(reason);
                    let message = match broke {
                        Some(broke) => format!("{broke}; {why}"),
                        None => why,
                    };
                    let _ = out.send(error_event(&message)).await;
                    return;
                }
            }
        }
    }

    /// Forward the complete events in `buf`.
    async fn forward_events(&mut self, buf: &mut Vec<u8>, out: &mpsc::Sender<Bytes>) -> Flow {
        while let Some(block) = next_block(buf) {
            let bytes = match self.event(&block) {
                Event::Skip => continue,
                Event::HandedOff => return Flow::HandedOff,
                Event::Forward(bytes) => bytes,
                Event::Done(bytes) => {
                    self.observe(&bytes);
                    let _ = out.send(bytes).await;
                    return Flow::End;
                }
            };
            self.observe(&bytes);
            if out.send(bytes).await.is_err() {
                // The client left: dropping the worker's stream kills the process.
                return Flow::End;
            }
        }
        Flow::Go
    }

    fn observe(&mut self, bytes: &Bytes) {
        if let Some(t) = &mut self.relay.placed.slot.traced {
            t.observe(bytes);
        }
    }

    /// One SSE event (its bytes, blank line included).
    fn event(&mut self, block: &[u8]) -> Event {
        let text = String::from_utf8_lossy(block);
        let mut data = None;
        for line in text.lines() {
            if let Some(comment) = line.strip_prefix(':') {
                let comment = comment.trim();
                if let Some(id) = comment
                    .strip_prefix(PROCESS_COMMENT)
                    .and_then(|rest| rest.strip_prefix(' '))
                {
                    self.process = Some(id.to_string());
                    self.relay.placed.ctl.streams.named(self.stream_id, id);
                    return Event::Skip;
                }
                if comment == HANDOFF_COMMENT {
                    return Event::HandedOff;
                }
            } else if let Some(d) = line.strip_prefix("data:") {
                data = Some(d.trim_start().to_string());
            }
        }
        let raw = Bytes::copy_from_slice(block);
        let Some(data) = data else {
            return Event::Forward(raw);
        };
        if data == "[DONE]" {
            return Event::Done(raw);
        }
        let Ok(mut chunk) = serde_json::from_str::<Value>(&data) else {
            return Event::Forward(raw);
        };
        let ids = chunk
            .as_object_mut()
            .and_then(|o| o.remove(TOKEN_IDS_KEY))
            .and_then(|v| serde_json::from_value::<Vec<u32>>(v).ok());
        self.keep_identity(&mut chunk);
        let Some(ids) = ids else {
            return Event::Forward(Bytes::from(format!("data: {chunk}\n\n")));
        };
        self.generated.extend_from_slice(&ids);
        if let Some(reason) = self.paused.take() {
            self.relay
                .placed
                .ctl
                .metrics
                .move_pause
                .get_or_create(&reason.label())
                .observe(self.last_token.elapsed().as_secs_f64());
        }
        self.last_token = Instant::now();
        if adds_nothing(&chunk) {
            return Event::Skip;
        }
        Event::Forward(Bytes::from(format!("data: {chunk}\n\n")))
    }

    /// The first worker's `id` and `created` on every chunk.
    fn keep_identity(&mut self, chunk: &mut Value) {
        let Some(o) = chunk.as_object_mut() else {
            return;
        };
        if !o.contains_key("id") {
            return;
        }
        match &self.first {
            None => {
                self.first = Some((o["id"].clone(), o["created"].clone()));
            }
            Some((id, created)) => {
                o.insert("id".into(), id.clone());
                o.insert("created".into(), created.clone());
            }
        }
    }

    /// Choose where a move goes and start its first stage (the prefetch).
    fn begin_move(&self, m: Move) -> Option<Migration> {
        let target_url = self.relay.placed.move_target(&m)?;
        Some(Migration {
            reason: m.reason,
            stage: Some(self.prefetch(&target_url)),
            target: m.to,
            phase: Phase::Bulk,
        })
    }

    /// The target pulls the pages the source holds of the tokens so far.
    fn prefetch(&self, target_url: &str) -> BoxFuture<'static, Result<(), String>> {
        let mut tokens = self.relay.placed.prompt.clone();
        tokens.extend_from_slice(&self.generated);
        post_json(
            self.relay.placed.ctl.clone(),
            format!("{target_url}/v1/internal/kv/prefetch"),
            self.relay.placed.acting.clone(),
            json!({"from": self.relay.placed.url, "tokens": tokens}),
        )
        .map(|r| r.map(|_| ()))
        .boxed()
    }

    /// The source's page size (0: unknown).
    fn page_size(&self) -> usize {
        self.relay
            .placed
            .ctl
            .registry
            .page_size_of(&self.relay.placed.worker)
    }

    /// After tokens arrived: ask for the hand-off when the next token
    /// completes the source's KV up to a page boundary (prompt + tokens, one
    /// more, is one past a multiple of the page size).
    async fn on_token(&self, m: &mut Migration) -> Result<(), String> {
        let page = self.page_size();
        let tokens = self.relay.placed.prompt.len() + self.generated.len();
        if m.phase == Phase::AwaitPage && tokens.is_multiple_of(page) {
            m.phase = Phase::HandedOff;
            return self.hand_off().await;
        }
        Ok(())
    }

    fn abandon(&self, m: &Migration, error: &str) {
        tracing::warn!(
            worker = self.relay.placed.worker,
            target = m.target,
            error,
            "move abandoned; the process goes on where it is"
        );
        self.count_failure(m.reason);
    }

    /// Ask the current worker to hand the process off.
    /// A 409 (the process ended meanwhile) is no failure: its stream ends
    /// as it would have.
    async fn hand_off(&self) -> Result<(), String> {
        let process = self
            .process
            .as_ref()
            .ok_or("the worker did not name its process")?;
        let url = format!(
            "{}/v1/internal/processes/{process}/handoff",
            self.relay.placed.url
        );
        let (status, answer) = post_to_worker(
            self.relay.placed.ctl.clone(),
            url.clone(),
            self.relay.placed.acting.clone(),
            json!({}),
        )
        .await?;
        if status.is_success() || status == StatusCode::CONFLICT {
            Ok(())
        } else {
            Err(format!("{url}: {status} {answer}"))
        }
    }

    /// Send the request, with the tokens so far, to `target` or a worker
    /// routing chooses (then others); `source` is a live worker that holds
    /// the pages (pulled from it). A live source that still serves is the
    /// last resort: it resumes from its own cache.
    async fn resume(
        &mut self,
        reason: Reason,
        target: Option<String>,
        source: Option<String>,
    ) -> Result<BoxStream<'static, reqwest::Result<Bytes>>, String> {
        self.resumes += 1;
        if self.resumes > MAX_RESUMES {
            return Err(format!(
                "the stream was moved {MAX_RESUMES} times; giving up"
            ));
        }
        let ctl = self.relay.placed.ctl.clone();
        if let Some(props) = ctl.streams.props_of(self.stream_id) {
            if let Ok(parsed) = Props::from_json(&props) {
                self.relay.placed.props = parsed;
            }
            self.relay.placed.body["props"] = props;
        }
        let old = self.relay.placed.worker.clone();
        let mut tried = vec![old.clone()];
        let mut target = target.and_then(|name| ctl.registry.url_of(&name).map(|url| (name, url)));
        let mut body = self.relay.placed.body.clone();
        body[RESUME_FIELD] = json!({"tokens": self.generated, "from": source});
        let body = Bytes::from(body.to_string());
        for _ in 0..MAX_TARGETS {
            let next = target.take().or_else(|| {
                let mut tokens = self.relay.placed.prompt.clone();
                tokens.extend_from_slice(&self.generated);
                let r = &self.relay.placed;
                choose_worker(&ctl, &tokens, &r.props, &r.acting, &tried)
            });
            let Some((name, url)) = next else { break };
            tried.push(name.clone());
            if let Some(upstream) = self.try_worker(&name, &url, body.clone()).await {
                self.switch_to(reason, &name, &url);
                return Ok(upstream);
            }
        }
        // `choose` never picks the worker it is moving from.
        if source.is_some() {
            let url = self.relay.placed.url.clone();
            if let Some(upstream) = self.try_worker(&old, &url, body).await {
                self.switch_to(reason, &old, &url);
                return Ok(upstream);
            }
        }
        Err(format!("no worker could resume the stream of `{old}`"))
    }

    /// The worker's stream if it started (2xx and first bytes).
    async fn try_worker(
        &self,
        name: &str,
        url: &str,
        body: Bytes,
    ) -> Option<BoxStream<'static, reqwest::Result<Bytes>>> {
        let r = &self.relay;
        let sent = send(
            &r.placed.ctl,
            Method::POST,
            &format!("{url}{}", r.path),
            &r.headers,
            &r.placed.acting,
            body,
        )
        .await;
        match sent {
            Ok(upstream) if upstream.status.is_success() => match upstream.first_bytes().await {
                Ok(up) => Some(up.body),
                Err(e) => {
                    tracing::warn!(worker = name, error = e, "resume failed");
                    r.placed.ctl.registry.mark_down(name);
                    None
                }
            },
            Ok(upstream) => {
                tracing::warn!(worker = name, status = %upstream.status, "resume refused");
                None
            }
            Err(e) => {
                tracing::warn!(worker = name, error = e, "resume failed");
                r.placed.ctl.registry.mark_down(name);
                None
            }
        }
    }

    fn switch_to(&mut self, reason: Reason, name: &str, url: &str) {
        let r = &mut self.relay.placed;
        let moved = Moved {
            id: self.stream_id,
            from: &r.worker,
            to: name,
            reason,
            props: &r.props,
            prompt: r.prompt.len(),
            generated: self.generated.len(),
        };
        moved.count(&r.ctl, &mut r.slot);
        self.relay.placed.worker = name.to_string();
        self.relay.placed.url = url.to_string();
        self.process = None;
        self.paused = Some(reason);
    }

    fn count_failure(&self, reason: Reason) {
        count_move_failure(&self.relay.placed.ctl, reason);
    }
}

pub fn routes() -> Router<Arc<Controller>> {
    Router::new().route("/v1/cluster/sessions/{session}/relocate", post(relocate))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RelocateBody {
    worker: String,
}

/// `POST /v1/cluster/sessions/{session}/relocate {"worker": NAME}` (admin):
/// the session's streams in flight move to that worker, live (prefetch,
/// hand-off, pull). 202 with how many were asked to move; 404 when the worker
/// does not serve or no stream of the session is in flight.
async fn relocate(
    State(ctl): State<Arc<Controller>>,
    Path(session): Path<String>,
    body: Result<Json<RelocateBody>, JsonRejection>,
) -> Response {
    let Json(RelocateBody { worker }) = match body {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    if !ctl.registry.serves(&worker) {
        return error(
            StatusCode::NOT_FOUND,
            format!("worker `{worker}` is not a serving worker of this cluster"),
        );
    }
    match ctl.streams.move_session(&session, &worker) {
        0 => error(
            StatusCode::NOT_FOUND,
            format!("no stream of session `{session}` is in flight off `{worker}`"),
        ),
        moving => (
            StatusCode::ACCEPTED,
            Json(json!({"session": session, "worker": worker, "moving": moving})),
        )
            .into_response(),
    }
}

/// Where the relay loop goes after a chunk.
enum Flow {
    Go,
    End,
    HandedOff,
}

/// An SSE error event (the stream ends after it).
fn error_event(message: &str) -> Bytes {
    let event = pie_core::api_error::error_body(502, message, None);
    Bytes::from(format!("data: {event}\n\n"))
}

/// The migration's pending stage, or never.
async fn stage(migration: &mut Option<Migration>) -> Result<(), String> {
    match migration.as_mut().and_then(|m| m.stage.as_mut()) {
        Some(f) => {
            let result = f.await;
            if let Some(m) = migration.as_mut() {
                m.stage = None;
            }
            result
        }
        None => std::future::pending().await,
    }
}

/// A move for `reason` that ended with the stream or process lost.
pub(crate) fn count_move_failure(ctl: &Controller, reason: Reason) {
    ctl.metrics
        .move_failures
        .get_or_create(&reason.label())
        .inc();
}

/// A completion or chat chunk with no text and no finish: a token that made
/// no character yet, sent only for its id.
fn adds_nothing(chunk: &Value) -> bool {
    let choice = &chunk["choices"][0];
    let text = choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
        .unwrap_or_default();
    text.is_empty() && choice["finish_reason"].is_null()
}

/// Take one complete SSE event (up to and including its blank line).
pub(crate) fn next_block(buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let end = buf.windows(2).position(|w| w == b"\n\n")? + 2;
    let rest = buf.split_off(end);
    Some(std::mem::replace(buf, rest))
}

/// A stream or native process `id` that went on from worker `from` on `to`.
pub(crate) struct Moved<'a> {
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

/// A serving worker for a process of `tokens` (prompt and output so far),
/// not one of `exclude`, by the routing pipeline (cache-aware finds the
/// pages, session-affinity the session), else the least loaded.
pub(crate) fn choose_worker(
    ctl: &Controller,
    tokens: &[u32],
    props: &Props,
    acting: &Acting,
    exclude: &[String],
) -> Option<(String, String)> {
    let chains = ctl.registry.chains(tokens, acting.cache_salt.as_deref());
    let views: Vec<_> = ctl
        .registry
        .views(&chains, false)
        .into_iter()
        .filter(|(v, _)| v.stage != Stage::Prefill && !exclude.contains(&v.name))
        .collect();
    let worker_views: Vec<_> = views.iter().map(|(v, _)| v.clone()).collect();
    let req = RouteRequest {
        props,
        prompt_tokens: tokens.len(),
    };
    let mut pipeline = ctl.pipeline.lock().unwrap_or_else(|e| e.into_inner());
    let chosen = route(&mut pipeline, now_ms(), &req, &worker_views)
        .map(|(i, _)| i)
        .ok()
        .or_else(|| (0..views.len()).min_by_key(|&i| views[i].0.load))?;
    let (view, url) = &views[chosen];
    Some((view.name.clone(), url.clone()))
}

/// POST `body` to a worker's internal route under the worker key, acting for
/// the stream's client (its cache salt).
async fn post_json(
    ctl: Arc<Controller>,
    url: String,
    acting: Acting,
    body: Value,
) -> Result<Value, String> {
    match post_to_worker(ctl, url.clone(), acting, body).await? {
        (status, answer) if status.is_success() => Ok(answer),
        (status, answer) => Err(format!("{url}: {status} {answer}")),
    }
}

/// `post_json`'s request: the status and JSON answer of any response.
pub(crate) async fn post_to_worker(
    ctl: Arc<Controller>,
    url: String,
    acting: Acting,
    body: Value,
) -> Result<(StatusCode, Value), String> {
    let req = acting.apply(ctl.http.post(&url)).json(&body);
    let resp = with_worker_key(req, ctl.worker_key.as_deref())
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let status = resp.status();
    Ok((status, resp.json().await.unwrap_or(Value::Null)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_split_at_blank_lines_whatever_the_chunking() {
        let stream = b": pie-process p1\n\ndata: {\"a\":1}\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut buf = Vec::new();
            let mut blocks = Vec::new();
            for part in [&stream[..cut], &stream[cut..]] {
                buf.extend_from_slice(part);
                while let Some(b) = next_block(&mut buf) {
                    blocks.push(b);
                }
            }
            assert_eq!(
                blocks,
                vec![
                    b": pie-process p1\n\n".to_vec(),
                    b"data: {\"a\":1}\n\n".to_vec(),
                    b"data: [DONE]\n\n".to_vec()
                ],
                "cut at {cut}"
            );
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn only_textless_unfinished_chunks_add_nothing() {
        let c = json!({"choices": [{"text": "hi", "finish_reason": null}]});
        assert!(!adds_nothing(&c));
        let c = json!({"choices": [{"delta": {"content": ""}, "finish_reason": null}]});
        assert!(adds_nothing(&c));
        let c = json!({"choices": [{"text": "", "finish_reason": null}]});
        assert!(adds_nothing(&c));
        let c = json!({"choices": [{"delta": {}, "finish_reason": "stop"}]});
        assert!(!adds_nothing(&c));
    }
}
