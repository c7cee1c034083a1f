//! Prefill across workers: pulling a process's pages from a peer before its
//! prefill (the prefill worker a controller's `disaggregate` chose, a
//! migration's source, or an offload peer when this worker is busy), and
//! prefilling a prompt here for a peer that then pulls its pages.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pie_core::SeqId;

use super::request::TextRules;
use super::sequence::{SeqEnd, SeqSink, TextStream};
use super::transfer::Pull;
use super::Runtime;
use crate::engine::Request;
use pie_core::clock::now_ms;

/// A peer worker this process's pages come from before its prefill.
#[derive(Clone, Debug)]
pub(super) struct PageSource {
    pub(super) url: String,
    /// The peer computes the prompt first (disaggregate); otherwise it sends
    /// what it holds (a migration's source).
    pub(super) prefill: bool,
}

impl Runtime {
    /// Prefill `tokens` (under `cache_salt`) for a peer, which then pulls
    /// their pages.
    pub(super) async fn prefill_for_peer(
        self: &Arc<Self>,
        tokens: Vec<u32>,
        cache_salt: Option<String>,
    ) -> Result<(), String> {
        let mut req = Request::fixed_length(tokens, 1);
        req.client = "peer".into();
        req.arrival_ms = now_ms();
        req.cache_salt = cache_salt;
        // A puller that gave up (timeout, gone) drops this future: the
        // prefill stops instead of computing for no one.
        let rules = TextRules::default();
        let mut text = TextStream::new(&self.model.tokenizer, &rules);
        match self.run_sequence(req, &[], &mut text, &mut Prefill).await {
            SeqEnd::Finished { .. } | SeqEnd::StopString | SeqEnd::Refused => Ok(()),
            SeqEnd::Failed(why) => Err(why),
        }
    }

    /// Before a process's prefill: pull its pages from the prefill worker the
    /// controller chose (`disaggregate`), or from an offload peer when this
    /// worker is busy. Any failure leaves the prefill (of what is missing) here.
    pub(super) async fn remote_prefill(&self, req: &Request, source: Option<&PageSource>) {
        let (peer, prefill, timeout_ms) = match source {
            Some(s) => (s.url.clone(), s.prefill, self.settings.transfer.timeout_ms),
            None => match self.offload_peer(req.prompt.len()) {
                Some((peer, timeout_ms)) => (peer, true, timeout_ms),
                None => return,
            },
        };
        let pull = Pull {
            peer: &peer,
            tokens: &req.prompt,
            cache_salt: req.cache_salt.as_deref(),
            blocks: None,
            prefill,
            timeout_ms,
        };
        if self.pull_pages(pull).await.is_ok() && source.is_none() {
            self.metrics.offloaded_prefills.inc();
        }
    }

    /// The offload peer and its timeout when `offload` says a prompt of
    /// `prompt_tokens` should be prefilled elsewhere.
    fn offload_peer(&self, prompt_tokens: usize) -> Option<(String, u64)> {
        let offload = self.offload.lock().unwrap_or_else(|e| e.into_inner());
        let o = offload.as_ref()?;
        let waiting = self.load.waiting_prefill_tokens.load(Ordering::Relaxed) + prompt_tokens;
        let rate = f64::from_bits(self.load.prefill_tokens_per_s.load(Ordering::Relaxed));
        if !o.should_offload(waiting, rate) {
            return None;
        }
        let n = self.offloads.fetch_add(1, Ordering::Relaxed) as usize;
        Some((o.peer(n)?.to_string(), o.config.timeout_ms))
    }
}

/// A peer's prefill: only its pages matter, not its one token.
struct Prefill;

impl SeqSink for Prefill {
    fn added(&mut self, _seq: SeqId) -> bool {
        true
    }

    fn token(&mut self, _token: u32, _text: String, _logprobs: Option<pie_model::TokenLogprobs>) {}
}
