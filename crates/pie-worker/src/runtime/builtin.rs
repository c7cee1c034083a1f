//! The built-in inferlets' per-process driver (`text-completion`, `chat`):
//! what is theirs alone around the one sequence runner (`sequence.rs`):
//! gathering the prompt's pages first (disk, pool, a prefill worker), a
//! resumed process's earlier tokens, recording the output in the process,
//! a hand-off, and the result (a chat session's turn included).
//!
//! Invariant: a process whose driver ends (finished, failed, or dropped by a
//! panic) is in a final state and its sequence is freed.

use std::sync::Arc;
use std::time::Instant;

use pie_model::{ChatMessage, TokenLogprobs};
use pie_workload::TraceInput;

use super::command::Command;
use super::offload::PageSource;
use super::request::TextRules;
use super::sequence::{SeqEnd, SeqSink, TextStream};
use super::Runtime;
use crate::engine::{FinishReason, Request};
use crate::process::{ProcState, Process};
use pie_core::clock::now_ms;

/// A resumed chat session's id and the messages of this turn's prompt.
pub(super) type SessionTurn = (String, Vec<ChatMessage>);

/// Drives one process: submits its sequence, turns tokens into text, applies stop
/// strings, and records the result.
pub(super) struct Driver {
    pub(super) rt: Arc<Runtime>,
    pub(super) process: Arc<Process>,
    pub(super) text: TextRules,
    /// For a resumed chat session: its id and the messages of this turn's prompt.
    pub(super) session_messages: Option<SessionTurn>,
    /// Set when the server records a trace.
    pub(super) trace_input: Option<TraceInput>,
    /// The worker to pull the prompt's pages from first.
    pub(super) pages_from: Option<PageSource>,
    /// Resumed: the tokens it generated elsewhere (the end of the request's
    /// prompt).
    pub(super) generated_before: Vec<u32>,
    /// Output `generated_before` again (see [`Resume::replay`](super::Resume::replay)).
    pub(super) replay_before: bool,
}

/// What a built-in process does with its sequence's tokens: record them
/// (text, token, log-probabilities) in the process, time them, and persist
/// the prompt's pages after its prefill where the process asked.
struct Recorder<'a> {
    driver: &'a Driver,
    /// Tokens output so far (a resumed process's earlier ones included).
    tokens: usize,
    last_token: Option<Instant>,
    persist_after_prefill: Option<Vec<pie_core::BlockHash>>,
}

