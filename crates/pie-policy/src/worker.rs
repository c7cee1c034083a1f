//! The worker-plane policy interface: which runnable sequence goes first.

use pie_core::{Props, SeqId};

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
}
