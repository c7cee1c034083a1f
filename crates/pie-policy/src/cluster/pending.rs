//! Anticipated prefixes: the block hashes of a prompt routed to a worker count
//! as pending on that worker from the routing decision until the worker's KV
//! events confirm them (it computed and published the pages) or `ttl_ms`
//! passes. Without this, requests of one new prefix that arrive while the
//! first is still prefilling all look cold and are spread over the workers,
//! each recomputing the prefix (SGLang's router inserts a request's text into
//! its tree when it routes it; Dynamo's KV router tracks predicted blocks).
//!
//! Pending blocks only ever add to what a worker holds: the routing views
//! carry both the held prefix and the held-or-pending one, and `cache-aware`
//! prefers the held one on a tie, so a worker that will have a prefix never
//! beats one that has it. Used by the controller's registry and by the
//! simulator's router alike. Invariant (tested): a block is pending on a slot
//! from `anticipate` until `confirm` or its deadline, whichever comes first;
//! anticipating it again moves the deadline.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use super::ClusterIndex;

/// Hashes a (slot, block hash) key by a folded 128-bit multiplication per
/// word, so both the high bits (the table's tags) and the low bits (its
/// buckets) depend on all of it: a lookup per routed and per published
/// block, where SipHash cost more than the probe.
#[derive(Debug, Default)]
struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        let m = u128::from(self.0 ^ x) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }

    /// A slot number, as in `PendingBlocks`' (slot, block) keys: one
    /// multiplication, not one per byte.
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

#[derive(Debug, Default)]
pub struct PendingBlocks {
    index: ClusterIndex,
    /// The latest deadline of each pending (slot, block).
    deadlines: HashMap<(usize, u64), u64, BuildHasherDefault<BlockHasher>>,
    /// (deadline, slot, block) in anticipation order; deadlines grow with it
    /// while `ttl_ms` stays, and a changed ttl only delays some expiries.
    queue: VecDeque<(u64, usize, u64)>,
    ttl_ms: u64,
}

impl PendingBlocks {
    /// Blocks stay pending `ttl_ms`; 0 anticipates nothing.
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            ttl_ms,
            ..Self::default()
        }
    }

    pub fn set_ttl(&mut self, ttl_ms: u64) {
        self.ttl_ms = ttl_ms;
    }

    /// A prompt with these block hashes was routed to `slot`, which holds
    /// the ones in `held` already: the others are pending there (a held block
    /// would never be confirmed again, its later eviction never seen here).
    pub fn anticipate(&mut self, slot: usize, hashes: &[u64], held: &ClusterIndex, now_ms: u64) {
        if self.ttl_ms == 0 {
            return;
        }
        let deadline = now_ms + self.ttl_ms;
        for &h in hashes.iter().filter(|&&h| !held.holds(slot, h)) {
            self.index.store(slot, h);
            self.deadlines.insert((slot, h), deadline);
            self.queue.push_back((deadline, slot, h));
        }
    }

    /// `slot` published `hash`: it is held, no longer pending.
    pub fn confirm(&mut self, slot: usize, hash: u64) {
        if self.deadlines.remove(&(slot, hash)).is_some() {
            self.index.remove(slot, hash);
        }
    }

    /// Drop what is past its deadline.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some(&(deadline, slot, hash)) = self.queue.front() {
            if deadline > now_ms {
                break;
            }
            self.queue.pop_front();
            if self.deadlines.get(&(slot, hash)) == Some(&deadline) {
                self.deadlines.remove(&(slot, hash));
                self.index.remove(slot, hash);
            }
        }
    }

    /// Whether `hash` is pending on `slot`.
    pub fn holds(&self, slot: usize, hash: u64) -> bool {
        self.index.holds(slot, hash)
    }

    /// The pending blocks by slot, to union with the held ones.
    pub fn index(&self) -> &ClusterIndex {
        &self.index
    }

    /// Pending (slot, block) pairs.
    pub fn len(&self) -> usize {
        self.deadlines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.deadlines.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_until_confirmed_or_expired_and_renewed_by_a_new_route() {
        let mut held = ClusterIndex::new();
        let mut p = PendingBlocks::new(100);
        p.anticipate(1, &[7, 8, 9], &held, 0);
        let depth = |p: &PendingBlocks| held.prefix_blocks_with(p.index(), &[7, 8, 9], 3);
        assert_eq!(depth(&p), vec![0, 3, 0]);
        p.confirm(1, 9);
        assert_eq!((depth(&p)[1], p.len()), (2, 2));
        p.anticipate(1, &[7], &held, 60);
        p.expire(100);
        assert_eq!(
            depth(&p)[1],
            1,
            "8 expired at 100; 7 was routed again at 60"
        );
        p.expire(160);
        assert!(p.is_empty());
        assert_eq!(depth(&p), vec![0, 0, 0]);
        held.store(2, 7);
        p.anticipate(2, &[7, 8], &held, 200);
        assert!(
            !p.holds(2, 7) && p.holds(2, 8),
            "a block held already is not pending"
        );
        let mut off = PendingBlocks::new(0);
        off.anticipate(0, &[1], &held, 0);
        assert!(off.is_empty(), "ttl 0 anticipates nothing");
    }
}
