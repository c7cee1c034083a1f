//! Virtual token counters (VTC; Sheng et al., OSDI 2024): the weighted service
//! each client received, what `fair` on a worker and `queue_order = "fair"`
//! in the controller both order by. Serving a client charges it
//! `input_weight` per prompt token and `output_weight` per generated token,
//! divided by its `weight`. A client that goes from no work to some is lifted
//! to `max(own, min over the clients that already have work)`, so idling
//! earns no credit; idle clients at or below every client with work are
//! forgotten (the floor stands for them), so the map stays bounded.
//! Invariant (tested here and through `fair`): the lift holds, idle clients'
//! counters do not pile up, and a counter survives a reload.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

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
pub struct ServiceCounters {
    config: FairConfig,
    counters: HashMap<String, f64>,
    /// The counter of every client not in `counters`: a client without work
    /// whose counter is at or below every client with work is forgotten (on
    /// its return it would be lifted to at least that), so the map holds only
    /// clients with work or with more service than them, not every client ever
    /// seen.
    floor: f64,
    /// Clients that had work at the last [`ServiceCounters::track`].
    active: HashSet<String>,
}

impl ServiceCounters {
    pub fn new(config: FairConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// New weights apply to what is charged from now on; counters stay.
    pub fn set_config(&mut self, config: FairConfig) {
        self.config = config;
    }

    pub fn counter(&self, client: &str) -> f64 {
        self.counters.get(client).copied().unwrap_or(self.floor)
    }

    /// The clients with work now are `present`: lift the newcomers among
    /// them, forget idle clients at or below them.
    pub fn track(&mut self, present: &HashSet<&str>) {
        self.lift_newcomers(present);
        self.forget_idle(present);
    }

    /// `client` received service: `input_tokens` prompt tokens computed,
    /// `output_tokens` generated, at `weight` (> 0; anything else counts as 1).
    pub fn charge(&mut self, client: &str, weight: f64, input_tokens: usize, output_tokens: usize) {
        let weight = if weight > 0.0 { weight } else { 1.0 };
        let cost = (self.config.input_weight * input_tokens as f64
            + self.config.output_weight * output_tokens as f64)
            / weight;
        let floor = self.floor;
        *self.counters.entry(client.to_string()).or_insert(floor) += cost;
    }

    /// Counters kept (a gauge: it must stay bounded).
    pub fn tracked_clients(&self) -> usize {
        self.counters.len()
    }

    pub fn summary(&self) -> Value {
        json!({"counters": self.counters, "floor": self.floor, "input_weight": self.config.input_weight, "output_weight": self.config.output_weight})
    }

    /// Take over the counters of an earlier [`ServiceCounters::summary`].
    pub fn restore(&mut self, previous: &Value) {
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
