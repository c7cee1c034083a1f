//! The `pie-controller` command line.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use pie_controller::api::router;
use pie_controller::config::{Config, WorkerEntry};
use pie_controller::controller::Controller;
use pie_controller::{actor_loop, install_sync};
use pie_policy::cluster::{health_events, WorkerHealth};
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
    let ctl = Controller::new(&config, args_config.as_deref())?;
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
            tokio::spawn(actor_loop::run(ctl.clone()));
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
    let mut before: Option<Vec<WorkerHealth>> = None;
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
                let client = &ctl.worker_client;
                let model = ctl.learn_model(&url).await;
                ctl.registry
                    .poll(&client.http, client.key.as_deref(), &worker, &url, model)
                    .await;
                install_sync::after_poll(&ctl, &worker, &url).await;

                // Capacity can also free up on the workers' side.
                ctl.release_waiters();
            });
            polls.insert(name, poll);
        }
        tokio::time::sleep(every).await;
        // Health changes are events only for actors: no copies without them.
        before = ctl.actors.active().then(|| {
            let after: Vec<WorkerHealth> =
                ctl.registry.snapshot().iter().map(|w| w.health()).collect();
            if let Some(before) = &before {
                ctl.actors.notify(health_events(before, &after));
            }
            after
        });
    }
}

/// SIGHUP re-reads the config file (see `Controller::reload`); a
/// `--policies` flag keeps overriding the file.
#[cfg(unix)]
async fn reload_on_sighup(ctl: Arc<Controller>, path: PathBuf, cli_policies: Option<Vec<String>>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        ctl.reload(&path, cli_policies.as_deref());
    }
}

#[cfg(not(unix))]
async fn reload_on_sighup(
    _ctl: Arc<Controller>,
    _path: PathBuf,
    _cli_policies: Option<Vec<String>>,
) {
}
