//! The process table: every live process and the finished ones still shown by
//! the API. Finished records are bounded in number (`[server]
//! max_finished_processes`), in bytes (`max_finished_bytes`, oldest launched
//! first for both) and in age (`finished_ttl_ms`): every client request adds
//! one, so without a bound the table grows with client input. (One record
//! is cut at `max_record_bytes` when it finishes: `Process::finish`.)

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::process::{ProcState, Process, StateCounts};

#[derive(Clone, Copy, Debug)]
pub struct RecordLimits {
    pub max_finished: usize,
    pub finished_ttl_ms: u64,
    /// `[server] max_finished_bytes`: what all finished records keep.
    pub max_finished_bytes: usize,
    /// `[server] max_record_bytes`: one finished record is cut past it.
    pub max_record_bytes: usize,
}

/// Processes by id, and their ids in launch order for dropping the oldest
/// finished records first.
pub struct ProcessTable {
    by_id: HashMap<String, Arc<Process>>,
    order: VecDeque<String>,
    limits: RecordLimits,
    /// Live (queued and running) processes, all of which are in the table.
    counts: Arc<StateCounts>,
}

impl ProcessTable {
    pub fn new(limits: RecordLimits, counts: Arc<StateCounts>) -> Self {
        Self {
            by_id: HashMap::new(),
            order: VecDeque::new(),
            limits,
            counts,
        }
    }

    pub fn get(&self, id: &str) -> Option<&Arc<Process>> {
        self.by_id.get(id)
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<Process>> {
        self.by_id.values()
    }

    /// Finished, failed and killed records kept.
    pub fn finished(&self) -> usize {
        let live = self.counts.get(ProcState::Queued) + self.counts.get(ProcState::Running);
        self.by_id.len().saturating_sub(live)
    }

    /// Add `process`, then forget the oldest finished records past the bound.
    pub fn insert(&mut self, process: Arc<Process>) {
        self.order.push_back(process.id.clone());
        self.by_id.insert(process.id.clone(), process);
        self.evict_excess();
    }

    /// Forget records finished more than `finished_ttl_ms` before `now_ms`
    /// (a full pass: the table is bounded), then any past the count bound.
    pub fn sweep(&mut self, now_ms: u64) {
        let ttl = self.limits.finished_ttl_ms;
        let (by_id, counts) = (&mut self.by_id, &self.counts);
        self.order.retain(|id| {
            let expired = by_id
                .get(id)
                .and_then(|p| p.finished_ms())
                .is_some_and(|done| now_ms.saturating_sub(done) >= ttl);
            if expired {
                if let Some(p) = by_id.remove(id) {
                    counts.forget(p.kept_bytes());
                }
            }
            !expired && by_id.contains_key(id)
        });
        self.evict_excess();
    }

    /// Past `max_finished` or `max_finished_bytes`, forget the oldest
    /// finished records. Live ones met on the way go to the back (amortised
    /// O(1) per launch).
    fn evict_excess(&mut self) {
        let mut passes = self.order.len();
        while self.over_budget() && passes > 0 {
            passes -= 1;
            let Some(id) = self.order.pop_front() else {
                break;
            };
            match self.by_id.get(&id) {
                Some(p) if !p.state().is_final() => self.order.push_back(id),
                _ => {
                    if let Some(p) = self.by_id.remove(&id) {
                        self.counts.forget(p.kept_bytes());
                    }
                }
            }
        }
    }

    fn over_budget(&self) -> bool {
        self.finished() > self.limits.max_finished
            || self.counts.finished_bytes() > self.limits.max_finished_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::Props;

    fn process(i: usize, counts: &Arc<StateCounts>) -> Arc<Process> {
        Arc::new(Process::new(
            format!("proc-{i}"),
            "text-completion",
            "c".into(),
            Props::new(),
            1,
            counts.clone(),
        ))
    }

    fn table(max_finished: usize, finished_ttl_ms: u64) -> ProcessTable {
        let limits = RecordLimits {
            max_finished,
            finished_ttl_ms,
            max_finished_bytes: usize::MAX,
            max_record_bytes: usize::MAX,
        };
        ProcessTable::new(limits, Arc::default())
    }

    /// Finished records past `max_finished_bytes` go oldest first, and their
    /// bytes stop counting.
    #[test]
    fn finished_records_are_kept_within_their_byte_budget() {
        let limits = RecordLimits {
            max_finished: 100,
            finished_ttl_ms: u64::MAX,
            max_finished_bytes: 3_000,
            max_record_bytes: usize::MAX,
        };
        let counts = Arc::<StateCounts>::default();
        let mut table = ProcessTable::new(limits, counts.clone());
        for i in 0..5 {
            let p = process(i, &counts);
            p.push_emitted("x".repeat(1_000));
            p.finish(ProcState::Finished, Some("stop"), None);
            table.insert(p);
        }
        assert!(
            counts.finished_bytes() <= 3_000,
            "{}",
            counts.finished_bytes()
        );
        assert_eq!(table.finished(), 2, "each keeps 1,000 bytes + its overhead");
        assert!(table.get("proc-2").is_none() && table.get("proc-3").is_some());
        table.sweep(u64::MAX);
        assert_eq!(table.finished(), 2);
    }

    #[test]
    fn the_oldest_finished_records_go_first_and_counts_follow_states() {
        let mut table = table(100, u64::MAX);
        let counts = table.counts.clone();
        for i in 0..=100 {
            let p = process(i, &counts);
            if i > 0 {
                p.finish(ProcState::Finished, Some("stop"), None);
            }
            table.insert(p);
        }
        assert_eq!(counts.get(ProcState::Queued), 1);
        table.by_id["proc-0"].mark_running();
        assert_eq!(counts.get(ProcState::Queued), 0);
        assert_eq!(counts.get(ProcState::Running), 1);
        assert_eq!(table.finished(), 100);
        table.insert(process(101, &counts));
        assert!(
            table.get("proc-1").is_some(),
            "a live record does not count"
        );
        let done = process(102, &counts);
        done.finish(ProcState::Killed, None, None);
        table.insert(done);
        assert_eq!(table.finished(), 100);
        assert!(table.get("proc-0").is_some(), "a running process stays");
        assert!(
            table.get("proc-1").is_none(),
            "the oldest finished one goes"
        );
        assert!(table.get("proc-2").is_some());
        assert_eq!(counts.get(ProcState::Queued), 1, "proc-101");
    }

    #[test]
    fn finished_records_expire_after_the_ttl_and_live_ones_never() {
        let mut table = table(100, 1_000);
        let counts = table.counts.clone();
        let (live, old, young) = (
            process(0, &counts),
            process(1, &counts),
            process(2, &counts),
        );
        for p in [&live, &old, &young] {
            table.insert(p.clone());
        }
        old.finish(ProcState::Failed, None, Some("x".into()));
        let done = old.finished_ms().unwrap();
        table.sweep(done + 999);
        assert_eq!(table.by_id.len(), 3, "not yet expired");
        std::thread::sleep(std::time::Duration::from_millis(5));
        young.finish(ProcState::Finished, Some("stop"), None);
        table.sweep(done + 1_000);
        assert!(table.get("proc-1").is_none(), "expired");
        assert!(table.get("proc-0").is_some() && table.get("proc-2").is_some());
        assert_eq!(table.order.len(), 2);
        table.sweep(u64::MAX);
        assert_eq!(table.order, ["proc-0"], "live processes stay");
    }
}
