//! Native processes (`POST /v1/processes`, any built-in inferlet) that move.
//! A native process has no client connection to relay: its client reads its
//! record and events by its `WORKER~ID` whenever it likes. So the controller
//! follows each one it launched (its events, with token ids, under the
//! worker key) for as long as it lives, and counts it in flight on its
//! worker until it ends. Asked to move it (a drain, a relocation, a
//! rebalance, a patched `pin`), the controller asks the worker to hand it
//! off and launches it on the target with the tokens so far (`pie_resume`,
//! pages pulled from the source); when its worker's stream breaks (a crash),
//! on another worker with the tokens seen so far, computed there. The
//! resumed process replays those tokens into its record as the same output
//! pieces, so its events line up index for index with the source's: a
//! client's event stream through the controller is continued from the
//! target where the source's ended, every piece once (see `to_owner`).
//!
//! Moves are one stage (hand-off, then the pull of every page): the move
//! plan starts there for a process whose tokens as its worker sees them the
//! controller does not know. A native chat resuming
//! a session takes the session's earlier turns along: its first worker names
//! them in the launch answer (`pie_session_turns`, to the controller only)
//! and the target uses them instead of its own, so its prompt and the
//! session it records are the first worker's; the session's next turn
//! follows it (session-affinity records the move).
//!
//! Invariant: after a hand-off or a break the process goes on elsewhere or
//! its id answers with the reason it was lost; never a silent end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use pie_client::sse::SseBlocks;
use pie_core::inferlet_ref::{self, BUILT_IN};
use pie_core::wire::{RESUME_FIELD, SESSION_TURNS_FIELD};
use pie_core::Props;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::Response;

use crate::caller::Acting;
use crate::controller::Controller;
use crate::live_move::{LiveMove, Next};
use crate::placed::{channel_body, count_move_failure, Moved, Placed, MAX_RESUMES};
use crate::respond::error;
use crate::streams::{Move, Reason, Whereabouts};
use crate::worker_client::{describe, Upstream};

/// Why a WebAssembly inferlet's process does not move.
const COMPONENT_STAYS: &str =
    "it is a WebAssembly inferlet's process, whose state lives in its guest's memory";

/// How long a kill of a process on a worker that broke may take, per try.
const KILL_TIMEOUT: Duration = Duration::from_secs(2);
/// Tries of that kill that fail before reaching the worker.
const KILL_TRIES: usize = 3;
/// How long a client's event stream waits for its process to go on
/// elsewhere after its worker's stream ended without a final state.
const MOVE_WAIT: Duration = Duration::from_secs(60);
/// How soon it asks again a worker that took the process but did not yet
/// answer for its events.
const OPEN_RETRY: Duration = Duration::from_millis(50);

/// A native process just launched on `placed.worker` as `local`.
pub struct NativeLaunch {
    pub placed: Placed,
    pub local: String,
    /// A chat resuming a session: the session's turns before this one.
    pub turns: Option<Value>,
}

/// How a worker's event stream of the process ended.
enum Ended {
    /// Finished, failed or killed: nothing to do.
    Final,
    /// Handed off (state `migrated`).
    HandedOff,
    /// Broken before a final state.
    Broke(String),
}

/// One event of a worker's native event stream.
enum Native {
    Token(u32),
    Text,
    Status(String),
    /// The process's props, as it set them.
    Props(Value),
}

impl NativeLaunch {
    /// A WebAssembly inferlet's process (not a built-in's).
    fn component(&self) -> bool {
        let name = self.placed.body["inferlet"].as_str().unwrap_or_default();
        !BUILT_IN.contains(&inferlet_ref::split(name).0)
    }

    /// Whether the process can move: a chat resuming a session only with
    /// its earlier turns (a worker that does not name them keeps it).
    pub fn movable(&self) -> bool {
        let body = &self.placed.body;
        let session_chat = body["inferlet"] == "chat" && !body["props"]["session"].is_null();
        !session_chat || self.turns.is_some()
    }

