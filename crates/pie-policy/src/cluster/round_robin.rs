//! `round-robin`: rotate through the candidates, for comparison.
//!
//! Rule: the n-th request goes to candidate `n mod len`. Props read: none.
//! Config keys: none. Invariant (tested): k*len requests spread exactly k per worker.

use super::{ClusterPolicy, Reject, RouteRequest, WorkerView};

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl ClusterPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn route(
        &mut self,
        _now_ms: u64,
        _req: &RouteRequest,
        workers: &[WorkerView],
        candidates: &mut Vec<usize>,
    ) -> Result<Option<String>, Reject> {
        let k = self.next % candidates.len();
        self.next = self.next.wrapping_add(1);
        candidates.rotate_left(k);
        Ok(Some(format!("turn of {}", workers[candidates[0]].name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::views;
    use pie_core::Props;

    #[test]
    fn spreads_evenly() {
        let w = views(&[0, 0, 0], &[0, 0, 0]);
        let mut rr = RoundRobin::default();
        let mut counts = [0; 3];
        for _ in 0..9 {
            let mut c = vec![0, 1, 2];
            rr.route(
                0,
                &RouteRequest {
                    props: &Props::new(),
                    prompt_tokens: 1,
                },
                &w,
                &mut c,
            )
            .unwrap();
            counts[c[0]] += 1;
        }
        assert_eq!(counts, [3, 3, 3]);
    }
}
