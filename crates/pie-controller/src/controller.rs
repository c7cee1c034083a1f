//! The controller's state, [`Controller`]: everything below it (registry,
//! routing pipeline, admission, the table of movable streams, actors) held
//! together, built from a config ([`Controller::new`], which tests call
//! in-process too) and reloaded from one ([`Controller::reload`]). It starts
//! no task but the KV event followers of the workers it adds.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use anyhow::{Context, Result};
use pie_core::auth::ApiKey;
use pie_model::gguf::GgufFile;
use pie_model::Tokenizer;
use pie_workload::TraceRecorder;

use crate::actors::Actors;
use crate::admission::Admission;
use crate::config::Config;
use crate::installs::Installs;
use crate::kv_sync;
use crate::metrics::ControllerMetrics;
use crate::model::{read_routing_model, RoutingModel};
use crate::registry::{RegisterLimits, Registry};
use crate::routing::Pipeline;
use crate::streams::Streams;
use crate::worker_client::WorkerClient;

pub struct Controller {
    pub registry: Registry,
    pub metrics: ControllerMetrics,
    pub pipeline: Pipeline,
    /// `cluster-priority`'s wait for a running slot.
    pub admission: Admission,
    /// The tokenizer and fingerprint routing uses (see `model`): set at
    /// start from `--model`, or from the first worker that answers. The
    /// prompt's ids go to workers reporting the same fingerprint
    /// (`pie_prompt_tokens`).
    pub model: OnceLock<RoutingModel>,
    /// Proxied requests, polls and internal calls, under the worker key.
    pub worker_client: WorkerClient,
    /// KV event streams: connect timeout; reads bounded by `kv_idle_timeout`.
    pub kv_http: reqwest::Client,
    pub kv_idle_timeout: Duration,
    /// Client keys (`[server] api_keys`); empty: no authentication.
    pub api_keys: RwLock<Vec<ApiKey>>,
    /// `[cluster] max_registered_workers`.
    pub max_registered_workers: usize,
    /// `[server] trace_file`: routed OpenAI requests are recorded here.
    pub trace: Option<TraceRecorder>,
    /// The cluster actors named in `cluster_policies`, and what they see.
    pub actors: Actors,
    /// Streams in flight that can move to another worker.
    pub streams: Streams,
    /// Inferlets installed through the controller, and who holds them.
    pub installs: Installs,
}

impl Controller {
    /// The controller `config` describes (`--policies` already applied);
    /// `config_file` is where relative paths in it are read from. Errors
    /// name the key.
    pub fn new(config: &Config, config_file: Option<&Path>) -> Result<Arc<Self>> {
        let cluster = &config.cluster;
        let ctl =
            Arc::new(Controller {
                registry: Registry::default(),
                metrics: ControllerMetrics::default(),
                pipeline: Mutex::new(cluster.pipeline().map_err(anyhow::Error::msg)?),
                admission: Admission::new(cluster),
                model: routing_model_of(config)?,
                worker_client: WorkerClient {
                    http: cluster.proxy_client()?,
                    key: cluster.worker_key.clone(),
                },
                kv_http: cluster.kv_client()?,
                kv_idle_timeout: Duration::from_millis(cluster.kv_idle_timeout_ms.get()),
                api_keys: RwLock::new(config.server.api_keys()?),
                max_registered_workers: cluster.max_registered_workers,
                trace: trace_recorder(config)?,
                actors: Actors::new(
                    cluster.actors().map_err(anyhow::Error::msg)?,
                    cluster.actor_tick_ms,
                    cluster.scale_history(config_file)?,
                ),
                streams: Streams::default(),
                installs: Installs::open(cluster.inferlets_dir.clone().unwrap_or_else(|| {
                    pie_core::config_file::pie_home().join("controller-inferlets")
                }))
                .map_err(|e| anyhow::anyhow!("key `cluster.inferlets_dir`: {e}"))?,
            });
        ctl.registry
            .set_anticipate_ms(cluster.cache_aware.anticipate_ms);
        ctl.registry.track_heat(ctl.actors.wants_hot_prefixes());
        Ok(ctl)
    }

    /// Re-read `path` (SIGHUP): `cluster_policies` (and their sections) and
    /// the static workers, `max_queued` and `max_wait_ms` apply at once;
    /// actors are rebuilt (their state restarts); the HTTP timeouts need a
    /// restart; an invalid file changes nothing and is logged and counted.
    /// `cli_policies` (a `--policies` flag) keeps overriding the file.
    pub fn reload(self: &Arc<Self>, path: &Path, cli_policies: Option<&[String]>) {
        match self.try_reload(path, cli_policies) {
            Ok(policies) => tracing::info!(?policies, "cluster config reloaded"),
            Err(e) => {
                self.metrics.reload_failures.inc();
                tracing::error!("cluster config reload refused, keeping the running one: {e:#}");
            }
        }
    }