    /// Follow the process until it ends, moving it when asked or broken.
    pub fn follow(self) {
        let ctl = self.placed.ctl.clone();
        let (id, moves) = ctl.streams.add(self.placed.placement(), true);
        ctl.streams.named(id, &self.local);
        if self.component() {
            ctl.streams.stays(id, COMPONENT_STAYS);
        }
        tokio::spawn(async move {
            let mut follower = Follower {
                launch: self,
                generated: Vec::new(),
                replayed: 0,
                asked: None,
                id,
            };
            let lost = follower.run(moves).await.err();
            ctl.streams.remove(id, lost);
        });
    }
}

struct Follower {
    launch: NativeLaunch,
    /// The token ids the process generated so far, in order.
    generated: Vec<u32>,
    /// Text events of the current worker still to come that replay `generated`.
    replayed: usize,
    /// The move asked of the current worker.
    asked: Option<Move>,
    id: u64,
}

impl Follower {
    /// Follow until a final state (Ok) or until the process is lost (Err:
    /// why).
    async fn run(&mut self, mut moves: mpsc::UnboundedReceiver<Move>) -> Result<(), String> {
        let mut resumes = 0;
        loop {
            let ended = match self.subscribe().await {
                Ok(events) => self.read(events, &mut moves).await,
                Err(e) => Ended::Broke(e),
            };
            let (reason, target, source) = match ended {
                Ended::Final => return Ok(()),
                Ended::HandedOff => match self.asked.take() {
                    Some(m) => (m.reason, Some(m.to), Some(self.launch.placed.url.clone())),
                    None => (Reason::Drain, None, Some(self.launch.placed.url.clone())),
                },
                Ended::Broke(cause) => {
                    tracing::warn!(
                        worker = self.launch.placed.worker,
                        cause,
                        "a native process's worker broke; resuming it elsewhere"
                    );
                    self.launch
                        .placed
                        .ctl
                        .registry
                        .mark_down(&self.launch.placed.worker);
                    // A worker that lost only our connection must not run it twice.
                    self.kill().await;
                    if self.launch.component() {
                        let worker = &self.launch.placed.worker;
                        return Err(format!(
                            "its worker `{worker}` failed ({cause}); {COMPONENT_STAYS}, so it cannot go on elsewhere"
                        ));
                    }
                    (Reason::Crash, None, None)
                }
            };
            resumes += 1;
            if resumes > MAX_RESUMES {
                return Err(format!("moved {MAX_RESUMES} times; given up"));
            }
            if let Err(why) = self.resume(reason, target, source).await {
                count_move_failure(&self.launch.placed.ctl, reason);
                tracing::warn!(process = self.launch.local, why, "native process lost");
                return Err(why);
            }
        }
    }

