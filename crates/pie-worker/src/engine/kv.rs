//! The engine's sequences over the real page pool: the scheduler's
//! [`KvAccounting`] answered by `pie-kv`. The only code that changes a
//! sequence's pages (besides fork, abort and the step's commit in `engine.rs`).

use std::collections::{HashMap, HashSet};

use pie_core::hash::chain_from;
use pie_core::{BlockHash, SeqId};
use pie_kv::transfer::export_page;
use pie_kv::{KvPool, PageTable};
use pie_model::{Constraint, Sampler};
use pie_policy::KvAccounting;

use super::score::Score;

/// Per-sequence facts a caller may report (e.g. OpenAI `usage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqInfo {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
}

pub(super) struct Sequence {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    pub stop_tokens: Vec<u32>,
    /// Stop tokens are masked until it generated this many.
    pub min_tokens: usize,
    pub sampler: Sampler,
    pub table: PageTable,
    /// Where its block-hash chain starts (the model's root, or salted).
    pub chain_root: BlockHash,
    /// Prompt tokens found cached at its first admission.
    pub cached_tokens: Option<usize>,
    /// Preempted, it waits for its prompt's pages from the disk tier ...
    pub reload_after_preemption: bool,
    /// ... once, before its next admission.
    pub reload_pending: bool,
    /// See [`crate::engine::Request::logprobs`].
    pub logprobs: Option<usize>,
    /// Its grammar's state (see [`crate::engine::Request::grammar`]).
    pub constraint: Option<Box<Constraint>>,
    /// See [`crate::engine::Request::resume_from`].
    pub resume_from: Vec<String>,
    /// See [`crate::engine::Request::score`].
    pub score: Option<Score>,
}

impl Sequence {
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The first position whose row the forward must return: the last
    /// token's, or the first a pass reports (until it sampled).
    pub fn first_logit_row(&self) -> usize {
        let last = self.tokens.len() - 1;
        match (&self.score, self.generated()) {
            (Some(score), 0) => score.first().map_or(last, |p| p.min(last)),
            _ => last,
        }
    }

    /// Rows of the chunk of `tokens` tokens from `start` that return logits.
    pub fn logit_rows(&self, start: usize, tokens: usize) -> usize {
        (start + tokens).saturating_sub(start.max(self.first_logit_row()))
    }

    pub fn info(&self) -> SeqInfo {
        SeqInfo {
            prompt_tokens: self.prompt_len,
            generated_tokens: self.generated(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
        }
    }
}

pub(super) struct EngineKv {
    pub pool: KvPool,
    pub page_size: usize,
    pub seqs: HashMap<SeqId, Sequence>,
    /// Finished sessions' pages kept for their next turn (keep-session).
    pub retained: HashMap<String, Retained>,
    pub prefix_hit_tokens: u64,
    /// Sequences admitted for the first time since the last take.
    pub started: Vec<(SeqId, usize)>,
    /// Preempted sequences that wait for the runtime to load their pages
    /// from disk (`Engine::reloaded` lets them in).
    pub reloading: HashSet<SeqId>,
    /// Those of them held back since the last take.
    pub to_reload: Vec<SeqId>,
    /// Retained sessions evicted early are spilled (`retain-all`) ...
    pub spill: bool,
    /// ... into here, until the runtime takes them.
    pub spilled: Vec<Spill>,
}

/// A retained session evicted before its `keep-ms` passed, as its full pages
/// in the transfer format: the runtime keeps them in the pool or on disk
/// until `expires_ms` (`retain-all`).
#[derive(Debug)]
pub struct Spill {
    pub session: String,
    /// The pages' block hashes, a chain from the sequence's first page.
    pub chain: Vec<BlockHash>,
    pub pages: Vec<Vec<u8>>,
    /// When its retention would have ended (unix ms).
    pub expires_ms: u64,
}

/// A finished session's pages and the tokens they hold.
pub(super) struct Retained {
    pub table: PageTable,
    pub tokens: Vec<u32>,
    pub chain_root: BlockHash,
}

impl Retained {
    /// How many tokens after `table`'s whole pages this retention holds as
    /// well, on the same chain: `table` (a sequence's attached prefix) and
    /// these pages agree on every token before, and `tokens` (the
    /// sequence's) on these.
    fn continues(&self, table: &PageTable, chain_root: BlockHash, tokens: &[u32]) -> usize {
        let whole = table.hashes();
        if chain_root != self.chain_root || self.table.hashes().get(..whole.len()) != Some(whole) {
            return 0;
        }
        let from = table.len();
        let held = &self.tokens[..self.table.len()];
        held.get(from..)
            .unwrap_or_default()
            .iter()
            .zip(tokens.get(from..).unwrap_or_default())
            .take_while(|(a, b)| a == b)
            .count()
    }
}

impl EngineKv {
    fn seq(&self, id: SeqId) -> &Sequence {
        &self.seqs[&id]
    }

    fn seq_mut(&mut self, id: SeqId) -> &mut Sequence {
        self.seqs
            .get_mut(&id)
            .expect("the scheduler names live sequences")
    }
}

impl KvAccounting for EngineKv {
    fn holds_pages(&self, seq: SeqId) -> bool {
        !self.seq(seq).table.pages().is_empty()
    }

    fn prefill_remaining(&self, seq: SeqId) -> usize {
        let s = self.seq(seq);
        s.prompt_len.saturating_sub(s.table.len())
    }

    fn uncomputed(&self, seq: SeqId) -> usize {
        let s = self.seq(seq);
        s.tokens.len() - s.table.len()
    }

