//! `config.toml`: the worker's settings. Unknown keys and bad values are errors
//! that name the file, the line and the key.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub model: ModelConfig,
    pub runtime: RuntimeConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Named API keys; when any are configured every route but /health needs one.
    pub api_keys: Vec<ApiKey>,
    /// A file of `name key` lines (blank lines and `#` comments ignored).
    pub api_keys_file: Option<PathBuf>,
    /// Processes waiting for their first scheduling; past this the API answers 429.
    pub max_queued: usize,
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Record finished requests here as a Mooncake-format JSONL trace (lengths,
    /// 512-token block ids and props; never token ids). Unset: no trace.
    pub trace_file: Option<PathBuf>,
    /// Log every engine step here (JSON lines: start, duration, idle time
    /// before it, shape), for `pie bench --calibrate --from-steps`. Unset: no log.
    pub step_log: Option<PathBuf>,
    /// The key this worker presents when it calls peers (offload), a pool or a
    /// controller (registration): a key with role `worker` there. The
    /// environment's `PIE_WORKER_KEY` takes precedence.
    pub worker_key: Option<String>,
    /// The engine is unhealthy (503 on /health) after this long without
    /// progress while work is pending.
    pub stall_ms: u64,
    /// Chat sessions kept; past this the least recently used is forgotten.
    pub max_sessions: usize,
    /// Finished process records kept for the API; past this the oldest go.
    pub max_finished_processes: usize,
    /// A finished process record is forgotten this long after it ended.
    pub finished_ttl_ms: u64,
    /// Bytes all finished records keep; past this the oldest go.
    pub max_finished_bytes: ByteSize,
    /// Bytes one finished record keeps; past this it is cut, with a marker.
    pub max_record_bytes: ByteSize,
    /// A drain (SIGTERM, `POST /v1/admin/drain`) exits once no process is
    /// left, or after this long, failing what is left.
    pub drain_timeout_ms: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            api_keys: Vec::new(),
            api_keys_file: None,
            max_queued: 256,
            max_body_bytes: 1 << 20,
            trace_file: None,
            step_log: None,
            worker_key: None,
            stall_ms: 30_000,
            max_sessions: 10_000,
            max_finished_processes: 10_000,
            max_finished_bytes: ByteSize(256 << 20),
            max_record_bytes: ByteSize(16 << 20),
            finished_ttl_ms: 3_600_000,
            drain_timeout_ms: 120_000,
        }
    }
}

pub use pie_core::auth::ApiKey;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// A Llama, Qwen, Phi-3 or Gemma GGUF; unset means the default model (fetched on first use).
    pub path: Option<PathBuf>,
    /// The name clients use in `model`; default: the file's stem.
    pub name: Option<String>,
    /// A Jinja chat template file used in place of the model's own
    /// (`--chat-template`; its tool-call format is read from it too).
    pub chat_template: Option<PathBuf>,
}

pub use pie_core::config_file::ConfigError;
pub use pie_core::ByteSize;
pub use pie_policy::runtime::{PolicyList, RuntimeConfig};

impl Config {
    /// Parse `text` (read from `file`, named in errors).
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let config: Config = pie_core::config_file::parse_toml(text, file)?;
        config
            .runtime
            .validate()
            .map_err(|(key, message)| ConfigError::key(file, &key, message))?;
        Ok(config)
    }

    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        Self::parse(&pie_core::config_file::read(file)?, file)
    }

    /// Every API key, inline and from `api_keys_file`.
    pub fn api_keys(&self) -> Result<Vec<ApiKey>, ConfigError> {
        let mut keys = self.server.api_keys.clone();
        if let Some(path) = &self.server.api_keys_file {
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
                location: path.display().to_string(),
                message: format!("server.api_keys_file: cannot read: {e}"),
            })?;
            let from_file =
                pie_core::auth::parse_key_file(&text).map_err(|(line, message)| ConfigError {
                    location: format!("{}:{line}", path.display()),
                    message,
                })?;
            keys.extend(from_file);
        }
        pie_core::auth::check_keys(&keys).map_err(|message| ConfigError {
            location: "server.api_keys".into(),
            message,
        })?;
        Ok(keys)
    }

    /// The key this worker presents to peers, pools and controllers.
    pub fn worker_key(&self) -> Result<Option<String>, ConfigError> {
        if std::env::var_os("PIE_CONTROLLER_KEY").is_some() {
            return Err(ConfigError {
                location: "PIE_CONTROLLER_KEY".into(),
                message: "replaced by PIE_WORKER_KEY (or [server] worker_key): one worker key for \
                          the controller, peers and pools"
                    .into(),
            });
        }
        Ok(std::env::var("PIE_WORKER_KEY")
            .ok()
            .or_else(|| self.server.worker_key.clone()))
    }

    /// KV pool pages for a model whose page takes `page_bytes`.
    pub fn kv_pages(&self, page_bytes: usize) -> usize {
        match (self.runtime.kv_pages, self.runtime.kv_memory) {
            (Some(p), _) => p,
            (None, Some(ByteSize(b))) => (b as usize / page_bytes).max(1),
            (None, None) => (DEFAULT_KV_MEMORY / page_bytes).max(1),
        }
    }
}

