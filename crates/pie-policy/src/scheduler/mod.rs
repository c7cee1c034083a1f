//! The one scheduler of a worker's steps: `pie-worker`'s engine and `pie-sim` both
//! plan through it, over their own [`KvAccounting`] (real pages or the page
//! model), so the simulator schedules as the engine does by construction.
//!
//! Each step ([`Scheduler::plan`]): the worker policy orders every sequence; in
//! that order each gets a prefill chunk or one decode token while the token
//! budget (`max_batch_tokens`) lasts. A sequence not yet running needs a slot
//! under `max_running` (or, if the policy preempts for slots, takes the slot of
//! the last running one) and first shares the longest cached prefix of its
//! tokens. When pages run out, unreferenced cached pages go (LRU, inside the KV
//! accounting), then retained sessions (soonest expiry first; evicted before
//! their expiry, which the accounting may spill: `retain-all`), then the running
//! sequence ordered last is preempted: its pages are released and it is
//! recomputed later. With keep-session's `admission_wait_ms`, a sequence not
//! yet running does neither while another runs, for up to that long after
//! it arrived: it waits. A sequence whose next uncached page another sequence is
//! computing waits until that page is cached (no prefix computed twice).
//! Progress needs an order that does not flip between two sequences from step
//! to step, or each would preempt the other forever (fair orders running
//! sequences first for this reason). The policy is charged the service each
//! sequence received
//! ([`Scheduler::charge`]); a finished sequence's pages are retained for its
//! session (keep-session) or released ([`Scheduler::finish_at`]).
//!
//! Invariants: the sequence ordered first can always preempt the others, so
//! every admitted sequence that fits the pool on its own finishes; a step's
//! tokens never exceed `max_batch_tokens` nor its running sequences
//! `max_running`; retained pages go before any running sequence is preempted.
//! Tested over a toy page pool (`tests.rs`: limits, page conservation, every
//! sequence finishes under each policy) and against the real engine
//! (`pie-worker/tests/sim_equivalence.rs`).

mod kv;
mod retention;
#[cfg(test)]
mod tests;

pub use kv::KvAccounting;

use pie_core::{Props, SeqId};

use std::collections::HashMap;

use crate::keep_session::{session_of, Retention};
use crate::{Candidate, KeepSession, WorkerPolicy};
use retention::Retained;

/// A worker's per-step limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLimits {
    /// Tokens computed in one step (prefill chunks plus decode tokens).
    pub max_batch_tokens: usize,
    /// Sequences holding pages at once.
    pub max_running: usize,
}

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// Its place among the scheduler's candidates, valid until one is removed.
    pub index: usize,
    pub seq: SeqId,
    /// Tokens to compute (a prefill chunk, or 1 while decoding).
    pub tokens: usize,
}

/// Prompt tokens among the `tokens` computed from `computed` on, of a sequence
/// whose prompt is `prompt_len` long: the prefill share of a step's service.
pub fn prefill_share(prompt_len: usize, computed: usize, tokens: usize) -> usize {
    prompt_len.clamp(computed, computed + tokens) - computed
}

pub struct Scheduler {
    policy: Box<dyn WorkerPolicy>,
    keep: Option<KeepSession>,
    limits: StepLimits,
    /// Every sequence on the worker, in the policy's last order (then arrivals).
    cands: Vec<Candidate>,
    retained: Retained,
    /// Sequences whose owner holds their pages after they finish, for this
    /// long, whether or not keep-session is on ([`Scheduler::hold`]).
    held: HashMap<SeqId, u64>,
    /// The time of the last plan: a step's effects (retention expiry) take it.
    plan_ms: u64,
    preemptions: u64,
}

impl Scheduler {
    pub fn new(mut policy: Box<dyn WorkerPolicy>, limits: StepLimits) -> Self {
        policy.set_max_running(limits.max_running);
        Self {
            policy,
            keep: None,
            limits,
            cands: Vec::new(),
            retained: Retained::default(),
            held: HashMap::new(),
            plan_ms: 0,
            preemptions: 0,
        }
    }

    pub fn policy(&self) -> &dyn WorkerPolicy {
        self.policy.as_ref()
    }

    /// Swap the ordering policy at a step boundary; the new one may take over the
    /// old one's state (see `WorkerPolicy::restore`).
    pub fn set_policy(&mut self, mut policy: Box<dyn WorkerPolicy>) {
        policy.restore(self.policy.name(), &self.policy.summary());
        policy.set_max_running(self.limits.max_running);
        self.policy = policy;
    }

    /// Turn keep-session on or off; retained sessions stay until they expire.
    pub fn set_keep_session(&mut self, keep: Option<KeepSession>) {
        self.keep = keep;
    }

