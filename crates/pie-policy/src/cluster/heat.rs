//! `PrefixHeat`: how often each prompt block was asked for, to find the hot
//! prefixes the KV-mobility actors (`persist-prefix`, later `replicate`) act
//! on. The observer records every routed prompt's block chain; a hot prefix is
//! a chain of blocks asked for at least twice whose next block (in any
//! prompt) was asked for less often than that, so a system prompt shared by
//! many requests with different questions shows up once, as its own chain.
//!
//! Bounded: at most `capacity` blocks are tracked; past it, the half least
//! recently asked for are forgotten (a chain whose first blocks were
//! forgotten is not reported: it could not be named whole).
//!
//! Invariant (tested): every reported chain is whole (first block first, each
//! block's parent before it), its hits never increase along it, and its last
//! block has no child with as many hits.

use std::collections::{HashMap, HashSet};

use pie_core::BlockHash;

/// Blocks the controller and the simulator track for hot prefixes; past it
/// the least recently asked half goes.
pub const HEAT_CAPACITY: usize = 1 << 16;
/// Hot prefixes in an actors' snapshot, at most.
pub const HOT_PREFIXES: usize = 64;

/// A block's count and its place in the chain.
#[derive(Clone, Copy, Debug)]
struct Heat {
    hits: u64,
    parent: Option<BlockHash>,
    depth: usize,
    first_ms: u64,
    last_ms: u64,
}

/// A hot chain: its blocks (first first), each block's hits, and the rate
/// of its first block's requests since first seen.
#[derive(Clone, Debug, PartialEq)]
pub struct HotChain {
    pub blocks: Vec<BlockHash>,
    pub hits: Vec<u64>,
    pub requests_per_s: f64,
}

#[derive(Debug)]
pub struct PrefixHeat {
    blocks: HashMap<BlockHash, Heat>,
    capacity: usize,
}

