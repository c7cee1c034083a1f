//! `fcfs`: first come, first served.
//!
//! Rule: earlier arrival first; equal arrivals by sequence id (admission order).
//! Props read: none. Config keys: none.
//! Invariant (tested): the order is sorted by (arrival, id) whatever the input order.

use crate::worker::{Candidate, WorkerPolicy};

#[derive(Debug, Default)]
pub struct Fcfs;

impl WorkerPolicy for Fcfs {
    fn name(&self) -> &'static str {
        "fcfs"
    }

    fn order(&mut self, _now_ms: u64, candidates: &mut [Candidate]) {
        candidates.sort_by_key(|c| (c.arrival_ms, c.seq));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::{Props, SeqId};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn order_is_arrival_then_id(arrivals in proptest::collection::vec(0u64..20, 0..30)) {
            let mut c: Vec<Candidate> = arrivals.iter().enumerate().map(|(i, &a)| Candidate {
                seq: SeqId(100 - i as u64), arrival_ms: a, running: i % 2 == 0, prefill_tokens: i, client: String::new(), props: Props::new(),
            }).collect();
            Fcfs.order(0, &mut c);
            for w in c.windows(2) {
                prop_assert!((w[0].arrival_ms, w[0].seq) < (w[1].arrival_ms, w[1].seq));
            }
        }
    }
}
