//! The cluster prefix index: which workers hold which block hashes, so that the
//! cached prefix of a prompt on every worker is found with one lookup per prompt
//! block, however many workers there are.
//!
//! Workers are numbered by slot (0, 1, ...). Each block hash maps to a bitmask of
//! the slots holding it, one `u64` mask per shard of 64 slots, so a lookup costs
//! one probe per prompt block per shard. Memory: one entry of 16 bytes (hash and
//! mask) plus one control byte per (block, shard) pair, at a load factor of at
//! most 7/8: about 20 bytes per distinct block per shard of 64 workers. A block
//! held by several workers of a shard costs one entry, not several.
//!
//! Invariant (tested): after any sequence of `store`, `remove` and `replace`,
//! `prefix_blocks` agrees with a per-worker set of hashes.

use std::collections::HashMap;

const SLOTS_PER_SHARD: usize = 64;

#[derive(Debug, Default)]
pub struct ClusterIndex {
    shards: Vec<HashMap<u64, u64>>,
    /// Blocks each slot holds.
    counts: Vec<usize>,
}

fn split(slot: usize) -> (usize, u64) {
    (slot / SLOTS_PER_SHARD, 1u64 << (slot % SLOTS_PER_SHARD))
}

impl ClusterIndex {
    pub fn new() -> Self {
        Self::default()
    }

    fn grow_to(&mut self, slot: usize) {
        let (shard, _) = split(slot);
        if self.shards.len() <= shard {
            self.shards.resize_with(shard + 1, HashMap::new);
        }
        if self.counts.len() <= slot {
            self.counts.resize(slot + 1, 0);
        }
    }

    /// `slot` now holds `hash`.
    pub fn store(&mut self, slot: usize, hash: u64) {
        self.grow_to(slot);
        let (shard, bit) = split(slot);
        let mask = self.shards[shard].entry(hash).or_insert(0);
        if *mask & bit == 0 {
            *mask |= bit;
            self.counts[slot] += 1;
        }
    }

    /// `slot` no longer holds `hash`.
    pub fn remove(&mut self, slot: usize, hash: u64) {
        let (shard, bit) = split(slot);
        let Some(map) = self.shards.get_mut(shard) else {
            return;
        };
        let Some(mask) = map.get_mut(&hash) else {
            return;
        };
        if *mask & bit != 0 {
            *mask &= !bit;
            self.counts[slot] -= 1;
            if *mask == 0 {
                map.remove(&hash);
            }
        }
    }

    /// Forget everything `slot` held (a worker left, or before a snapshot).
    /// Costs one pass over the slot's shard.
    pub fn clear(&mut self, slot: usize) {
        let (shard, bit) = split(slot);
        if let Some(map) = self.shards.get_mut(shard) {
            map.retain(|_, mask| {
                *mask &= !bit;
                *mask != 0
            });
        }
        if let Some(count) = self.counts.get_mut(slot) {
            *count = 0;
        }
    }

    /// `slot` holds exactly `hashes` (a snapshot).
    pub fn replace(&mut self, slot: usize, hashes: impl IntoIterator<Item = u64>) {
        self.clear(slot);
        for h in hashes {
            self.store(slot, h);
        }
    }

    /// Whether `slot` holds `hash`.
    pub fn holds(&self, slot: usize, hash: u64) -> bool {
        let (shard, bit) = split(slot);
        self.shards
            .get(shard)
            .and_then(|map| map.get(&hash))
            .is_some_and(|mask| mask & bit != 0)
    }

    /// Blocks `slot` holds.
    pub fn blocks_of(&self, slot: usize) -> usize {
        self.counts.get(slot).copied().unwrap_or(0)
    }

    /// Distinct (block, shard) entries: what the memory cost is proportional to.
    pub fn entries(&self) -> usize {
        self.shards.iter().map(HashMap::len).sum()
    }

    /// For each slot below `slots`, how many leading blocks of the chain `hashes`
    /// it holds.
    pub fn prefix_blocks(&self, hashes: &[u64], slots: usize) -> Vec<usize> {
        prefix_blocks_of(&[self], hashes, slots)
    }

    /// As [`Self::prefix_blocks`], a block counting as held when this index or
    /// `other` has it (held blocks and anticipated ones).
    pub fn prefix_blocks_with(
        &self,
        other: &ClusterIndex,
        hashes: &[u64],
        slots: usize,
    ) -> Vec<usize> {
        prefix_blocks_of(&[self, other], hashes, slots)
    }
}

