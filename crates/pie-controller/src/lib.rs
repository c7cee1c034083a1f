//! `pie-controller`: fronts many workers with the worker's own client API.
//!
//! - [`config`]: `config.toml` and the routing pipeline it names.
//! - [`registry`]: the workers (static and registered), their health, load and
//!   prefix-cache index, polled from each worker's `/v1/internal/state`.
//! - [`model`]: the tokenizer and fingerprint routing uses (`--model`, or a
//!   worker's).
//! - [`routing`]: one routing decision (views, pipeline, anticipation).
//! - [`proxy`]: the pass-through of requests and streams.
//! - [`relay`]: streams that move; [`whole`]: non-streamed answers gathered
//!   from one; [`native`]: native processes that move.
//! - [`actors`]: the cluster actors' snapshot, tick, and executed actions.

pub mod actors;
pub mod clients;
pub mod config;
pub mod kv_sync;
pub mod metrics;
pub mod model;
pub mod native;
pub mod proxy;
pub mod registry;
pub mod relay;
pub mod routing;
pub mod trace;
pub mod whole;
