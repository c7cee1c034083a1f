//! What is on its way between a worker, its disk and the pool: the state
//! `Sim` holds for the features that move pages (`disk.rs`, `pool.rs`).

use pie_core::BlockHash;

use crate::pages::Seq;

/// A pull from the pool: request `seq` waits for its pages `from..to` to
/// reach worker `w`.
pub(super) struct Pull {
    pub(super) w: usize,
    pub(super) seq: Seq,
    pub(super) from: usize,
    /// Pages `from..disk_to` come from its disk, the rest from the pool.
    pub(super) disk_to: usize,
    pub(super) to: usize,
}

/// Pages on their way to the pool, soft-pinned there until `pinned_until_ms`
/// (0: not pinned); `spilled_by`: a spill of that worker's.
pub(super) struct PoolPush {
    pub(super) blocks: Vec<BlockHash>,
    pub(super) pinned_until_ms: u64,
    pub(super) spilled_by: Option<usize>,
}

/// Pages on their way to worker `w`'s disk; `spill`: a retained session's.
pub(super) struct DiskWrite {
    pub(super) w: usize,
    pub(super) blocks: Vec<BlockHash>,
    pub(super) spill: bool,
}
