//! The shared page pool (`pie-pool`) in the simulator, without page
//! contents: the pages it holds in memory by block hash, up to a capacity in
//! pages, with `pie-pool`'s high/low watermark LRU eviction (once above
//! `high` x capacity, least recently used pages go until `low` x capacity
//! remain; soft-pinned pages go only when nothing else can, least recently
//! used first too); a read (a worker's pull) refreshes the pages it reads. A
//! spilled retained session (`retain-all`) is soft-pinned until its `keep-ms`
//! expiry, after which its pages are ordinary LRU pages. Also the run's pool
//! counters (`PoolCounters`). What moving pages costs, and when they arrive,
//! is `sim/pool.rs`'s (the profile's transfer cost over each worker's links).

use std::collections::{BTreeMap, HashMap};

use pie_core::pool::{HIGH_WATERMARK, LOW_WATERMARK};
use pie_core::BlockHash;
use serde::Serialize;

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// Its place in the LRU order (larger: more recent).
    tick: u64,
    /// Soft-pinned while the time (ms) is before this.
    pinned_until_ms: u64,
}

/// The pool's pages and their LRU order.
#[derive(Debug)]
pub struct Pool {
    capacity: usize,
    high: f64,
    low: f64,
    pages: HashMap<BlockHash, Entry>,
    /// tick -> page, oldest first.
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    /// Pages evicted, and of them those still pinned when they went.
    pub evicted: u64,
    pub evicted_pinned: u64,
    /// The most pages held once a put's eviction was done.
    pub max_held: usize,
}

impl Pool {
    /// A pool of `capacity` pages with `pie-pool`'s default watermarks.
    pub fn new(capacity: usize) -> Self {
        Self::with_watermarks(capacity, HIGH_WATERMARK, LOW_WATERMARK)
    }

