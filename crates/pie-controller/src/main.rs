//! The `pie-controller` command line.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use pie_controller::actors::{self, Actors};
use pie_controller::config::{ClusterConfig, Config, WorkerEntry};
use pie_controller::model::RoutingModel;
use pie_controller::proxy::{router, Controller};
use pie_controller::registry::{Registry, Worker};
use pie_model::gguf::GgufFile;
use pie_model::Tokenizer;
use pie_policy::cluster::PriorityQueue;
use pie_workload::TraceRecorder;
use tokio::task::JoinHandle;

#[derive(Parser)]
#[command(
    name = "pie-controller",
    version,
    about = "Routes Pie sessions across workers"
)]
struct Args {
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    host: Option<String>,
    /// 0 picks a free port (printed on start).
    #[arg(long)]
    port: Option<u16>,
    /// The workers' GGUF (for the tokenizer and block hashes).
    #[arg(long)]
    model: Option<PathBuf>,
    /// NAME=URL, repeatable.
    #[arg(long = "worker")]
    workers: Vec<String>,
    /// Comma-separated cluster policies, in pipeline order.
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<String>>,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut config = match &args.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    config.server.host = args.host.unwrap_or(config.server.host);
    config.server.port = args.port.unwrap_or(config.server.port);
    config.model.path = args.model.or(config.model.path);
    for w in &args.workers {
        let (name, url) = w
            .split_once('=')
            .with_context(|| format!("--worker `{w}`: expected NAME=URL"))?;
        config.cluster.workers.push(WorkerEntry {
            name: name.into(),
            url: url.into(),
            group: None,
        });
    }
    let cli_policies = args.policies.clone();
    let args_config = args.config.clone();
    if let Some(p) = args.policies {
        config.cluster.cluster_policies = p;
    }
    let pipeline = config.cluster.pipeline().map_err(anyhow::Error::msg)?;
    let runner = config.cluster.actors().map_err(anyhow::Error::msg)?;
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
    let ctl = Arc::new(Controller {
        registry: Registry::default(),
        metrics: Default::default(),
        pipeline: Mutex::new(pipeline),
        queueing: AtomicBool::new(config.cluster.queueing()),
        queue: Mutex::new(wait_queue(&config.cluster)),
        clients_in_flight: Default::default(),
        max_wait_ms: config.cluster.max_wait_ms.get().into(),
        woken: Default::default(),
        api_keys: RwLock::new(config.server.api_keys()?),
        max_registered_workers: config.cluster.max_registered_workers,
        trace: trace_recorder(&config)?,
        model,
        http: config.cluster.proxy_client()?,
        kv_http: config.cluster.kv_client()?,
        kv_idle_timeout: Duration::from_millis(config.cluster.kv_idle_timeout_ms.get()),
        worker_key: config.cluster.worker_key.clone(),
        actors: Actors::new(
            runner,
            config.cluster.actor_tick_ms,
            config.cluster.scale_history(args_config.as_deref())?,
        ),
        streams: Default::default(),
    });
    ctl.registry
        .set_anticipate_ms(config.cluster.cache_aware.anticipate_ms);
    ctl.registry.track_heat(ctl.actors.wants_hot_prefixes());
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let listener =
                tokio::net::TcpListener::bind((config.server.host.as_str(), config.server.port))
                    .await?;
            println!(
                "pie-controller: listening on http://{}",
                listener.local_addr()?
            );
            for w in &config.cluster.workers {
                ctl.add_worker(&w.name, &w.url, w.group.clone());
            }
            if let Some(pool) = &config.cluster.pool {
                tracing::info!(pool, "following the shared pool's KV events");
                ctl.follow_pool(pool.trim_end_matches('/').to_string());
            }
            tokio::spawn(actors::run(ctl.clone()));
            let every = Duration::from_millis(config.cluster.poll_ms.max(10));
            let ttl_ms = config.cluster.registration_ttl_ms.get();
            tokio::spawn(poll_workers(ctl.clone(), every, ttl_ms));
            if let Some(path) = args_config {
                tokio::spawn(reload_on_sighup(ctl.clone(), path, cli_policies));
            }
            // Relayed streams are many small writes: no Nagle delay on them.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(listener, router(ctl)).await?;
            Ok(())
        })
}

