//! The controller's `config.toml`: `[server]`, `[model]` (for the tokenizer) and
//! `[cluster]`. Unknown keys are errors naming file, line and key.

use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Result};
use pie_core::auth::{parse_key_file, ApiKey};
use pie_policy::cluster::{
    routing_policy, split_policies, ActorConfigs, ActorRunner, CacheAwareConfig, ClusterPolicy,
    DisaggregateConfig, DrainMigrateConfig, PersistPrefixConfig, PinConfig, PoolReplicateConfig,
    QueueOrder, RebalanceConfig, ReplicateConfig, RetainAllConfig, RoutingConfigs,
    ScaleByPropConfig, SessionAffinityConfig, DEFAULT_MAX_QUEUED,
};
use pie_policy::FairConfig;
use pie_workload::JsonLines;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub model: ModelConfig,
    pub cluster: ClusterConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Client API keys; when any are set every route but /health needs one, and
    /// the key's name is sent to workers as the request's `client` prop.
    pub api_keys: Vec<ApiKey>,
    /// A file of `name key` lines.
    pub api_keys_file: Option<PathBuf>,
    /// Record routed OpenAI requests as a Mooncake-format JSONL trace (needs
    /// `[model] path` to count and hash prompt tokens). Unset: no trace.
    pub trace_file: Option<PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 9090,
            api_keys: Vec::new(),
            api_keys_file: None,
            trace_file: None,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The workers' GGUF: the controller reads its tokenizer and fingerprint to
    /// compute block hashes exactly as the workers do. Unset: no prefix matching.
    pub path: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerEntry {
    pub name: String,
    pub url: String,
    /// The worker's group label (`scale-by-prop` counts workers per group).
    #[serde(default)]
    pub group: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    pub workers: Vec<WorkerEntry>,
    /// Routing policies and actors, in one list (see `split_policies`).
    pub cluster_policies: Vec<String>,
    /// Sent as `Authorization: Bearer` to workers.
    pub worker_key: Option<String>,
    /// A shared `pie-pool` (its URL) whose KV events the controller follows,
    /// so `cache-aware` counts the prefix the pool holds for the workers that
    /// pull from it (`[runtime] pool`); read at start.
    pub pool: Option<String>,
    /// How often worker health and load are polled.
    pub poll_ms: u64,
    /// With `cluster-priority`: requests waiting in the controller before 429.
    pub max_queued: usize,
    /// With `cluster-priority`: how one priority level of the wait queue is
    /// ordered: "priority" (FCFS) or "fair" (the client with the least
    /// weighted service cluster-wide first, charged as `[cluster.fair]` says).
    pub queue_order: QueueOrder,
    /// What a client's service costs under `queue_order = "fair"`:
    /// `input_weight` per prompt token, `output_weight` per generated token.
    pub fair: FairConfig,
    /// The longest a request waits for a running slot (in the cluster-priority
    /// queue, or for any worker to come back) before 503 with `Retry-After`.
    pub max_wait_ms: NonZeroU64,
    /// Connecting to a worker (requests, polls, KV event streams).
    pub connect_timeout_ms: NonZeroU64,
    /// The longest silence while reading a worker's response: before its first
    /// byte (then another worker is tried) and between two bytes (then the
    /// stream ends with an error event). Not a total: a streamed response may
    /// run for as long as it keeps sending; a non-streamed one must arrive
    /// within it.
    pub read_timeout_ms: NonZeroU64,
    /// A KV event stream without a byte for this long (workers send a keep-alive
    /// every 15 s) is half-open: it is dropped and resubscribed.
    pub kv_idle_timeout_ms: NonZeroU64,
    /// How often the actors see a fresh cluster snapshot.
    pub actor_tick_ms: u64,
    /// Every scale hint published (`scale-by-prop`), appended as a JSON line:
    /// the history an operator or an autoscaler's tuning reads back.
    pub scale_history_file: Option<PathBuf>,
    /// Where inferlets installed through the controller are kept (a
    /// manifest and the components), so a restart keeps the set; unset:
    /// `$PIE_HOME/controller-inferlets` (`~/.cache/pie/...`).
    pub inferlets_dir: Option<PathBuf>,
    /// Workers that may join by registration (`POST /v1/cluster/register`,
    /// a worker-role key); beyond: 403.
    pub max_registered_workers: usize,
    /// A registered worker that has not registered again (its heartbeat,
    /// every 2 s) for this long expires from the registry.
    pub registration_ttl_ms: NonZeroU64,
    #[serde(rename = "cache-aware")]
    pub cache_aware: CacheAwareConfig,
    #[serde(rename = "session-affinity")]
    pub session_affinity: SessionAffinityConfig,
    pub pin: PinConfig,
    pub disaggregate: DisaggregateConfig,
    #[serde(rename = "scale-by-prop")]
    pub scale_by_prop: ScaleByPropConfig,
    pub rebalance: RebalanceConfig,
    #[serde(rename = "drain-migrate")]
    pub drain_migrate: DrainMigrateConfig,
    #[serde(rename = "persist-prefix")]
    pub persist_prefix: PersistPrefixConfig,
    pub replicate: ReplicateConfig,
    #[serde(rename = "pool-replicate")]
    pub pool_replicate: PoolReplicateConfig,
    #[serde(rename = "retain-all")]
    pub retain_all: RetainAllConfig,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            workers: Vec::new(),
            cluster_policies: vec![
                "pin".into(),
                "session-affinity".into(),
                "cache-aware".into(),
                "drain-migrate".into(),
            ],
            worker_key: None,
            pool: None,
            poll_ms: 250,
            max_queued: DEFAULT_MAX_QUEUED,
            queue_order: QueueOrder::Priority,
            fair: FairConfig::default(),
            max_wait_ms: ms(30_000),
            connect_timeout_ms: ms(2_000),
            read_timeout_ms: ms(120_000),
            kv_idle_timeout_ms: ms(45_000),
            actor_tick_ms: 1000,
            scale_history_file: None,
            inferlets_dir: None,
            max_registered_workers: 64,
            registration_ttl_ms: ms(10_000),
            cache_aware: CacheAwareConfig::default(),
            session_affinity: SessionAffinityConfig::default(),
            pin: PinConfig::default(),
            disaggregate: DisaggregateConfig::default(),
            scale_by_prop: ScaleByPropConfig::default(),
            rebalance: RebalanceConfig::default(),
            drain_migrate: DrainMigrateConfig::default(),
            persist_prefix: PersistPrefixConfig::default(),
            replicate: ReplicateConfig::default(),
            pool_replicate: PoolReplicateConfig::default(),
            retain_all: RetainAllConfig::default(),
        }
    }
}

