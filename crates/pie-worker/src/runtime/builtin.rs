//! The built-in inferlets' per-process driver (`text-completion`, `chat`):
//! submits the process's sequence, turns its tokens into text, applies stop
//! strings, and records the result (a chat session's turn included).
//!
//! Invariant: a process whose driver ends (finished, failed, or dropped by a
//! panic) is in a final state and its sequence is freed.

use std::sync::Arc;
use std::time::Instant;

use pie_model::{ChatMessage, IncrementalDecoder, TokenLogprobs};
use pie_workload::TraceInput;

use super::command::{Command, SeqEvent};
use super::offload::PageSource;
use super::stop::StopScanner;
use super::Runtime;
use crate::engine::{FinishReason, Request};
use crate::process::{ProcState, Process};
use pie_core::clock::now_ms;

/// The longest a preempted sequence waits for its pages from disk.
const RELOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A resumed chat session's id and the messages of this turn's prompt.
pub(super) type SessionTurn = (String, Vec<ChatMessage>);

/// A process's output as it is made: text through the decoder and the stop
/// scanner, the tokens so far, when the last came.
struct Output<'a> {
    text: StopScanner<'a>,
    decoder: IncrementalDecoder,
    tokens: usize,
    last_token: Option<Instant>,
    /// The next token's log-probabilities (sent just before it).
    logprobs: Option<TokenLogprobs>,
}

/// Drives one process: submits its sequence, turns tokens into text, applies stop
/// strings, and records the result.
pub(super) struct Driver {
    pub(super) rt: Arc<Runtime>,
    pub(super) process: Arc<Process>,
    pub(super) stop: Vec<String>,
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

impl Driver {
    pub(super) async fn run(self, mut req: Request) {
        let max_tokens = req.max_tokens;
        let chain = self.gather_pages(&mut req).await;
        let mut persist_after_prefill =
            (req.props.bool("persist") == Some(true)).then(|| chain.clone());
        let mut out = Output {
            text: StopScanner::new(&self.stop),
            decoder: IncrementalDecoder::default(),
            tokens: self.generated_before.len(),
            // A resumed process's first token here is no first token.
            last_token: (!self.generated_before.is_empty()).then(Instant::now),
            logprobs: None,
        };
        self.resume_text(&mut out.text, &mut out.decoder);
        if req.max_tokens == 0 {
            self.process.push_text(out.text.flush(), None, out.tokens);
            self.complete("length");
            return;
        }
        let (seq, mut events) = match self.rt.add_sequence(req).await {
            Ok(added) => added,
            Err(why) => return self.fail(why),
        };
        self.process.set_seq(seq);
        if self.process.state().is_final() {
            self.rt.send(Command::Abort(seq));
            return;
        }
        while let Some(event) = events.recv().await {
            match event {
                SeqEvent::Started { cached_tokens } => {
                    self.process.set_cached_tokens(cached_tokens);
                    self.process.mark_running();
                }
                SeqEvent::Reload => {
                    // Bounded: a stuck disk delays the sequence, never stalls it.
                    let load = self.rt.load_persisted(&chain);
                    let _ = tokio::time::timeout(RELOAD_TIMEOUT, load).await;
                    self.rt.send(Command::Reloaded(seq));
                }
                SeqEvent::Logprobs(lp) => out.logprobs = Some(lp),
                SeqEvent::Token(t) => {
                    if let Some(chain) = persist_after_prefill.take() {
                        self.rt.persist_in_background(chain);
                    }
                    let stopped = self.on_token(&mut out, t);
                    if stopped != Ok(false) {
                        self.rt.send(Command::Abort(seq));
                        // A token that cannot be decoded fails this process only.
                        match stopped {
                            Err(why) => self.fail(why),
                            _ => self.complete("stop"),
                        }
                        return;
                    }
                }
                SeqEvent::Finished(FinishReason::Expired, _) => {
                    self.fail("the deadline passed (deadline-ms) and on_miss = \"abort\"".into());
                    return;
                }
                SeqEvent::Finished(FinishReason::Length, info)
                    if self.process.handing_off() && info.generated_tokens < max_tokens =>
                {
                    // Stopped early for a hand-off: what is held back is the
                    // target's to send.
                    self.rt.stop(&self.process, ProcState::Migrated);
                    return;
                }
                SeqEvent::Finished(reason, info) => {
                    self.process.push_text(
                        out.text.flush(),
                        None,
                        self.generated_before.len() + info.generated_tokens,
                    );
                    self.complete(if reason == FinishReason::Stop {
                        "stop"
                    } else {
                        "length"
                    });
                    return;
                }
                SeqEvent::Failed(e) => {
                    self.fail(e);
                    return;
                }
            }
        }
        // The engine dropped the sequence without a last word: it is gone.
        self.fail(self.rt.engine_stopped());
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

    /// Token `t` came: timed, decoded, scanned for stop strings and
    /// recorded. Ok(true) when a stop string ended the output; Err when the
    /// token cannot be decoded.
    fn on_token(&self, out: &mut Output<'_>, t: u32) -> Result<bool, String> {
        let now = Instant::now();
        match out.last_token {
            None => self.rt.metrics.ttft.observe(
                (now_ms().saturating_sub(self.process.snapshot().created_ms)) as f64 / 1000.0,
            ),
            Some(prev) => {
                (self.rt.metrics.inter_token).observe(now.duration_since(prev).as_secs_f64())
            }
        }
        out.last_token = Some(now);
        out.tokens += 1;
        let delta = (out.decoder.push(&self.rt.model.tokenizer, t))
            .map_err(|e| format!("cannot detokenize token {t}: {e}"))?;
        let (emit, stopped) = out.text.push(&delta);
        match out.logprobs.take() {
            Some(lp) => self.process.push_scored(emit, t, lp, out.tokens),
            None => self.process.push_text(emit, Some(t), out.tokens),
        }
        Ok(stopped)
    }

    /// A resumed process's tokens from elsewhere, through the decoder and the
    /// stop scanner: what the source held back (a partial character, a
    /// possible stop string's start) is held here the same way; what it sent
    /// is not sent again, unless replayed: then as the same pieces, one a token.
    fn resume_text(&self, text: &mut StopScanner, decoder: &mut IncrementalDecoder) {
        for (i, &t) in self.generated_before.iter().enumerate() {
            if let Ok(delta) = decoder.push(&self.rt.model.tokenizer, t) {
                let (emit, _) = text.push(&delta);
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
