//! The `pie-controller` command line.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use pie_controller::config::{Config, WorkerEntry};
use pie_controller::proxy::{router, Controller};
use pie_controller::registry::{Registry, Worker};
use pie_model::gguf::GgufFile;
use pie_model::Tokenizer;

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
        });
    }
    if let Some(p) = args.policies {
        config.cluster.cluster_policies = p;
    }
    let pipeline = config.cluster.pipeline().map_err(anyhow::Error::msg)?;
    let tokenizer = match &config.model.path {
        Some(path) => Some(Tokenizer::from_gguf(&GgufFile::open(path)?)?),
        None => None,
    };
    let ctl = Arc::new(Controller {
        registry: Registry::new(
            config
                .cluster
                .workers
                .iter()
                .map(|w| Worker::new(&w.name, &w.url)),
        ),
        metrics: Default::default(),
        pipeline: Mutex::new(pipeline),
        tokenizer,
        http: reqwest::Client::new(),
        worker_key: config.cluster.worker_key.clone(),
    });
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
            let poller = ctl.clone();
            let every = Duration::from_millis(config.cluster.poll_ms.max(10));
            tokio::spawn(async move {
                loop {
                    poller
                        .registry
                        .poll(&poller.http, poller.worker_key.as_deref())
                        .await;
                    tokio::time::sleep(every).await;
                }
            });
            axum::serve(listener, router(ctl)).await?;
            Ok(())
        })
}
