//! `pie-pool`: a shared store of KV pages (see the crate docs and `api`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Result;
use clap::Parser;
use pie_pool::api::{router, Pool};
use pie_pool::config::Config;
use pie_pool::store::{Limits, PageStore};

/// A page pool for Pie workers.
#[derive(Parser)]
#[command(name = "pie-pool", version)]
struct Args {
    /// config.toml (`[server]`, `[pool]`); every key is optional.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    host: Option<String>,
    /// 0 picks a free port (printed on the first line).
    #[arg(long)]
    port: Option<u16>,
    /// The disk tier's directory (`[pool] dir`).
    #[arg(long)]
    dir: Option<PathBuf>,
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
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    config.server.host = args.host.unwrap_or(config.server.host);
    config.server.port = args.port.unwrap_or(config.server.port);
    config.pool.dir = args.dir.or(config.pool.dir);
    let p = &config.pool;
    let (store, on_disk) = PageStore::open(Limits {
        capacity: p.capacity.0,
        high: p.high_watermark,
        low: p.low_watermark,
        disk: p.dir.clone().map(|d| (d, p.disk_budget.0)),
    })
    .map_err(|e| anyhow::anyhow!("pool.dir: {e}"))?;
    match &p.dir {
        Some(dir) => tracing::info!(dir = %dir.display(), pages = on_disk, "disk tier opened"),
        None => tracing::info!("no [pool] dir: pages live in memory only and a restart loses them"),
    }
    let pool = Arc::new(Pool::new(store, config.server.api_keys.clone()));
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let listener =
                tokio::net::TcpListener::bind((config.server.host.as_str(), config.server.port))
                    .await?;
            println!("pie-pool: listening on http://{}", listener.local_addr()?);
            if config.pool.ttl_ms > 0 {
                tokio::spawn(expire(
                    pool.clone(),
                    Duration::from_millis(config.pool.ttl_ms),
                ));
            }
            axum::serve(listener, router(pool)).await?;
            Ok(())
        })
}

/// Delete pages unused for `ttl`, every quarter of it (at most every minute).
async fn expire(pool: Arc<Pool>, ttl: Duration) {
    let every = (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(60));
    loop {
        tokio::time::sleep(every).await;
        let _ = pool
            .with_store(move |s| s.remove_older_than(ttl, SystemTime::now()))
            .await;
    }
}