impl SeqSink for Recorder<'_> {
    fn added(&mut self, seq: pie_core::SeqId) -> bool {
        self.driver.process.set_seq(seq);
        !self.driver.process.state().is_final()
    }

    fn started(&mut self, cached_tokens: usize) {
        self.driver.process.set_cached_tokens(cached_tokens);
        self.driver.process.mark_running();
    }

    fn token(&mut self, token: u32, text: String, logprobs: Option<TokenLogprobs>) {
        if let Some(chain) = self.persist_after_prefill.take() {
            self.driver.rt.persist_in_background(chain);
        }
        let (rt, process) = (&self.driver.rt, &self.driver.process);
        let now = Instant::now();
        match self.last_token {
            None => rt
                .metrics
                .ttft
                .observe((now_ms().saturating_sub(process.snapshot().created_ms)) as f64 / 1000.0),
            Some(prev) => (rt.metrics.inter_token).observe(now.duration_since(prev).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.tokens += 1;
        match logprobs {
            Some(lp) => process.push_scored(text, token, lp, self.tokens),
            None => process.push_text(text, Some(token), self.tokens),
        }
    }
}

impl Driver {
    pub(super) async fn run(self, mut req: Request) {
        let max_tokens = req.max_tokens;
        let chain = self.gather_pages(&mut req).await;
        let mut text = TextStream::new(&self.rt.model.tokenizer, &self.text);
        self.resume_text(&mut text);
        if req.max_tokens == 0 {
            let tail = text.flush();
            self.process
                .push_text(tail, None, self.generated_before.len());
            self.complete("length");
            return;
        }
        let mut recorder = Recorder {
            driver: &self,
            tokens: self.generated_before.len(),
            // A resumed process's first token here is no first token.
            last_token: (!self.generated_before.is_empty()).then(Instant::now),
            persist_after_prefill: (req.props.bool("persist") == Some(true)).then(|| chain.clone()),
        };
        match self
            .rt
            .run_sequence(req, &chain, &mut text, &mut recorder)
            .await
        {
            SeqEnd::Refused => {}
            SeqEnd::StopString => self.complete("stop"),
            SeqEnd::Failed(why) => self.fail(why),
            SeqEnd::Finished {
                reason: FinishReason::Expired,
                ..
            } => self.fail("the deadline passed (deadline-ms) and on_miss = \"abort\"".into()),
            SeqEnd::Finished {
                reason: FinishReason::Length,
                info,
                ..
            } if self.process.handing_off() && info.generated_tokens < max_tokens => {
                // Stopped early for a hand-off: what is held back is the
                // target's to send.
                self.rt.stop(&self.process, ProcState::Migrated);
            }
            SeqEnd::Finished {
                reason, info, tail, ..
            } => {
                let tokens = self.generated_before.len() + info.generated_tokens;
                self.process.push_text(tail, None, tokens);
                self.complete(if reason == FinishReason::Stop {
                    "stop"
                } else {
                    "length"
                });
            }
        }
    }

    /// Before the sequence is added: the prompt's pages from disk, the pool
    /// or a prefill worker, what is there; returns the prompt's block chain.
    async fn gather_pages(&self, req: &mut Request) -> Vec<pie_core::BlockHash> {
        let chain = self.rt.chain(&req.prompt, req.cache_salt.as_deref());
        self.rt.load_persisted(&chain).await;
        self.rt.pull_from_pool(req).await;
        self.rt.remote_prefill(req, self.pages_from.as_ref()).await;
        req.reload_after_preemption = self.rt.on_disk(&chain);
        chain
    }

    /// A resumed process's tokens from elsewhere, through the decoder and the
    /// stop scanner: what the source held back (a partial character, a
    /// possible stop string's start) is held here the same way; what it sent
    /// is not sent again, unless replayed: then as the same pieces, one a token.
    fn resume_text(&self, text: &mut TextStream) {
        for (i, &t) in self.generated_before.iter().enumerate() {
            if let Ok((emit, _)) = text.push(t) {
                if self.replay_before {
                    self.process.push_text(emit, Some(t), i + 1);
                }
            }
        }
    }

    fn complete(&self, reason: &'static str) {
        if !self.process.finish(ProcState::Finished, Some(reason), None) {
            return;
        }
        self.rt.metrics.count_request("finished");
        self.count_deadline_miss();
        if let (Some(trace), Some(input)) = (&self.rt.settings.trace, &self.trace_input) {
            let p = self.process.snapshot();
            if let Err(e) = trace.record(input.clone(), p.usage.completion_tokens, &p.props) {
                tracing::warn!("server.trace_file: cannot write: {e}");
            }
        }
        if let Some((session, mut messages)) = self.session_messages.clone() {
            messages.push(ChatMessage::text(
                "assistant",
                self.process.snapshot().output,
            ));
            // The inferlet records which turn this was as its own prop.
            let turns = messages.iter().filter(|m| m.role == "assistant").count() as i64;
            self.rt.lock_sessions().insert(session, messages);
            let _ = self
                .process
                .update_props(|p| p.set("turn", pie_core::PropValue::Int(turns)));
        }
    }

    fn fail(&self, error: String) {
        if self.process.finish(ProcState::Failed, None, Some(error)) {
            self.rt.metrics.count_request("failed");
            self.count_deadline_miss();
        }
    }

    fn count_deadline_miss(&self) {
        let d = self.process.snapshot();
        if let (Some(deadline), Some(done)) = (d.props.int("deadline-ms"), d.finished_ms) {
            if done > d.created_ms.saturating_add(deadline.max(0) as u64) {
                self.rt.metrics.deadline_misses.inc();
            }
        }
    }
}

/// A driver that ends before its process does (its task panicked or was
/// dropped) fails the process and frees its sequence: a failure in one
/// process's own code never leaves it running forever.
impl Drop for Driver {
    fn drop(&mut self) {
        if self.process.state().is_final() {
            return;
        }
        self.fail("internal error: the process's driver stopped unexpectedly".into());
        if let Some(seq) = self.process.seq() {
            self.rt.send(Command::Abort(seq));
        }
    }
}
