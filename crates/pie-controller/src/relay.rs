//! Streams the controller can move between workers. A streamed OpenAI
//! generation is relayed event by event; each token's chunk carries its id
//! (`pie_stream_ids`, stripped here), so the controller knows exactly which
//! tokens the client has. When the worker's stream breaks (the worker died),
//! the request goes to another worker with `pie_resume` (the tokens sent so
//! far): greedy and seeded sampling continue as they would have and the
//! client sees every token once, with no error. A live move (a draining
//! worker, a relocation, a rebalance) follows the move plan (`live_move`):
//! the target prefetches what the source holds while the source keeps
//! decoding, again while more than a page came meanwhile; then, one token
//! short of a page boundary, the source is asked to hand the process off,
//! stops after that token with its KV ending at the boundary, and the target
//! pulls only the pages that came after.
//!
//! Invariants: the client's chunks keep the first worker's `id` and
//! `created`; a move that fails before the hand-off leaves the process where
//! it was; after a hand-off or a break the stream goes on elsewhere or ends
//! with an error event, never silently.

use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode};
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use pie_client::sse::{SseBlocks, SseTooLarge};
use pie_core::wire::{HANDOFF_COMMENT, PROCESS_COMMENT, RESUME_FIELD, TOKEN_IDS_KEY};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::live_move::{LiveMove, Next};
use crate::placed::{channel_body, count_move_failure, Moved, Placed, MAX_RESUMES};
use crate::respond::error_event;
use crate::streams::{Move, Reason};
use crate::worker_client::describe;

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
        let (id, moves) = ctl.streams.add(self.placed.placement(), false);
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
        let mut blocks = SseBlocks::default();
        let mut migration: Option<LiveMove> = None;
        loop {
            let mut broke = None;
            let step = tokio::select! {
                chunk = upstream.next() => Step::Chunk(chunk),
                m = moves.recv() => Step::Move(m),
                staged = LiveMove::staged(&mut migration) => Step::Staged(staged),
            };
            let resume = match step {
                Step::Chunk(Some(Ok(bytes))) => {
                    match self.forward_events(blocks.push(&bytes), &out).await {
                        Flow::Go => {
                            self.advance(&mut migration).await;
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
                        migration = self.begin_move(m).await;
                    }
                    continue;
                }
                Step::Staged(Ok(())) => {
                    self.advance(&mut migration).await;
                    continue;
                }
                Step::Staged(Err(e)) => {
                    if let Some(m) = migration.take() {
                        m.abandon(&self.relay.placed, &e);
                    }
                    continue;
                }
            };
            blocks = SseBlocks::default();
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

    /// Forward the events a chunk completed; an event over the cap ends the
    /// stream with an error event.
    async fn forward_events(
        &mut self,
        blocks: Result<Vec<Vec<u8>>, SseTooLarge>,
        out: &mpsc::Sender<Bytes>,
    ) -> Flow {
        let blocks = match blocks {
            Ok(blocks) => blocks,
            Err(e) => {
                let _ = out
                    .send(error_event(&format!("the worker's stream broke: {e}")))
                    .await;
                return Flow::End;
            }
        };
        for block in blocks {
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
        self.relay.placed.slot.observe(bytes);
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

    /// The prompt and every token the client has: what the source's KV
    /// holds once its current step ends.
    fn tokens(&self) -> Vec<u32> {
        let mut tokens = self.relay.placed.prompt.clone();
        tokens.extend_from_slice(&self.generated);
        tokens
    }

    /// Start move `m` (its first stage, the prefetch); None when it cannot.
    async fn begin_move(&self, m: Move) -> Option<LiveMove> {
        let (live, next) = LiveMove::begin(&self.relay.placed, m, Some(&self.tokens()))?;
        self.act(live, next).await
    }

    /// After a stage ended or a token arrived: the move plan's next step.
    async fn advance(&self, migration: &mut Option<LiveMove>) {
        if let Some(mut live) = migration.take() {
            let next = live.advance(&self.relay.placed, &self.tokens());
            *migration = self.act(live, next).await;
        }
    }

    /// Ask for the hand-off if `next` says so; the move, unless it failed.
    async fn act(&self, live: LiveMove, next: Next) -> Option<LiveMove> {
        if next == Next::HandOff {
            if let Err(e) = self.hand_off().await {
                live.abandon(&self.relay.placed, &e);
                return None;
            }
        }
        Some(live)
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
        let (status, answer) = self.relay.placed.post(url.clone(), json!({})).await?;
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
        self.relay.placed.refresh_props(self.stream_id);
        let old = self.relay.placed.worker.clone();
        let mut body = self.relay.placed.body.clone();
        body[RESUME_FIELD] = json!({"tokens": self.generated, "from": source});
        let body = Bytes::from(body.to_string());
        let tokens = self.tokens();
        let mut targets = self.relay.placed.resume_targets(target);
        while let Some((name, url)) = targets.next(&self.relay.placed, &tokens) {
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
        let sent = (r.placed.ctl.worker_client)
            .send(
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

/// Where the relay loop goes after a chunk.
enum Flow {
    Go,
    End,
    HandedOff,
}

/// A completion or chat chunk with no text and no finish: a token that made
/// no character yet, sent only for its id.
fn adds_nothing(chunk: &Value) -> bool {
    let choice = &chunk["choices"][0];
    let text = choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
        .unwrap_or_default();
    text.is_empty() && choice["finish_reason"].is_null() && choice["logprobs"].is_null()
}

#[cfg(test)]
mod tests {
    use super::*;

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
