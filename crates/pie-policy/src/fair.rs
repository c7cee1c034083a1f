//! `fair`: fair share across clients with a virtual token counter (VTC; Sheng et
//! al., "Fairness in Serving Large Language Models", OSDI 2024).
//!
//! Rule: each client has a counter. Serving a sequence charges its client
//! `input_weight` per prompt token computed and `output_weight` per generated
//! token, divided by the client's `weight` prop. Running sequences (those
//! holding pages) go first, then waiting ones; within each, the client with the
//! smallest counter first, FCFS within a client. So fairness decides admission,
//! as in VTC, and never displaces a running sequence: an order that follows the
//! service charged flips between two sequences as they are served, and if
//! either could preempt the other for pages, both would be recomputed forever
//! (found by the engine-vs-simulator property test). The order is
//! work-conserving: every runnable sequence stays in it. When a client goes from no
//! runnable work to some, its counter is lifted to `max(own, min over the clients
//! that already have work)`, so idling earns no credit.
//! Props read: `weight` (float > 0, default 1). The client comes from the request.
//! Config keys: `[runtime.fair] input_weight` (default 1), `output_weight` (2).
//! Invariant (tested): for two backlogged clients, the weighted service difference
//! stays within `2 * max(input_weight * max_input_len, output_weight * max_batch_tokens)`;
//! a client sending ten times more requests gets no more service; the lift holds.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::worker::{Candidate, WorkerPolicy};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FairConfig {
    pub input_weight: f64,
    pub output_weight: f64,
}

impl Default for FairConfig {
    fn default() -> Self {
        Self {
            input_weight: 1.0,
            output_weight: 2.0,
        }
    }
}

#[derive(Debug, Default)]
pub struct Fair {
    config: FairConfig,
    counters: HashMap<String, f64>,
    /// Clients that had runnable work at the last ordering.
    active: HashSet<String>,
}

impl Fair {
    pub fn new(config: FairConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    pub fn counter(&self, client: &str) -> f64 {
        self.counters.get(client).copied().unwrap_or(0.0)
    }

    /// Lift the counters of clients that just got work.
    fn lift_newcomers(&mut self, present: &HashSet<&str>) {
        let min_active = present
            .iter()
            .filter(|c| self.active.contains(**c))
            .map(|c| self.counter(c))
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.min(x))));
        for client in present.iter().filter(|c| !self.active.contains(**c)) {
            let own = self.counter(client);
            self.counters
                .insert(client.to_string(), min_active.map_or(own, |m| own.max(m)));
        }
        self.active = present.iter().map(|c| c.to_string()).collect();
    }
}

fn weight(c: &Candidate) -> f64 {
    c.props.float("weight").filter(|w| *w > 0.0).unwrap_or(1.0)
}

