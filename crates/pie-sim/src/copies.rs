//! Prefix copies in the simulator (`CopyPrefix`, from `replicate`): the hot
//! prefixes the actors see and what a copy costs.
//!
//! The simulator records every routed prompt's usable blocks in a
//! `PrefixHeat` (the controller's) when an actor reads hot prefixes; a hot
//! prefix's holders are the workers whose prefix cache holds its leading
//! blocks, as the controller's index says. A copy sends the blocks the
//! source still holds (from the first) that the target lacks over the
//! target's receiving link (`disaggregate::Links`, as a disaggregated
//! prefill's pages, KV bytes per token as `disaggregate::kv_bytes_per_token`);
//! when they arrive they go into the target's prefix cache (as many as fit)
//! and so into the router's index, which is what the controller's KV events
//! do. Nothing is recomputed. A copy whose target stopped (autoscaling)
//! before it arrived fails: its pages are dropped and the actors hear
//! `ActionFailed`.

use pie_core::BlockHash;
use pie_policy::cluster::{Action, HotPrefix, PrefixHeat, HOT_PREFIXES};
use serde::Serialize;

use crate::cache::PrefixCache;

/// A copy on its way: the target (its incarnation, `Fleet::stops`, when
/// the copy started), the blocks it gets, and the action it carries out.
#[derive(Clone, Debug)]
pub struct PrefixCopy {
    pub to: usize,
    pub incarnation: u32,
    pub blocks: Vec<BlockHash>,
    pub action: Action,
}

/// What a run's prefix copies did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CopyCounters {
    /// Copies executed (one per `CopyPrefix`).
    pub copies: u64,
    /// Pages sent and their bytes.
    pub pages: u64,
    pub bytes: u64,
    /// Pages the targets took into their caches when they arrived.
    pub received: u64,
    /// Copies whose target stopped before they arrived (their pages
    /// dropped; `ActionFailed` told to the actors).
    #[serde(skip_serializing_if = "is_zero")]
    pub failed: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How many of `blocks`, from the first, `cache` holds.
pub fn leading_held(cache: &PrefixCache, blocks: &[BlockHash]) -> usize {
    blocks.iter().take_while(|h| cache.contains(h)).count()
}

/// The hottest prefixes with the workers (`w0`, `w1`, ...) that hold a
/// leading part of them.
pub fn hot_prefixes<'a>(
    heat: &PrefixHeat,
    now_ms: u64,
    page_size: usize,
    caches: impl Iterator<Item = &'a PrefixCache> + Clone,
) -> Vec<HotPrefix> {
    heat.hot(now_ms, HOT_PREFIXES)
        .into_iter()
        .map(|c| HotPrefix {
            holders: caches
                .clone()
                .enumerate()
                .map(|(w, cache)| (format!("w{w}"), leading_held(cache, &c.blocks)))
                .filter(|&(_, n)| n > 0)
                .collect(),
            persisted: Vec::new(),
            blocks: c.blocks,
            hits: c.hits,
            page_size,
            requests_per_s: c.requests_per_s,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_are_the_caches_with_a_leading_part() {
        let mut heat = PrefixHeat::new(64);
        let chain: Vec<BlockHash> = (1..=3).map(BlockHash).collect();
        for t in 0..3 {
            heat.record(&chain, t * 1000);
        }
        let mut a = PrefixCache::new(false);
        let mut b = PrefixCache::new(false);
        let c = PrefixCache::new(false);
        for h in &chain {
            a.insert(*h);
        }
        b.insert(BlockHash(2));
        let hot = hot_prefixes(&heat, 3000, 16, [&a, &b, &c].into_iter());
        assert_eq!(hot.len(), 1);
        assert_eq!(
            hot[0].holders,
            vec![("w0".to_string(), 3)],
            "b holds block 2 but not the first: not a holder"
        );
        assert_eq!(hot[0].blocks, chain);
    }
}
