//! `pie-workload`: what `pie bench` (on a real deployment) and `pie-sim` (over a
//! cost model) share, so that both measure the same thing: the seeded workload
//! generators, the trace format (`trace.rs`) that `pie serve` records and both
//! replay, and the step-time cost profile that `pie bench --calibrate` writes
//! and the simulator reads, and the one percentile rule both report with
//! (`percentiles.rs`). Pure (no clock, no I/O beyond (de)serialisation)
//! except `recorder.rs`, which appends JSON lines (traces) to a file.

mod agent;
pub mod cost;
pub mod percentiles;
pub mod recorder;
mod request;
pub mod trace;
pub mod workload;

pub use cost::{CostProfile, StepDraw, StepKind, StepShape, AFTER_IDLE_MS};
pub use percentiles::{nearest_rank, Percentiles};
pub use recorder::{JsonLines, TraceInput, TraceRecorder};
pub use trace::{read_trace, trace_block_ids, trace_requests, TraceRecord, TRACE_BLOCK_TOKENS};
pub use workload::{Request, Segment, WorkloadSpec};
