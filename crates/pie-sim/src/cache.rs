//! One simulated worker's prefix cache: the full pages it holds, named by block
//! hash, with reference counts and LRU eviction of unreferenced pages. It models
//! `pie-kv`'s prefix index and eviction order, without page contents.

use std::collections::VecDeque;

use pie_core::BlockHash;

#[derive(Clone, Copy, Debug)]
struct Entry {
    hash: BlockHash,
    refs: u32,
    /// When it last became unreferenced (wrapping); matches its live LRU queue
    /// entry. 32 bits keep a slot at 16 bytes, a quarter of a cache line.
    tick: u32,
}

/// A free slot's `refs`.
const VACANT: u32 = u32::MAX;

/// Block hash -> entry, open addressing with linear probing and backward-shift
/// deletion. At 1,000 workers the tables (1,000 x 28,000 pages) are far larger
/// than any CPU cache, so each probe is a cache miss; a SwissTable
/// (`std::collections::HashMap`) touches its control bytes and its bucket, two
/// misses, where a slot here is one, and its address is known from the hash
/// alone, so a sequence's pages can be prefetched before they are released.
/// Block hashes are XXH3 digests: their low bits index the table directly.
#[derive(Debug)]
struct PageTable {
    slots: Vec<Entry>,
    len: usize,
}

impl Default for PageTable {
    fn default() -> Self {
        Self::with_slots(64)
    }
}

impl PageTable {
    fn with_slots(n: usize) -> Self {
        let vacant = Entry {
            hash: BlockHash(0),
            refs: VACANT,
            tick: 0,
        };
        Self {
            slots: vec![vacant; n],
            len: 0,
        }
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn home(&self, h: BlockHash) -> usize {
        h.0 as usize & self.mask()
    }

    /// The slot holding `h`, else the vacant slot where it would go.
    fn probe(&self, h: BlockHash) -> (usize, bool) {
        let mut i = self.home(h);
        loop {
            let e = &self.slots[i];
            if e.refs == VACANT {
                return (i, false);
            }
            if e.hash == h {
                return (i, true);
            }
            i = (i + 1) & self.mask();
        }
    }

    fn get_mut(&mut self, h: BlockHash) -> Option<&mut Entry> {
        match self.probe(h) {
            (i, true) => Some(&mut self.slots[i]),
            _ => None,
        }
    }

    /// Start loading `h`'s home slot into the cache.
    fn prefetch(&self, h: BlockHash) {
        prefetch(&self.slots[self.home(h)]);
    }

    /// `h`'s entry, inserted with `refs` 0 if absent; true if it was inserted.
    fn entry(&mut self, h: BlockHash) -> (&mut Entry, bool) {
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        let (i, found) = self.probe(h);
        if !found {
            self.slots[i] = Entry {
                hash: h,
                refs: 0,
                tick: 0,
            };
            self.len += 1;
        }
        (&mut self.slots[i], !found)
    }

    fn remove(&mut self, h: BlockHash) {
        let (mut hole, found) = self.probe(h);
        if !found {
            return;
        }
        self.len -= 1;
        // Shift later entries of the probe run back, so no probe stops early.
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask();
            let e = self.slots[j];
            if e.refs == VACANT {
                break;
            }
            let home = self.home(e.hash);
            if (j.wrapping_sub(home) & self.mask()) >= (j.wrapping_sub(hole) & self.mask()) {
                self.slots[hole] = e;
                hole = j;
            }
        }
        self.slots[hole].refs = VACANT;
    }

    fn grow(&mut self) {
        let old = std::mem::replace(self, Self::with_slots(2 * self.slots.len()));
        for e in old.slots.into_iter().filter(|e| e.refs != VACANT) {
            let (i, _) = self.probe(e.hash);
            self.slots[i] = e;
            self.len += 1;
        }
    }
}

/// Start loading `value`'s cache line: at 1,000 workers most of the simulator's
/// time is cache misses, and overlapping them is cheaper than taking them in turn.
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        let line: *const T = value;
        // SAFETY: a prefetch is a hint; it reads nothing and never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch(line.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[derive(Debug, Default)]
pub struct PrefixCache {
    entries: PageTable,
    /// Unreferenced pages, oldest first; entries whose tick no longer matches (or
    /// that are referenced again) are stale and skipped.
    lru: VecDeque<(u32, BlockHash)>,
    tick: u32,
    evictable: usize,
    /// Pages added and evicted since the last drain (true: added), when tracked
    /// for a cluster index.
    log: Option<Vec<(BlockHash, bool)>>,
}

impl PrefixCache {
    pub fn new(track: bool) -> Self {
        Self {
            log: track.then(Vec::new),
            ..Self::default()
        }
    }

    /// Pages held (referenced or not).
    pub fn len(&self) -> usize {
        self.entries.len
    }

    pub fn is_empty(&self) -> bool {
        self.entries.len == 0
    }

    /// Unreferenced pages (evictable).
    pub fn evictable(&self) -> usize {
        self.evictable
    }

