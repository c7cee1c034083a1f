//! The engine's state, below every file that implements it: [`Engine`] (its
//! fields are the engine module's own), its config and its counters.

use std::sync::Arc;

use pie_kv::KvDtype;
use pie_model::Model;
use pie_policy::Scheduler;

use super::kv::EngineKv;

#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    pub page_size: usize,
    pub kv_pages: usize,
    /// The pages' element type (`[runtime] kv_dtype`).
    pub kv_dtype: KvDtype,
    pub max_batch_tokens: usize,
    pub max_running: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            kv_pages: 2048,
            kv_dtype: KvDtype::default(),
            max_batch_tokens: 512,
            max_running: 64,
        }
    }
}

/// Counters since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineCounters {
    pub steps: u64,
    pub prefill_tokens: u64,
    /// Tokens whose KV was computed after the prompt (recomputes included).
    pub decode_tokens: u64,
    /// Tokens sampled and returned.
    pub generated_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub preemptions: u64,
}

pub struct Engine {
    pub(super) model: Arc<Model>,
    pub(super) config: EngineConfig,
    pub(super) kv: EngineKv,
    pub(super) scheduler: Scheduler,
    pub(super) next_id: u64,
    pub(super) counters: EngineCounters,
}
