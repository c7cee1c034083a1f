//! One generation over an inferlet's context: a sequence of the one
//! scheduler (its slots, budgets, charges, preemption), run by the one
//! sequence runner (`sequence.rs`), whose tokens come back whole to the
//! caller, with their log-probabilities if asked, and optionally stream to
//! the process's output as they come. No guest code runs per token.
//!
//! Invariant: the sequence lives no longer than the call: a caller that
//! stops waiting (its process killed, its guest trapped) aborts it.

use std::sync::Arc;

use pie_core::{PropValue, SeqId};
use pie_model::TokenLogprobs;
use pie_policy::keep_session::retention_key;

use super::command::Command;
use super::request::{Generate, Generated};
use super::sequence::{SeqEnd, SeqSink, TextStream};
use super::Runtime;
use crate::engine::{FinishReason, Request, Scored};
use crate::process::Process;
use pie_core::clock::now_ms;

/// What a guest's generation does with its sequence's tokens: gathers them
/// into the result, counts them in the process's usage, streams their text
/// where asked, and forgets the sequence in the process when dropped (the
/// generation ended, or its caller went away).
struct Gatherer<'a> {
    process: &'a Process,
    /// The sequence's prompt length, and how much of it the usage counts.
    prompt: usize,
    counted: usize,
    retain_as: String,
    stream: bool,
    seq: Option<SeqId>,
    out: Generated,
}

impl SeqSink for Gatherer<'_> {
    fn added(&mut self, seq: SeqId) -> bool {
        self.process.add_context_seq(seq, self.retain_as.clone());
        self.seq = Some(seq);
        true
    }

    /// Its prompt's new tokens (past what the usage counts) join the
    /// usage's prompt tokens, those of them found cached its cached tokens,
    /// as a built-in's prompt does.
    fn started(&mut self, cached_tokens: usize) {
        let new = self.prompt.saturating_sub(self.counted);
        let cached = cached_tokens.saturating_sub(self.counted).min(new);
        self.process.count_prompt(new, cached);
    }

    fn token(&mut self, token: u32, text: String, logprobs: Option<TokenLogprobs>) {
        if let Some(lp) = logprobs {
            self.first_top(&lp);
            self.out.logprobs.push(lp.logprob);
        }
        self.out.tokens.push(token);
        self.emit(text, Some(token));
    }

    fn scored(&mut self, scored: Scored) {
        self.out.scored.insert(scored.position, scored);
    }
}

impl Gatherer<'_> {
    /// The first sample's alternatives (a `forward`'s answer).
    fn first_top(&mut self, lp: &TokenLogprobs) {
        if self.out.logprobs.is_empty() && self.out.first_top.is_empty() {
            self.out.first_top = lp.top.clone();
        }
    }

    /// Text made by the generation: kept in its result, counted in the
    /// process's usage, and (streamed) sent to the process's output.
    fn emit(&mut self, text: String, token: Option<u32>) {
        self.out.text.push_str(&text);
        match (self.stream, token) {
            (true, _) => self.process.push_generated(text, token),
            (false, Some(_)) => self.process.count_generated(),
            (false, None) => {}
        }
    }
}

impl Drop for Gatherer<'_> {
    fn drop(&mut self) {
        if let Some(seq) = self.seq {
            self.process.remove_seq(seq);
        }
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
        let prompt = call.tokens.len();
        let mut props = process.props();
        props
            .set("session", PropValue::Str(call.retain_as.clone()))
            .map_err(|e| e.to_string())?;
        let mut req = Request::new(
            call.tokens,
            call.max_tokens,
            process.client.clone(),
            props,
            now_ms(),
        );
        req.sampling = call.sampling;
        req.ignore_eos = call.ignore_eos;
        req.cache_salt = call.cache_salt;
        req.logprobs = call.logprobs;
        req.grammar = call.grammar;
        req.score = call.score;
        req.hold_ms = Some(call.hold_ms);
        req.resume_from = (call.resume_from.iter())
            .map(|key| retention_key(&process.client, key))
            .collect();
        let mut text = TextStream::new(&self.model.tokenizer, &call.text);
        let mut gatherer = Gatherer {
            process,
            prompt,
            counted: call.counted,
            retain_as: call.retain_as,
            stream: call.stream,
            seq: None,
            out: Generated::default(),
        };
        match self.run_sequence(req, &[], &mut text, &mut gatherer).await {
            SeqEnd::StopString => gatherer.out.stopped = true,
            SeqEnd::Finished {
                reason,
                tail,
                last_logprobs,
                ..
            } => {
                if let Some(lp) = last_logprobs {
                    gatherer.first_top(&lp);
                }
                gatherer.emit(tail, None);
                gatherer.out.stopped = reason != FinishReason::Length;
            }
            SeqEnd::Failed(why) => return Err(why),
            SeqEnd::Refused => return Err(self.engine_stopped()),
        }
        Ok(std::mem::take(&mut gatherer.out))
    }

    /// End the retention of `client`'s context `key`'s pages (it was
    /// dropped, or its process ended): they fall back to the prefix cache.
    pub fn release_retained(&self, client: &str, key: &str) {
        self.send(Command::ReleaseSession(retention_key(client, key)));
    }

    /// Keep only the first `len` tokens of `client`'s context `key`'s
    /// retained pages (the context was truncated).
    pub fn truncate_retained(&self, client: &str, key: &str, len: usize) {
        self.send(Command::TruncateSession {
            session: retention_key(client, key),
            len,
        });
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
}