impl PrefixHeat {
    pub fn new(capacity: usize) -> Self {
        Self {
            blocks: HashMap::new(),
            capacity: capacity.max(2),
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// A prompt whose full pages have these block hashes was routed.
    pub fn record(&mut self, chain: &[BlockHash], now_ms: u64) {
        let mut parent = None;
        for (depth, &hash) in chain.iter().enumerate() {
            let heat = self.blocks.entry(hash).or_insert(Heat {
                hits: 0,
                parent,
                depth,
                first_ms: now_ms,
                last_ms: now_ms,
            });
            heat.hits += 1;
            heat.last_ms = now_ms;
            parent = Some(hash);
        }
        if self.blocks.len() > self.capacity {
            self.forget_coldest();
        }
    }

    /// Keep the half most recently asked for; among blocks last asked for at
    /// the same time, the larger hashes stay (not the map's order: runs repeat).
    fn forget_coldest(&mut self) {
        let keep = self.capacity / 2;
        let mut by_age: Vec<(u64, BlockHash)> =
            self.blocks.iter().map(|(b, h)| (h.last_ms, *b)).collect();
        let cut = by_age.len().saturating_sub(keep);
        if cut == 0 {
            return;
        }
        by_age.select_nth_unstable(cut - 1);
        for (_, block) in &by_age[..cut] {
            self.blocks.remove(block);
        }
    }

    /// The hot chains, at most `limit`: the one whose last block is asked
    /// for most first, then the longer, then by hashes (reproducible).
    pub fn hot(&self, now_ms: u64, limit: usize) -> Vec<HotChain> {
        let hot = |h: &Heat| h.hits >= 2;
        // A block's child as hot as itself makes it no chain's end.
        let mut covered: HashSet<BlockHash> = HashSet::new();
        for h in self.blocks.values().filter(|h| hot(h)) {
            if let Some(parent) = h.parent.and_then(|p| self.blocks.get(&p).map(|ph| (p, ph))) {
                if parent.1.hits <= h.hits {
                    covered.insert(parent.0);
                }
            }
        }
        let mut chains: Vec<HotChain> = self
            .blocks
            .iter()
            .filter(|(hash, h)| hot(h) && !covered.contains(hash))
            .filter_map(|(&hash, _)| self.chain_to(hash, now_ms))
            .collect();
        chains.sort_by(|a, b| {
            b.hits[b.hits.len() - 1]
                .cmp(&a.hits[a.hits.len() - 1])
                .then(b.blocks.len().cmp(&a.blocks.len()))
                .then(a.blocks.cmp(&b.blocks))
        });
        chains.truncate(limit);
        chains
    }

    /// The whole chain ending at `last`; None when a block of it was forgotten.
    fn chain_to(&self, last: BlockHash, now_ms: u64) -> Option<HotChain> {
        let mut blocks = Vec::new();
        let mut hits = Vec::new();
        let mut at = Some(last);
        let mut first_ms = now_ms;
        while let Some(hash) = at {
            let h = self.blocks.get(&hash)?;
            blocks.push(hash);
            hits.push(h.hits);
            first_ms = h.first_ms;
            at = h.parent;
        }
        // A block forgotten and asked for again restarts its count: such a
        // chain is not whole either.
        if blocks.len() != self.blocks[&last].depth + 1 || hits.windows(2).any(|w| w[0] > w[1]) {
            return None;
        }
        blocks.reverse();
        hits.reverse();
        let seconds = (now_ms.saturating_sub(first_ms) as f64 / 1000.0).max(1.0);
        Some(HotChain {
            requests_per_s: hits[0] as f64 / seconds,
            blocks,
            hits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chain(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().copied().map(BlockHash).collect()
    }

    #[test]
    fn a_shared_system_prompt_is_one_chain() {
        let mut heat = PrefixHeat::new(1000);
        for (i, question) in [10, 11, 12].into_iter().enumerate() {
            heat.record(&chain(&[1, 2, 3, question]), i as u64 * 1000);
        }
        heat.record(&chain(&[7]), 0);
        let hot = heat.hot(4000, 10);
        assert_eq!(hot.len(), 1, "{hot:?}");
        assert_eq!(hot[0].blocks, chain(&[1, 2, 3]));
        assert_eq!(hot[0].hits, vec![3, 3, 3]);
        assert!((hot[0].requests_per_s - 0.75).abs() < 1e-9);
    }

    #[test]
    fn a_longer_shared_part_is_its_own_chain() {
        let mut heat = PrefixHeat::new(1000);
        for c in [[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 2, 5]] {
            heat.record(&chain(&c), 0);
        }
        let hot = heat.hot(0, 10);
        let found: Vec<(Vec<BlockHash>, Vec<u64>)> =
            hot.into_iter().map(|c| (c.blocks, c.hits)).collect();
        assert_eq!(
            found,
            vec![
                (chain(&[1, 2]), vec![4, 4]),
                (chain(&[1, 2, 3]), vec![4, 4, 2])
            ]
        );
    }

    /// Which of the blocks tied at the cut go does not depend on the map's
    /// (per-instance, random) order.
    #[test]
    fn forgetting_ties_is_reproducible() {
        for _ in 0..10 {
            let mut heat = PrefixHeat::new(8);
            for b in 1..=9 {
                heat.record(&chain(&[b]), 0);
            }
            let mut kept: Vec<u64> = heat.blocks.keys().map(|b| b.0).collect();
            kept.sort_unstable();
            assert_eq!(kept, [6, 7, 8, 9]);
        }
    }

    #[test]
    fn forgetting_keeps_the_recent_half_and_drops_broken_chains() {
        let mut heat = PrefixHeat::new(8);
        heat.record(&chain(&[1, 2]), 0);
        heat.record(&chain(&[1, 2]), 0);
        for t in 1..=4u64 {
            heat.record(&chain(&[100 + t, 200 + t]), t);
        }
        assert!(heat.len() <= 8);
        heat.record(&chain(&[2]), 10);
        assert!(heat.hot(10, 10).iter().all(|c| c.blocks[0] != BlockHash(2)));
    }

    proptest! {
        #[test]
        fn reported_chains_are_whole_and_end_where_hits_drop(
            prompts in proptest::collection::vec(proptest::collection::vec(0u64..4, 1..6), 1..40),
            capacity in 4usize..64,
        ) {
            let mut heat = PrefixHeat::new(capacity);
            let mut recorded: Vec<Vec<BlockHash>> = Vec::new();
            for (t, p) in prompts.iter().enumerate() {
                // Hashes of a chain depend on every block before (like the real chain).
                let c: Vec<BlockHash> = p
                    .iter()
                    .scan(0u64, |h, &b| {
                        *h = h.wrapping_mul(31).wrapping_add(b + 1);
                        Some(BlockHash(*h))
                    })
                    .collect();
                heat.record(&c, t as u64);
                recorded.push(c);
            }
            prop_assert!(heat.len() <= capacity.max(2));
            for hot in heat.hot(prompts.len() as u64, usize::MAX) {
                prop_assert!(recorded.iter().any(|c| c.starts_with(&hot.blocks)));
                prop_assert!(hot.hits.windows(2).all(|w| w[0] >= w[1]));
                let last = *hot.blocks.last().unwrap();
                let last_hits = *hot.hits.last().unwrap();
                prop_assert!(last_hits >= 2);
                for c in &recorded {
                    if let Some(i) = c.iter().position(|&b| b == last) {
                        if let Some(child) = c.get(i + 1) {
                            let child_hits = heat.blocks.get(child).map_or(0, |h| h.hits);
                            prop_assert!(child_hits < last_hits);
                        }
                    }
                }
            }
        }
    }
}
