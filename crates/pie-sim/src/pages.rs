//! One simulated worker's sequences and pages: the scheduler's
//! [`KvAccounting`] answered by the page model (a prefix cache by block hash,
//! counts of private pages), so `pie_policy::Scheduler` plans here as it does
//! over the engine's real pages. A retained session evicted before its
//! expiry on a worker that spills (`retain-all`) leaves its full pages in
//! `spilled` for the simulation to push to the pool (`pool.rs`).

use std::collections::HashMap;

use pie_core::{BlockHash, SeqId};
use pie_policy::cluster::Tier;
use pie_policy::{Candidate, KvAccounting};

use crate::cache::{prefetch, PrefixCache};
use crate::records::Record;

/// A `SeqId` is the sequence's arrival number (as the engine numbers them, so
/// policies break ties in arrival order) above its slot in its worker's `seqs`.
pub const SLOT_BITS: u32 = 24;

pub fn slot(seq: SeqId) -> usize {
    (seq.0 & ((1 << SLOT_BITS) - 1)) as usize
}

/// A sequence on a worker.
pub struct Seq {
    /// Hashes of the full pages of its prompt and output tokens.
    pub hashes: Vec<BlockHash>,
    pub prompt_len: u32,
    pub max_tokens: u32,
    pub generated: u32,
    /// Tokens whose KV is computed.
    pub len: u32,
    /// Pages held: `published` leading cache pages plus private ones.
    pub pages: u32,
    pub published: u32,
    pub client: u32,
    /// The request it serves (index into the workload and the records).
    pub req: u32,
    /// Tokens served while load was offered, added to its client's at finish.
    pub window_tokens: u64,
    /// When its last output token was sampled (for inter-token latency).
    pub last_token_us: u64,
    /// A prefill for decode worker `Some(w)` (`disaggregate`): it ends when its
    /// prompt is computed, sampling no token, and its pages go to `w`.
    pub handoff: Option<u32>,
    /// The retained session it continues (its `session` prop), whose
    /// partial page it copies as the engine does.
    pub resume: Option<String>,
}

impl Seq {
    pub fn tokens(&self) -> u32 {
        self.prompt_len + self.generated
    }

    /// Its prompt's full pages before the last prompt token: the prefix a
    /// worker can attach from its cache (so what a remote prefill hands over).
    pub fn prefix_pages(&self, page_size: usize) -> usize {
        ((self.prompt_len as usize).saturating_sub(1) / page_size).min(self.hashes.len())
    }

    /// Pages it holds outside the prefix cache, given its `duplicates` (see
    /// [`WorkerPages::duplicates`]).
    fn private_pages(&self, duplicates: &[u32]) -> usize {
        (self.pages - self.published) as usize + duplicates.len()
    }

    /// The cached pages it references.
    fn cached_hashes(&self, duplicates: &[u32]) -> Vec<BlockHash> {
        cached(&self.hashes[..self.published as usize], duplicates)
    }
}

/// The pages of `published` in the prefix cache: all but the `duplicates`.
fn cached(published: &[BlockHash], duplicates: &[u32]) -> Vec<BlockHash> {
    (0..published.len())
        .filter(|i| !duplicates.contains(&(*i as u32)))
        .map(|i| published[i])
        .collect()
}

/// A finished session's pages kept for its next turn.
struct Retained {
    /// Its full pages, first first (what a spill sends).
    published: Vec<BlockHash>,
    /// Those of them held privately (see [`WorkerPages::duplicates`]).
    duplicates: Vec<u32>,
    private: u32,
    /// Tokens its pages hold.
    len: u32,
}

impl Retained {
    /// As the engine's `Retained::continues`: the tokens after `s`'s `hit`
    /// attached pages that these pages hold too, before `s`'s last token.
    /// A turn repeats the one before it, so every token of a page both
    /// have is taken as the same; a page they differ in, as differing from
    /// its first token.
    fn continues(&self, s: &Seq, hit: u32, ps: u32) -> u32 {
        let whole = &s.hashes[..hit as usize];
        if self.published.get(..whole.len()) != Some(whole) {
            return 0;
        }
        let held = match self.published.get(hit as usize) {
            None => self.len,
            Some(h) if s.hashes.get(hit as usize) == Some(h) => (hit + 1) * ps,
            Some(_) => hit * ps,
        };
        held.min(s.tokens() - 1).saturating_sub(hit * ps).min(ps)
    }
}

/// A retained session's full pages evicted before its expiry, to be pushed
/// to the pool and soft-pinned there until `expires_ms`.
pub struct Spill {
    pub blocks: Vec<BlockHash>,
    pub expires_ms: u64,
}

