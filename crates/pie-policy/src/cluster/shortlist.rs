//! Shortlists: the few candidates a routing decision can depend on, so that a
//! pipeline at 1,000 workers looks at the workers that can win instead of
//! sorting all of them per request.
//!
//! For a pipeline of [`SHORTLIST_POLICIES`] (pin, session-affinity,
//! cache-aware, least-loaded, in any order), [`super::route_among`] over a
//! shortlist decides exactly as [`super::route`] over every candidate, when
//! the shortlist holds:
//! - the candidate cache-aware's prefix rule picks among the holders: the
//!   longest prefix of the prompt held or anticipated, then the most held,
//!   then the least loaded, then the lowest slot ([`LoadOrder::best_holder`];
//!   no other holder can win under any of these policies unless it is least
//!   loaded or named, and the rule needs only one holder with the longest
//!   prefix to know the prompt is not cold); with a shared page pool a
//!   worker able to pull a pooled prefix may win too, so the simulator's
//!   router routes a prompt the pool holds part of over every worker instead,
//! - every candidate at the minimum load (the imbalance rule, a cold prompt's
//!   rotation among the least loaded and least-loaded pick among them, and the
//!   rotation needs all of them to count the ties),
//! - one candidate at the maximum load (the imbalance rule reads min and max),
//! - the worker each policy names for the request (`pin`'s, the session's:
//!   [`super::ClusterPolicy::named_worker`]), where it is a candidate.
//!
//! Each of these policies picks by name, or by a total order over the
//! candidates' views, or from that minimum, maximum and ties, so any superset
//! of the above decides the same. [`LoadOrder`] keeps the candidates ordered by
//! load as loads change, so a shortlist costs a pass over the holders' loads
//! plus the least-loaded workers, not a pass over every worker's view. Invariant (tested by a proptest
//! against the full pipeline): same worker, same reason, same refusals.

use std::cmp::Reverse;
use std::collections::BTreeMap;

/// The routing policies whose decisions a shortlist preserves.
pub const SHORTLIST_POLICIES: &[&str] = &["pin", "session-affinity", "cache-aware", "least-loaded"];

/// Whether a pipeline of these routing policies decides the same on a
/// shortlist as on every candidate.
pub fn decides_on_shortlist<S: AsRef<str>>(names: &[S]) -> bool {
    names
        .iter()
        .all(|n| SHORTLIST_POLICIES.contains(&n.as_ref()))
}

/// The candidate workers (by slot) ordered by load, updated as loads change.
#[derive(Debug, Default)]
pub struct LoadOrder {
    /// Each slot's load; None when it is no candidate (prefill stage).
    loads: Vec<Option<usize>>,
    /// Candidate slots by load, each bucket ascending.
    buckets: BTreeMap<usize, Vec<usize>>,
}

impl LoadOrder {
    pub fn new() -> Self {
        Self::default()
    }

    /// `slot` is a candidate with `load` processes. Costs O(log W) plus
    /// moving the slot between two buckets.
    pub fn set(&mut self, slot: usize, load: usize) {
        self.remove(slot);
        self.loads[slot] = Some(load);
        let bucket = self.buckets.entry(load).or_default();
        let at = bucket.binary_search(&slot).unwrap_or_else(|at| at);
        bucket.insert(at, slot);
    }

    /// `slot` is no candidate.
    pub fn remove(&mut self, slot: usize) {
        if self.loads.len() <= slot {
            self.loads.resize(slot + 1, None);
        }
        let Some(load) = self.loads[slot].take() else {
            return;
        };
        let bucket = self.buckets.get_mut(&load).expect("a candidate's bucket");
        let at = bucket
            .binary_search(&slot)
            .expect("a candidate in its bucket");
        bucket.remove(at);
        if bucket.is_empty() {
            self.buckets.remove(&load);
        }
    }

    /// Whether `slot` is a candidate.
    pub fn contains(&self, slot: usize) -> bool {
        self.loads.get(slot).is_some_and(Option::is_some)
    }