    pub fn contains(&self, h: &BlockHash) -> bool {
        self.entries.probe(*h).1
    }

    /// Start loading `h`'s entry, ahead of an `insert` of it.
    pub fn prefetch(&self, h: BlockHash) {
        self.entries.prefetch(h);
    }

    /// Reference a cached page; false if it is not cached.
    pub fn acquire(&mut self, h: BlockHash) -> bool {
        match self.entries.get_mut(h) {
            Some(e) => {
                if e.refs == 0 {
                    self.evictable -= 1;
                }
                e.refs += 1;
                true
            }
            None => false,
        }
    }

    /// Add a page, referenced once; false (and nothing changes) if a page with
    /// this hash is already cached: `pie-kv` keeps the older page in its index.
    pub fn insert(&mut self, h: BlockHash) -> bool {
        let (e, inserted) = self.entries.entry(h);
        if inserted {
            e.refs = 1;
            if let Some(log) = &mut self.log {
                log.push((h, true));
            }
        }
        inserted
    }

    /// Drop one reference; at zero the page becomes the most recently used
    /// evictable one.
    fn release(&mut self, h: BlockHash) {
        let Some(e) = self.entries.get_mut(h) else {
            return;
        };
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 {
            self.tick = self.tick.wrapping_add(1);
            e.tick = self.tick;
            self.evictable += 1;
            self.lru.push_back((self.tick, h));
            if self.lru.len() > 2 * self.entries.len + 1024 {
                self.compact();
            }
        }
    }

    /// Release a sequence's pages, last first (as the engine frees them, so that
    /// eviction keeps prefixes reachable), after prefetching them all: their
    /// misses overlap instead of following one another.
    pub fn release_all(&mut self, hashes: &[BlockHash]) {
        for &h in hashes {
            self.entries.prefetch(h);
        }
        for &h in hashes.iter().rev() {
            self.release(h);
        }
    }

    /// Evict the least recently used unreferenced page; false if none.
    pub fn evict_one(&mut self) -> bool {
        while let Some((tick, h)) = self.lru.pop_front() {
            if self.is_evictable(tick, h) {
                self.entries.remove(h);
                self.evictable -= 1;
                if let Some(log) = &mut self.log {
                    log.push((h, false));
                }
                return true;
            }
        }
        false
    }

    /// Take the pages added and evicted since the last call.
    pub fn drain_log(&mut self) -> Vec<(BlockHash, bool)> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Whether the LRU queue's `(tick, h)` is live: `h` unreferenced since `tick`.
    fn is_evictable(&self, tick: u32, h: BlockHash) -> bool {
        match self.entries.probe(h) {
            (i, true) => {
                let e = &self.entries.slots[i];
                e.refs == 0 && e.tick == tick
            }
            _ => false,
        }
    }

    fn compact(&mut self) {
        let mut lru = std::mem::take(&mut self.lru);
        lru.retain(|&(tick, h)| self.is_evictable(tick, h));
        self.lru = lru;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_only_unreferenced_oldest_first() {
        let mut c = PrefixCache::new(true);
        for i in 0..3 {
            assert!(c.insert(BlockHash(i)));
            assert!(
                !c.insert(BlockHash(i)),
                "an indexed hash is not added twice"
            );
        }
        c.release(BlockHash(2));
        c.release(BlockHash(0));
        assert_eq!(c.evictable(), 2);
        // 2 became free first, then 0; 1 is still referenced.
        assert!(c.evict_one());
        assert!(!c.contains(&BlockHash(2)));
        // Re-referencing 0 protects it.
        assert!(c.acquire(BlockHash(0)));
        assert!(!c.evict_one());
        assert_eq!(c.len(), 2);
        assert_eq!(
            c.drain_log(),
            vec![
                (BlockHash(0), true),
                (BlockHash(1), true),
                (BlockHash(2), true),
                (BlockHash(2), false)
            ]
        );
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// The table agrees with a `HashMap` through inserts, reference changes
        /// and removals, with hashes crowded into few home slots (long probe runs
        /// that wrap around the end).
        #[test]
        fn agrees_with_a_hash_map(ops in proptest::collection::vec((0u8..3, 0u64..40), 0..400)) {
            let mut table = PageTable::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            for (op, k) in ops {
                // Keys share low bits: 40 keys over few home slots of 64.
                let h = BlockHash((k % 5) * 64 + (k / 5) + 60);
                match op {
                    0 => {
                        let (e, inserted) = table.entry(h);
                        prop_assert_eq!(inserted, !model.contains_key(&h.0));
                        e.refs += 1;
                        *model.entry(h.0).or_default() += 1;
                    }
                    1 => {
                        table.remove(h);
                        model.remove(&h.0);
                    }
                    _ => {
                        let got = table.get_mut(h).map(|e| e.refs);
                        prop_assert_eq!(got, model.get(&h.0).copied());
                    }
                }
                prop_assert_eq!(table.len, model.len());
            }
            for (&k, &refs) in &model {
                prop_assert_eq!(table.get_mut(BlockHash(k)).map(|e| e.refs), Some(refs));
            }
        }
    }
}