/// KV pool size when neither kv_pages nor kv_memory is set.
pub const DEFAULT_KV_MEMORY: usize = 1 << 30;

/// The commented file `pie config init` writes.
pub const DEFAULT_CONFIG: &str = r#"# Pie worker configuration. Every key is optional; shown are the defaults.

[server]
host = "127.0.0.1"
port = 8080
# Named API keys. When any are set, every route but /health needs
# `Authorization: Bearer KEY`; the key's name is the process's client.
# role: "client" (default: its own processes only), "worker" (internal
# routes; what a controller or peer presents), "admin" (everything).
# limits (client keys): weight (default 1), max_priority, max_keep_ms,
# min_deadline_ms, pin (default true), persist (default false), cache_salt,
# upload_inferlets (default false: only admin keys install inferlets),
# max_wall_ms and max_idle_ms (in place of [runtime.inferlets]'s),
# max_inferlets (default 16) and max_inferlet_bytes (default 256 MiB).
# api_keys = [{ name = "alice", key = "sk-alice-secret" },
#             { name = "ctl", key = "sk-ctl", role = "worker" },
#             { name = "bob", key = "sk-bob", limits = { max_priority = 5 } }]
# api_keys_file = "keys.txt"      # lines of `name key [role] [limit=value ...]`
# worker_key = "sk-w1"            # presented to peers and the controller (or PIE_WORKER_KEY)
max_queued = 256                   # processes waiting to start; beyond: 429
max_body_bytes = 1048576           # beyond: 413
# trace_file = "trace.jsonl"       # record finished requests (lengths, block ids, props; no tokens)
# step_log = "steps.jsonl"         # every engine step's start, time and shape (pie bench --calibrate --from-steps)
stall_ms = 30000                   # engine without progress this long with work pending: 503 on /health
max_sessions = 10000               # chat sessions kept; beyond: least recently used forgotten
max_finished_processes = 10000     # finished process records kept; beyond: oldest forgotten
finished_ttl_ms = 3600000          # a finished process record is forgotten this long after it ended
max_finished_bytes = "256MiB"      # bytes all finished records keep; beyond: oldest forgotten
max_record_bytes = "16MiB"         # bytes one finished record keeps; beyond: cut, with a marker event
drain_timeout_ms = 120000          # a drain (SIGTERM, POST /v1/admin/drain) exits by then, failing what is left

[model]
# path = "/models/model.gguf"     # unset: SmolLM2-135M-Instruct, fetched on first use
# name = "SmolLM2-135M-Instruct"  # what clients pass as `model`
# chat_template = "/models/chat.jinja"  # in place of the file's (and its tool-call format)

[runtime]
worker_policy = "fcfs"             # or a list, e.g. ["fcfs"]
page_size = 16                     # tokens per KV page
# kv_pages = 2048                 # KV pool size in pages, or:
# kv_memory = "1GiB"              # ... in bytes (default 1GiB)
kv_dtype = "f16"                   # KV page values: "f16" or "f32" (twice the memory and transfer bytes);
                                   # pages move only between workers (and pools, disk) of one dtype
max_batch_tokens = 512             # tokens per engine step (prefill chunks + decodes)
max_running = 64                   # sequences holding KV pages at once
stage = "both"                     # or "prefill" / "decode" (disaggregate, in the controller)
# pool = "http://127.0.0.1:8090"  # a pie-pool: missing prefix pages pulled before prefill, persisted prefixes pushed

# Policy options (used when the policy is listed in worker_policy).
[runtime.fair]                     # VTC fair share across clients
input_weight = 1.0                 # charge per prompt token
output_weight = 2.0                # charge per generated token
max_idle_clients = 10000           # counters kept for clients without work

[runtime.priority]
# aging_ms = 1000                 # +1 effective priority per aging_ms waited

[runtime.deadline]
on_miss = "continue"               # or "abort"