/// Every `every`, poll each worker whose last poll has finished, each in its
/// own task: a slow worker delays only its own health. Registered workers
/// silent for `registration_ttl_ms` expire first.
async fn poll_workers(ctl: Arc<Controller>, every: Duration, registration_ttl_ms: u64) {
    let mut polls: HashMap<String, JoinHandle<()>> = HashMap::new();
    let mut before: Option<Vec<Worker>> = None;
    loop {
        for name in ctl.registry.expire_silent(registration_ttl_ms) {
            tracing::warn!(
                worker = name,
                "no registration for cluster.registration_ttl_ms: expired"
            );
        }
        for (name, url) in ctl.registry.endpoints() {
            if polls.get(&name).is_some_and(|p| !p.is_finished()) {
                continue;
            }
            let (ctl, worker) = (ctl.clone(), name.clone());
            let poll = tokio::spawn(async move {
                let key = ctl.worker_key.as_deref();
                let model = ctl.learn_model(&url).await;
                ctl.registry
                    .poll(&ctl.http, key, &worker, &url, model)
                    .await;

                // Capacity can also free up on the workers' side.
                ctl.release_waiters();
            });
            polls.insert(name, poll);
        }
        tokio::time::sleep(every).await;
        // Health changes are events only for actors: no copies without them.
        before = ctl.actors.active().then(|| {
            let after = ctl.registry.snapshot();
            if let Some(before) = &before {
                ctl.actors.notify(actors::health_events(before, &after));
            }
            after
        });
    }
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

/// SIGHUP re-reads the config file: `cluster_policies` (and their sections) and
/// the static workers, `max_queued` and `max_wait_ms` apply at once; actors are
/// rebuilt (their state restarts); the HTTP timeouts need a restart; an invalid file changes nothing and is logged and counted. A `--policies`
/// flag keeps overriding the file.
#[cfg(unix)]
async fn reload_on_sighup(ctl: Arc<Controller>, path: PathBuf, cli_policies: Option<Vec<String>>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        let fresh = Config::load(&path).and_then(|mut c| {
            if let Some(p) = &cli_policies {
                c.cluster.cluster_policies = p.clone();
            }
            let pipeline = c.cluster.pipeline().map_err(anyhow::Error::msg)?;
            let runner = c.cluster.actors().map_err(anyhow::Error::msg)?;
            let keys = c.server.api_keys()?;
            let history = c.cluster.scale_history(Some(&path))?;
            Ok((c, pipeline, runner, keys, history))
        });
        match fresh {
            Ok((config, pipeline, runner, keys, history)) => {
                *ctl.pipeline.lock().unwrap_or_else(|e| e.into_inner()) = pipeline;
                ctl.registry
                    .set_anticipate_ms(config.cluster.cache_aware.anticipate_ms);
                ctl.actors
                    .replace(runner, config.cluster.actor_tick_ms, history, &ctl.metrics);
                ctl.registry.track_heat(ctl.actors.wants_hot_prefixes());
                *ctl.api_keys.write().unwrap_or_else(|e| e.into_inner()) = keys;
                ctl.queueing
                    .store(config.cluster.queueing(), Ordering::Relaxed);
                {
                    let mut queue = ctl.queue.lock().unwrap_or_else(|e| e.into_inner());
                    queue.set_max_queued(config.cluster.max_queued);
                    queue.set_order(config.cluster.queue_order);
                }
                ctl.max_wait_ms
                    .store(config.cluster.max_wait_ms.get(), Ordering::Relaxed);
                ctl.release_waiters();
                for w in &config.cluster.workers {
                    ctl.add_worker(&w.name, &w.url, w.group.clone());
                }
                tracing::info!(policies = ?config.cluster.cluster_policies, "cluster config reloaded");
            }
            Err(e) => {
                ctl.metrics.reload_failures.inc();
                tracing::error!("cluster config reload refused, keeping the running one: {e:#}");
            }
        }
    }
}

#[cfg(not(unix))]
async fn reload_on_sighup(
    _ctl: Arc<Controller>,
    _path: PathBuf,
    _cli_policies: Option<Vec<String>>,
) {
}

/// `cluster-priority`'s wait queue as `[cluster]` configures it.
fn wait_queue<T>(cluster: &ClusterConfig) -> PriorityQueue<T> {
    let mut queue = PriorityQueue::new(cluster.max_queued);
    queue.set_order(cluster.queue_order);
    queue
}
