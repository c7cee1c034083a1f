//! `priority`: higher `priority` prop first.
//!
//! Rule: order by effective priority, highest first, FCFS within a level. The
//! effective priority is the `priority` prop (default 0), plus one per `aging_ms`
//! waited when aging is on. A waiting sequence ordered before a running one takes
//! its slot when `max_running` is reached, and under page pressure the engine
//! preempts the running sequence ordered last: the lowest priority, latest arrival.
//! Props read: `priority` (int). Config keys: `[runtime.priority] aging_ms`
//! (unset: no aging).
//! Invariant (tested): the order is sorted by (effective priority desc, arrival);
//! the preemption victim is the lowest-priority, latest-arrived running sequence;
//! with aging, any waiting sequence eventually outranks a newcomer of fixed priority.

use serde::{Deserialize, Serialize};

use crate::worker::{Candidate, WorkerPolicy};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityConfig {
    pub aging_ms: Option<u64>,
}

#[derive(Debug, Default)]
pub struct Priority {
    config: PriorityConfig,
}

impl Priority {
    pub fn new(config: PriorityConfig) -> Self {
        Self { config }
    }

    pub fn effective(&self, now_ms: u64, c: &Candidate) -> i64 {
        let base = c.props.int("priority").unwrap_or(0);
        let aged = self
            .config
            .aging_ms
            .filter(|a| *a > 0)
            .map_or(0, |a| (now_ms.saturating_sub(c.arrival_ms) / a) as i64);
        base.saturating_add(aged)
    }
}

impl WorkerPolicy for Priority {
    fn name(&self) -> &'static str {
        "priority"
    }

    fn order(&mut self, now_ms: u64, candidates: &mut [Candidate]) {
        candidates.sort_by_cached_key(|c| {
            (
                std::cmp::Reverse(self.effective(now_ms, c)),
                c.arrival_ms,
                c.seq,
            )
        });
    }

    fn preempts_for_slots(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::{PropValue, Props, SeqId};
    use proptest::prelude::*;

    fn cand(seq: u64, priority: i64, arrival_ms: u64, running: bool) -> Candidate {
        let mut props = Props::new();
        props.set("priority", PropValue::Int(priority)).unwrap();
        Candidate {
            seq: SeqId(seq),
            arrival_ms,
            running,
            prefill_tokens: 0,
            client: String::new(),
            props,
        }
    }

    proptest! {
        #[test]
        fn order_and_victim(jobs in proptest::collection::vec((-3i64..4, 0u64..50, any::<bool>()), 1..40)) {
            let mut c: Vec<Candidate> = jobs.iter().enumerate().map(|(i, &(p, a, r))| cand(i as u64, p, a, r)).collect();
            let mut policy = Priority::default();
            policy.order(100, &mut c);
            for w in c.windows(2) {
                let (pa, pb) = (w[0].props.int("priority").unwrap(), w[1].props.int("priority").unwrap());
                prop_assert!(pa > pb || (pa == pb && (w[0].arrival_ms, w[0].seq) < (w[1].arrival_ms, w[1].seq)));
            }
            // The engine preempts the last running sequence in the order.
            if let Some(victim) = c.iter().rev().find(|c| c.running) {
                let vp = victim.props.int("priority").unwrap();
                for other in c.iter().filter(|o| o.running) {
                    let op = other.props.int("priority").unwrap();
                    prop_assert!(op > vp || (op == vp && (other.arrival_ms, other.seq) <= (victim.arrival_ms, victim.seq)));
                }
            }
        }
    }

    #[test]
    fn aging_prevents_starvation() {
        let mut policy = Priority::new(PriorityConfig {
            aging_ms: Some(100),
        });
        let old = cand(0, 0, 0, false);
        // At t=1000 the old request has aged 10 levels: it beats a fresh priority-9 one.
        let mut c = vec![cand(1, 9, 1000, false), old.clone()];
        policy.order(1000, &mut c);
        assert_eq!(c[0].seq, SeqId(0));
        // Without aging it would wait forever behind priority 9.
        let mut c = vec![cand(1, 9, 1000, false), old];
        Priority::default().order(1000, &mut c);
        assert_eq!(c[0].seq, SeqId(1));
    }
}
