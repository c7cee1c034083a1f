//! The cluster prefix index: which workers hold which block hashes, so that the
//! cached prefix of a prompt on every worker is found with one lookup per prompt
//! block, however many workers there are.
//!
//! Workers are numbered by slot (0, 1, ...). Each block hash maps to a bitmask of
//! the slots holding it, one `u64` mask per shard of 64 slots, so a lookup costs
//! one probe per prompt block per shard. Memory: one slot of 16 bytes (hash and
//! mask) per (block, shard) pair, at a load factor of at most 3/4 (a
//! [`MaskTable`]: one cache miss per probe, and a prefix walk prefetches the
//! next block's slots): 21-43 bytes per distinct block per shard of 64
//! workers. A block held by several workers of a shard costs one entry, not
//! several.
//!
//! Invariant (tested): after any sequence of `store`, `remove` and `replace`,
//! `prefix_blocks` agrees with a per-worker set of hashes, and
//! `prefix_holders` with `prefix_blocks` and `prefix_blocks_with`.

use super::masks::MaskTable;

const SLOTS_PER_SHARD: usize = 64;

/// How many leading blocks of a prompt's chain one slot holds, and holds or
/// has pending.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PrefixHolder {
    pub slot: usize,
    pub held: usize,
    pub ahead: usize,
}

