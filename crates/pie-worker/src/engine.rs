//! The continuous-batching engine: one worker's sequences over one page pool.
//!
//! Each [`Engine::step`]: the worker policy orders the runnable sequences; in that
//! order each gets a prefill chunk or one decode token while the token budget
//! (`max_batch_tokens`) and the page budget last; one batched forward runs; the
//! sequences that reached the end of their tokens sample the next one.
//!
//! Pages: a new sequence first shares the longest cached prefix of its prompt
//! (before any prefill). When pages run out the pool evicts unreferenced cached
//! pages (LRU); if that is not enough the running sequence that the policy puts
//! last is preempted: its pages are released (full ones stay cached) and it is
//! recomputed later. Admission caps `max_tokens` so a sequence always fits the pool
//! on its own, and the sequence ordered first can always preempt the others, so
//! every admitted sequence finishes.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Result;
use pie_core::{block_hashes, Props, SeqId};
use pie_kv::{KvPool, PageTable, PoolStats};
use pie_model::{Model, Sampler, SamplingParams, SeqInput};
use pie_policy::{Candidate, KeepSession, WorkerPolicy};

#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    pub page_size: usize,
    pub kv_pages: usize,
    pub max_batch_tokens: usize,
    pub max_running: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            kv_pages: 2048,
            max_batch_tokens: 512,
            max_running: 64,
        }
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra stop tokens besides the model's end-of-turn tokens.
    pub stop_tokens: Vec<u32>,
    /// Generate to `max_tokens` even past the model's end-of-turn tokens.
    pub ignore_eos: bool,
    pub arrival_ms: u64,
    /// Who is served (fair share is per client).
    pub client: String,
    /// The owning process's props (policies read them).
    pub props: Props,
}

impl Request {
    /// Exactly `max_tokens` greedy tokens after `prompt` (end-of-turn tokens
    /// ignored), with no client or props: for calibration, benchmarks and tests.
    pub fn fixed_length(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            ignore_eos: true,
            arrival_ms: 0,
            client: String::new(),
            props: Props::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was sampled (it is not part of the output).
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The policy stopped it (e.g. its deadline passed with `on_miss = "abort"`).
    Expired,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("prompt of {prompt} tokens leaves no room to generate: the limit is {limit} tokens ({what})")]
    TooLong {
        prompt: usize,
        limit: usize,
        what: &'static str,
    },
}

/// Events of one step, in order.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub tokens: Vec<(SeqId, u32)>,
    /// Finished sequences with their final facts; their pages are already released.
    pub finished: Vec<(SeqId, FinishReason, SeqInfo)>,
    /// Tokens computed in this step (prefill and decode).
    pub batch_tokens: usize,
    /// Sequences scheduled for the first time in this step.
    pub started: Vec<SeqId>,
}

/// Counters since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineCounters {
    pub steps: u64,
    pub prefill_tokens: u64,
    /// Tokens whose KV was computed after the prompt (recomputes included).
    pub decode_tokens: u64,
    /// Tokens sampled and returned.
    pub generated_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub preemptions: u64,
}

struct Sequence {
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    sampler: Sampler,
    table: PageTable,
    arrival_ms: u64,
    cached_tokens: Option<usize>,
    client: String,
    props: Props,
}

/// A finished session's pages kept for its next turn.
struct Retained {
    table: PageTable,
    expires_ms: u64,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn info(&self) -> SeqInfo {
        SeqInfo {
            prompt_tokens: self.prompt_len,
            generated_tokens: self.generated(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
        }
    }
}

/// Per-sequence facts a caller may report (e.g. OpenAI `usage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqInfo {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
}

pub struct Engine {
    model: Arc<Model>,
    config: EngineConfig,
    pool: KvPool,
    policy: Box<dyn WorkerPolicy>,
    keep: Option<KeepSession>,
    retained: HashMap<String, Retained>,
    seqs: HashMap<SeqId, Sequence>,
    next_id: u64,
    counters: EngineCounters,
}

