//! `config.toml`: the worker's settings. Unknown keys and bad values are errors
//! that name the file, the line and the key.

use std::path::{Path, PathBuf};

use pie_policy::{DeadlineConfig, FairConfig, KeepSessionConfig, OffloadConfig, PriorityConfig};
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
        }
    }
}

pub use pie_core::auth::ApiKey;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// A Llama-family GGUF; unset means the default model (fetched on first use).
    pub path: Option<PathBuf>,
    /// The name clients use in `model`; default: the file's stem.
    pub name: Option<String>,
}

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
    pub max_batch_tokens: usize,
    pub max_running: usize,
    pub fair: FairConfig,
    pub priority: PriorityConfig,
    pub deadline: DeadlineConfig,
    #[serde(rename = "keep-session")]
    pub keep_session: KeepSessionConfig,
    pub offload: OffloadConfig,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            worker_policy: PolicyList::default(),
            page_size: 16,
            kv_pages: None,
            kv_memory: None,
            max_batch_tokens: 512,
            max_running: 64,
            fair: FairConfig::default(),
            priority: PriorityConfig::default(),
            deadline: DeadlineConfig::default(),
            keep_session: KeepSessionConfig::default(),
            offload: OffloadConfig::default(),
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(b) => Ok(ByteSize(b)),
            Raw::Text(t) => parse_bytes(&t)
                .map(ByteSize)
                .map_err(serde::de::Error::custom),
        }
    }
}

fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a size like \"512MiB\""))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit `{other}` in `{text}` (use B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    Ok((num * mult as f64) as u64)
}

/// A config problem: where it is and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{location}: {message}")]
pub struct ConfigError {
    pub location: String,
    pub message: String,
}

impl Config {
    /// Parse `text` (read from `file`, named in errors).
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let de = toml::Deserializer::new(text);
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let inner = e.into_inner();
            let line = inner
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            let location = match line {
                Some(l) => format!("{}:{l}", file.display()),
                None => file.display().to_string(),
            };
            let message = if key.is_empty() || key == "." {
                inner.message().to_string()
            } else {
                format!("key `{key}`: {}", inner.message())
            };
            ConfigError { location, message }
        })?;
        config.validate().map_err(|(key, message)| ConfigError {
            location: file.display().to_string(),
            message: format!("key `{key}`: {message}"),
        })?;
        Ok(config)
    }

    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(file).map_err(|e| ConfigError {
            location: file.display().to_string(),
            message: format!("cannot read: {e}"),
        })?;
        Self::parse(&text, file)
    }

    /// Checks serde cannot express. Returns the offending key and the problem.
    fn validate(&self) -> Result<(), (String, String)> {
        let rt = &self.runtime;
        crate::policies::WorkerPolicies::build(rt)
            .map_err(|e| ("runtime.worker_policy".to_string(), e))?;
        for (key, value) in [
            ("runtime.page_size", rt.page_size),
            ("runtime.max_batch_tokens", rt.max_batch_tokens),
            ("runtime.max_running", rt.max_running),
        ] {
            if value == 0 {
                return Err((key.into(), "must be at least 1".into()));
            }
        }
        if rt.kv_pages.is_some() && rt.kv_memory.is_some() {
            return Err((
                "runtime.kv_pages".into(),
                "set kv_pages or kv_memory, not both".into(),
            ));
        }
        if rt.kv_pages == Some(0) {
            return Err(("runtime.kv_pages".into(), "must be at least 1".into()));
        }
        Ok(())
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
        Ok(keys)
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
# api_keys = [{ name = "alice", key = "sk-alice-secret" }]
# api_keys_file = "keys.txt"      # lines of `name key`
max_queued = 256                   # processes waiting to start; beyond: 429
max_body_bytes = 1048576           # beyond: 413
# trace_file = "trace.jsonl"       # record finished requests (lengths, block ids, props; no tokens)

[model]
# path = "/models/model.gguf"     # unset: SmolLM2-135M-Instruct, fetched on first use
# name = "SmolLM2-135M-Instruct"  # what clients pass as `model`

[runtime]
worker_policy = "fcfs"             # or a list, e.g. ["fcfs"]
page_size = 16                     # tokens per KV page
# kv_pages = 2048                 # KV pool size in pages, or:
# kv_memory = "1GiB"              # ... in bytes (default 1GiB)
max_batch_tokens = 512             # tokens per engine step (prefill chunks + decodes)
max_running = 64                   # sequences holding KV pages at once

# Policy options (used when the policy is listed in worker_policy).
[runtime.fair]                     # VTC fair share across clients
input_weight = 1.0                 # charge per prompt token
output_weight = 2.0                # charge per generated token

[runtime.priority]
# aging_ms = 1000                 # +1 effective priority per aging_ms waited

[runtime.deadline]
on_miss = "continue"               # or "abort"

[runtime.keep-session]
# default_keep_ms = 30000         # keep a finished session's pages this long

[runtime.offload]
peers = []                         # peer worker URLs for prefill offload
queue_tokens = 2048                # offload when waiting prefill tokens exceed this
wait_ms = 2000                     # ... or the estimated prefill wait exceeds this
timeout_ms = 10000                 # a slower peer is abandoned (prefill runs locally)
# key = "sk-peer"                 # API key the peers accept
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
    fn sizes_and_pages() {
        let c = parse("[runtime]\nkv_memory = \"1MiB\"\n").unwrap();
        assert_eq!(c.kv_pages(1024), 1024);
        let c = parse("[runtime]\nkv_pages = 7\n").unwrap();
        assert_eq!(c.kv_pages(1024), 7);
        assert!(parse("[runtime]\nkv_pages = 7\nkv_memory = 100\n").is_err());
    }
}