pub struct WorkerPages {
    page_size: u32,
    kv_pages: usize,
    /// Its live sequences by slot (the low bits of their `SeqId`); finished
    /// slots are reused, so a worker's sequences stay together in memory.
    seqs: Vec<Option<Seq>>,
    free_slots: Vec<u32>,
    pub cache: PrefixCache,
    /// By slot, a sequence's published pages whose hash another page already
    /// held when they filled: as in `pie-kv`, they stay private (freed on
    /// release) instead of joining the cached one. Rare, so kept out of `Seq`.
    duplicates: HashMap<usize, Vec<u32>>,
    /// Pages held by sequences and retained sessions outside the cache.
    private_pages: usize,
    retained: HashMap<String, Retained>,
    /// Where it spills retained sessions it evicts early (`RetainSpill`);
    /// None: it drops them.
    pub spill: Option<Tier>,
    /// Spills since the simulation last took them.
    pub spilled: Vec<Spill>,
}

impl WorkerPages {
    pub fn new(page_size: usize, kv_pages: usize, track_prefixes: bool) -> Self {
        Self {
            page_size: page_size as u32,
            kv_pages,
            seqs: Vec::new(),
            free_slots: Vec::new(),
            cache: PrefixCache::new(track_prefixes),
            duplicates: HashMap::new(),
            private_pages: 0,
            retained: HashMap::new(),
            spill: None,
            spilled: Vec::new(),
        }
    }

    pub fn seq(&self, slot: usize) -> &Seq {
        self.seqs[slot].as_ref().expect("sequence exists")
    }

    pub fn seq_mut(&mut self, slot: usize) -> &mut Seq {
        self.seqs[slot].as_mut().expect("sequence exists")
    }

    /// Prefetch a sequence's state ahead of touching it.
    pub fn prefetch_seq(&self, slot: usize) {
        if let Some(s) = self.seqs.get(slot) {
            prefetch(s);
        }
    }

    /// A slot for a new sequence; `None` past 2^SLOT_BITS live sequences.
    pub fn insert(&mut self, seq: Seq) -> Option<usize> {
        if let Some(s) = self.free_slots.pop() {
            self.seqs[s as usize] = Some(seq);
            return Some(s as usize);
        }
        if self.seqs.len() >= 1 << SLOT_BITS {
            return None;
        }
        self.seqs.push(Some(seq));
        Some(self.seqs.len() - 1)
    }

    /// Take a finished sequence out (its pages already released or retained).
    pub fn remove(&mut self, slot: usize) -> Seq {
        let s = self.seqs[slot].take().expect("finishing sequence exists");
        self.free_slots.push(slot as u32);
        s
    }

    /// Publish a page a step filled: into the prefix cache, or kept private if
    /// its hash is cached already.
    pub fn publish(&mut self, hash: BlockHash, slot: usize, page: u32) {
        if self.cache.insert(hash) {
            self.private_pages -= 1;
        } else {
            self.duplicates.entry(slot).or_default().push(page);
        }
    }

    /// Take in the pages of `hashes` another worker computed (a disaggregated
    /// prefill's, leading page first) into the prefix cache, unreferenced, as
    /// many as fit by evicting other unreferenced pages; returns how many are
    /// cached now. Tail pages are released first, so they are evicted first.
    pub fn receive(&mut self, hashes: &[BlockHash]) -> usize {
        let mut held = Vec::with_capacity(hashes.len());
        for &h in hashes {
            // Pinned while the rest go in, so that making room cannot evict them.
            if !self.cache.acquire(h) {
                if self.free_pages() == 0 && !self.cache.evict_one() {
                    break;
                }
                self.cache.insert(h);
            }
            held.push(h);
        }
        self.cache.release_all(&held);
        held.len()
    }

    pub fn free_pages(&self) -> usize {
        self.kv_pages - self.private_pages - self.cache.len()
    }

    fn take_duplicates(&mut self, slot: usize) -> Vec<u32> {
        if self.duplicates.is_empty() {
            return Vec::new();
        }
        self.duplicates.remove(&slot).unwrap_or_default()
    }
}

/// A worker's pages as the scheduler sees them, with where a first admission's
/// cache hit is recorded.
pub struct PageModel<'a> {
    pub pages: &'a mut WorkerPages,
    pub records: &'a mut [Record],
    pub prefix_hit_tokens: &'a mut u64,
}

impl PageModel<'_> {
    fn seq(&self, seq: SeqId) -> &Seq {
        self.pages.seq(slot(seq))
    }
}

