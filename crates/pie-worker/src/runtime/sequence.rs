//! The one consumer of engine events. Every sequence a process runs (a
//! built-in's, an OpenAI route's, an inferlet's generation, a peer's
//! prefill, a resumed process's) is submitted, followed and ended here:
//! its tokens turned into text (held back where a stop string may start),
//! each paired with its log-probabilities, a preempted sequence's pages
//! reloaded from disk, and the sequence aborted when it stops early or its
//! caller goes away. What a token means to its process is the caller's
//! [`SeqSink`]. `scripts/check-architecture.py` refuses a `SeqEvent` match
//! anywhere else.
//!
//! Invariant: a sequence lives no longer than [`Runtime::run_sequence`]: on
//! every way out (its end, a stop string, a failure, the future dropped) the
//! engine is told to abort it, which is a no-op for one already finished.

use std::sync::Arc;

use pie_core::{BlockHash, SeqId};
use pie_model::{IncrementalDecoder, TokenLogprobs, Tokenizer};

use super::command::{Command, SeqEvent};
use super::request::TextRules;
use super::stop::StopScanner;
use super::Runtime;
use crate::engine::{FinishReason, Request, Scored, SeqInfo};

/// The longest a preempted sequence waits for its pages from disk.
const RELOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// What a sequence's owner does with its life; every call is made from the
/// task that runs [`Runtime::run_sequence`].
pub(super) trait SeqSink {
    /// The engine took the sequence as `seq`; false stops (aborts) it at
    /// once (its process ended meanwhile).
    fn added(&mut self, seq: SeqId) -> bool;
    /// It was scheduled for the first time, finding this many prompt
    /// tokens cached.
    fn started(&mut self, _cached_tokens: usize) {}
    /// A token, the text it completes (stop strings held back: possibly
    /// empty), and its log-probabilities where the request asked.
    fn token(&mut self, token: u32, text: String, logprobs: Option<TokenLogprobs>);
    /// A distribution its pass asked for (again, after a preemption).
    fn scored(&mut self, _scored: Scored) {}
}

/// How a sequence ended.
#[derive(Debug)]
pub(super) enum SeqEnd {
    /// The sink refused it in [`SeqSink::added`].
    Refused,
    /// A stop string ended its text.
    StopString,
    /// The engine finished it; `tail` is the text held back until then, and
    /// `last_logprobs` those of a stop token's sample (not output).
    Finished {
        reason: FinishReason,
        info: SeqInfo,
        tail: String,
        last_logprobs: Option<TokenLogprobs>,
    },
    /// It failed (a token that cannot be decoded, its own bad input, the
    /// engine gone): the error names why.
    Failed(String),
}

/// A sequence's text as its tokens come: incremental decoding, then stop
/// strings (no part of one is emitted).
pub(super) struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    scanner: StopScanner<'a>,
    decoder: IncrementalDecoder,
}

impl<'a> TextStream<'a> {
    pub(super) fn new(tokenizer: &'a Tokenizer, rules: &'a TextRules) -> Self {
        Self {
            tokenizer,
            scanner: StopScanner::new(rules),
            decoder: IncrementalDecoder::keeping_special(rules.keep_special),
        }
    }

    /// The text `token` completes, and whether a stop string ended it; Err
    /// when the token cannot be decoded.
    pub(super) fn push(&mut self, token: u32) -> Result<(String, bool), String> {
        let delta = (self.decoder.push(self.tokenizer, token))
            .map_err(|e| format!("cannot detokenize token {token}: {e}"))?;
        Ok(self.scanner.push(&delta))
    }

    /// What is held back, at the end.
    pub(super) fn flush(&mut self) -> String {
        self.scanner.flush()
    }
}

/// Aborts a sequence when dropped.
struct AbortOnDrop<'a> {
    rt: &'a Runtime,
    seq: SeqId,
}

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        self.rt.send(Command::Abort(self.seq));
    }
}

impl Runtime {
    /// Run `req` to its end through `text`, telling `sink`. A preempted
    /// sequence waiting for its pages from disk gets `reload_chain` loaded
    /// (bounded: a stuck disk delays it, never stalls it).
    pub(super) async fn run_sequence(
        self: &Arc<Self>,
        req: Request,
        reload_chain: &[BlockHash],
        text: &mut TextStream<'_>,
        sink: &mut impl SeqSink,
    ) -> SeqEnd {
        let (seq, mut events) = match self.add_sequence(req).await {
            Ok(added) => added,
            Err(why) => return SeqEnd::Failed(why),
        };
        let _abort = AbortOnDrop { rt: self, seq };
        if !sink.added(seq) {
            return SeqEnd::Refused;
        }
        let mut logprobs = None;
        while let Some(event) = events.recv().await {
            match event {
                SeqEvent::Started { cached_tokens } => sink.started(cached_tokens),
                SeqEvent::Reload => {
                    let load = self.load_persisted(reload_chain);
                    let _ = tokio::time::timeout(RELOAD_TIMEOUT, load).await;
                    self.send(Command::Reloaded(seq));
                }
                SeqEvent::Logprobs(lp) => logprobs = Some(lp),
                SeqEvent::Scored(scored) => sink.scored(scored),
                SeqEvent::Token(t) => match text.push(t) {
                    Err(why) => return SeqEnd::Failed(why),
                    Ok((emit, stopped)) => {
                        sink.token(t, emit, logprobs.take());
                        if stopped {
                            return SeqEnd::StopString;
                        }
                    }
                },
                SeqEvent::Finished(reason, info) => {
                    return SeqEnd::Finished {
                        reason,
                        info,
                        tail: text.flush(),
                        last_logprobs: logprobs,
                    }
                }
                SeqEvent::Failed(why) => return SeqEnd::Failed(why),
            }
        }
        // The engine dropped the sequence without a last word: it is gone.
        SeqEnd::Failed(self.engine_stopped())
    }
}