[runtime.keep-session]
# default_keep_ms = 30000         # keep a finished session's pages this long
admission_wait_ms = 0              # >0: while anything runs, a new sequence waits up to this long for pages rather than drop a retention

[runtime.offload]
peers = []                         # peer worker URLs for prefill offload
queue_tokens = 2048                # offload when waiting prefill tokens exceed this
wait_ms = 2000                     # ... or the estimated prefill wait exceeds this
timeout_ms = 10000                 # a slower peer is abandoned (prefill runs locally)

[runtime.transfer]                 # KV pages pulled from peers (offload, disaggregate)
timeout_ms = 60000                 # a slower pull is abandoned (prefill runs locally)
max_bytes = "1GiB"                 # the most page bytes one pull brings in
lease_ms = 10000                   # pages sent to a peer stay pinned this long after the last one

[runtime.persist]                  # the disk tier of persist-prefix (the controller's actor, or a `persist` prop)
# dir = "/var/lib/pie/kv"         # unset: this worker cannot persist pages
budget = "10GiB"                   # the most page bytes on disk; beyond: least recently used go
ttl_ms = 0                         # a page unused this long is deleted; 0: kept until evicted

[runtime.inferlets]                # uploaded WebAssembly inferlets (POST /v1/inferlets)
# dir = "/var/lib/pie/inferlets"  # unset: ~/.cache/pie/inferlets (components and their compiled code)
max_cpu_ms = 30000                 # a process's own guest execution time; past it, it fails
max_memory = "256MiB"              # linear memory per instance; past it, it fails
max_instances = 32                 # live instances; more launches wait queued
max_output_bytes = "16MiB"         # text and events one process may emit
max_pending_messages = 64          # messages waiting for a process; beyond: 429
max_pending_bytes = "1MiB"         # bytes of messages waiting for a process; beyond: 429
max_wall_ms = 1800000              # a process's whole life from its instance's start; past it, it fails
max_idle_ms = 300000               # blocked in receive or sleep with nothing arriving; past it, it fails
log_lines_per_s = 20               # guest log lines per process a second; beyond: dropped and counted
log_lines_burst = 200              # ... at once
all_log_lines_per_s = 200          # guest log lines of all processes a second
all_log_lines_burst = 1000         # ... at once
max_upload = "32MiB"               # the largest component an upload may send
threads = 1                        # threads guest code runs on
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("config.toml"))
    }

    #[test]
    fn default_file_parses_to_defaults() {
        assert_eq!(parse(DEFAULT_CONFIG).unwrap(), Config::default());
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let err = parse("[server]\nport = 1\n\n[runtime]\npage_sise = 8\n").unwrap_err();
        assert_eq!(err.location, "config.toml:5");
        assert!(err.message.contains("page_sise"), "{err}");
    }

    #[test]
    fn bad_value_names_the_key() {
        let err = parse("[runtime]\nmax_running = \"many\"\n").unwrap_err();
        assert!(err.message.contains("runtime.max_running"), "{err}");
        assert_eq!(err.location, "config.toml:2");
        let err = parse("[runtime]\nworker_policy = [\"fcfs\", \"bogus\"]\n").unwrap_err();
        assert!(
            err.message.contains("bogus") && err.message.contains("runtime.worker_policy"),
            "{err}"
        );
        let err = parse("[runtime]\nkv_memory = \"3 parsecs\"\n").unwrap_err();
        assert!(err.message.contains("parsecs"), "{err}");
    }

    #[test]
    fn kv_dtype_is_f16_or_f32() {
        assert_eq!(Config::default().runtime.kv_dtype, pie_core::KvDtype::F16);
        let c = parse("[runtime]\nkv_dtype = \"f32\"\n").unwrap();
        assert_eq!(c.runtime.kv_dtype, pie_core::KvDtype::F32);
        let err = parse("[server]\nport = 1\n[runtime]\nkv_dtype = \"bf16\"\n").unwrap_err();
        assert_eq!(err.location, "config.toml:4");
        assert!(
            err.message.contains("runtime.kv_dtype") && err.message.contains("bf16"),
            "{err}"
        );
    }

    #[test]
    fn sizes_and_pages() {
        let c = parse("[runtime]\nkv_memory = \"1MiB\"\n").unwrap();
        assert_eq!(c.kv_pages(1024), 1024);
        let c = parse("[runtime]\nkv_pages = 7\n").unwrap();
        assert_eq!(c.kv_pages(1024), 7);
        assert!(parse("[runtime]\nkv_pages = 7\nkv_memory = 100\n").is_err());
    }
}
