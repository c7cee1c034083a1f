//! `least-loaded`: the worker with the fewest queued and running processes.
//!
//! Rule: candidates sorted by load, ties by worker order. Props read: none.
//! Config keys: none. Invariant (tested): the first candidate has the minimum load.

use super::{ClusterPolicy, Reject, RouteRequest, WorkerView};

#[derive(Debug, Default)]
pub struct LeastLoaded;

impl ClusterPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn route(
        &mut self,
        _now_ms: u64,
        _req: &RouteRequest,
        workers: &[WorkerView],
        candidates: &mut Vec<usize>,
    ) -> Result<Option<String>, Reject> {
        candidates.sort_by_key(|&i| (workers[i].load, i));
        let best = &workers[candidates[0]];
        Ok(Some(format!("{} processes on {}", best.load, best.name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::views;
    use pie_core::Props;

    #[test]
    fn picks_minimum_load() {
        let w = views(&[3, 1, 2], &[0, 0, 0]);
        let mut c = vec![0, 1, 2];
        LeastLoaded
            .route(
                0,
                &RouteRequest {
                    props: &Props::new(),
                    prompt_tokens: 1,
                },
                &w,
                &mut c,
            )
            .unwrap();
        assert_eq!(c, vec![1, 2, 0]);
    }
}
