//! The `pie` worker: the continuous-batching engine, processes, the HTTP API.

pub mod api;
pub mod calibrate;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod fetch;
pub mod inbox;
pub mod inferlet_cli;
pub mod inferlets;
pub mod leases;
pub mod memory_bound;
pub mod metrics;
pub mod process;
pub mod records;
pub mod register;
pub mod reload;
pub mod runtime;
pub mod serve;
pub mod sessions;
pub mod step_log;
pub mod supervisor;

pub use engine::{Engine, EngineConfig, FinishReason, Request};