    /// Everything is read and checked before anything applies.
    fn try_reload(
        self: &Arc<Self>,
        path: &Path,
        cli_policies: Option<&[String]>,
    ) -> Result<Vec<String>> {
        let mut config = Config::load(path)?;
        if let Some(p) = cli_policies {
            config.cluster.cluster_policies = p.to_vec();
        }
        let cluster = &config.cluster;
        let pipeline = cluster.pipeline().map_err(anyhow::Error::msg)?;
        let runner = cluster.actors().map_err(anyhow::Error::msg)?;
        let keys = config.server.api_keys()?;
        let history = cluster.scale_history(Some(path))?;
        *self.pipeline.lock().unwrap_or_else(|e| e.into_inner()) = pipeline;
        self.registry
            .set_anticipate_ms(cluster.cache_aware.anticipate_ms);
        self.actors
            .replace(runner, cluster.actor_tick_ms, history, &self.metrics);
        self.registry.track_heat(self.actors.wants_hot_prefixes());
        *self.api_keys.write().unwrap_or_else(|e| e.into_inner()) = keys;
        self.admission.apply(cluster);
        self.release_waiters();
        for w in &cluster.workers {
            self.add_worker(&w.name, &w.url, w.group.clone());
        }
        Ok(config.cluster.cluster_policies)
    }

    /// Add (or update) a worker from the config; a new one gets a KV event
    /// follower.
    pub fn add_worker(self: &Arc<Self>, name: &str, url: &str, group: Option<String>) {
        let limits = RegisterLimits {
            max_registered: self.max_registered_workers,
            may_rebind: true,
        };
        if let Ok(Some(slot)) = self.registry.register(name, url, group, None, limits) {
            self.follow_kv_events(slot);
        }
    }

    /// Start following a new worker's KV event stream.
    pub fn follow_kv_events(self: &Arc<Self>, slot: usize) {
        let ctl = self.clone();
        tokio::spawn(async move {
            kv_sync::follow(&ctl.registry, &ctl.kv_stream(), slot, &ctl.metrics).await
        });
    }

    /// How KV event streams are read: the KV client, the worker key, the
    /// idle timeout.
    fn kv_stream(&self) -> kv_sync::Stream<'_> {
        kv_sync::Stream {
            http: &self.kv_http,
            key: self.worker_client.key.as_deref(),
            idle_timeout: self.kv_idle_timeout,
        }
    }

    /// Follow the shared pool's KV events (`[cluster] pool`).
    pub fn follow_pool(self: &Arc<Self>, pool: String) {
        let ctl = self.clone();
        tokio::spawn(async move {
            kv_sync::follow_pool(&ctl.registry, &ctl.kv_stream(), &pool, &ctl.metrics).await
        });
    }

    /// Wake as many waiting requests as there are free slots.
    pub fn release_waiters(&self) {
        self.admission
            .release_waiters(&self.registry, &self.metrics);
    }

    pub fn routing_model(&self) -> Option<&RoutingModel> {
        self.model.get()
    }

    /// The model's fingerprint, learning the tokenizer from the worker at
    /// `url` when the controller has none yet.
    pub async fn learn_model(&self, url: &str) -> Result<u64, String> {
        if let Some(model) = self.model.get() {
            return Ok(model.fingerprint);
        }
        let learned = read_routing_model(&self.worker_client, url).await?;
        let fingerprint = learned.fingerprint;
        if self.model.set(learned).is_ok() {
            tracing::info!(
                url,
                fingerprint = format!("{fingerprint:#018x}"),
                "routing with the tokenizer read from this worker"
            );
        }
        Ok(self.model.get().map_or(fingerprint, |m| m.fingerprint))
    }
}

/// `--model`'s tokenizer and fingerprint; without one, the first worker's.
fn routing_model_of(config: &Config) -> Result<OnceLock<RoutingModel>> {
    let model = OnceLock::new();
    match &config.model.path {
        Some(path) => {
            let gguf = GgufFile::open(path)?;
            let _ = model.set(RoutingModel {
                tokenizer: Tokenizer::from_gguf(&gguf)?,
                fingerprint: gguf.fingerprint.0,
            });
        }
        None => tracing::warn!(
            "no --model: the tokenizer comes from the first worker that answers; no worker takes requests before (cache-aware, disaggregate, tokenize-once and trace_file all need the prompt's tokens)"
        ),
    }
    Ok(model)
}

/// The `[server] trace_file` recorder (it counts and hashes prompt tokens:
/// the tokenizer is `--model`'s or the workers').
fn trace_recorder(config: &Config) -> Result<Option<TraceRecorder>> {
    let Some(path) = &config.server.trace_file else {
        return Ok(None);
    };
    let recorder = TraceRecorder::open(path)
        .with_context(|| format!("server.trace_file: cannot open {}", path.display()))?;
    Ok(Some(recorder))
}