impl WorkerPolicy for Fair {
    fn name(&self) -> &'static str {
        "fair"
    }

    fn order(&mut self, _now_ms: u64, candidates: &mut [Candidate]) {
        let present: HashSet<&str> = candidates.iter().map(|c| c.client.as_str()).collect();
        self.lift_newcomers(&present);
        // Counters are never negative, so their bit patterns sort like their values.
        candidates.sort_by_cached_key(|c| {
            (
                !c.running,
                self.counter(&c.client).to_bits(),
                c.arrival_ms,
                c.seq,
            )
        });
    }

    fn charge(&mut self, c: &Candidate, prefill_tokens: usize, generated_tokens: usize) {
        let cost = (self.config.input_weight * prefill_tokens as f64
            + self.config.output_weight * generated_tokens as f64)
            / weight(c);
        *self.counters.entry(c.client.clone()).or_default() += cost;
    }

    fn summary(&self) -> Value {
        json!({"counters": self.counters, "input_weight": self.config.input_weight, "output_weight": self.config.output_weight})
    }

    fn restore(&mut self, previous_name: &str, previous: &Value) {
        if previous_name != self.name() {
            return;
        }
        if let Some(counters) = previous
            .get("counters")
            .and_then(|c| serde_json::from_value(c.clone()).ok())
        {
            self.counters = counters;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::{PropValue, Props, SeqId};
    use proptest::prelude::*;

    fn cand(seq: u64, client: &str, arrival_ms: u64) -> Candidate {
        Candidate {
            seq: SeqId(seq),
            arrival_ms,
            running: false,
            prefill_tokens: 0,
            client: client.into(),
            props: Props::new(),
        }
    }

    const MAX_INPUT: usize = 64;
    const MAX_BATCH: usize = 32;

    /// Serve the first candidate each step with a job of (input, output) tokens;
    /// clients' queues hold `queued[c]` jobs, refilled so both stay backlogged.
    /// Returns the service each client got (weight 1, input 1, output 2).
    fn simulate(jobs: &[(usize, usize)], queued: [usize; 2]) -> [f64; 2] {
        let mut p = Fair::new(FairConfig::default());
        let clients = ["a", "b"];
        let mut next_seq = 0;
        let mut queue: Vec<Candidate> = Vec::new();
        for (ci, n) in queued.iter().enumerate() {
            for _ in 0..*n {
                queue.push(cand(next_seq, clients[ci], next_seq));
                next_seq += 1;
            }
        }
        let mut service = [0.0; 2];
        for &(input, output) in jobs {
            p.order(0, &mut queue);
            let served = queue.remove(0);
            p.charge(&served, input, output);
            let ci = clients.iter().position(|c| *c == served.client).unwrap();
            service[ci] += input as f64 + 2.0 * output as f64;
            queue.push(cand(next_seq, clients[ci], next_seq));
            next_seq += 1;
        }
        service
    }

    proptest! {
        #[test]
        fn service_difference_is_bounded(jobs in proptest::collection::vec((0..=MAX_INPUT, 0..=MAX_BATCH), 1..300)) {
            let [a, b] = simulate(&jobs, [1, 1]);
            let bound = 2.0 * (MAX_INPUT as f64).max(2.0 * MAX_BATCH as f64);
            prop_assert!((a - b).abs() <= bound, "a {a} b {b}");
        }

        #[test]
        fn ten_times_the_requests_buys_no_more_service(jobs in proptest::collection::vec((0..=MAX_INPUT, 0..=MAX_BATCH), 1..300)) {
            let [flood, light] = simulate(&jobs, [10, 1]);
            let bound = 2.0 * (MAX_INPUT as f64).max(2.0 * MAX_BATCH as f64);
            prop_assert!(flood - light <= bound, "flood {flood} light {light}");
        }
    }

    #[test]
    fn idle_clients_earn_no_credit() {
        let mut p = Fair::new(FairConfig::default());
        let mut q = vec![cand(0, "a", 0)];
        p.order(0, &mut q);
        p.charge(&q[0], 1000, 0);
        // "b" arrives while "a" has work: lifted to a's counter, not left at 0.
        let mut q = vec![cand(1, "a", 1), cand(2, "b", 2)];
        p.order(0, &mut q);
        assert_eq!(p.counter("b"), 1000.0);
        // Ties go FCFS, so a's older request still leads.
        assert_eq!(q[0].client, "a");
    }

    #[test]
    fn running_sequences_keep_their_place_before_waiting_ones() {
        let mut p = Fair::new(FairConfig::default());
        let mut q = vec![cand(0, "a", 0), cand(1, "b", 1)];
        p.order(0, &mut q);
        p.charge(&q[0], 1000, 0);
        let mut waiting = cand(2, "b", 2);
        let mut running = cand(0, "a", 0);
        running.running = true;
        waiting.running = false;
        let mut q = vec![waiting, running];
        p.order(0, &mut q);
        assert!(p.counter("a") > p.counter("b"));
        assert_eq!(q[0].client, "a", "the running sequence is not displaced");
        q[0].running = false;
        p.order(0, &mut q);
        assert_eq!(q[0].client, "b", "among waiting ones, the smaller counter");
    }

    #[test]
    fn weight_divides_the_charge() {
        let mut p = Fair::new(FairConfig {
            input_weight: 1.0,
            output_weight: 2.0,
        });
        let mut heavy = cand(0, "h", 0);
        heavy.props.set("weight", PropValue::Float(4.0)).unwrap();
        p.charge(&heavy, 8, 4);
        assert_eq!(p.counter("h"), (8.0 + 8.0) / 4.0);
    }

    #[test]
    fn counters_survive_a_reload_into_fair() {
        let mut old = Fair::new(FairConfig::default());
        old.charge(&cand(0, "x", 0), 10, 0);
        let mut new = Fair::new(FairConfig::default());
        new.restore("fair", &old.summary());
        assert_eq!(new.counter("x"), 10.0);
    }
}
