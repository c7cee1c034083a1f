//! Test fixtures shared by the actors' tests: workers and hot prefixes.

use pie_core::BlockHash;

use super::actions::{HotPrefix, WorkerState};

/// A healthy worker with `load` of `max_running` 4.
pub fn worker(name: &str, load: usize) -> WorkerState {
    WorkerState {
        name: name.into(),
        healthy: true,
        load,
        max_running: 4,
        ..WorkerState::default()
    }
}

/// A hot prefix of blocks `first..first + hits.len()` with `hits`, held as
/// `holders` say, at `rate` requests/s.
pub fn hot(first: u64, hits: &[u64], holders: &[(String, usize)], rate: f64) -> HotPrefix {
    HotPrefix {
        blocks: (first..first + hits.len() as u64).map(BlockHash).collect(),
        hits: hits.to_vec(),
        page_size: 16,
        holders: holders.to_vec(),
        persisted: Vec::new(),
        requests_per_s: rate,
    }
}

/// `(name, blocks)` pairs as owned holders.
pub fn holders(list: &[(&str, usize)]) -> Vec<(String, usize)> {
    list.iter().map(|(w, n)| (w.to_string(), *n)).collect()
}

/// Prefix `i` of a property test: 3 blocks asked for 5 times each, held by
/// `w{w % workers}` as `at` says (the last entry for a worker wins).
pub fn generated_hot(i: usize, rate: f64, at: &[(usize, usize)], workers: usize) -> HotPrefix {
    let at: std::collections::BTreeMap<usize, usize> =
        at.iter().map(|&(w, n)| (w % workers, n)).collect();
    let held: Vec<(String, usize)> = at.iter().map(|(w, n)| (format!("w{w}"), *n)).collect();
    hot(i as u64 * 10, &[5, 5, 5], &held, rate)
}