/// For each slot, the leading blocks of `hashes` held in any of `indexes`.
fn prefix_blocks_of(indexes: &[&ClusterIndex], hashes: &[u64], slots: usize) -> Vec<usize> {
    let mut out = vec![0; slots];
    let shards = indexes.iter().map(|i| i.shards.len()).max().unwrap_or(0);
    for shard in 0..shards {
        let base = shard * SLOTS_PER_SHARD;
        if base >= slots {
            break;
        }
        let maps: Vec<&HashMap<u64, u64>> =
            indexes.iter().filter_map(|i| i.shards.get(shard)).collect();
        let mut alive = u64::MAX;
        for (depth, h) in hashes.iter().enumerate() {
            let held = maps
                .iter()
                .fold(0, |m, map| m | map.get(h).copied().unwrap_or(0));
            let dropped = alive & !held;
            record_depth(&mut out, base, dropped, depth);
            alive &= held;
            if alive == 0 {
                break;
            }
        }
        record_depth(&mut out, base, alive, hashes.len());
    }
    out
}

/// Slots in `mask` (offset by `base`) hold exactly `depth` leading blocks.
fn record_depth(out: &mut [usize], base: usize, mut mask: u64, depth: usize) {
    while mask != 0 {
        let slot = base + mask.trailing_zeros() as usize;
        mask &= mask - 1;
        if let Some(o) = out.get_mut(slot) {
            *o = depth;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn prefix_depth_per_worker() {
        let mut idx = ClusterIndex::new();
        idx.replace(0, [1, 2, 3]);
        idx.replace(1, [1, 2]);
        idx.store(70, 1);
        assert_eq!(idx.prefix_blocks(&[1, 2, 3, 4], 71)[..2], [3, 2]);
        assert_eq!(idx.prefix_blocks(&[1, 2, 3, 4], 71)[70], 1);
        assert!(idx.holds(70, 1) && !idx.holds(70, 2) && !idx.holds(9, 1));
        assert_eq!(
            idx.prefix_blocks(&[4, 1], 2),
            vec![0, 0],
            "prefix starts at block 0"
        );
        idx.remove(0, 2);
        assert_eq!(idx.prefix_blocks(&[1, 2, 3], 2), vec![1, 2]);
        assert_eq!(idx.blocks_of(0), 2);
        idx.clear(1);
        assert_eq!(idx.blocks_of(1), 0);
        assert_eq!(
            idx.entries(),
            3,
            "blocks 1 and 3 of shard 0, block 1 of shard 1"
        );
    }

    #[test]
    fn a_block_held_in_either_index_counts() {
        let (mut held, mut pending) = (ClusterIndex::new(), ClusterIndex::new());
        held.replace(0, [1, 2]);
        pending.replace(0, [3]);
        pending.replace(65, [1, 2, 3]);
        assert_eq!(held.prefix_blocks_with(&pending, &[1, 2, 3, 4], 66)[0], 3);
        assert_eq!(held.prefix_blocks_with(&pending, &[1, 2, 3, 4], 66)[65], 3);
        assert_eq!(pending.prefix_blocks_with(&held, &[4, 1], 1), vec![0]);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Store(usize, u64),
        Remove(usize, u64),
        Replace(usize, Vec<u64>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..130usize, 0..8u64).prop_map(|(s, h)| Op::Store(s, h)),
            (0..130usize, 0..8u64).prop_map(|(s, h)| Op::Remove(s, h)),
            (0..130usize, prop::collection::vec(0..8u64, 0..6))
                .prop_map(|(s, h)| Op::Replace(s, h)),
        ]
    }

    proptest! {
        #[test]
        fn agrees_with_per_worker_sets(ops in prop::collection::vec(op(), 0..200), chain in prop::collection::vec(0..8u64, 0..6)) {
            let mut idx = ClusterIndex::new();
            let mut sets = vec![HashSet::new(); 130];
            for op in ops {
                match op {
                    Op::Store(s, h) => { idx.store(s, h); sets[s].insert(h); }
                    Op::Remove(s, h) => { idx.remove(s, h); sets[s].remove(&h); }
                    Op::Replace(s, hs) => { idx.replace(s, hs.clone()); sets[s] = hs.into_iter().collect(); }
                }
            }
            let got = idx.prefix_blocks(&chain, 130);
            for (slot, set) in sets.iter().enumerate() {
                let want = chain.iter().take_while(|h| set.contains(h)).count();
                prop_assert_eq!(got[slot], want, "slot {}", slot);
                prop_assert_eq!(idx.blocks_of(slot), set.len());
            }
        }
    }
}
