//! `pie-client`: a small client of the Pie HTTP API (a worker and a controller
//! speak the same one) and the load generator behind `pie bench`.
//!
//! - `client.rs`: streaming `/v1/completions` with token-id prompts, `/v1/models`,
//!   a process's generated tokens, `/metrics`;
//! - `sse.rs`: server-sent events framing;
//! - `prom.rs`: reading counters out of Prometheus text;
//! - `stats.rs`: percentiles;
//! - `bench.rs`: running a `pie-workload` request list open- or closed-loop;
//! - `report.rs`: the summary, its table and its JSON;
//! - `command.rs`: `pie bench` from its arguments.

pub mod bench;
pub mod client;
pub mod command;
pub mod prom;
pub mod report;
pub mod sse;
pub mod stats;

pub use bench::{run, BenchConfig};
pub use client::{Client, ClientError, Completion};
pub use command::BenchCommand;
pub use report::{Record, Report, Summary};
