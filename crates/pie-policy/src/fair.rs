//! `fair`: fair share across clients with a virtual token counter (VTC; Sheng et
//! al., "Fairness in Serving Large Language Models", OSDI 2024), and max-min
//! fair running slots.
//!
//! Rule: each client has a counter. Serving a sequence charges its client
//! `input_weight` per prompt token computed and `output_weight` per generated
//! token, divided by the client's `weight` prop. The worker's `max_running`
//! slots are divided max-min fairly by demand (each client's sequences on the
//! worker): a client asking for less than an equal split gets all it asks, the
//! rest is split among the others. A client's sequences within its slot share
//! (running ones first, then by arrival) go before every sequence beyond a
//! share, and a waiting sequence within its share takes the slot of a running
//! one beyond another's (preempts for slots): so a light client below its
//! share gets all of its demand at once, without waiting for a flooder's
//! sequence to finish. Within each of the two groups, running sequences go
//! first, then waiting ones; among those, the client with the smallest counter
//! first, FCFS within a client. Running first keeps progress: an order that
//! follows the service charged flips between two sequences as they are served,
//! and if either could preempt the other for pages, both would be recomputed
//! forever (found by the engine-vs-simulator property test). The order is
//! work-conserving: every runnable sequence stays in it, slots beyond the
//! shares go to the sequences beyond a share. When a client goes from no
//! runnable work to some, its counter is lifted to `max(own, min over the
//! clients that already have work)`, so idling earns no credit.
//! Props read: `weight` (float > 0, default 1; a client key's limits cap it).
//! The client comes from the request.
//! Config keys: `[runtime.fair] input_weight` (default 1), `output_weight` (2),
//! `max_idle_clients` (10000).
//! Invariant (tested): for two backlogged clients, the weighted service difference
//! stays within `2 * max(input_weight * max_input_len, output_weight * max_batch_tokens)`;
//! a client sending ten times more requests gets no more service; the lift
//! holds; idle clients' counters do not pile up; a light client (2 sequences) beside a flooder (12) on 4 slots gets
//! half of the tokens (`scheduler/tests.rs`).

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use pie_core::SeqId;

use crate::worker::{Candidate, WorkerPolicy};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FairConfig {
    pub input_weight: f64,
    pub output_weight: f64,
    /// Counters kept for clients without work; past this the smallest go
    /// (a returning client then starts at the floor, which can only favour it
    /// by the service it had beyond the clients with work).
    pub max_idle_clients: usize,
}

impl Default for FairConfig {
    fn default() -> Self {
        Self {
            input_weight: 1.0,
            output_weight: 2.0,
            max_idle_clients: 10_000,
        }
    }
}

#[derive(Debug, Default)]
pub struct Fair {
    config: FairConfig,
    counters: HashMap<String, f64>,
    /// The counter of every client not in `counters`: a client without work
    /// whose counter is at or below every client with work is forgotten (on
    /// its return it would be lifted to at least that), so the map holds only
    /// clients with work or with more service than them, not every client ever
    /// seen.
    floor: f64,
    /// Clients that had runnable work at the last ordering.
    active: HashSet<String>,
    /// The worker's running slots, divided among clients (unbounded until told).
    max_running: Option<usize>,
}