    /// When `seq` finishes, its pages are retained for its session for
    /// `keep_ms` (replacing what keep-session would do): an inferlet's
    /// context holds its pages between its calls, evictable as any
    /// retention (soonest expiry first, before a running sequence).
    pub fn hold(&mut self, seq: SeqId, keep_ms: u64) {
        self.held.insert(seq, keep_ms);
    }

    /// Whether `seq`'s owner holds its pages ([`Scheduler::hold`]).
    pub fn is_held(&self, seq: SeqId) -> bool {
        self.held.contains_key(&seq)
    }

    pub fn len(&self) -> usize {
        self.cands.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cands.is_empty()
    }

    pub fn candidates(&self) -> &[Candidate] {
        &self.cands
    }

    pub fn candidate(&self, seq: SeqId) -> Option<&Candidate> {
        self.cands.iter().find(|c| c.seq == seq)
    }

    /// Running sequences preempted since start.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Sessions with retained pages and when their retention expires (ms).
    pub fn retained_sessions(&self) -> Vec<(String, u64)> {
        self.retained.sessions()
    }

    /// A new sequence (its `running` and `prefill_tokens` are read from `kv`).
    pub fn add(&mut self, kv: &impl KvAccounting, mut cand: Candidate) {
        refresh(kv, &mut cand);
        self.cands.push(cand);
    }

    /// Replace a sequence's props (a PATCH, or the inferlet changing its own).
    pub fn set_props(&mut self, seq: SeqId, props: Props) -> bool {
        match self.cands.iter_mut().find(|c| c.seq == seq) {
            Some(c) => {
                c.props = props;
                true
            }
            None => false,
        }
    }

    /// End `session`'s retention now: its pages fall back to the LRU cache.
    pub fn release_session(&mut self, kv: &mut impl KvAccounting, session: &str) {
        if self.retained.remove(session) {
            kv.drop_retained(session);
        }
    }

    /// Drop retention that expired by `now_ms` (its pages fall back to the LRU
    /// cache). Call before [`Self::expired`] and [`Self::plan`].
    pub fn expire_retained(&mut self, kv: &mut impl KvAccounting, now_ms: u64) {
        while let Some((session, _)) = self.retained.pop_soonest(now_ms) {
            kv.drop_retained(&session);
        }
    }

    /// Indices (ascending) of the sequences the policy stops at `now_ms`, e.g.
    /// past their deadline: finish them in this order, not to be retained.
    pub fn expired(&self, now_ms: u64) -> Vec<usize> {
        (0..self.cands.len())
            .filter(|&i| self.policy.abort(now_ms, &self.cands[i]))
            .collect()
    }

    /// Fill `plan` with this step's sequences and reserve their pages, at
    /// `now_ms`. Their indices stay valid until a candidate is removed.
    pub fn plan(&mut self, kv: &mut impl KvAccounting, now_ms: u64, plan: &mut Vec<Planned>) {
        plan.clear();
        self.plan_ms = now_ms;
        self.policy.order(now_ms, &mut self.cands);
        kv.will_visit(&self.cands);
        let mut running = self.cands.iter().filter(|c| c.running).count();
        let mut budget = self.limits.max_batch_tokens;
        let preempts = self.policy.preempts_for_slots();
        let admission_wait_ms = self.keep.as_ref().map_or(0, KeepSession::admission_wait_ms);
        for rank in 0..self.cands.len() {
            if budget == 0 {
                break;
            }
            let seq = self.cands[rank].seq;
            let was_running = kv.holds_pages(seq);
            let mut hit = 0;
            if !was_running {
                let slots_full = running >= self.limits.max_running;
                // Checked before the prefix (which hashes the prompt): a
                // queue longer than the slots is visited every step.
                if slots_full && !preempts {
                    continue;
                }
                // Computing a shared prefix twice in one step (requests of
                // one system prompt arriving together) costs the prefill and
                // the pages of a copy; a step later it is a cache hit.
                // Checked before a preemption, which it would waste.
                if kv.prefix_in_flight(seq) || kv.hold_for_pages(seq) {
                    continue;
                }
                if slots_full {
                    if !self.preempt_last(kv, rank + 1) {
                        continue;
                    }
                    running -= 1;
                }
                hit = kv.attach_prefix(seq);
            }
            let waited = now_ms.saturating_sub(self.cands[rank].arrival_ms);
            let waits = !was_running && running > 0 && waited < admission_wait_ms;
            match self.reserve(kv, rank, budget, waits) {
                Some(tokens) => {
                    if !was_running {
                        running += 1;
                        kv.admitted(seq, hit);
                    }
                    budget -= tokens;
                    plan.push(Planned {
                        index: rank,
                        seq,
                        tokens,
                    });
                }
                None if !was_running => kv.release(seq),
                None => {}
            }
            refresh(kv, &mut self.cands[rank]);
        }
    }

