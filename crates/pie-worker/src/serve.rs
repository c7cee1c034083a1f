//! `pie serve`: bind, load the model, start the runtime, serve the API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use anyhow::{Context, Result};
use pie_model::Model;

use crate::api::{router, AppState};
use crate::config::Config;
use crate::engine::{Engine, EngineConfig};
use crate::fetch;
use crate::metrics::Metrics;
use crate::runtime::{Runtime, RuntimeSettings};

/// Serve until the process is stopped. Prints `pie: listening on http://ADDR`
/// as soon as the port is bound (tests and scripts wait for that line), then
/// loads the model; `/health` answers 503 until it is ready.
pub async fn serve(config: Config) -> Result<()> {
    let api_keys = config.api_keys()?;
    let addr = format!("{}:{}", config.server.host, config.server.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local: SocketAddr = listener.local_addr()?;
    println!("pie: listening on http://{local}");
    let state = AppState {
        runtime: Arc::new(OnceLock::new()),
        api_keys: Arc::new(api_keys),
    };
    let app = router(state.clone(), config.server.max_body_bytes);
    let loader = tokio::task::spawn_blocking(move || start_runtime(&config));
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let runtime = loader.await.context("model loading panicked")??;
    let _ = state.runtime.set(runtime);
    println!("pie: ready");
    server.await.context("server task panicked")??;
    Ok(())
}

fn start_runtime(config: &Config) -> Result<Arc<Runtime>> {
    let path: PathBuf = match &config.model.path {
        Some(p) => p.clone(),
        None => fetch::default_model()?,
    };
    let model =
        Arc::new(Model::load(&path).with_context(|| format!("loading {}", path.display()))?);
    let rt = &config.runtime;
    let page_bytes = model.kv_layout(rt.page_size).page_bytes();
    let engine_config = EngineConfig {
        page_size: rt.page_size,
        kv_pages: config.kv_pages(page_bytes),
        max_batch_tokens: rt.max_batch_tokens,
        max_running: rt.max_running,
    };
    let names = rt.worker_policy.names();
    let policy = crate::policies::build(&names).map_err(anyhow::Error::msg)?;
    let model_name = config.model.name.clone().unwrap_or_else(|| {
        path.file_stem().map_or("model".into(), |s| {
            s.to_string_lossy()
                .split('.')
                .next()
                .unwrap_or("model")
                .to_string()
        })
    });
    let engine = Engine::new(model, engine_config, policy);
    let settings = RuntimeSettings {
        model_name,
        max_queued: config.server.max_queued,
    };
    Ok(Runtime::start(
        engine,
        settings,
        names,
        Arc::new(Metrics::new()),
    ))
}
