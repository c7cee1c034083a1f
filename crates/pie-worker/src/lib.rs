//! The `pie` worker: the continuous-batching engine and the default-model fetch.

pub mod engine;
pub mod fetch;

pub use engine::{Engine, EngineConfig, FinishReason, Request};
