//! The continuous-batching engine: one worker's sequences over one page pool.
//!
//! Each [`Engine::step`]: `pie_policy::Scheduler` (the same code `pie-sim`
//! runs) plans the step over the real pages (`kv.rs`): the policy's order, the
//! token and page budgets, chunked prefill, prefix attach, eviction and
//! preemption; one batched forward runs; the sequences that reached the end of
//! their tokens sample the next one; the policy is charged; finished sequences'
//! pages are retained for their session or released.
//!
//! Admission caps `max_tokens` so a sequence always fits the pool on its own,
//! and the sequence ordered first can always preempt the others, so every
//! admitted sequence finishes.

mod constrained;
mod kv;
mod request;
mod score;
mod state;
mod transfer;

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Result;
use pie_core::{Props, SeqId};
use pie_kv::{KvPool, PageTable, PoolStats};
use pie_model::{check_token_ids, Model, Sampler, SamplingParams, SeqInput, TokenLogprobs};
use pie_policy::{
    keep_session::session_of, scheduler::prefill_share, Candidate, KeepSession, Planned, Scheduler,
    StepLimits, WorkerPolicy,
};
use pie_workload::StepShape;

use kv::{EngineKv, Sequence};
pub use kv::{SeqInfo, Spill};
pub use request::Request;
pub use score::{Score, Scored};
pub use state::{Engine, EngineConfig, EngineCounters};

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
    #[error("the tokens to resume from break the output's constraint: {0}")]
    Constraint(String),
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
    /// What the step's forward computed: tokens (prefill and decode),
    /// context, attention pairs, sequences (the simulator's cost terms).
    pub shape: StepShape,
    /// Sequences scheduled for the first time in this step, with the prompt
    /// tokens they found cached (known here even for one that also finishes
    /// in this step and is gone by the time anyone could ask).
    pub started: Vec<(SeqId, usize)>,
    /// Sequences stopped by an error of their own, with it (their pages are
    /// released); the rest of the batch ran.
    pub failed: Vec<(SeqId, String)>,
    /// Preempted sequences held back in this step for their pages from disk
    /// (`Request::reload_after_preemption`) until [`Engine::reloaded`].
    pub to_reload: Vec<SeqId>,
    /// For sequences that asked ([`Request::logprobs`]): each sample's
    /// log-probabilities, a stop token's included, before its token.
    pub logprobs: Vec<(SeqId, TokenLogprobs)>,
    /// For passes ([`Request::score`]): the distributions after their
    /// positions computed this step (again after a preemption).
    pub scored: Vec<(SeqId, Scored)>,
    /// Sequences that finished in this step whose owner holds their pages
    /// (an inferlet's context, likely back with its next call at once),
    /// with the session they are retained under.
    pub held: Vec<(SeqId, String)>,
    /// How long each constrained sequence's mask took this step.
    pub mask_times: Vec<std::time::Duration>,
}

impl Engine {
    pub fn new(model: Arc<Model>, config: EngineConfig, policy: Box<dyn WorkerPolicy>) -> Self {
        let pool = KvPool::with_dtype(
            model.kv_layout(config.page_size),
            config.kv_dtype,
            config.kv_pages,
            model.fingerprint,
        );
        let limits = StepLimits {
            max_batch_tokens: config.max_batch_tokens,
            max_running: config.max_running,
        };
        Self {
            kv: EngineKv {
                pool,
                page_size: config.page_size,
                seqs: HashMap::new(),
                retained: HashMap::new(),
                prefix_hit_tokens: 0,
                started: Vec::new(),
                reloading: Default::default(),
                to_reload: Vec::new(),
                spill: false,
                spilled: Vec::new(),
            },
            scheduler: Scheduler::new(policy, limits),
            model,
            config,
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
        &self.kv.pool
    }

    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.kv.pool
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.kv.pool.stats()
    }

    pub fn counters(&self) -> EngineCounters {
        EngineCounters {
            prefix_hit_tokens: self.kv.prefix_hit_tokens,
            preemptions: self.scheduler.preemptions(),
            ..self.counters
        }
    }