    /// The current worker's events of the process, with token ids.
    async fn subscribe(&self) -> Result<BoxStream<'static, reqwest::Result<Bytes>>, String> {
        let l = &self.launch;
        let url = process_url(
            &l.placed.url,
            "processes",
            &l.local,
            "/events?pie_stream_ids=true",
        );
        let resp = (l.placed.ctl.worker_client)
            .acting(&l.placed.acting, Method::GET, &url)
            .send()
            .await
            .map_err(|e| describe(&e))?;
        if !resp.status().is_success() {
            return Err(format!("{url}: {}", resp.status()));
        }
        Ok(resp.bytes_stream().boxed())
    }

    async fn read(
        &mut self,
        mut events: BoxStream<'static, reqwest::Result<Bytes>>,
        moves: &mut mpsc::UnboundedReceiver<Move>,
    ) -> Ended {
        let mut blocks = SseBlocks::default();
        loop {
            tokio::select! {
                chunk = events.next() => match chunk {
                    Some(Ok(bytes)) => match blocks.push(&bytes) {
                        Ok(events) => if let Some(ended) = self.take_events(events) {
                            return ended;
                        },
                        Err(e) => return Ended::Broke(e.to_string()),
                    },
                    Some(Err(e)) => return Ended::Broke(describe(&e)),
                    None => return Ended::Broke("it ended early".into()),
                },
                Some(m) = moves.recv(), if self.asked.is_none() => self.hand_off(m).await,
            }
        }
    }

    fn take_events(&mut self, blocks: Vec<Vec<u8>>) -> Option<Ended> {
        for block in blocks {
            match parse(&block) {
                Some(Native::Token(_)) if self.replayed > 0 => self.replayed -= 1,
                Some(Native::Token(t)) => {
                    self.generated.push(t);
                    self.launch.placed.slot.generated(1);
                }
                Some(Native::Text) | None => {}
                Some(Native::Props(props)) => self.props_changed(&props),
                Some(Native::Status(state)) if state == "migrated" => {
                    return Some(Ended::HandedOff)
                }
                Some(Native::Status(_)) => {
                    self.launch.placed.slot.observe(&block);
                    return Some(Ended::Final);
                }
            }
        }
        None
    }

    /// The process set its props (an inferlet's `set-prop`, a PATCH to its
    /// worker): the actors' snapshot has them from the next tick, and the
    /// workers it moves to get them.
    fn props_changed(&mut self, props: &Value) {
        let placed = &mut self.launch.placed;
        let Ok(parsed) = Props::from_json(props) else {
            return;
        };
        if let Some(demand) = &placed.slot.demand {
            demand.set_props(parsed.clone());
        }
        placed.props = parsed;
        placed.ctl.streams.set_props(self.id, props);
    }

    /// Kill the process on its current worker, if that still answers. A try
    /// that fails to connect or to send is made again: the break that brought
    /// us here can leave a pooled connection to the worker that is already
    /// closed, and a fresh one reaches a worker that lost only that.
    async fn kill(&self) {
        let l = &self.launch;
        let url = process_url(&l.placed.url, "processes", &l.local, "");
        for _ in 0..KILL_TRIES {
            let sent = (l.placed.ctl.worker_client)
                .acting(&l.placed.acting, Method::DELETE, &url)
                .timeout(KILL_TIMEOUT)
                .send()
                .await;
            match sent {
                Err(e) if !e.is_timeout() => continue,
                _ => return,
            }
        }
    }

    /// Move `m`: a native process's tokens as its worker sees them (session
    /// turns, an inferlet's own prompt) are the worker's, so its move plan
    /// starts at the hand-off, asked of the current worker here.
    async fn hand_off(&mut self, m: Move) {
        let l = &self.launch;
        let Some((live, Next::HandOff)) = LiveMove::begin(&l.placed, m.clone(), None) else {
            return;
        };
        let url = process_url(&l.placed.url, "internal/processes", &l.local, "/handoff");
        match l.placed.post(url, json!({})).await {
            Ok((status, _)) if status.is_success() => self.asked = Some(m),
            // It ended meanwhile: its events end as they would have.
            Ok((status, _)) if status == reqwest::StatusCode::CONFLICT => {}
            Ok((status, answer)) => {
                live.abandon(&l.placed, &format!("hand-off refused: {status} {answer}"))
            }
            Err(e) => live.abandon(&l.placed, &format!("hand-off failed: {e}")),
        }
    }

    /// Launch the process on `target` (or a worker routing chooses, then
    /// others) with the tokens so far; `source` holds their pages.
    async fn resume(
        &mut self,
        reason: Reason,
        target: Option<String>,
        source: Option<String>,
    ) -> Result<(), String> {
        self.launch.placed.refresh_props(self.id);
        let mut body = self.launch.placed.body.clone();
        body[RESUME_FIELD] =
            json!({"tokens": self.generated, "from": source, "turns": self.launch.turns});
        let mut tokens = self.launch.placed.prompt.clone();
        tokens.extend_from_slice(&self.generated);
        let old = self.launch.placed.worker.clone();
        let mut targets = self.launch.placed.resume_targets(target);
        while let Some((name, url)) = targets.next(&self.launch.placed, &tokens) {
            match self.launch_on(&url, &body).await {
                Ok(local) => {
                    self.switch_to(reason, name, url, local);
                    return Ok(());
                }
                Err(e) => tracing::warn!(worker = name, e, "native resume refused"),
            }
        }
        Err(format!(
            "no worker could resume the process of `{old}` ({} tokens generated)",
            self.generated.len()
        ))
    }

    /// POST the launch to `url`; the new process's id there.
    async fn launch_on(&self, url: &str, body: &Value) -> Result<String, String> {
        let l = &self.launch;
        let url = format!("{url}/v1/processes");
        let (status, answer) = l.placed.post(url.clone(), body.clone()).await?;
        match answer["id"].as_str() {
            Some(id) if status.is_success() => Ok(id.to_string()),
            _ => Err(format!("{url}: {status} {answer}")),
        }
    }

    fn switch_to(&mut self, reason: Reason, name: String, url: String, local: String) {
        let l = &mut self.launch;
        let moved = Moved {
            id: self.id,
            from: &l.placed.worker,
            to: &name,
            reason,
            props: &l.placed.props,
            prompt: l.placed.prompt.len(),
            generated: self.generated.len(),
        };
        moved.count(&l.placed.ctl, &mut l.placed.slot);
        l.placed.ctl.streams.named(self.id, &local);
        self.replayed = self.generated.len();
        self.launch.placed.worker = name;
        self.launch.placed.url = url;
        self.launch.local = local;
    }
}