/// A default duration in ms (timeouts and waits are never 0: a 0 in the file
/// is an error naming its line and key).
fn ms(n: u64) -> NonZeroU64 {
    NonZeroU64::new(n).unwrap_or(NonZeroU64::MIN)
}

/// `cluster-priority` is not a routing step: it gates requests before routing.
pub const CLUSTER_PRIORITY: &str = "cluster-priority";

impl ClusterConfig {
    fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms.get())
    }

    /// The client requests are proxied with: connect and read timeouts.
    pub fn proxy_client(&self) -> reqwest::Result<reqwest::Client> {
        reqwest::Client::builder()
            .connect_timeout(self.connect_timeout())
            .read_timeout(Duration::from_millis(self.read_timeout_ms.get()))
            .build()
    }

    /// The client KV event streams are followed with: they are idle for long
    /// stretches, so `kv_idle_timeout_ms` bounds their reads, not `read_timeout_ms`.
    pub fn kv_client(&self) -> reqwest::Result<reqwest::Client> {
        reqwest::Client::builder()
            .connect_timeout(self.connect_timeout())
            .build()
    }

    /// Whether requests wait in the controller when the cluster is saturated.
    pub fn queueing(&self) -> bool {
        self.cluster_policies.iter().any(|p| p == CLUSTER_PRIORITY)
    }

    /// `cluster_policies` (but `cluster-priority`) as routing names and actor
    /// names; an unknown name is an error listing every known one.
    fn split(&self) -> Result<(Vec<String>, Vec<String>), String> {
        let names: Vec<String> = self
            .cluster_policies
            .iter()
            .filter(|name| *name != CLUSTER_PRIORITY)
            .cloned()
            .collect();
        let (routing, actors) = split_policies(&names)
            .map_err(|e| format!("{e}; before routing: `{CLUSTER_PRIORITY}`"))?;
        let owned = |v: Vec<&str>| v.into_iter().map(String::from).collect();
        Ok((owned(routing), owned(actors)))
    }

    /// The routing pipeline, or an error naming the bad entry.
    pub fn pipeline(&self) -> Result<Vec<Box<dyn ClusterPolicy>>, String> {
        let configs = RoutingConfigs {
            pin: self.pin.clone(),
            session_affinity: self.session_affinity.clone(),
            cache_aware: self.cache_aware.clone(),
            disaggregate: self.disaggregate.clone(),
        };
        let (routing, _) = self.split()?;
        routing
            .into_iter()
            .map(|name| routing_policy(&name, &configs))
            .collect()
    }

    /// `scale_history_file`, opened for appending; None without one; an
    /// error names the config file it came from, the key and the file.
    pub fn scale_history(&self, config_file: Option<&Path>) -> Result<Option<JsonLines>> {
        let Some(path) = &self.scale_history_file else {
            return Ok(None);
        };
        let from = config_file.map_or("the config".into(), |f| f.display().to_string());
        let lines = JsonLines::open(path).map_err(|e| {
            anyhow!(
                "{from}: key `cluster.scale_history_file`: cannot open {}: {e}",
                path.display()
            )
        })?;
        Ok(Some(lines))
    }

    /// The actors named in `cluster_policies`, with their `[cluster.<name>]`
    /// sections; errors name the actor and key (`scale-by-prop.hysteresis: ...`).
    pub fn actors(&self) -> Result<ActorRunner, String> {
        let (_, actors) = self.split()?;
        let configs = ActorConfigs {
            scale_by_prop: self.scale_by_prop.clone(),
            rebalance: self.rebalance.clone(),
            drain_migrate: self.drain_migrate.clone(),
            persist_prefix: self.persist_prefix.clone(),
            replicate: self.replicate.clone(),
            pool_replicate: self.pool_replicate.clone(),
            retain_all: self.retain_all.clone(),
        };
        let names: Vec<&str> = actors.iter().map(String::as_str).collect();
        ActorRunner::new(&names, &configs)
    }
}