    pub fn policy_name(&self) -> &'static str {
        self.scheduler.policy().name()
    }

    /// Swap the ordering policy at a step boundary; the new one may take over the
    /// old one's state (see `WorkerPolicy::restore`).
    pub fn set_policy(&mut self, policy: Box<dyn WorkerPolicy>) {
        self.scheduler.set_policy(policy);
    }

    /// Turn keep-session on or off; retained sessions stay until they expire.
    pub fn set_keep_session(&mut self, keep: Option<KeepSession>) {
        self.scheduler.set_keep_session(keep);
    }

    /// Spill retained sessions evicted before their expiry (`retain-all`)
    /// instead of dropping them.
    pub fn set_spill(&mut self, on: bool) {
        self.kv.spill = on;
    }

    /// The sessions spilled since the last take.
    pub fn take_spills(&mut self) -> Vec<Spill> {
        std::mem::take(&mut self.kv.spilled)
    }

    pub fn policy_clients(&self) -> usize {
        self.scheduler.policy().tracked_clients()
    }

    pub fn policy_summary(&self) -> serde_json::Value {
        self.scheduler.policy().summary()
    }

    /// Some sequence may run: not every one waits for pages from disk (the
    /// engine thread then sleeps until `Engine::reloaded` or a new command).
    pub fn has_work(&self) -> bool {
        self.scheduler.len() > self.kv.reloading.len()
    }

    pub fn len(&self) -> usize {
        self.scheduler.len()
    }

    pub fn is_empty(&self) -> bool {
        self.scheduler.is_empty()
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
        let chain_root = self
            .kv
            .pool
            .fingerprint()
            .salted_root(req.cache_salt.as_deref());
        let mut stop_tokens = req.stop_tokens;
        if !req.ignore_eos {
            stop_tokens.extend_from_slice(self.model.tokenizer.stop_tokens());
        }
        let (prompt, sampled) = req
            .prompt
            .split_at(req.prompt.len().saturating_sub(req.sampled_before));
        let sampler = Sampler::resumed(req.sampling, prompt, sampled);
        let constraint = match &req.grammar {
            Some(grammar) => {
                let mut constraint = grammar.start();
                constraint
                    .advance(sampled)
                    .map_err(AdmitError::Constraint)?;
                Some(Box::new(constraint))
            }
            None => None,
        };
        let seq = Sequence {
            prompt_len: req.prompt.len(),
            max_tokens: req.max_tokens.min(limit - req.prompt.len()),
            tokens: req.prompt,
            stop_tokens,
            min_tokens: req.min_tokens,
            sampler,
            table: PageTable::with_root(chain_root),
            chain_root,
            cached_tokens: None,
            reload_after_preemption: req.reload_after_preemption,
            reload_pending: false,
            logprobs: req.logprobs,
            constraint,
            resume_from: match session_of(&req.client, &req.props) {
                Some(session) if req.resume_from.is_empty() => vec![session],
                _ => req.resume_from,
            },
            score: req.score,
        };
        let id = self.insert(seq, req.arrival_ms, req.client, req.props);
        if let Some(ms) = req.hold_ms {
            self.scheduler.hold(id, ms);
        }
        Ok(id)
    }

    fn insert(&mut self, seq: Sequence, arrival_ms: u64, client: String, props: Props) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.kv.seqs.insert(id, seq);
        let candidate = Candidate {
            seq: id,
            arrival_ms,
            running: false,
            prefill_tokens: 0,
            client,
            props,
        };
        self.scheduler.add(&self.kv, candidate);
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
        let (Some(p), Some(owner)) = (self.kv.seqs.get(&parent), self.scheduler.candidate(parent))
        else {
            anyhow::bail!("no sequence {parent:?}");
        };
        let (client, props) = (owner.client.clone(), owner.props.clone());
        let table = p.table.fork(&mut self.kv.pool)?;
        let (limit, _) = self.max_sequence_tokens();
        let seq = Sequence {
            tokens: p.tokens.clone(),
            prompt_len: p.tokens.len(),
            max_tokens: max_tokens.min(limit.saturating_sub(p.tokens.len())),
            stop_tokens: p.stop_tokens.clone(),
            min_tokens: 0,
            sampler: Sampler::new(sampling, &p.tokens),
            table,
            chain_root: p.chain_root,
            cached_tokens: Some(0),
            reload_after_preemption: false,
            reload_pending: false,
            logprobs: p.logprobs,
            constraint: None,
            resume_from: Vec::new(),
            score: None,
        };
        Ok(self.insert(seq, arrival_ms, client, props))
    }

    /// Stop a sequence and free its pages (full pages stay in the prefix cache).
    pub fn abort(&mut self, id: SeqId) -> bool {
        let Some(index) = self.scheduler.position(id) else {
            return false;
        };
        self.scheduler.finish(&mut self.kv, &[index], false);
        self.kv.seqs.remove(&id);
        self.kv.reloading.remove(&id);
        true
    }

    /// Free the pages retained for `session` now (its owner is gone).
    pub fn release_session(&mut self, session: &str) {
        self.scheduler.release_session(&mut self.kv, session);
    }

    /// Keep only the first `len` tokens of the pages retained for
    /// `session` (its context was truncated): the pages past them go.
    pub fn truncate_session(&mut self, session: &str, len: usize) {
        if let Some(retained) = self.kv.retained.get_mut(session) {
            retained.table.truncate(&mut self.kv.pool, len);
            retained.tokens.truncate(len);
        }
    }

    /// The runtime loaded what it could of a preempted sequence's pages from
    /// disk (or gave up): it may be admitted again.
    pub fn reloaded(&mut self, id: SeqId) {
        self.kv.reloading.remove(&id);
    }

    /// Let a sequence generate one more token, then finish (`Length`): a
    /// hand-off stops it between steps, with its KV up to date and no step
    /// wasted.
    pub fn stop_after_next(&mut self, id: SeqId) -> bool {
        let Some(seq) = self.kv.seqs.get_mut(&id) else {
            return false;
        };
        seq.max_tokens = seq.max_tokens.min(seq.generated() + 1);
        true
    }

    /// Replace a sequence's props (a PATCH, or the inferlet changing its own).
    pub fn set_props(&mut self, id: SeqId, props: Props) -> bool {
        self.scheduler.set_props(id, props)
    }

    pub fn info(&self, id: SeqId) -> Option<SeqInfo> {
        self.kv.seqs.get(&id).map(Sequence::info)
    }

    /// Run one engine step at time `now_ms`.
    pub fn step(&mut self, now_ms: u64) -> Result<StepOutput> {
        let mut out = StepOutput::default();
        self.scheduler.expire_retained(&mut self.kv, now_ms);
        self.abort_expired(now_ms, &mut out);
        let mut plan = Vec::new();
        self.scheduler.plan(&mut self.kv, now_ms, &mut plan);
        out.started = std::mem::take(&mut self.kv.started);
        out.to_reload = std::mem::take(&mut self.kv.to_reload);
        let mut rejected = self.reject_invalid(&mut plan);
        if plan.is_empty() {
            self.fail(rejected, &mut out);
            return Ok(out);
        }
        let taken = self.take_constraints(&plan);
        let (logits, masked) = constrained::overlapped(taken, || self.forward(&plan));
        let mut logits = logits?.into_iter();
        let mut mask_failed = self.return_constraints(masked, &mut out);
        self.counters.steps += 1;
        let mut done = Vec::new();
        for p in plan {
            let seq = self
                .kv
                .seqs
                .get_mut(&p.seq)
                .expect("planned sequence exists");
            let len = seq.table.len();
            out.shape.add(len, p.tokens);
            let new_len = len + p.tokens;
            let prefill = prefill_share(seq.prompt_len, len, p.tokens);
            self.counters.prefill_tokens += prefill as u64;
            self.counters.decode_tokens += (p.tokens - prefill) as u64;
            seq.table.commit(&mut self.kv.pool, &seq.tokens, new_len);
            let wanted = seq.logit_rows(len, p.tokens);
            let mut rows: Vec<Vec<f32>> = (&mut logits).take(wanted).collect();
            report_scored(seq, p.seq, new_len, &rows, &mut out);
            let mut generated = 0;
            if new_len == seq.tokens.len() {
                let row = rows.pop().expect("logits for every finished chunk");
                let sampled = match mask_failed.remove(&p.seq) {
                    Some(e) => Err(e),
                    None => sample_next(seq, p.seq, &row, &mut out),
                };
                match sampled {
                    Ok((n, finish)) => {
                        generated = n;
                        if let Some(reason) = finish {
                            out.finished.push((p.seq, reason, seq.info()));
                            done.push(p.index);
                        }
                    }
                    Err(e) => rejected.push((p.seq, e)),
                }
            }
            self.counters.generated_tokens += generated as u64;
            self.scheduler.charge(&self.kv, p.index, prefill, generated);
        }
        out.held = (done.iter())
            .map(|&i| &self.scheduler.candidates()[i])
            .filter(|c| self.scheduler.is_held(c.seq))
            .filter_map(|c| Some((c.seq, session_of(&c.client, &c.props)?)))
            .collect();
        for id in self.scheduler.finish(&mut self.kv, &done, true) {
            self.kv.seqs.remove(&id);
        }
        self.fail(rejected, &mut out);
        Ok(out)
    }

    /// The constraints of the planned sequences that sample this step,
    /// taken out for their masks.
    fn take_constraints(&mut self, plan: &[Planned]) -> constrained::Taken {
        let mut taken = Vec::new();
        for p in plan {
            let Some(s) = self.kv.seqs.get_mut(&p.seq) else {
                continue;
            };
            if s.table.len() + p.tokens == s.tokens.len() {
                if let Some(c) = s.constraint.take() {
                    taken.push((p.seq, c));
                }
            }
        }
        taken
    }

    /// Put the masked constraints back; the sequences whose constraint failed.
    fn return_constraints(
        &mut self,
        masked: constrained::Masked,
        out: &mut StepOutput,
    ) -> HashMap<SeqId, String> {
        out.mask_times = masked.times;
        for (id, c) in masked.ready {
            if let Some(seq) = self.kv.seqs.get_mut(&id) {
                seq.constraint = Some(c);
            }
        }
        masked.failed
    }

    /// Take out of `plan` the chunks that would fail the whole batched forward
    /// because of their own sequence (a token outside the vocabulary, a
    /// position past the context), so that only those sequences fail.
    fn reject_invalid(&self, plan: &mut Vec<Planned>) -> Vec<(SeqId, String)> {
        let mut rejected = Vec::new();
        plan.retain(|p| match self.chunk_error(p) {
            Some(error) => {
                rejected.push((p.seq, error));
                false
            }
            None => true,
        });
        rejected
    }

    fn chunk_error(&self, p: &Planned) -> Option<String> {
        let s = &self.kv.seqs[&p.seq];
        let end = s.table.len() + p.tokens;
        if end > self.model.max_positions() {
            return Some(format!(
                "sequence of {end} tokens exceeds the model's context length {}",
                self.model.max_positions()
            ));
        }
        check_token_ids(&s.tokens[s.table.len()..end], self.model.config.vocab)
            .err()
            .map(|e| e.to_string())
    }

    /// Stop the `rejected` sequences (pages released, not retained) and report them.
    fn fail(&mut self, rejected: Vec<(SeqId, String)>, out: &mut StepOutput) {
        // Looked up now: finishing the step's other sequences moved indices.
        let indices: Vec<usize> = rejected
            .iter()
            .filter_map(|(id, _)| self.scheduler.position(*id))
            .collect();
        for id in self.scheduler.finish(&mut self.kv, &indices, false) {
            self.kv.seqs.remove(&id);
        }
        out.failed.extend(rejected);
    }

    /// One batched forward over the planned chunks; the logits of each
    /// chunk's rows that sample or report ([`Sequence::logit_rows`]), in
    /// plan order.
    fn forward(&mut self, plan: &[Planned]) -> Result<Vec<Vec<f32>>> {
        let inputs: Vec<SeqInput> = plan
            .iter()
            .map(|p| {
                let s = &self.kv.seqs[&p.seq];
                let start = s.table.len();
                SeqInput {
                    tokens: &s.tokens[start..start + p.tokens],
                    start,
                    table: &s.table,
                    logit_rows: s.logit_rows(start, p.tokens),
                }
            })
            .collect();
        self.model.forward(&mut self.kv.pool, &inputs)
    }

    /// Stop the sequences the policy gives up on (e.g. deadline passed) before
    /// planning, so they compute nothing more; their pages are released, not
    /// retained.
    fn abort_expired(&mut self, now_ms: u64, out: &mut StepOutput) {
        let expired = self.scheduler.expired(now_ms);
        for id in self.scheduler.finish(&mut self.kv, &expired, false) {
            if let Some(seq) = self.kv.seqs.remove(&id) {
                out.finished.push((id, FinishReason::Expired, seq.info()));
            }
        }
    }

    /// Sessions whose pages are retained: (session, pages, expiry ms).
    pub fn retained_sessions(&self) -> Vec<(String, usize, u64)> {
        self.scheduler
            .retained_sessions()
            .into_iter()
            .map(|(session, expires_ms)| {
                let pages = self
                    .kv
                    .retained
                    .get(&session)
                    .map_or(0, |r| r.table.pages().len());
                (session, pages, expires_ms)
            })
            .collect()
    }

    /// Prompt tokens admitted but not yet prefilled.
    pub fn waiting_prefill_tokens(&self) -> usize {
        self.kv
            .seqs
            .values()
            .map(|s| s.prompt_len.saturating_sub(s.table.len()))
            .sum()
    }
}