/// A client's events of a native process the controller follows, from
/// `process_url` on `worker` (its `/events`), continued on each worker it
/// moves to: the client gets every text event once, then its final status
/// (or a `failed` status saying why it could not go on).
pub(crate) async fn events(
    ctl: Arc<Controller>,
    origin: (String, String),
    (worker, local): (&str, &str),
    process_url: &str,
    acting: &Acting,
) -> Response {
    let upstream = match open(&ctl, process_url, acting).await {
        Ok(up) if up.status.is_success() => up,
        Ok(up) => return up.into_response(),
        Err(e) => return error(StatusCode::BAD_GATEWAY, format!("worker `{worker}`: {e}")),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let stitch = Stitch {
        ctl,
        origin,
        at: (worker.to_string(), local.to_string()),
        acting: acting.clone(),
        sent: 0,
        out: tx,
    };
    tokio::spawn(stitch.run(upstream.body));
    let mut resp = Response::new(channel_body(rx));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    if let Ok(value) = worker.parse() {
        h.insert("x-pie-worker", value);
    }
    resp
}

async fn open(ctl: &Controller, url: &str, acting: &Acting) -> Result<Upstream, String> {
    ctl.worker_client
        .send(Method::GET, url, &HeaderMap::new(), acting, Bytes::new())
        .await
}

/// One client's event stream of a native process across its workers.
struct Stitch {
    ctl: Arc<Controller>,
    /// The process as its client knows it (first worker, id there).
    origin: (String, String),
    /// The worker whose events are read now, and the process's id there.
    at: (String, String),
    acting: Acting,
    /// Text events the client has: the next worker replays these first.
    sent: usize,
    out: mpsc::Sender<Bytes>,
}

impl Stitch {
    async fn run(mut self, mut body: BoxStream<'static, reqwest::Result<Bytes>>) {
        loop {
            match self.forward(body).await {
                Some(true) | None => return,
                Some(false) => {}
            }
            match self.next_worker().await {
                Ok(next) => body = next,
                Err(why) => {
                    let status = json!({"state": "failed", "finish_reason": null, "usage": null, "error": why});
                    let event = format!("event: status\ndata: {status}\n\n");
                    let _ = self.out.send(Bytes::from(event)).await;
                    return;
                }
            }
        }
    }

    /// Forward one worker's events past those the client has; Some(true):
    /// the final status went out; Some(false): the process went on
    /// elsewhere or the stream broke; None: the client left.
    async fn forward(
        &mut self,
        mut body: BoxStream<'static, reqwest::Result<Bytes>>,
    ) -> Option<bool> {
        let mut replayed = self.sent;
        let mut blocks = SseBlocks::default();
        while let Some(Ok(bytes)) = body.next().await {
            let Ok(events) = blocks.push(&bytes) else {
                return Some(false);
            };
            for block in events {
                let last = match parse(&block) {
                    Some(Native::Token(_) | Native::Text) if replayed > 0 => {
                        replayed -= 1;
                        continue;
                    }
                    Some(Native::Token(_) | Native::Text) => {
                        self.sent += 1;
                        false
                    }
                    Some(Native::Status(state)) if state == "migrated" => return Some(false),
                    Some(Native::Status(_)) => true,
                    Some(Native::Props(_)) | None => false,
                };
                self.out.send(Bytes::from(block)).await.ok()?;
                if last {
                    return Some(true);
                }
            }
        }
        Some(false)
    }

    /// The events of the worker the process went on to, once the follower
    /// moved it (Err: why it could not go on).
    async fn next_worker(&mut self) -> Result<BoxStream<'static, reqwest::Result<Bytes>>, String> {
        let started = Instant::now();
        let streams = &self.ctl.streams;
        let ((origin, origin_local), at) = (&self.origin, &self.at);
        loop {
            let left = MOVE_WAIT.saturating_sub(started.elapsed());
            let found = streams
                .wait_for(left, || match streams.current(origin, origin_local) {
                    Some(Whereabouts::Lost(why)) => Some(Err(why)),
                    Some(Whereabouts::At { worker, local, .. })
                        if (&worker, &local) != (&at.0, &at.1) =>
                    {
                        Some(Ok((worker, local)))
                    }
                    _ => None,
                })
                .await;
            let (worker, local) = match found {
                Some(found) => found?,
                None => {
                    return Err(format!(
                        "its worker `{}` stopped answering and it went on nowhere within {} s",
                        at.0,
                        MOVE_WAIT.as_secs()
                    ))
                }
            };
            if let Some(url) = self.ctl.registry.url_of(&worker) {
                let url = process_url(&url, "processes", &local, "/events");
                if let Ok(up) = open(&self.ctl, &url, &self.acting).await {
                    if up.status.is_success() {
                        self.at = (worker, local);
                        return Ok(up.body);
                    }
                }
            }
            // Named there but not answering yet: look again shortly.
            tokio::time::sleep(OPEN_RETRY).await;
        }
    }
}

