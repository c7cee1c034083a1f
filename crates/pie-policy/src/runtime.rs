//! The worker's `[runtime]` table and the worker policies built from it: one
//! schema and one factory for `pie serve` and `pie-sim --worker-config`, so the
//! simulator runs a worker's settings (`[runtime.fair]`, `[runtime.priority]`,
//! ...) exactly as the worker does. At most one ordering policy (`fcfs`, `fair`,
//! `priority`, `deadline`) plus `keep-session` and/or `offload`. The
//! worker's own subsystems' tables (`transfer`, `persist`, `pool`,
//! `inferlets`) are `pie_core::worker_config`'s schemas: held here so one
//! `[runtime]` table reads alike in both, never interpreted here.

pub use pie_core::worker_config::{check_pool_url, InferletsConfig, PersistConfig, TransferConfig};
use pie_core::{ByteSize, KvDtype};
use serde::{Deserialize, Serialize};

use crate::cluster::Stage;
use crate::{
    Deadline, DeadlineConfig, Fair, FairConfig, Fcfs, KeepSession, KeepSessionConfig, Offload,
    OffloadConfig, Priority, PriorityConfig, WorkerPolicy,
};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// One policy name or a list (see `pie-policy`).
    pub worker_policy: PolicyList,
    pub page_size: usize,
    /// KV pool size in pages; `kv_memory` instead gives it in bytes.
    pub kv_pages: Option<usize>,
    /// KV pool size as bytes or a string like "512MiB", "2GiB".
    pub kv_memory: Option<ByteSize>,
    /// Element type of the KV pages: "f32" or "f16" (half the memory and
    /// transfer bytes). Pages move only between workers of one dtype.
    pub kv_dtype: KvDtype,
    pub max_batch_tokens: usize,
    pub max_running: usize,
    pub fair: FairConfig,
    pub priority: PriorityConfig,
    pub deadline: DeadlineConfig,
    #[serde(rename = "keep-session")]
    pub keep_session: KeepSessionConfig,
    pub offload: OffloadConfig,
    /// What this worker serves: "both", or one side of `disaggregate`.
    pub stage: Stage,
    pub transfer: TransferConfig,
    pub persist: PersistConfig,
    /// A `pie-pool` (URL): prompts' missing prefix pages are pulled from it
    /// before a prefill, and persisted prefixes are pushed to it.
    pub pool: Option<String>,
    pub inferlets: InferletsConfig,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            worker_policy: PolicyList::default(),
            page_size: 16,
            kv_pages: None,
            kv_memory: None,
            kv_dtype: KvDtype::default(),
            max_batch_tokens: 512,
            max_running: 64,
            fair: FairConfig::default(),
            priority: PriorityConfig::default(),
            deadline: DeadlineConfig::default(),
            keep_session: KeepSessionConfig::default(),
            offload: OffloadConfig::default(),
            stage: Stage::Both,
            transfer: TransferConfig::default(),
            persist: PersistConfig::default(),
            pool: None,
            inferlets: InferletsConfig::default(),
        }
    }
}

/// `worker_policy = "fcfs"` or `worker_policy = ["fair", "keep-session"]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PolicyList {
    One(String),
    Many(Vec<String>),
}

impl Default for PolicyList {
    fn default() -> Self {
        PolicyList::One("fcfs".into())
    }
}

impl PolicyList {
    pub fn names(&self) -> Vec<String> {
        match self {
            PolicyList::One(n) => vec![n.clone()],
            PolicyList::Many(v) => v.clone(),
        }
    }
}

impl RuntimeConfig {
    /// Checks serde cannot express: the offending key (under `runtime.`) and
    /// the problem.
    pub fn validate(&self) -> Result<(), (String, String)> {
        WorkerPolicies::build(self).map_err(|e| ("runtime.worker_policy".to_string(), e))?;
        for (key, value) in [
            ("runtime.page_size", self.page_size),
            ("runtime.max_batch_tokens", self.max_batch_tokens),
            ("runtime.max_running", self.max_running),
        ] {
            if value == 0 {
                return Err((key.into(), "must be at least 1".into()));
            }
        }
        self.transfer.validate()?;
        self.inferlets.validate()?;
        if self.kv_pages.is_some() && self.kv_memory.is_some() {
            return Err((
                "runtime.kv_pages".into(),
                "set kv_pages or kv_memory, not both".into(),
            ));
        }
        check_pool_url(self.pool.as_deref())?;
        if self.kv_pages == Some(0) {
            return Err(("runtime.kv_pages".into(), "must be at least 1".into()));
        }
        Ok(())
    }
}

/// Every worker policy name this build knows.
pub const AVAILABLE: &[&str] = &[
    "fcfs",
    "fair",
    "priority",
    "deadline",
    "keep-session",
    "offload",
];

/// The active worker policies.
pub struct WorkerPolicies {
    pub names: Vec<String>,
    pub ordering: Box<dyn WorkerPolicy>,
    pub keep_session: Option<KeepSession>,
    pub offload: Option<Offload>,
}

impl WorkerPolicies {
    /// Build from config, or an error naming the bad entry.
    pub fn build(rt: &RuntimeConfig) -> Result<Self, String> {
        let names = rt.worker_policy.names();
        let mut ordering: Option<Box<dyn WorkerPolicy>> = None;
        let mut keep_session = None;
        let mut offload = None;
        for name in &names {
            let order: Box<dyn WorkerPolicy> = match name.as_str() {
                "fcfs" => Box::new(Fcfs),
                "fair" => Box::new(Fair::new(rt.fair.clone())),
                "priority" => Box::new(Priority::new(rt.priority.clone())),
                "deadline" => Box::new(Deadline::new(rt.deadline.clone())),
                "keep-session" => {
                    keep_session = Some(KeepSession::new(rt.keep_session.clone()));
                    continue;
                }
                "offload" => {
                    if rt.offload.peers.is_empty() {
                        return Err(
                            "`offload` needs at least one peer in [runtime.offload] peers".into(),
                        );
                    }
                    offload = Some(Offload::new(rt.offload.clone()));
                    continue;
                }
                other => {
                    return Err(format!(
                        "unknown worker policy `{other}` (available: {})",
                        AVAILABLE.join(", ")
                    ))
                }
            };
            if let Some(first) = &ordering {
                return Err(format!(
                    "`{name}`: only one ordering policy may be listed (already `{}`)",
                    first.name()
                ));
            }
            ordering = Some(order);
        }
        Ok(Self {
            names,
            ordering: ordering.unwrap_or_else(|| Box::new(Fcfs)),
            keep_session,
            offload,
        })
    }
}