/// What a pass asked of the `rows` that end at `end` (see [`Score`]).
fn report_scored(seq: &Sequence, id: SeqId, end: usize, rows: &[Vec<f32>], out: &mut StepOutput) {
    let Some(score) = &seq.score else {
        return;
    };
    let first = end - rows.len();
    for (i, row) in rows.iter().enumerate() {
        if let Some(scored) = score.report(first + i, row) {
            out.scored.push((id, scored));
        }
    }
}

/// Sample `seq`'s next token from `row` (under its constraint's mask):
/// the tokens it generated (0 for a stop token) and why it finishes, or why
/// it fails.
fn sample_next(
    seq: &mut Sequence,
    id: SeqId,
    row: &[f32],
    out: &mut StepOutput,
) -> std::result::Result<(usize, Option<FinishReason>), String> {
    let too_early = seq.generated() < seq.min_tokens && !seq.stop_tokens.is_empty();
    let token = match (&seq.constraint, too_early) {
        (None, false) => seq.sampler.sample(row),
        (constraint, _) => {
            let mut masked = row.to_vec();
            if let Some(c) = constraint {
                c.apply(&mut masked);
            }
            if too_early {
                for &t in &seq.stop_tokens {
                    if let Some(logit) = masked.get_mut(t as usize) {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
            seq.sampler.sample(&masked)
        }
    };
    if let Some(top) = seq.logprobs {
        out.logprobs
            .push((id, pie_model::logprobs(row, token, top)));
    }
    if seq.stop_tokens.contains(&token) {
        return Ok((0, Some(FinishReason::Stop)));
    }
    let complete = match &mut seq.constraint {
        Some(c) => {
            c.advance(&[token])
                .map_err(|e| format!("constrained generation: {e}"))?;
            c.is_stopped()
        }
        None => false,
    };
    seq.tokens.push(token);
    out.tokens.push((id, token));
    let finish = match complete {
        true => Some(FinishReason::Stop),
        false => (seq.generated() >= seq.max_tokens).then_some(FinishReason::Length),
    };
    Ok((1, finish))
}
