//! One simulated worker's prefix cache: the full pages it holds, named by block
//! hash, with reference counts and LRU eviction of unreferenced pages. It models
//! `pie-kv`'s prefix index and eviction order, without page contents.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use pie_core::BlockHash;

/// Block hashes are already XXH3 digests: hash maps keyed by them use the value
/// itself instead of hashing it again.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// A map keyed by block hash.
pub type HashMapByBlock<V> = HashMap<BlockHash, V, BuildHasherDefault<PassThrough>>;

#[derive(Clone, Copy, Debug)]
struct Entry {
    refs: u32,
    /// When it last became unreferenced (wrapping); matches its live LRU queue
    /// entry. 32 bits keep an entry at 8 bytes: the tables dominate memory traffic.
    tick: u32,
}

#[derive(Debug, Default)]
pub struct PrefixCache {
    entries: HashMapByBlock<Entry>,
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
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Unreferenced pages (evictable).
    pub fn evictable(&self) -> usize {
        self.evictable
    }

    pub fn contains(&self, h: &BlockHash) -> bool {
        self.entries.contains_key(h)
    }

    /// Reference a cached page; false if it is not cached.
    pub fn acquire(&mut self, h: BlockHash) -> bool {
        match self.entries.get_mut(&h) {
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

    /// Reference the page, adding it if absent.
    pub fn acquire_or_insert(&mut self, h: BlockHash) {
        match self.entries.entry(h) {
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let e = o.get_mut();
                if e.refs == 0 {
                    self.evictable -= 1;
                }
                e.refs += 1;
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Entry { refs: 1, tick: 0 });
                if let Some(log) = &mut self.log {
                    log.push((h, true));
                }
            }
        }
    }

    /// Drop one reference; at zero the page becomes the most recently used
    /// evictable one.
    pub fn release(&mut self, h: BlockHash) {
        let Some(e) = self.entries.get_mut(&h) else {
            return;
        };
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 {
            self.tick = self.tick.wrapping_add(1);
            e.tick = self.tick;
            self.evictable += 1;
            self.lru.push_back((self.tick, h));
            if self.lru.len() > 2 * self.entries.len() + 1024 {
                self.compact();
            }
        }
    }

    /// Evict the least recently used unreferenced page; false if none.
    pub fn evict_one(&mut self) -> bool {
        while let Some((tick, h)) = self.lru.pop_front() {
            if self
                .entries
                .get(&h)
                .is_some_and(|e| e.refs == 0 && e.tick == tick)
            {
                self.entries.remove(&h);
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

    fn compact(&mut self) {
        let entries = &self.entries;
        self.lru.retain(|(tick, h)| {
            entries
                .get(h)
                .is_some_and(|e| e.refs == 0 && e.tick == *tick)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_only_unreferenced_oldest_first() {
        let mut c = PrefixCache::new(true);
        for i in 0..3 {
            c.acquire_or_insert(BlockHash(i));
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
