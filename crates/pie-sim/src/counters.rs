//! The simulation's running counts ([`Counters`]): its own (events, steps,
//! tokens, prefix hits, preemptions, inter-token gaps) and each feature's
//! (transfers, migrations, copies, pool, disk), which `metrics.rs` turns
//! into a run's figures.

use crate::copies::CopyCounters;
use crate::disaggregate::TransferCounters;
use crate::disk::DiskCounters;
use crate::histogram::LogHistogram;
use crate::migrate::MigrationCounters;
use crate::pool::PoolCounters;

/// Simulator-wide counters.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub events: u64,
    pub end_us: u64,
    pub steps: u64,
    pub batch_tokens: u64,
    pub prefill_tokens: u64,
    /// Tokens computed after the prompt (recomputes after preemption included).
    pub decode_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub preemptions: u64,
    pub rejected: u64,
    /// Tokens served (prompt computed + generated) per client id until the last
    /// open-loop arrival.
    pub window_service: Vec<u64>,
    /// Gaps between consecutive output tokens of a request.
    pub itl: LogHistogram,
    pub transfers: TransferCounters,
    pub migrations: MigrationCounters,
    pub copies: CopyCounters,
    pub pool: PoolCounters,
    pub disk: DiskCounters,
}
