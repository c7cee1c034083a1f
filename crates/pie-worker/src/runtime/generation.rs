//! One generation over an inferlet's context: a sequence of the one
//! scheduler (its slots, budgets, charges, preemption), whose tokens come
//! back whole to the caller, with their log-probabilities if asked, and optionally
//! stream to the process's output as they come. No guest code runs per token.
//!
//! Invariant: the sequence lives no longer than the call: a caller that
//! stops waiting (its process killed, its guest trapped) aborts it.

use std::sync::Arc;

use pie_core::{PropValue, SeqId};
use pie_model::IncrementalDecoder;

use super::command::{Command, SeqEvent};
use super::request::{Generate, Generated};
use super::stop::StopScanner;
use super::Runtime;
use crate::engine::{FinishReason, Request};
use crate::process::Process;
use pie_core::clock::now_ms;

/// Aborts the sequence and forgets it in the process when dropped: the
/// generation ended, or its caller went away.
struct SeqGuard<'a> {
    rt: &'a Runtime,
    process: &'a Process,
    seq: SeqId,
}

impl Drop for SeqGuard<'_> {
    fn drop(&mut self) {
        self.process.remove_seq(self.seq);
        self.rt.send(Command::Abort(self.seq));
    }
}

impl Runtime {
    /// Run one generation for `process` (see [`Generate`]).
    pub async fn generate(
        self: &Arc<Self>,
        process: &Process,
        call: Generate,
    ) -> Result<Generated, String> {
        self.check_generation(&call)?;
        let mut props = process.props();
        props
            .set("session", PropValue::Str(call.retain_as.clone()))
            .map_err(|e| e.to_string())?;
        let req = Request {
            client: process.client.clone(),
            prompt: call.tokens,
            max_tokens: call.max_tokens,
            sampling: call.sampling,
            stop_tokens: Vec::new(),
            ignore_eos: call.ignore_eos,
            cache_salt: call.cache_salt,
            arrival_ms: now_ms(),
            props,
            sampled_before: 0,
            reload_after_preemption: false,
            logprobs: call.logprobs,
            grammar: call.grammar,
            resume_from: call.resume_from,
        };
        let (seq, mut events) = self.add_sequence(req).await?;
        process.add_context_seq(seq, call.retain_as);
        let _guard = SeqGuard {
            rt: self,
            process,
            seq,
        };
        let mut text = StopScanner::new(&call.stop);
        let mut decoder = IncrementalDecoder::default();
        let mut out = Generated::default();
        while let Some(event) = events.recv().await {
            match event {
                SeqEvent::Started { .. } | SeqEvent::Reload => {}
                SeqEvent::Logprobs(lp) => {
                    if out.logprobs.is_empty() {
                        out.first_top = lp.top;
                    }
                    out.logprobs.push(lp.logprob);
                }
                SeqEvent::Token(t) => {
                    out.tokens.push(t);
                    let delta = decoder
                        .push(&self.model.tokenizer, t)
                        .map_err(|e| format!("cannot detokenize token {t}: {e}"))?;
                    let (emit, stopped) = text.push(&delta);
                    self.emit_generated(process, &mut out, emit, Some(t), call.stream);
                    if stopped {
                        out.stopped = true;
                        return Ok(out);
                    }
                }
                SeqEvent::Finished(reason, _) => {
                    // A stop token's logprob came without a token: not output.
                    out.logprobs.truncate(out.tokens.len());
                    self.emit_generated(process, &mut out, text.flush(), None, call.stream);
                    out.stopped = reason != FinishReason::Length;
                    return Ok(out);
                }
                SeqEvent::Failed(e) => return Err(e),
            }
        }
        Err(self.engine_stopped())
    }

    /// End the retention of a context's pages (it was dropped, or its
    /// process ended): they fall back to the prefix cache.
    pub fn release_retained(&self, key: String) {
        self.send(Command::ReleaseSession(key));
    }

    /// The tokens fit the vocabulary and a sequence; it asks for a token.
    fn check_generation(&self, call: &Generate) -> Result<(), String> {
        if call.tokens.is_empty() {
            return Err("the context is empty: append tokens or text first".into());
        }
        if call.max_tokens == 0 {
            return Err("max-tokens must be at least 1".into());
        }
        self.check_vocab("context", &call.tokens)
            .map_err(|e| e.to_string())?;
        if call.tokens.len() >= self.max_seq_tokens {
            return Err(format!(
                "the context has {} tokens but a sequence can hold at most {}",
                call.tokens.len(),
                self.max_seq_tokens
            ));
        }
        Ok(())
    }

    /// Text made by a generation: kept in its result, counted in the
    /// process's usage, and (streamed) sent to the process's output.
    fn emit_generated(
        &self,
        process: &Process,
        out: &mut Generated,
        text: String,
        token: Option<u32>,
        stream: bool,
    ) {
        out.text.push_str(&text);
        match (stream, token) {
            (true, _) => process.push_generated(text, token),
            (false, Some(_)) => process.count_generated(),
            (false, None) => {}
        }
    }
}