/// `{worker_url}/v1/{route}/{local}{tail}`, the process id percent-encoded
/// so that it can only name a process.
fn process_url(worker_url: &str, route: &str, local: &str, tail: &str) -> String {
    let local = utf8_percent_encode(local, NON_ALPHANUMERIC);
    format!("{worker_url}/v1/{route}/{local}{tail}")
}

/// One SSE event of a native event stream.
fn parse(block: &[u8]) -> Option<Native> {
    let text = String::from_utf8_lossy(block);
    let mut kind = None;
    let mut data = None;
    for line in text.lines() {
        if let Some(k) = line.strip_prefix("event:") {
            kind = Some(k.trim().to_string());
        } else if let Some(d) = line.strip_prefix("data:") {
            data = Some(d.trim_start().to_string());
        }
    }
    let data: Value = serde_json::from_str(&data?).ok()?;
    match kind.as_deref()? {
        "text" => Some(match data["token"].as_u64() {
            Some(t) => Native::Token(u32::try_from(t).ok()?),
            None => Native::Text,
        }),
        "status" => Some(Native::Status(data["state"].as_str()?.to_string())),
        "props" => Some(Native::Props(data["props"].clone())),
        _ => None,
    }
}

/// `{"id": "proc-3"}` from worker w1 becomes `{"id": "w1~proc-3"}`; a
/// `launch` the controller follows from then on (see `native`).
pub async fn qualify_id(resp: Response, worker: &str, launch: Option<NativeLaunch>) -> Response {
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return error(StatusCode::BAD_GATEWAY, "unreadable worker response");
    };
    let mut v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let turns = v
        .as_object_mut()
        .and_then(|o| o.remove(SESSION_TURNS_FIELD));
    if let Some(id) = v["id"].as_str() {
        let launch = launch.map(|launch| NativeLaunch {
            local: id.to_string(),
            turns,
            ..launch
        });
        if let Some(launch) = launch.filter(NativeLaunch::movable) {
            launch.follow();
        }
        v["id"] = json!(format!("{worker}~{id}"));
    }
    parts.headers.remove("content-length");
    Response::from_parts(parts, Body::from(v.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_events_parse_with_and_without_ids() {
        let text = b"event: text\ndata: {\"text\":\"a\",\"token\":17}\n\n";
        assert!(matches!(parse(text), Some(Native::Token(17))));
        let flush = b"event: text\ndata: {\"text\":\"b\",\"token\":null}\n\n";
        assert!(matches!(parse(flush), Some(Native::Text)));
        let done = b"event: status\ndata: {\"state\":\"migrated\"}\n\n";
        assert!(matches!(parse(done), Some(Native::Status(s)) if s == "migrated"));
        assert!(parse(b": keep-alive\n\n").is_none());
    }
}
