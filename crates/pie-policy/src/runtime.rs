//! The worker's `[runtime]` table and the worker policies built from it: one
//! schema and one factory for `pie serve` and `pie-sim --worker-config`, so the
//! simulator runs a worker's settings (`[runtime.fair]`, `[runtime.priority]`,
//! ...) exactly as the worker does. At most one ordering policy (`fcfs`, `fair`,
//! `priority`, `deadline`) plus `keep-session` and/or `offload`.

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

/// `[runtime.inferlets]`: uploaded WebAssembly inferlets, where they are
/// kept and what one process of them may use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InferletsConfig {
    /// Uploaded components and their compiled code (content-addressed).
    /// Unset: `~/.cache/pie/inferlets`.
    pub dir: Option<std::path::PathBuf>,
    /// The guest's own execution time a process may use (not time spent
    /// waiting for the host or a message).
    pub max_cpu_ms: u64,
    /// Linear memory one instance may grow to.
    pub max_memory: ByteSize,
    /// Live instances; launches beyond wait in the queue (`max_queued`).
    pub max_instances: usize,
    /// Text and events one process may emit.
    pub max_output_bytes: ByteSize,
    /// Messages waiting for a process; beyond, the sender gets 429.
    pub max_pending_messages: usize,
    /// The largest component an upload may send.
    pub max_upload: ByteSize,
    /// Threads that run guest code (host calls and generation run elsewhere).
    pub threads: usize,
}

impl Default for InferletsConfig {
    fn default() -> Self {
        Self {
            dir: None,
            max_cpu_ms: 30_000,
            max_memory: ByteSize(256 << 20),
            max_instances: 64,
            max_output_bytes: ByteSize(16 << 20),
            max_pending_messages: 64,
            max_upload: ByteSize(32 << 20),
            threads: 1,
        }
    }
}

/// `[runtime.persist]`: the disk tier `persist-prefix` writes (see
/// `pie_kv::disk`). Without `dir` the worker cannot persist and says so.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PersistConfig {
    /// Where pages rest (one directory per worker).
    pub dir: Option<std::path::PathBuf>,
    /// The most bytes of pages kept; past it the least recently used go.
    pub budget: ByteSize,
    /// A page not used for this long is deleted; 0: kept until evicted.
    pub ttl_ms: u64,
}

impl Default for PersistConfig {
    fn default() -> Self {
        Self {
            dir: None,
            budget: ByteSize(10 << 30),
            ttl_ms: 0,
        }
    }
}

/// `[runtime.transfer]`: moving KV pages between workers (offload, disaggregate).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransferConfig {
    /// A pull slower than this (the peer's prefill included) is abandoned and
    /// the prompt is prefilled here.
    pub timeout_ms: u64,
    /// The most page bytes one pull may bring in.
    pub max_bytes: ByteSize,
    /// Pages exported to a peer stay pinned this long after the last page
    /// sent (renewed while the transfer runs).
    pub lease_ms: u64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            timeout_ms: 60_000,
            max_bytes: ByteSize(1 << 30),
            lease_ms: 10_000,
        }
    }
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
            (
                "runtime.transfer.timeout_ms",
                self.transfer.timeout_ms as usize,
            ),
            (
                "runtime.transfer.max_bytes",
                self.transfer.max_bytes.0 as usize,
            ),
            ("runtime.transfer.lease_ms", self.transfer.lease_ms as usize),
            (
                "runtime.inferlets.max_cpu_ms",
                self.inferlets.max_cpu_ms as usize,
            ),
            (
                "runtime.inferlets.max_memory",
                self.inferlets.max_memory.0 as usize,
            ),
            (
                "runtime.inferlets.max_instances",
                self.inferlets.max_instances,
            ),
            (
                "runtime.inferlets.max_upload",
                self.inferlets.max_upload.0 as usize,
            ),
            ("runtime.inferlets.threads", self.inferlets.threads),
        ] {
            if value == 0 {
                return Err((key.into(), "must be at least 1".into()));
            }
        }
        if self.kv_pages.is_some() && self.kv_memory.is_some() {
            return Err((
                "runtime.kv_pages".into(),
                "set kv_pages or kv_memory, not both".into(),
            ));
        }
        if let Some(url) = &self.pool {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err((
                    "runtime.pool".into(),
                    format!("`{url}` is not an http:// or https:// URL"),
                ));
            }
        }
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