impl Engine {
    pub fn new(model: Arc<Model>, config: EngineConfig, policy: Box<dyn WorkerPolicy>) -> Self {
        let pool = KvPool::new(
            model.kv_layout(config.page_size),
            config.kv_pages,
            model.fingerprint,
        );
        Self {
            model,
            config,
            pool,
            policy,
            keep: None,
            retained: HashMap::new(),
            seqs: HashMap::new(),
            next_id: 0,
            counters: EngineCounters::default(),
        }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Swap the ordering policy at a step boundary; the new one may take over the
    /// old one's state (see `WorkerPolicy::restore`).
    pub fn set_policy(&mut self, mut policy: Box<dyn WorkerPolicy>) {
        policy.restore(self.policy.name(), &self.policy.summary());
        self.policy = policy;
    }

    /// Turn keep-session on or off; retained sessions stay until they expire.
    pub fn set_keep_session(&mut self, keep: Option<KeepSession>) {
        self.keep = keep;
    }

    pub fn policy_summary(&self) -> serde_json::Value {
        self.policy.summary()
    }

    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Tokens one sequence can hold at most: the pool's capacity and the model's context.
    pub fn max_sequence_tokens(&self) -> (usize, &'static str) {
        let pool = self.config.kv_pages * self.config.page_size;
        if pool < self.model.max_positions() {
            (pool, "KV pool capacity")
        } else {
            (self.model.max_positions(), "model context length")
        }
    }

    /// Admit a request. `max_tokens` is capped so the sequence fits on its own.
    pub fn add(&mut self, req: Request) -> Result<SeqId, AdmitError> {
        if req.prompt.is_empty() {
            return Err(AdmitError::EmptyPrompt);
        }
        let (limit, what) = self.max_sequence_tokens();
        if req.prompt.len() >= limit {
            return Err(AdmitError::TooLong {
                prompt: req.prompt.len(),
                limit,
                what,
            });
        }
        let mut stop_tokens = req.stop_tokens;
        if !req.ignore_eos {
            stop_tokens.extend_from_slice(self.model.tokenizer.stop_tokens());
        }
        let seq = Sequence {
            prompt_len: req.prompt.len(),
            max_tokens: req.max_tokens.min(limit - req.prompt.len()),
            tokens: req.prompt,
            stop_tokens,
            sampler: Sampler::new(req.sampling),
            table: PageTable::new(),
            arrival_ms: req.arrival_ms,
            cached_tokens: None,
            client: req.client,
            props: req.props,
        };
        Ok(self.insert(seq))
    }

    fn insert(&mut self, seq: Sequence) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, seq);
        id
    }

    /// A new sequence continuing `parent`'s tokens with its own sampling: full pages
    /// are shared, the partial last page copied.
    pub fn fork(
        &mut self,
        parent: SeqId,
        max_tokens: usize,
        sampling: SamplingParams,
        arrival_ms: u64,
    ) -> Result<SeqId> {
        let p = self
            .seqs
            .get(&parent)
            .ok_or_else(|| anyhow::anyhow!("no sequence {parent:?}"))?;
        let table = p.table.fork(&mut self.pool)?;
        let (limit, _) = self.max_sequence_tokens();
        let seq = Sequence {
            tokens: p.tokens.clone(),
            prompt_len: p.tokens.len(),
            max_tokens: max_tokens.min(limit.saturating_sub(p.tokens.len())),
            stop_tokens: p.stop_tokens.clone(),
            sampler: Sampler::new(sampling),
            table,
            arrival_ms,
            cached_tokens: Some(0),
            client: p.client.clone(),
            props: p.props.clone(),
        };
        Ok(self.insert(seq))
    }

    /// Stop a sequence and free its pages (full pages stay in the prefix cache).
    pub fn abort(&mut self, id: SeqId) -> bool {
        match self.seqs.remove(&id) {
            Some(mut seq) => {
                seq.table.release(&mut self.pool);
                true
            }
            None => false,
        }
    }

    /// Replace a sequence's props (a PATCH, or the inferlet changing its own).
    pub fn set_props(&mut self, id: SeqId, props: Props) -> bool {
        self.seqs.get_mut(&id).map(|s| s.props = props).is_some()
    }

    pub fn info(&self, id: SeqId) -> Option<SeqInfo> {
        self.seqs.get(&id).map(Sequence::info)
    }

    /// Run one engine step at time `now_ms`.
    pub fn step(&mut self, now_ms: u64) -> Result<StepOutput> {
        let mut out = StepOutput::default();
        self.expire_retained(now_ms);
        self.abort_expired(now_ms, &mut out);
        let plan = self.plan(now_ms, &mut out.started);
        if plan.is_empty() {
            self.finish_all(now_ms, &out);
            return Ok(out);
        }
        let inputs: Vec<SeqInput> = plan
            .iter()
            .map(|&(id, n)| {
                let s = &self.seqs[&id];
                let start = s.table.len();
                SeqInput {
                    tokens: &s.tokens[start..start + n],
                    start,
                    table: &s.table,
                    logits: start + n == s.tokens.len(),
                }
            })
            .collect();
        let mut logits = self.model.forward(&mut self.pool, &inputs)?.into_iter();
        drop(inputs);
        self.counters.steps += 1;
        for (id, n) in plan {
            out.batch_tokens += n;
            let seq = self.seqs.get_mut(&id).expect("planned sequence exists");
            let len = seq.table.len();
            let new_len = len + n;
            let prefill = seq.prompt_len.clamp(len, new_len) - len;
            self.counters.prefill_tokens += prefill as u64;
            self.counters.decode_tokens += (n - prefill) as u64;
            seq.table.commit(&mut self.pool, &seq.tokens, new_len);
            let mut generated = 0;
            if new_len == seq.tokens.len() {
                let token = seq
                    .sampler
                    .sample(&logits.next().expect("logits for every finished chunk"));
                let finish = if seq.stop_tokens.contains(&token) {
                    Some(FinishReason::Stop)
                } else {
                    seq.tokens.push(token);
                    out.tokens.push((id, token));
                    generated = 1;
                    (seq.generated() >= seq.max_tokens).then_some(FinishReason::Length)
                };
                if let Some(reason) = finish {
                    out.finished.push((id, reason, seq.info()));
                }
            }
            self.counters.generated_tokens += generated as u64;
            let candidate = self.candidate(id);
            self.policy.charge(&candidate, prefill, generated);
        }
        self.finish_all(now_ms, &out);
        Ok(out)
    }

    fn candidate(&self, seq: SeqId) -> Candidate {
        let s = &self.seqs[&seq];
        Candidate {
            seq,
            arrival_ms: s.arrival_ms,
            running: !s.table.pages().is_empty(),
            prefill_tokens: s.prompt_len.saturating_sub(s.table.len()),
            client: s.client.clone(),
            props: s.props.clone(),
        }
    }

    /// Stop the sequences the policy gives up on (e.g. deadline passed); their
    /// pages are released, not retained.
    fn abort_expired(&mut self, now_ms: u64, out: &mut StepOutput) {
        let expired: Vec<SeqId> = self
            .seqs
            .keys()
            .copied()
            .filter(|&id| self.policy.abort(now_ms, &self.candidate(id)))
            .collect();
        for id in expired {
            out.finished
                .push((id, FinishReason::Expired, self.seqs[&id].info()));
            // Gone before planning, so an expired sequence computes nothing more.
            self.abort(id);
        }
    }

    /// Remove finished sequences: their pages are retained for their session (per
    /// keep-session) or released to the prefix cache.
    fn finish_all(&mut self, now_ms: u64, out: &StepOutput) {
        for &(id, reason, _) in &out.finished {
            let Some(mut seq) = self.seqs.remove(&id) else {
                continue;
            };
            let retention = self
                .keep
                .as_ref()
                .filter(|_| reason != FinishReason::Expired)
                .and_then(|k| k.retention(&seq.props, now_ms));
            match retention {
                Some(r) => {
                    let table = std::mem::take(&mut seq.table);
                    if let Some(mut old) = self.retained.insert(
                        r.session,
                        Retained {
                            table,
                            expires_ms: r.expires_ms,
                        },
                    ) {
                        old.table.release(&mut self.pool);
                    }
                }
                None => seq.table.release(&mut self.pool),
            }
        }
    }

    /// Retention past its time falls back to the ordinary LRU cache.
    fn expire_retained(&mut self, now_ms: u64) {
        let expired: Vec<String> = self
            .retained
            .iter()
            .filter(|(_, r)| r.expires_ms <= now_ms)
            .map(|(s, _)| s.clone())
            .collect();
        for session in expired {
            self.drop_retained(&session);
        }
    }

    fn drop_retained(&mut self, session: &str) {
        if let Some(mut r) = self.retained.remove(session) {
            r.table.release(&mut self.pool);
        }
    }

    /// Sessions whose pages are retained: (session, pages, expiry ms).
    pub fn retained_sessions(&self) -> Vec<(String, usize, u64)> {
        let mut v: Vec<_> = self
            .retained
            .iter()
            .map(|(s, r)| (s.clone(), r.table.pages().len(), r.expires_ms))
            .collect();
        v.sort();
        v
    }

    /// Prompt tokens admitted but not yet prefilled.
    pub fn waiting_prefill_tokens(&self) -> usize {
        self.seqs
            .values()
            .map(|s| s.prompt_len.saturating_sub(s.table.len()))
            .sum()
    }

    /// Export the cached full pages of `tokens`' prefix (for offload to a peer).
    pub fn export_prefix(&self, tokens: &[u32]) -> Vec<Vec<u8>> {
        let hashes = block_hashes(self.pool.fingerprint(), tokens, self.config.page_size);
        self.pool
            .longest_prefix(&hashes)
            .into_iter()
            .filter_map(|page| pie_kv::transfer::export_page(&self.pool, page).ok())
            .collect()
    }

    /// Import pages exported by a peer; returns how many were accepted.
    pub fn import_pages(&mut self, pages: &[Vec<u8>]) -> usize {
        pages
            .iter()
            .filter(|bytes| pie_kv::transfer::import_page(&mut self.pool, bytes).is_ok())
            .count()
    }

    /// Pick this step's (sequence, token count) pairs and reserve their pages.
    fn plan(&mut self, now_ms: u64, started: &mut Vec<SeqId>) -> Vec<(SeqId, usize)> {
        let mut candidates: Vec<Candidate> =
            self.seqs.keys().map(|&id| self.candidate(id)).collect();
        self.policy.order(now_ms, &mut candidates);
        let order: Vec<SeqId> = candidates.iter().map(|c| c.seq).collect();
        let mut running = candidates.iter().filter(|c| c.running).count();
        let mut budget = self.config.max_batch_tokens;
        let mut plan = Vec::new();
        for (rank, &id) in order.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let was_running = !self.seqs[&id].table.pages().is_empty();
            let mut hit = 0;
            if !was_running {
                if running >= self.config.max_running {
                    if !(self.policy.preempts_for_slots() && self.preempt_last(&order[rank + 1..]))
                    {
                        continue;
                    }
                    running -= 1;
                }
                hit = self.attach_prefix(id);
            }
            match self.reserve(id, budget, &order[rank + 1..]) {
                Some(n) => {
                    if !was_running {
                        running += 1;
                        self.note_first_admission(id, hit, started);
                    }
                    budget -= n;
                    plan.push((id, n));
                }
                None if !was_running => self
                    .seqs
                    .get_mut(&id)
                    .expect("exists")
                    .table
                    .release(&mut self.pool),
                None => {}
            }
        }
        plan
    }

    /// Share the longest cached prefix of a new (or preempted) sequence's tokens,
    /// always leaving at least one token to compute. Returns the tokens covered.
    fn attach_prefix(&mut self, id: SeqId) -> usize {
        let page_size = self.config.page_size;
        let seq = self.seqs.get_mut(&id).expect("exists");
        let hashes = block_hashes(
            self.pool.fingerprint(),
            &seq.tokens[..seq.tokens.len() - 1],
            page_size,
        );
        seq.table.attach_prefix(&mut self.pool, &hashes)
    }

    /// Record the prefix-cache hit of a sequence's first scheduling (not of
    /// recomputes after preemption).
    fn note_first_admission(&mut self, id: SeqId, hit: usize, started: &mut Vec<SeqId>) {
        let seq = self.seqs.get_mut(&id).expect("exists");
        if seq.cached_tokens.is_none() {
            seq.cached_tokens = Some(hit.min(seq.prompt_len));
            self.counters.prefix_hit_tokens += hit as u64;
            started.push(id);
        }
    }

    /// Preempt the running sequence ordered last among `later`; false if none runs.
    fn preempt_last(&mut self, later: &[SeqId]) -> bool {
        let Some(&victim) = later
            .iter()
            .rev()
            .find(|v| !self.seqs[v].table.pages().is_empty())
        else {
            return false;
        };
        self.seqs
            .get_mut(&victim)
            .expect("exists")
            .table
            .release(&mut self.pool);
        self.counters.preemptions += 1;
        true
    }

    /// Reserve pages for up to `budget` of the sequence's next tokens. When the pool
    /// is short, retained sessions go first (soonest expiry first), then running
    /// sequences from the back of `later` are preempted. Returns how many tokens it
    /// may compute, or None if not even one fits.
    fn reserve(&mut self, id: SeqId, budget: usize, later: &[SeqId]) -> Option<usize> {
        let page_size = self.config.page_size;
        let mut victims = later.to_vec();
        loop {
            let seq = &self.seqs[&id];
            let len = seq.table.len();
            let want = (seq.tokens.len() - len).min(budget);
            // Tokens that fit in the pages it has plus every page the pool can give.
            let room = (seq.table.pages().len() + self.pool.available()) * page_size - len;
            let soonest = self
                .retained
                .iter()
                .min_by_key(|(_, r)| r.expires_ms)
                .map(|(s, _)| s.clone());
            if room < want {
                if let Some(session) = soonest {
                    self.drop_retained(&session);
                    continue;
                }
                if self.preempt_last(&victims) {
                    victims.retain(|v| !self.seqs[v].table.pages().is_empty());
                    continue;
                }
            }
            let n = want.min(room);
            if n == 0 {
                return None;
            }
            let seq = self.seqs.get_mut(&id).expect("exists");
            seq.table
                .reserve(&mut self.pool, len + n)
                .expect("room was checked");
            return Some(n);
        }
    }
}
