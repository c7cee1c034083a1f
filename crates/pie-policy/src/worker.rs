//! The worker-plane policy interface: which runnable sequence goes first.

use pie_core::{Props, SeqId};
use serde_json::Value;

/// What a worker policy sees of one runnable sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub seq: SeqId,
    /// Arrival time in ms (any fixed epoch); ties are broken by `seq`.
    pub arrival_ms: u64,
    /// Holds KV pages now (prefilled at least partly); a preemption victim must.
    pub running: bool,
    /// Prompt tokens still to prefill (0 when decoding).
    pub prefill_tokens: usize,
    /// Who is served: the API key's name, else the `client` prop, else "anonymous".
    pub client: String,
    /// The owning process's props as of this step.
    pub props: Props,
}

/// Orders a worker's runnable sequences each engine step.
///
/// The engine fills its token and page budget in the returned order; under page
/// pressure it preempts the running sequence that comes last.
pub trait WorkerPolicy: Send {
    fn name(&self) -> &'static str;

    /// Sort `candidates` most urgent first, at time `now_ms`.
    fn order(&mut self, now_ms: u64, candidates: &mut [Candidate]);

    /// Service a sequence received in one step: prompt tokens computed and tokens
    /// generated.
    fn charge(&mut self, _candidate: &Candidate, _prefill_tokens: usize, _generated_tokens: usize) {
    }

    /// Whether a waiting sequence ordered before a running one may take its place
    /// when `max_running` is reached (the running one is preempted).
    fn preempts_for_slots(&self) -> bool {
        false
    }

    /// The worker's `max_running`, for a policy that divides running slots
    /// among clients (the scheduler tells it before the first order).
    fn set_max_running(&mut self, _max_running: usize) {}

    /// Whether the sequence should be stopped now (e.g. its deadline passed).
    fn abort(&self, _now_ms: u64, _candidate: &Candidate) -> bool {
        false
    }

    /// Clients whose state the policy keeps (a gauge: it must stay bounded).
    fn tracked_clients(&self) -> usize {
        0
    }

    /// A JSON summary of the policy's state for `GET /v1/policies`.
    fn summary(&self) -> Value {
        Value::Null
    }

    /// Take over state from the policy this one replaces (a config reload); the
    /// argument is the old policy's `summary()`. Default: start fresh.
    fn restore(&mut self, _previous_name: &str, _previous_summary: &Value) {}
}
