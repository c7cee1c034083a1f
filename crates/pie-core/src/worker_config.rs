//! The schemas of the worker's own subsystems in `[runtime]`: moving KV
//! between workers (`[runtime.transfer]`), the disk tier
//! (`[runtime.persist]`), the page pool's URL (`pool`) and WebAssembly
//! inferlets (`[runtime.inferlets]`), with their defaults and the checks
//! serde cannot express. Not policy: `pie-policy`'s `RuntimeConfig` only
//! holds them, so that the worker and `pie-sim --worker-config` read one
//! `[runtime]` table.

use serde::{Deserialize, Serialize};

use crate::ByteSize;

/// A config error: the offending key (under `runtime.`) and the problem.
pub type KeyError = (String, String);

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
    /// Bytes of messages waiting for a process; beyond, the sender gets 429.
    pub max_pending_bytes: ByteSize,
    /// The whole life of a process's instance, from taking its slot.
    pub max_wall_ms: u64,
    /// How long a process may stay blocked in `receive` or `sleep` with
    /// nothing arriving.
    pub max_idle_ms: u64,
    /// Guest log lines one process may write a second, sustained, and at
    /// once; past either, lines are dropped and counted.
    pub log_lines_per_s: u64,
    pub log_lines_burst: u64,
    /// The same for all processes of the worker together.
    pub all_log_lines_per_s: u64,
    pub all_log_lines_burst: u64,
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
            max_instances: 32,
            max_output_bytes: ByteSize(16 << 20),
            max_pending_messages: 64,
            max_pending_bytes: ByteSize(1 << 20),
            max_wall_ms: 30 * 60_000,
            max_idle_ms: 5 * 60_000,
            log_lines_per_s: 20,
            log_lines_burst: 200,
            all_log_lines_per_s: 200,
            all_log_lines_burst: 1000,
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

impl TransferConfig {
    pub fn validate(&self) -> Result<(), KeyError> {
        at_least_one(&[
            ("runtime.transfer.timeout_ms", self.timeout_ms),
            ("runtime.transfer.max_bytes", self.max_bytes.0),
            ("runtime.transfer.lease_ms", self.lease_ms),
        ])
    }
}

impl InferletsConfig {
    pub fn validate(&self) -> Result<(), KeyError> {
        at_least_one(&[
            ("runtime.inferlets.max_cpu_ms", self.max_cpu_ms),
            ("runtime.inferlets.max_memory", self.max_memory.0),
            ("runtime.inferlets.max_instances", self.max_instances as u64),
            ("runtime.inferlets.max_upload", self.max_upload.0),
            (
                "runtime.inferlets.max_pending_bytes",
                self.max_pending_bytes.0,
            ),
            ("runtime.inferlets.max_wall_ms", self.max_wall_ms),
            ("runtime.inferlets.max_idle_ms", self.max_idle_ms),
            ("runtime.inferlets.log_lines_burst", self.log_lines_burst),
            (
                "runtime.inferlets.all_log_lines_burst",
                self.all_log_lines_burst,
            ),
            ("runtime.inferlets.threads", self.threads as u64),
        ])
    }
}

/// `runtime.pool`, when set, is an http:// or https:// URL.
pub fn check_pool_url(pool: Option<&str>) -> Result<(), KeyError> {
    match pool {
        Some(url) if !(url.starts_with("http://") || url.starts_with("https://")) => Err((
            "runtime.pool".into(),
            format!("`{url}` is not an http:// or https:// URL"),
        )),
        _ => Ok(()),
    }
}

fn at_least_one(values: &[(&str, u64)]) -> Result<(), KeyError> {
    match values.iter().find(|(_, v)| *v == 0) {
        Some((key, _)) => Err((key.to_string(), "must be at least 1".into())),
        None => Ok(()),
    }
}