    /// Charge the policy for a planned sequence's service, once its step's
    /// tokens are committed in `kv`.
    pub fn charge(
        &mut self,
        kv: &impl KvAccounting,
        index: usize,
        prefill_tokens: usize,
        generated_tokens: usize,
    ) {
        let cand = &mut self.cands[index];
        refresh(kv, cand);
        self.policy.charge(cand, prefill_tokens, generated_tokens);
    }

    /// Where a sequence stands among the candidates.
    pub fn position(&self, seq: SeqId) -> Option<usize> {
        self.cands.iter().position(|c| c.seq == seq)
    }

    /// Remove the candidates at `indices` (distinct), their pages settled in
    /// that order (it decides the LRU order of what they free): if
    /// `may_retain` (they finished, rather than being aborted or expiring),
    /// retained for their session (keep-session, from the time of the last
    /// plan), replacing the session's earlier retention (a turn that keeps
    /// nothing ends it: its pages are this turn's past); else, or without a
    /// session, released. Returns their ids, in the same order.
    pub fn finish(
        &mut self,
        kv: &mut impl KvAccounting,
        indices: &[usize],
        may_retain: bool,
    ) -> Vec<SeqId> {
        let seqs: Vec<SeqId> = indices.iter().map(|&i| self.cands[i].seq).collect();
        for &i in indices {
            match self.retention(i, may_retain, kv) {
                Some(r) => {
                    kv.retain(self.cands[i].seq, &r.session);
                    self.retained.insert(r.session, r.expires_ms);
                }
                None => kv.release(self.cands[i].seq),
            }
        }
        let mut descending = indices.to_vec();
        descending.sort_unstable_by(|a, b| b.cmp(a));
        for i in descending {
            self.cands.swap_remove(i);
        }
        seqs
    }

    /// Whether the candidate at `i`, finishing, keeps its pages: held by its
    /// owner, or by keep-session; either way its session's earlier
    /// retention ends (a turn that keeps nothing ends it).
    fn retention(
        &mut self,
        i: usize,
        may_retain: bool,
        kv: &mut impl KvAccounting,
    ) -> Option<Retention> {
        let (seq, client, props) = (
            self.cands[i].seq,
            &self.cands[i].client,
            &self.cands[i].props,
        );
        let held = self.held.remove(&seq).filter(|_| may_retain);
        let keep = self.keep.as_ref().filter(|_| may_retain);
        let session = session_of(client, props).filter(|_| held.is_some() || keep.is_some())?;
        if self.retained.remove(&session) {
            kv.drop_retained(&session);
        }
        match held {
            Some(ms) => Some(Retention {
                session,
                expires_ms: self.plan_ms.saturating_add(ms),
            }),
            None => keep.and_then(|k| k.retention(client, props, self.plan_ms)),
        }
    }

    /// Reserve pages for up to `budget` of the next tokens of the candidate at
    /// `rank`; when short, drop retained sessions, then preempt sequences
    /// ordered after it, or, if it `waits` (keep-session's
    /// `admission_wait_ms`), neither. Returns the tokens it may compute, or None if they do not fit.
    fn reserve(
        &mut self,
        kv: &mut impl KvAccounting,
        rank: usize,
        budget: usize,
        waits: bool,
    ) -> Option<usize> {
        let seq = self.cands[rank].seq;
        loop {
            let want = kv.uncomputed(seq).min(budget);
            let room = kv.room(seq);
            if room < want && waits {
                return None;
            }
            if room < want && (self.evict_soonest_retained(kv) || self.preempt_last(kv, rank + 1)) {
                continue;
            }
            let tokens = want.min(room);
            if tokens == 0 {
                return None;
            }
            kv.reserve(seq, tokens);
            return Some(tokens);
        }
    }

    /// Evict the retained session that expires soonest (before its expiry:
    /// the accounting may spill it); false when none is retained. The
    /// scheduler does so when a sequence needs pages; the engine when pages
    /// pulled for an arriving prompt need room.
    pub fn evict_soonest_retained(&mut self, kv: &mut impl KvAccounting) -> bool {
        match self.retained.pop_soonest(u64::MAX) {
            Some((session, expires_ms)) => {
                kv.evict_retained(&session, expires_ms);
                true
            }
            None => false,
        }
    }

    /// Preempt the running sequence ordered last from `from` on; false if none
    /// runs there.
    fn preempt_last(&mut self, kv: &mut impl KvAccounting, from: usize) -> bool {
        let Some(victim) = (from..self.cands.len())
            .rev()
            .find(|&i| kv.holds_pages(self.cands[i].seq))
        else {
            return false;
        };
        let seq = self.cands[victim].seq;
        kv.release(seq);
        kv.preempted(seq);
        refresh(kv, &mut self.cands[victim]);
        self.preemptions += 1;
        true
    }
}

/// A candidate's view of its sequence's pages, after they changed.
fn refresh(kv: &impl KvAccounting, cand: &mut Candidate) {
    cand.running = kv.holds_pages(cand.seq);
    cand.prefill_tokens = kv.prefill_remaining(cand.seq);
}