impl ServerConfig {
    /// Every client API key, inline and from `api_keys_file`.
    pub fn api_keys(&self) -> Result<Vec<ApiKey>> {
        let mut keys = self.api_keys.clone();
        if let Some(path) = &self.api_keys_file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                anyhow!("server.api_keys_file: cannot read {}: {e}", path.display())
            })?;
            let from_file = parse_key_file(&text)
                .map_err(|(line, message)| anyhow!("{}:{line}: {message}", path.display()))?;
            keys.extend(from_file);
        }
        pie_core::auth::check_keys(&keys).map_err(|e| anyhow!("server.api_keys: {e}"))?;
        Ok(keys)
    }
}

impl Config {
    pub fn load(file: &Path) -> Result<Self> {
        Self::parse(&pie_core::config_file::read(file)?, file)
    }

    /// Parse `text` (read from `file`, named in errors) and check its policies.
    pub fn parse(text: &str, file: &Path) -> Result<Self> {
        let config: Config = pie_core::config_file::parse_toml(text, file)?;
        config.cluster.pipeline().map_err(|e| {
            // `cache-aware.pool_weight: ...` names its key; others the list.
            match e.split_once(": ").filter(|(key, _)| !key.contains(' ')) {
                Some((key, message)) => {
                    anyhow!("{}: key `cluster.{key}`: {message}", file.display())
                }
                None => anyhow!("{}: key `cluster.cluster_policies`: {e}", file.display()),
            }
        })?;
        if let Some(url) = &config.cluster.pool {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(anyhow!(
                    "{}: key `cluster.pool`: `{url}` is not an http(s) URL",
                    file.display()
                ));
            }
        }
        config.cluster.actors().map_err(|e| {
            let (key, message) = e
                .split_once(": ")
                .unwrap_or(("cluster_policies", e.as_str()));
            anyhow!("{}: key `cluster.{key}`: {message}", file.display())
        })?;
        Ok(config)
    }
}
