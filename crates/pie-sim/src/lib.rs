//! `pie-sim`: a discrete-event simulator of Pie workers behind a router. It runs
//! the real `pie-policy` objects, unchanged, over a modelled page pool and prefix
//! cache with step times from a cost model, fed by seeded workload generators.
//!
//! Layers, each using only those below it: leaves (`records`, `histogram`,
//! `cache`, `pages`, `events`, `jitter`, `machine`, `router`, `actors`, and
//! the features' cost models and counters: `disaggregate`, `migrate`,
//! `copies`, `pool`, `disk`, `autoscale`); `counters`, `config` and
//! `schedule`; the simulation itself (`sim`, with each feature's behaviour
//! in `sim/<feature>.rs`); the report (`metrics`, `tables`, `plots`) and
//! `run` on top.

pub mod actors;
pub mod autoscale;
pub mod cache;
pub mod config;
pub mod copies;
pub mod counters;
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
pub mod records;
pub mod requests;
pub mod router;
pub mod run;
pub mod schedule;
pub mod sim;
pub mod svg;
pub mod tables;
pub mod worker_config;

pub use config::{PolicyName, SimConfig};
pub use metrics::RunMetrics;
pub use pie_workload::{cost, workload, CostProfile, Percentiles};
pub use records::Record;
pub use router::RouterSpec;
pub use run::{run, run_records, run_with};
pub use schedule::{LoggedStep, Schedule};
pub use sim::run_schedule;
pub use workload::{Request, Segment, WorkloadSpec};
