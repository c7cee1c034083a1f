//! A one-worker run logged step by step ([`Schedule`], from
//! `crate::run_schedule`): what `pie-worker`'s engine, driven on the
//! simulator's clock, must reproduce.

use crate::records::Record;

/// A logged schedule longer than this is a livelock.
pub const MAX_SCHEDULE_STEPS: usize = 100_000;

/// A one-worker run step by step: what the engine, driven on the simulator's
/// clock, must reproduce.
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    /// Every request's record (first token, finish, cached tokens).
    pub records: Vec<Record>,
    /// Every time the worker planned, in order, also when it found nothing to
    /// run (sequences may have expired then).
    pub steps: Vec<LoggedStep>,
    /// Admitted requests in admission order, each with the number of plans made
    /// before it arrived: it joins the next.
    pub admissions: Vec<(usize, usize)>,
    pub preemptions: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoggedStep {
    pub start_us: u64,
    /// `start_us` when nothing ran.
    pub end_us: u64,
    pub batch_tokens: usize,
    /// Free pages and unreferenced cached pages once the step took effect.
    pub free_pages: usize,
    pub cached_pages: usize,
}