impl Fair {
    pub fn new(config: FairConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    pub fn counter(&self, client: &str) -> f64 {
        self.counters.get(client).copied().unwrap_or(self.floor)
    }

    /// Forget idle clients at or below the smallest counter with work.
    fn forget_idle(&mut self, present: &HashSet<&str>) {
        let Some(min) = present
            .iter()
            .map(|c| self.counter(c))
            .min_by(f64::total_cmp)
        else {
            return;
        };
        self.counters
            .retain(|client, counter| *counter > min || present.contains(client.as_str()));
        self.floor = self.floor.max(min);
        let idle = self.counters.len() - present.len();
        if idle > self.config.max_idle_clients {
            let mut by_counter: Vec<(f64, String)> = self
                .counters
                .iter()
                .filter(|(client, _)| !present.contains(client.as_str()))
                .map(|(client, counter)| (*counter, client.clone()))
                .collect();
            by_counter.sort_by(|a, b| a.0.total_cmp(&b.0));
            for (_, client) in by_counter
                .into_iter()
                .take(idle - self.config.max_idle_clients)
            {
                self.counters.remove(&client);
            }
        }
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

/// Max-min fair division of `slots` among clients by their demand: in order
/// of demand, each gets the smaller of its demand and an equal split of what
/// is left (whole slots; a remainder stays undivided).
fn slot_shares<'a>(demand: &HashMap<&'a str, usize>, slots: usize) -> HashMap<&'a str, usize> {
    let mut by_demand: Vec<(&str, usize)> = demand.iter().map(|(c, n)| (*c, *n)).collect();
    by_demand.sort_by_key(|&(client, n)| (n, client));
    let mut left = slots;
    let count = by_demand.len();
    by_demand
        .into_iter()
        .enumerate()
        .map(|(i, (client, n))| {
            let share = n.min(left / (count - i));
            left -= share;
            (client, share)
        })
        .collect()
}

/// The sequences beyond their client's slot share: a client's running
/// sequences count first, then its waiting ones by arrival.
fn beyond_share(candidates: &[Candidate], slots: usize) -> HashSet<SeqId> {
    let mut mine: HashMap<&str, Vec<&Candidate>> = HashMap::new();
    for c in candidates {
        mine.entry(c.client.as_str()).or_default().push(c);
    }
    let demand = mine.iter().map(|(c, seqs)| (*c, seqs.len())).collect();
    let shares = slot_shares(&demand, slots);
    let mut beyond = HashSet::new();
    for (client, mut seqs) in mine {
        seqs.sort_by_key(|c| (!c.running, c.arrival_ms, c.seq));
        beyond.extend(seqs[shares[client]..].iter().map(|c| c.seq));
    }
    beyond
}

impl WorkerPolicy for Fair {
    fn name(&self) -> &'static str {
        "fair"
    }

    fn order(&mut self, _now_ms: u64, candidates: &mut [Candidate]) {
        let present: HashSet<&str> = candidates.iter().map(|c| c.client.as_str()).collect();
        self.lift_newcomers(&present);
        self.forget_idle(&present);
        let beyond = beyond_share(candidates, self.max_running.unwrap_or(usize::MAX));
        // Counters are never negative, so their bit patterns sort like their values.
        candidates.sort_by_cached_key(|c| {
            (
                beyond.contains(&c.seq),
                !c.running,
                self.counter(&c.client).to_bits(),
                c.arrival_ms,
                c.seq,
            )
        });
    }

    fn preempts_for_slots(&self) -> bool {
        true
    }

    fn set_max_running(&mut self, max_running: usize) {
        self.max_running = Some(max_running);
    }

    fn tracked_clients(&self) -> usize {
        self.counters.len()
    }

    fn charge(&mut self, c: &Candidate, prefill_tokens: usize, generated_tokens: usize) {
        let cost = (self.config.input_weight * prefill_tokens as f64
            + self.config.output_weight * generated_tokens as f64)
            / weight(c);
        let floor = self.floor;
        *self.counters.entry(c.client.clone()).or_insert(floor) += cost;
    }

    fn summary(&self) -> Value {
        json!({"counters": self.counters, "floor": self.floor, "input_weight": self.config.input_weight, "output_weight": self.config.output_weight})
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
        if let Some(floor) = previous.get("floor").and_then(Value::as_f64) {
            self.floor = floor;
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
    fn counters_of_idle_clients_are_bounded() {
        let mut p = Fair::new(FairConfig {
            max_idle_clients: 100,
            ..FairConfig::default()
        });
        for i in 0..1000 {
            let mut q = vec![cand(i, &format!("once-{i}"), i)];
            p.order(0, &mut q);
            p.charge(&q[0], 10, 0);
        }
        let mut q = vec![cand(1000, "steady", 1000)];
        p.order(0, &mut q);
        assert!(
            p.tracked_clients() <= 101,
            "{} counters kept",
            p.tracked_clients()
        );
        // A forgotten client comes back at the floor, never below a client with work.
        let mut q = vec![cand(1001, "steady", 1001), cand(1002, "once-3", 1002)];
        p.order(0, &mut q);
        assert!(p.counter("once-3") >= p.counter("steady"));
    }

    #[test]
    fn weight_divides_the_charge() {
        let mut p = Fair::new(FairConfig::default());
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