impl KvAccounting for PageModel<'_> {
    fn holds_pages(&self, seq: SeqId) -> bool {
        self.seq(seq).pages > 0
    }

    fn prefill_remaining(&self, seq: SeqId) -> usize {
        let s = self.seq(seq);
        s.prompt_len.saturating_sub(s.len) as usize
    }

    fn uncomputed(&self, seq: SeqId) -> usize {
        let s = self.seq(seq);
        (s.tokens() - s.len) as usize
    }

    fn room(&self, seq: SeqId) -> usize {
        let s = self.seq(seq);
        let available = self.pages.free_pages() + self.pages.cache.evictable();
        (s.pages as usize + available) * self.pages.page_size as usize - s.len as usize
    }

    fn attach_prefix(&mut self, seq: SeqId) -> usize {
        let ps = self.pages.page_size;
        let WorkerPages {
            seqs,
            cache,
            retained,
            ..
        } = &mut *self.pages;
        let s = seqs[slot(seq)].as_mut().expect("sequence exists");
        let usable = ((s.tokens() - 1) / ps) as usize;
        let mut hit = 0;
        for h in s.hashes.iter().take(usable) {
            if !cache.acquire(*h) {
                break;
            }
            hit += 1;
        }
        s.published = hit;
        s.pages = hit;
        s.len = hit * ps;
        let resumed = s.resume.as_ref().and_then(|key| retained.get(key));
        let slots = resumed.map_or(0, |r| r.continues(s, hit, ps));
        // As the engine: a copy only while the pool holds every page the
        // sequence's tokens need.
        let needed = s.tokens().div_ceil(ps) - hit;
        let available = self.pages.free_pages() + self.pages.cache.evictable();
        if slots > 0
            && available >= needed as usize
            && (self.pages.free_pages() > 0 || self.pages.cache.evict_one())
        {
            let s = self.pages.seq_mut(slot(seq));
            s.pages += 1;
            s.len += slots;
            self.pages.private_pages += 1;
        }
        self.pages.seq(slot(seq)).len as usize
    }

    fn prefix_in_flight(&self, seq: SeqId) -> bool {
        let ps = self.pages.page_size;
        let s = self.seq(seq);
        let usable = ((s.tokens() - 1) / ps) as usize;
        let full = &s.hashes[..usable.min(s.hashes.len())];
        let cache = &self.pages.cache;
        let cached = full.iter().take_while(|h| cache.contains(h)).count();
        let Some(&next) = full.get(cached) else {
            return false;
        };
        let end = (cached as u32 + 1) * ps;
        let own = slot(seq);
        let others = self
            .pages
            .seqs
            .iter()
            .enumerate()
            .filter(|&(at, _)| at != own);
        others.filter_map(|(_, other)| other.as_ref()).any(|other| {
            other.pages > 0
                && other.len < end
                && other.tokens() > end
                && other.hashes.get(cached) == Some(&next)
        })
    }

    fn reserve(&mut self, seq: SeqId, tokens: usize) {
        let ps = self.pages.page_size;
        let s = self.seq(seq);
        let need = (s.len + tokens as u32).div_ceil(ps) - s.pages;
        while self.pages.free_pages() < need as usize {
            if !self.pages.cache.evict_one() {
                break;
            }
        }
        self.pages.private_pages += need as usize;
        self.pages.seq_mut(slot(seq)).pages += need;
    }

    /// Tail first as the engine does, so eviction keeps prefixes reachable.
    fn release(&mut self, seq: SeqId) {
        let pages = &mut *self.pages;
        let duplicates = pages.take_duplicates(slot(seq));
        let s = pages.seqs[slot(seq)].as_mut().expect("sequence exists");
        if duplicates.is_empty() {
            pages.cache.release_all(&s.hashes[..s.published as usize]);
        } else {
            pages.cache.release_all(&s.cached_hashes(&duplicates));
        }
        pages.private_pages -= s.private_pages(&duplicates);
        s.pages = 0;
        s.published = 0;
        s.len = 0;
    }

    fn admitted(&mut self, seq: SeqId, cached_tokens: usize) {
        let s = self.pages.seq(slot(seq));
        let rec = &mut self.records[s.req as usize];
        if rec.cached_tokens.is_none() {
            let hit = (cached_tokens as u32).min(s.prompt_len);
            rec.cached_tokens = Some(hit);
            *self.prefix_hit_tokens += u64::from(hit);
        }
    }

    fn retain(&mut self, seq: SeqId, session: &str) {
        let pages = &mut *self.pages;
        let duplicates = pages.take_duplicates(slot(seq));
        let s = pages.seqs[slot(seq)].as_mut().expect("sequence exists");
        let retained = Retained {
            published: s.hashes[..s.published as usize].to_vec(),
            private: s.private_pages(&duplicates) as u32,
            duplicates,
            len: s.len,
        };
        s.pages = 0;
        s.published = 0;
        s.len = 0;
        let previous = pages.retained.insert(session.to_string(), retained);
        debug_assert!(
            previous.is_none(),
            "the scheduler drops a session's pages first"
        );
    }

    fn drop_retained(&mut self, session: &str) {
        if let Some(r) = self.pages.retained.remove(session) {
            if r.duplicates.is_empty() {
                self.pages.cache.release_all(&r.published);
            } else {
                self.pages
                    .cache
                    .release_all(&cached(&r.published, &r.duplicates));
            }
            self.pages.private_pages -= r.private as usize;
        }
    }

    /// Spilled first when the worker spills (`retain-all`): its full pages go
    /// to the pool (`Spill`), then they are freed here as by `drop_retained`.
    fn evict_retained(&mut self, session: &str, expires_ms: u64) {
        if self.pages.spill.is_some() {
            if let Some(r) = self.pages.retained.get(session) {
                if !r.published.is_empty() {
                    self.pages.spilled.push(Spill {
                        blocks: r.published.clone(),
                        expires_ms,
                    });
                }
            }
        }
        self.drop_retained(session);
    }

    fn will_visit(&self, cands: &[Candidate]) {
        for c in cands {
            self.pages.prefetch_seq(slot(c.seq));
        }
    }
}