    pub fn with_watermarks(capacity: usize, high: f64, low: f64) -> Self {
        Self {
            capacity,
            high,
            low,
            pages: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            evicted: 0,
            evicted_pinned: 0,
            max_held: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    pub fn contains(&self, h: &BlockHash) -> bool {
        self.pages.contains_key(h)
    }

    /// How many of `blocks`, from the first, it holds (what a pull of them
    /// gets: `pie-pool` answers with a leading run).
    pub fn leading(&self, blocks: &[BlockHash]) -> usize {
        blocks.iter().take_while(|h| self.contains(h)).count()
    }

    /// A worker reads `blocks` (a pull): each one held becomes the most
    /// recently used, in order.
    pub fn read(&mut self, blocks: &[BlockHash]) {
        for h in blocks {
            if let Some(e) = self.pages.get(h).copied() {
                self.touch(*h, e.pinned_until_ms);
            }
        }
    }

    /// Store `blocks` (a push that arrived), each the most recently used,
    /// soft-pinned until `pinned_until_ms` (0: not pinned; a page held
    /// already keeps the later of its pins), evicting past the high watermark
    /// after each page as `pie-pool` does. Returns how many were new.
    pub fn put(&mut self, blocks: &[BlockHash], pinned_until_ms: u64, now_ms: u64) -> usize {
        let mut new = 0;
        for &h in blocks {
            let pin = match self.pages.get(&h) {
                Some(e) => e.pinned_until_ms.max(pinned_until_ms),
                None => {
                    new += 1;
                    pinned_until_ms
                }
            };
            self.touch(h, pin);
            self.evict_past_watermark(now_ms);
        }
        self.max_held = self.max_held.max(self.pages.len());
        new
    }

    /// Soft-pin the pages of `blocks` it holds until `pinned_until_ms` (at
    /// least) and make them the most recently used: a push of pages it holds
    /// already moves nothing.
    pub fn pin(&mut self, blocks: &[BlockHash], pinned_until_ms: u64) {
        for h in blocks {
            if let Some(e) = self.pages.get(h).copied() {
                self.touch(*h, e.pinned_until_ms.max(pinned_until_ms));
            }
        }
    }

    fn touch(&mut self, h: BlockHash, pinned_until_ms: u64) {
        self.tick += 1;
        let entry = Entry {
            tick: self.tick,
            pinned_until_ms,
        };
        if let Some(old) = self.pages.insert(h, entry) {
            self.lru.remove(&old.tick);
        }
        self.lru.insert(self.tick, h);
    }

    /// Above `high` x capacity: least recently used pages go until `low` x
    /// capacity remain, unpinned ones first, then pinned ones.
    fn evict_past_watermark(&mut self, now_ms: u64) {
        let capacity = self.capacity as f64;
        if (self.pages.len() as f64) <= self.high * capacity {
            return;
        }
        let target = (self.low * capacity) as usize;
        for pinned_too in [false, true] {
            let mut victims = Vec::new();
            let mut left = self.pages.len();
            for (&tick, h) in &self.lru {
                if left <= target {
                    break;
                }
                let pinned = self.pages[h].pinned_until_ms > now_ms;
                if pinned && !pinned_too {
                    continue;
                }
                victims.push((tick, *h, pinned));
                left -= 1;
            }
            for (tick, h, pinned) in victims {
                self.lru.remove(&tick);
                self.pages.remove(&h);
                self.evicted += 1;
                self.evicted_pinned += u64::from(pinned);
            }
            if self.pages.len() <= target {
                return;
            }
        }
    }
}

/// What a run's pool did (present in the metrics when the run has a pool).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PoolCounters {
    /// The pool's capacity in pages.
    pub capacity_pages: usize,
    /// Retained sessions spilled to the pool (`retain-all`: evicted from
    /// their worker before their `keep-ms` passed).
    pub spills: u64,
    /// Pages those spills sent (the ones the pool lacked), and their bytes.
    pub spilled_pages: u64,
    pub spilled_bytes: u64,
    /// Spills dropped because `SPILLS_IN_FLIGHT` of their worker's were on
    /// their way, and their pages.
    pub dropped_spills: u64,
    pub dropped_spill_pages: u64,
    /// Prefixes pushed by `CopyPrefixToPool` (`pool-replicate`), the pages
    /// they sent and their bytes.
    pub replicated: u64,
    pub replicated_pages: u64,
    pub replicated_bytes: u64,
    /// Pages that reached the pool: new ones, and ones another push had
    /// brought meanwhile (every page sent arrives: sent = stored + already).
    pub stored_pages: u64,
    pub already_held_pages: u64,
    /// Pulls before a prefill (a worker got pages from the pool), their
    /// pages and bytes.
    pub pulls: u64,
    pub pulled_pages: u64,
    pub pulled_bytes: u64,
    /// Seconds the pulls took (link waits included), summed.
    pub pull_s: f64,
    /// Pulls whose pages did not all fit their worker's memory when they
    /// arrived (every page held by running or retained sequences: the
    /// engine imports into free or unreferenced cached pages only), and the
    /// pages that did not fit (recomputed).
    pub short_pulls: u64,
    pub unfit_pages: u64,
    /// Pulls per worker (`w0` first; not in the JSON).
    #[serde(skip)]
    pub pulls_by_worker: Vec<u64>,
    /// Pages evicted, and of them pinned ones (nothing else could go).
    pub evicted_pages: u64,
    pub evicted_pinned_pages: u64,
    /// The most pages held after a put's eviction, and the pages held at the
    /// end.
    pub max_held_pages: usize,
    pub held_pages: usize,
}

impl PoolCounters {
    /// The pool's own figures (eviction, occupancy) copied in.
    pub fn finish(&mut self, pool: &Pool) {
        self.capacity_pages = pool.capacity();
        self.evicted_pages = pool.evicted;
        self.evicted_pinned_pages = pool.evicted_pinned;
        self.max_held_pages = pool.max_held;
        self.held_pages = pool.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(r: std::ops::Range<u64>) -> Vec<BlockHash> {
        r.map(BlockHash).collect()
    }

    #[test]
    fn past_the_high_watermark_lru_pages_go_down_to_the_low_one() {
        let mut pool = Pool::new(10);
        assert_eq!(pool.put(&blocks(0..9), 0, 0), 9);
        assert_eq!(pool.len(), 9, "at 0.9 x capacity: nothing goes");
        pool.read(&blocks(0..1)); // 0 is now the most recent
        assert_eq!(pool.put(&blocks(9..10), 0, 0), 1);
        assert_eq!(pool.len(), 8, "down to 0.8 x capacity");
        assert!(pool.contains(&BlockHash(0)), "read: refreshed");
        assert!(!pool.contains(&BlockHash(1)) && !pool.contains(&BlockHash(2)));
        assert_eq!(pool.evicted, 2);
        assert!(pool.max_held <= pool.capacity());
        assert_eq!(pool.leading(&blocks(0..4)), 1, "a leading run only");
    }

    #[test]
    fn pinned_pages_outlive_unpinned_ones_until_their_pin_ends() {
        let mut pool = Pool::new(10);
        // Oldest first: a pinned spill, then unpinned pages.
        pool.put(&blocks(0..4), 5_000, 0);
        pool.put(&blocks(10..15), 0, 0);
        pool.put(&blocks(20..22), 0, 1_000);
        assert!(pool.leading(&blocks(0..4)) == 4, "pinned spill kept");
        assert_eq!(pool.evicted_pinned, 0);
        assert!(!pool.contains(&BlockHash(10)), "unpinned went first");
        // After the pin: ordinary LRU pages, the oldest.
        pool.put(&blocks(30..33), 0, 6_000);
        assert!(!pool.contains(&BlockHash(0)), "expired pin: LRU again");
        // All pinned: pinned pages go when nothing else can.
        let mut full = Pool::new(10);
        full.put(&blocks(0..12), 9_000, 0);
        assert!(full.len() <= 9 && full.evicted_pinned > 0);
        assert!(full.max_held <= full.capacity());
    }

    #[test]
    fn a_page_held_keeps_the_later_pin() {
        let mut pool = Pool::new(10);
        pool.put(&blocks(0..1), 5_000, 0);
        pool.pin(&blocks(0..1), 1_000);
        pool.put(&blocks(1..10), 0, 2_000);
        assert!(pool.contains(&BlockHash(0)), "still pinned at 2 s");
    }
}