    /// Of `holders` (slot, prefix blocks held or anticipated, blocks held),
    /// the candidate cache-aware's prefix rule picks: the longest prefix held
    /// or anticipated, then the most held, then the least loaded, then the
    /// lowest slot. One pass over the holders and their loads here, so that a
    /// prefix every worker holds (a shared system prompt) costs a shortlist
    /// of one holder, not of every worker's view.
    pub fn best_holder(
        &self,
        holders: impl IntoIterator<Item = (usize, usize, usize)>,
    ) -> Option<usize> {
        holders
            .into_iter()
            .filter_map(|(slot, ahead, held)| {
                let load = self.loads.get(slot).copied().flatten()?;
                Some((Reverse(ahead.max(held)), Reverse(held), load, slot))
            })
            .min()
            .map(|(_, _, _, slot)| slot)
    }

    /// The shortlist for a request: `holders` (slots holding or anticipating
    /// a prefix of its prompt, ascending: every one, or the best one) and
    /// `named` (the workers the
    /// policies name for it) that are candidates, every candidate at the
    /// minimum load, and one at the maximum; ascending, each once. Empty when
    /// there is no candidate. Costs a merge of the holders with the
    /// least-loaded workers.
    pub fn shortlist(&self, holders: &[usize], named: &[usize]) -> Vec<usize> {
        let (Some((_, least)), Some((_, most))) = (
            self.buckets.first_key_value(),
            self.buckets.last_key_value(),
        ) else {
            return Vec::new();
        };
        debug_assert!(holders.windows(2).all(|w| w[0] < w[1]), "ascending");
        let mut out = Vec::with_capacity(least.len() + holders.len() + named.len() + 1);
        let (mut a, mut b) = (least.iter().peekable(), holders.iter().peekable());
        loop {
            // The least loaded are candidates; a holder may not be.
            match (a.peek(), b.peek()) {
                (Some(&&x), Some(&&y)) if x <= y => {
                    if x == y {
                        b.next();
                    }
                    a.next();
                    out.push(x);
                }
                (_, Some(&&y)) => {
                    b.next();
                    if self.contains(y) {
                        out.push(y);
                    }
                }
                (Some(_), None) => {
                    out.extend(a);
                    break;
                }
                (None, None) => break,
            }
        }
        for &slot in named.iter().chain([&most[0]]) {
            if let (Err(at), true) = (out.binary_search(&slot), self.contains(slot)) {
                out.insert(at, slot);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{
        route, route_among, routing_policy, ClusterPolicy, RouteRequest, RoutingConfigs, Stage,
        WorkerView,
    };
    use pie_core::{PropValue, Props};
    use proptest::prelude::*;

    #[test]
    fn shortlist_holds_the_least_loaded_one_most_loaded_and_the_named() {
        let mut order = LoadOrder::new();
        for (slot, load) in [(0, 3), (1, 1), (2, 5), (3, 1), (4, 2)] {
            order.set(slot, load);
        }
        order.remove(2);
        assert_eq!(order.shortlist(&[4], &[]), vec![0, 1, 3, 4]);
        order.set(1, 7);
        // Slot 2 is no candidate: a holder or name there is left out.
        assert_eq!(order.shortlist(&[2], &[0, 0]), vec![0, 1, 3]);
        assert!(LoadOrder::new().shortlist(&[1], &[2]).is_empty());
        assert!(decides_on_shortlist(&[
            "pin",
            "session-affinity",
            "cache-aware"
        ]));
        assert!(!decides_on_shortlist(&["cache-aware", "round-robin"]));
    }

    /// One request: its props, and per worker (load, held, anticipated extra)
    /// prefix tokens; workers may be prefill-stage.
    #[derive(Clone, Debug)]
    struct Step {
        session: Option<u8>,
        pin: Option<u8>,
        workers: Vec<(usize, usize, usize, bool)>,
    }

    fn step(workers: usize) -> impl Strategy<Value = Step> {
        let worker = (
            0..14usize,
            prop_oneof![4 => Just(0usize), 1 => 1..6usize],
            prop_oneof![4 => Just(0usize), 1 => 1..4usize],
            prop::bool::weighted(0.05),
        );
        // Narrow loads make ties and balanced load common; a cold step
        // (no prefix anywhere) rotates among the least loaded.
        (
            prop::option::weighted(0.5, 0..6u8),
            prop::option::weighted(0.1, 0..(workers as u8 + 2)),
            prop::collection::vec(worker, workers),
            any::<bool>(),
            prop::bool::weighted(0.4),
        )
            .prop_map(|(session, pin, mut workers, narrow, cold)| {
                for (load, held, extra, _) in &mut workers {
                    if narrow {
                        *load %= 3;
                    }
                    if cold {
                        (*held, *extra) = (0, 0);
                    }
                }
                Step {
                    session,
                    pin,
                    workers,
                }
            })
    }

    fn pipelines() -> impl Strategy<Value = Vec<&'static str>> {
        prop::sample::select(vec![
            vec!["cache-aware"],
            vec!["session-affinity", "cache-aware"],
            vec!["pin", "session-affinity", "cache-aware"],
            vec!["pin", "session-affinity", "least-loaded"],
            vec!["least-loaded"],
            vec!["cache-aware", "least-loaded"],
        ])
    }

    proptest! {
        #[test]
        fn a_shortlist_decides_as_every_candidate(
            pipeline in pipelines(),
            steps in (1..40usize).prop_flat_map(|w| prop::collection::vec(step(w), 1..30)),
        ) {
            let build = || -> Vec<Box<dyn ClusterPolicy>> {
                pipeline.iter().map(|n| routing_policy(n, &RoutingConfigs::default()).expect("known")).collect()
            };
            let (mut full, mut short) = (build(), build());
            for (t, s) in steps.iter().enumerate() {
                let now_ms = t as u64 * 1000;
                let mut props = Props::new();
                if let Some(session) = s.session {
                    props.set("session", PropValue::Str(format!("s{session}"))).expect("prop");
                }
                if let Some(pin) = s.pin {
                    props.set("pin", PropValue::Str(format!("w{pin}"))).expect("prop");
                }
                let req = RouteRequest { props: &props, prompt_tokens: 100 };
                let views: Vec<WorkerView> = s.workers.iter().enumerate().map(|(i, &(load, held, extra, prefill))| WorkerView {
                    name: format!("w{i}"),
                    load,
                    cached_prefix_tokens: held * 16,
                    anticipated_prefix_tokens: (held + extra) * 16,
                    stage: if prefill { Stage::Prefill } else { Stage::Both },
                    max_running: 0,
                    pool_prefix_tokens: 0,
                }).collect();
                let mut order = LoadOrder::new();
                for (i, v) in views.iter().enumerate() {
                    if v.stage != Stage::Prefill {
                        order.set(i, v.load);
                    }
                }
                let holders: Vec<usize> = order.best_holder((0..views.len())
                    .filter(|&i| views[i].anticipated_prefix_tokens > 0)
                    .map(|i| (i, views[i].anticipated_prefix_tokens, views[i].cached_prefix_tokens)))
                    .into_iter()
                    .collect();
                let named: Vec<usize> = short.iter()
                    .filter_map(|p| p.named_worker(now_ms, &req))
                    .filter_map(|n| views.iter().position(|v| v.name == n))
                    .collect();
                let shortlist = order.shortlist(&holders, &named);
                let want = route(&mut full, now_ms, &req, &views);
                let got = route_among(&mut short, now_ms, &req, &views, shortlist);
                prop_assert_eq!(&got, &want, "step {}", t);
                if let Ok((w, _)) = want {
                    crate::cluster::record(&mut full, now_ms, &req, &views[w].name);
                    crate::cluster::record(&mut short, now_ms, &req, &views[w].name);
                }
            }
        }
    }
}