#[derive(Debug, Default)]
pub struct ClusterIndex {
    shards: Vec<MaskTable>,
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
            self.shards.resize_with(shard + 1, MaskTable::default);
        }
        if self.counts.len() <= slot {
            self.counts.resize(slot + 1, 0);
        }
    }

    /// `slot` now holds `hash`.
    pub fn store(&mut self, slot: usize, hash: u64) {
        self.grow_to(slot);
        let (shard, bit) = split(slot);
        if self.shards[shard].set_bit(hash, bit) {
            self.counts[slot] += 1;
        }
    }

    /// Start loading the entry a `store` or `remove` of (`slot`, `hash`)
    /// reads, so that a batch of them (a worker's KV events) overlaps its
    /// cache misses.
    pub fn prefetch(&self, slot: usize, hash: u64) {
        if let Some(map) = self.shards.get(split(slot).0) {
            map.prefetch(hash);
        }
    }

    /// `slot` no longer holds `hash`.
    pub fn remove(&mut self, slot: usize, hash: u64) {
        let (shard, bit) = split(slot);
        if self
            .shards
            .get_mut(shard)
            .is_some_and(|map| map.clear_bit(hash, bit))
        {
            self.counts[slot] -= 1;
        }
    }

    /// Forget everything `slot` held (a worker left, or before a snapshot).
    /// Costs one pass over the slot's shard.
    pub fn clear(&mut self, slot: usize) {
        let (shard, bit) = split(slot);
        if let Some(map) = self.shards.get_mut(shard) {
            map.clear_bits(bit);
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
        self.shards.iter().map(MaskTable::len).sum()
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

    /// The slots below `slots` holding, here or in `pending`, at least the
    /// first block of the chain `hashes`, with what [`Self::prefix_blocks`]
    /// (`held`) and [`Self::prefix_blocks_with`] (`ahead`) report for them;
    /// ascending by slot. One walk for both and no pass over every slot: the
    /// cost follows the prompt's blocks times the shards where a slot still
    /// holds its chain, plus the holders.
    pub fn prefix_holders(
        &self,
        pending: &ClusterIndex,
        hashes: &[u64],
        slots: usize,
    ) -> Vec<PrefixHolder> {
        let shards =
            (self.shards.len().max(pending.shards.len())).min(slots.div_ceil(SLOTS_PER_SHARD));
        if hashes.is_empty() {
            return Vec::new();
        }
        let mut walks: Vec<MaskTableWalk> = (0..shards)
            .map(|s| MaskTableWalk::new(s, hashes.len()))
            .collect();
        let mut live: Vec<usize> = (0..shards).collect();
        let mut held = Vec::with_capacity(shards);
        // Depth by depth over every shard still holding the chain, so that one
        // depth's probes (each a likely cache miss) are independent of each
        // other and overlap, instead of a shard's chain of probes one by one.
        for (depth, h) in hashes.iter().enumerate() {
            if let Some(&next) = hashes.get(depth + 1) {
                for &s in &live {
                    if let Some(map) = self.shards.get(s) {
                        map.prefetch(next);
                    }
                }
            }
            held.clear();
            held.extend(live.iter().map(|&s| probe(self.shards.get(s), h)));
            for (&s, &mine) in live.iter().zip(&held) {
                let walk = &mut walks[s];
                let ahead = mine
                    | if walk.ahead_alive & !mine != 0 {
                        probe(pending.shards.get(s), h)
                    } else {
                        0
                    };
                walk.step(depth, mine, ahead);
            }
            live.retain(|&s| walks[s].ahead_alive != 0);
            if live.is_empty() {
                break;
            }
        }
        let mut out = Vec::new();
        for walk in &walks {
            walk.holders_below(slots, &mut out);
        }
        out
    }
}

/// `map`'s mask for `hash`: the shard's slots holding it.
fn probe(map: Option<&MaskTable>, hash: &u64) -> u64 {
    map.and_then(|m| m.get(hash)).copied().unwrap_or(0)
}

/// One shard's walk down a prompt's chain in [`ClusterIndex::prefix_holders`].
struct MaskTableWalk {
    shard: usize,
    /// The slots (bits) holding every block so far, and holding or having
    /// pending every block so far.
    held_alive: u64,
    ahead_alive: u64,
    /// The slots holding or having pending the first block.
    holders: u64,
    /// Per bit: the depth where it stopped holding (held only, and held or
    /// pending); the chain's length if it never did.
    held_at: [u32; SLOTS_PER_SHARD],
    ahead_at: [u32; SLOTS_PER_SHARD],
}

impl MaskTableWalk {
    fn new(shard: usize, chain: usize) -> Self {
        let chain = u32::try_from(chain).expect("a chain under 2^32 blocks");
        Self {
            shard,
            held_alive: u64::MAX,
            ahead_alive: u64::MAX,
            holders: 0,
            held_at: [chain; SLOTS_PER_SHARD],
            ahead_at: [chain; SLOTS_PER_SHARD],
        }
    }

    /// The block at `depth` is held by the slots in `held` and held or
    /// pending on those in `ahead`.
    fn step(&mut self, depth: usize, held: u64, ahead: u64) {
        let at = depth as u32;
        for_bits(self.held_alive & !held, |bit| self.held_at[bit] = at);
        for_bits(self.ahead_alive & !ahead, |bit| self.ahead_at[bit] = at);
        self.held_alive &= held;
        self.ahead_alive &= ahead;
        if depth == 0 {
            self.holders = ahead;
        }
    }

    /// Appends the holders below `slots`, ascending.
    fn holders_below(&self, slots: usize, out: &mut Vec<PrefixHolder>) {
        let base = self.shard * SLOTS_PER_SHARD;
        for_bits(self.holders, |bit| {
            let slot = base + bit;
            if slot < slots {
                out.push(PrefixHolder {
                    slot,
                    held: self.held_at[bit] as usize,
                    ahead: self.ahead_at[bit] as usize,
                });
            }
        });
    }
}

/// Calls `f` with each set bit's position in `mask`, ascending.
fn for_bits(mut mask: u64, mut f: impl FnMut(usize)) {
    while mask != 0 {
        f(mask.trailing_zeros() as usize);
        mask &= mask - 1;
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
        let maps: Vec<&MaskTable> = indexes.iter().filter_map(|i| i.shards.get(shard)).collect();
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
        let holder = |slot, held, ahead| PrefixHolder { slot, held, ahead };
        assert_eq!(
            held.prefix_holders(&pending, &[1, 2, 3, 4], 66),
            vec![holder(0, 2, 3), holder(65, 0, 3)]
        );
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
        fn agrees_with_per_worker_sets(ops in prop::collection::vec(op(), 0..200), chain in prop::collection::vec(0..8u64, 0..6), extra in prop::collection::vec(0..8u64, 0..40)) {
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
            let mut pending = ClusterIndex::new();
            for (slot, &h) in extra.iter().enumerate() {
                pending.store(slot * 7 % 130, h);
            }
            let ahead = idx.prefix_blocks_with(&pending, &chain, 130);
            let mut sparse = vec![(0, 0); 130];
            for p in idx.prefix_holders(&pending, &chain, 130) {
                prop_assert!(p.ahead > 0 && sparse[p.slot] == (0, 0), "slot {} once, a holder", p.slot);
                sparse[p.slot] = (p.held, p.ahead);
            }
            let dense: Vec<(usize, usize)> = got.iter().copied().zip(ahead).collect();
            prop_assert_eq!(sparse, dense, "holders are the slots holding a prefix");
            for (slot, set) in sets.iter().enumerate() {
                let want = chain.iter().take_while(|h| set.contains(h)).count();
                prop_assert_eq!(got[slot], want, "slot {}", slot);
                prop_assert_eq!(idx.blocks_of(slot), set.len());
            }
        }
    }
}
