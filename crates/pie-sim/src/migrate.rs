//! Live migration of a process between workers in the simulator (the
//! `MigrateProcess` action, e.g. from `rebalance`): what it costs and what the
//! run counts of it. `sim/migrate.rs` carries it out in stages, as Llumnix does:
//!
//! The stages are `pie_policy::cluster::MovePlan`'s, the controller's own:
//!
//! 1. Copy: the process's computed pages (a running process's full pages; a
//!    queued one's prefix cached on the source) that the target does not hold
//!    go over the target's receiving link (`disaggregate::Links`, KV bytes per
//!    token as `disaggregate::kv_bytes_per_token`), while the process keeps
//!    running on the source.
//! 2. At the source's step boundaries after a copy ends: another stage if
//!    more than one full page was computed meanwhile; otherwise, once its KV
//!    ends at a page boundary (at once for a queued process), the process
//!    leaves the source (its pages released there) and pauses: the pages
//!    computed since the last stage cross the link, then [`PAUSE_US`] more.
//!    It produces no token while paused.
//! 3. Resume: its pages go into the target's prefix cache (as a transferred
//!    prefill's do) and it joins the target's queue with its arrival time and
//!    the tokens it generated, so no token is lost or produced twice; its
//!    session is routed to the target from then on.
//!
//! A process that finishes or is aborted on the source before it leaves is
//! not moved (counted as abandoned), as a real migration is abandoned, never
//! half done.

use pie_policy::cluster::MovePlan;
use serde::Serialize;

/// The fixed part of a migration's pause (us), beyond the transfer of its last
/// pages: Llumnix (Sun et al., OSDI 2024) reports a downtime of about 20-30 ms
/// that does not grow with the sequence's length (the figure as issue 14
/// quotes it); we take its low end for the fixed part, the last pages' copy
/// adding the rest.
pub const PAUSE_US: u64 = 20_000;

/// A migration in progress.
#[derive(Clone, Copy, Debug)]
pub struct Migration {
    pub from: usize,
    pub to: usize,
    /// The stages so far and what comes next (the controller's plan).
    pub plan: MovePlan,
}

/// What a run's migrations did (simulator-wide counts).
#[derive(Clone, Debug, Default)]
pub struct MigrationCounters {
    pub started: u64,
    pub completed: u64,
    /// The process finished or was aborted on its source before it left.
    pub abandoned: u64,
    /// Copy stages, the final copy in the pause included.
    pub stages: u64,
    pub pages: u64,
    pub bytes: u64,
    /// Pauses (leaving the source to joining the target's queue), summed, and
    /// the longest.
    pub pause_us: u64,
    pub max_pause_us: u64,
}

/// The migration figures of [`crate::RunMetrics`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Migrations {
    pub started: u64,
    pub completed: u64,
    pub abandoned: u64,
    pub stages: u64,
    pub pages: u64,
    pub bytes: u64,
    pub mean_pause_ms: f64,
    pub max_pause_ms: f64,
}

impl Migrations {
    pub fn new(c: &MigrationCounters) -> Self {
        Self {
            started: c.started,
            completed: c.completed,
            abandoned: c.abandoned,
            stages: c.stages,
            pages: c.pages,
            bytes: c.bytes,
            mean_pause_ms: if c.completed > 0 {
                c.pause_us as f64 / c.completed as f64 / 1000.0
            } else {
                0.0
            },
            max_pause_ms: c.max_pause_us as f64 / 1000.0,
        }
    }
}
