//! `deadline`: earliest deadline first (EDF).
//!
//! Rule: a sequence's deadline is its arrival plus its `deadline-ms` prop; the
//! earliest deadline goes first, sequences without one after all that have one
//! (FCFS among them). With `on_miss = "abort"` a sequence whose deadline passed is
//! stopped; with `continue` (default) it keeps running. Misses are counted by the
//! worker (`pie_deadline_misses_total`).
//! Props read: `deadline-ms` (int, ms after arrival). Config keys:
//! `[runtime.deadline] on_miss` = "continue" | "abort".
//! Invariant (tested): on random feasible job sets EDF misses no more deadlines
//! than FCFS (none, since EDF is optimal for a feasible set released together).

use serde::{Deserialize, Serialize};

use crate::worker::{Candidate, WorkerPolicy};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnMiss {
    #[default]
    Continue,
    Abort,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeadlineConfig {
    pub on_miss: OnMiss,
}

#[derive(Debug, Default)]
pub struct Deadline {
    config: DeadlineConfig,
}

/// Absolute deadline of a sequence, if it has one.
pub fn deadline_of(c: &Candidate) -> Option<u64> {
    c.props
        .int("deadline-ms")
        .map(|d| c.arrival_ms.saturating_add(d.max(0) as u64))
}

impl Deadline {
    pub fn new(config: DeadlineConfig) -> Self {
        Self { config }
    }
}

impl WorkerPolicy for Deadline {
    fn name(&self) -> &'static str {
        "deadline"
    }

    fn order(&mut self, _now_ms: u64, candidates: &mut [Candidate]) {
        candidates
            .sort_by_cached_key(|c| (deadline_of(c).unwrap_or(u64::MAX), c.arrival_ms, c.seq));
    }

    fn abort(&self, now_ms: u64, c: &Candidate) -> bool {
        self.config.on_miss == OnMiss::Abort && deadline_of(c).is_some_and(|d| now_ms > d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fcfs::Fcfs;
    use pie_core::{PropValue, Props, SeqId};
    use proptest::prelude::*;

    /// Run jobs (length, deadline) released at 0 one at a time in the policy's order;
    /// count the misses.
    fn misses(policy: &mut dyn WorkerPolicy, jobs: &[(u64, u64)]) -> usize {
        let mut queue: Vec<Candidate> = jobs
            .iter()
            .enumerate()
            .map(|(i, &(_, d))| {
                let mut props = Props::new();
                props.set("deadline-ms", PropValue::Int(d as i64)).unwrap();
                Candidate {
                    seq: SeqId(i as u64),
                    arrival_ms: 0,
                    running: false,
                    prefill_tokens: 0,
                    client: String::new(),
                    props,
                }
            })
            .collect();
        let mut now = 0;
        let mut missed = 0;
        while !queue.is_empty() {
            policy.order(now, &mut queue);
            let job = queue.remove(0);
            now += jobs[job.seq.0 as usize].0;
            missed += usize::from(now > deadline_of(&job).unwrap());
        }
        missed
    }

    proptest! {
        #[test]
        fn edf_misses_no_more_than_fcfs(lengths in proptest::collection::vec(1u64..20, 1..20), slack in proptest::collection::vec(0u64..10, 20), shuffle in any::<u64>()) {
            // Feasible by construction: in some order (a rotation) every job meets its
            // deadline with a little slack.
            let n = lengths.len();
            let start = (shuffle as usize) % n;
            let mut t = 0;
            let mut jobs = vec![(0, 0); n];
            for (k, extra) in slack.iter().enumerate().take(n) {
                let i = (start + k) % n;
                t += lengths[i];
                jobs[i] = (lengths[i], t + extra);
            }
            let edf = misses(&mut Deadline::default(), &jobs);
            let fcfs = misses(&mut Fcfs, &jobs);
            prop_assert_eq!(edf, 0);
            prop_assert!(edf <= fcfs);
        }
    }

    #[test]
    fn no_deadline_goes_last_and_abort_only_when_asked() {
        let mut with = Props::new();
        with.set("deadline-ms", PropValue::Int(50)).unwrap();
        let a = Candidate {
            seq: SeqId(0),
            arrival_ms: 0,
            running: false,
            prefill_tokens: 0,
            client: String::new(),
            props: Props::new(),
        };
        let b = Candidate {
            seq: SeqId(1),
            arrival_ms: 10,
            props: with,
            ..a.clone()
        };
        let mut q = vec![a.clone(), b.clone()];
        Deadline::default().order(0, &mut q);
        assert_eq!(q[0].seq, SeqId(1));
        assert!(!Deadline::default().abort(100, &b));
        assert!(Deadline::new(DeadlineConfig {
            on_miss: OnMiss::Abort
        })
        .abort(100, &b));
        assert!(!Deadline::new(DeadlineConfig {
            on_miss: OnMiss::Abort
        })
        .abort(59, &b));
        assert!(!Deadline::new(DeadlineConfig {
            on_miss: OnMiss::Abort
        })
        .abort(100, &a));
    }
}