    fn room(&self, seq: SeqId) -> usize {
        let s = self.seq(seq);
        (s.table.pages().len() + self.pool.available()) * self.page_size - s.table.len()
    }

    /// Whole pages from the prefix cache; then, for a sequence that resumes
    /// a retained session, the slots of the session's next page that hold
    /// its next tokens too, copied (a turn after a turn computes only what
    /// is new, not the rest of the page the last turn left partial). Only
    /// while the pool holds every page its tokens need: a sequence that
    /// will wait for pages is attached again each step, and would copy again.
    fn attach_prefix(&mut self, seq: SeqId) -> usize {
        let EngineKv {
            pool,
            seqs,
            retained,
            page_size,
            ..
        } = self;
        let s = seqs
            .get_mut(&seq)
            .expect("the scheduler names live sequences");
        let usable = &s.tokens[..s.first_logit_row()];
        let hashes = chain_from(s.chain_root, usable, *page_size);
        let hit = s.table.attach_prefix(pool, &hashes);
        if pool.available() < s.tokens.len().div_ceil(*page_size) - hit / *page_size {
            return hit;
        }
        let best = s
            .resume_from
            .iter()
            .filter_map(|key| retained.get(key))
            .map(|from| (from.continues(&s.table, s.chain_root, usable), from))
            .filter(|(slots, _)| *slots > 0)
            .max_by_key(|(slots, _)| *slots);
        match best {
            None => hit,
            Some((slots, from)) => {
                let src = from.table.pages()[hit / *page_size];
                s.table
                    .attach_copy(pool, src, slots.min(*page_size))
                    .unwrap_or(hit)
            }
        }
    }

    fn prefix_in_flight(&self, seq: SeqId) -> bool {
        let ps = self.page_size;
        let s = self.seq(seq);
        let chain = chain_from(s.chain_root, &s.tokens[..s.first_logit_row()], ps);
        let cached = self.pool.longest_prefix(&chain).len();
        let Some(&next) = chain.get(cached) else {
            return false;
        };
        let end = (cached + 1) * ps;
        self.seqs.iter().any(|(&id, other)| {
            id != seq
                && !other.table.pages().is_empty()
                && other.table.len() < end
                && other.tokens.len() > end
                && other.chain_root == s.chain_root
                && chain_from(other.chain_root, &other.tokens[..end], ps).last() == Some(&next)
        })
    }

    fn preempted(&mut self, seq: SeqId) {
        let s = self.seq_mut(seq);
        s.reload_pending = s.reload_after_preemption;
    }

    /// A preempted sequence whose prompt's pages are on disk: held back,
    /// once, when it could be admitted but the cache lost some of them, while
    /// the runtime loads them (into the room it would have taken).
    fn hold_for_pages(&mut self, seq: SeqId) -> bool {
        if self.reloading.contains(&seq) {
            return true;
        }
        let s = self.seq(seq);
        // No room yet for it to run: ask again later, before hashing its prompt.
        if !s.reload_pending || self.pool.available() < s.tokens.len().div_ceil(self.page_size) {
            return false;
        }
        let chain = chain_from(s.chain_root, &s.tokens[..s.prompt_len], self.page_size);
        if self.pool.longest_prefix(&chain).len() == chain.len() {
            self.seq_mut(seq).reload_pending = false;
            return false;
        }
        self.seq_mut(seq).reload_pending = false;
        self.reloading.insert(seq);
        self.to_reload.push(seq);
        true
    }

    fn reserve(&mut self, seq: SeqId, tokens: usize) {
        let s = self
            .seqs
            .get_mut(&seq)
            .expect("the scheduler names live sequences");
        let new_len = s.table.len() + tokens;
        s.table
            .reserve(&mut self.pool, new_len)
            .expect("the scheduler checked the room");
    }

    fn release(&mut self, seq: SeqId) {
        let s = self
            .seqs
            .get_mut(&seq)
            .expect("the scheduler names live sequences");
        s.table.release(&mut self.pool);
    }

    fn admitted(&mut self, seq: SeqId, cached_tokens: usize) {
        let s = self.seq_mut(seq);
        if s.cached_tokens.is_none() {
            let hit = cached_tokens.min(s.prompt_len);
            s.cached_tokens = Some(hit);
            self.prefix_hit_tokens += hit as u64;
            self.started.push((seq, hit));
        }
    }

    fn retain(&mut self, seq: SeqId, session: &str) {
        let s = self.seq_mut(seq);
        let retained = Retained {
            table: std::mem::take(&mut s.table),
            tokens: s.tokens.clone(),
            chain_root: s.chain_root,
        };
        let previous = self.retained.insert(session.to_string(), retained);
        debug_assert!(
            previous.is_none(),
            "the scheduler drops a session's pages first"
        );
    }

    fn drop_retained(&mut self, session: &str) {
        if let Some(mut retained) = self.retained.remove(session) {
            retained.table.release(&mut self.pool);
        }
    }

    /// Copied out before the pages go (the copy is the only way they can
    /// outlive this step: the scheduler needs them now).
    fn evict_retained(&mut self, session: &str, expires_ms: u64) {
        if let (true, Some(Retained { table, .. })) = (self.spill, self.retained.get(session)) {
            let chain = table.hashes().to_vec();
            let pages: Vec<Vec<u8>> = table.pages()[..chain.len()]
                .iter()
                .map_while(|&page| export_page(&self.pool, page).ok())
                .collect();
            if !pages.is_empty() {
                self.spilled.push(Spill {
                    session: session.to_string(),
                    chain: chain[..pages.len()].to_vec(),
                    pages,
                    expires_ms,
                });
            }
        }
        self.drop_retained(session);
    }
}
