//! `pie-sim`: a discrete-event simulator of Pie workers behind a router. It runs
//! the real `pie-policy` objects, unchanged, over a modelled page pool and prefix
//! cache with step times from a cost model, fed by seeded workload generators.

pub mod actors;
pub mod autoscale;
pub mod cache;
pub mod copies;
pub mod disaggregate;
pub mod disk;
pub mod events;
pub mod histogram;
pub mod jitter;
pub mod machine;
pub mod metrics;
pub mod migrate;
pub mod pages;
pub mod plots;
pub mod pool;
pub mod profile;
pub mod requests;
pub mod router;
pub mod sim;
pub mod svg;
pub mod worker_config;

pub use metrics::RunMetrics;
pub use pie_workload::{cost, workload, CostProfile};
pub use router::RouterSpec;
pub use sim::{
    run, run_records, run_schedule, run_with, LoggedStep, PolicyName, Schedule, SimConfig,
};
pub use workload::{Request, Segment, WorkloadSpec};
