//! `pie serve`: bind, load the model, start the runtime, serve the API, reload
//! on SIGHUP, register with a controller, drain on SIGTERM. The top of the
//! worker: it wires the runtime, the API, reload and registration together.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, RwLock};

use anyhow::{Context, Result};
use pie_model::{Model, Window};

use crate::api::router;
use crate::api::state::AppState;
use crate::config::Config;
use crate::engine::{Engine, EngineConfig};
use crate::fetch;
use crate::inferlets::Inferlets;
use crate::memory_bound::{machine_memory, MemoryBound};
use crate::metrics::Metrics;
use crate::register::{deregister, heartbeat, Registration};
use crate::reload::{reload_on_sighup, Reloader};
use crate::runtime::{Runtime, RuntimeSettings};
use pie_policy::runtime::WorkerPolicies;

/// Serve until the process is stopped. Prints `pie: listening on http://ADDR`
/// as soon as the port is bound (tests and scripts wait for that line), then
/// loads the model; `/health` answers 503 until it is ready.
pub async fn serve(
    config: Config,
    reloader: Reloader,
    registration: Option<Registration>,
) -> Result<()> {
    let api_keys = config.api_keys()?;
    let worker_key = config.worker_key()?;
    let inferlets = Inferlets::new(&config.runtime.inferlets)?;
    let addr = format!("{}:{}", config.server.host, config.server.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local: SocketAddr = listener.local_addr()?;
    println!("pie: listening on http://{local}");
    let state = AppState {
        runtime: Arc::new(OnceLock::new()),
        api_keys: Arc::new(RwLock::new(api_keys)),
        reloader,
        config: Arc::new(RwLock::new(config.clone())),
        inferlets,
    };
    let app = router(state.clone(), config.server.max_body_bytes);
    let loader = tokio::task::spawn_blocking(move || start_runtime(&config));
    // Streams are many small writes; Nagle would hold each behind a delayed ACK.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });
    let runtime = loader.await.context("model loading panicked")??;
    let _ = state.runtime.set(runtime.clone());
    println!("pie: ready");
    let reloaded = state.clone();
    tokio::spawn(reload_on_sighup(move || {
        let _ = reloaded.reload();
    }));
    let leave = registration
        .as_ref()
        .map(|r| (r.controller.clone(), r.name.clone(), worker_key.clone()));
    let heartbeat = registration.map(|registration| {
        tokio::spawn(heartbeat(
            registration,
            format!("http://{local}"),
            worker_key,
        ))
    });
    tokio::select! {
        served = &mut server => served.context("server task panicked")??,
        () = drained(&runtime, &state) => {
            if let Some(h) = heartbeat {
                h.abort();
            }
            if let Some((controller, name, key)) = leave {
                deregister(&controller, &name, key.as_deref()).await;
            }
            // Streams that just ended send their last events; endless ones
            // (a controller's KV event stream) are cut after a grace second.
            let _ = stop.send(());
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), server).await;
            println!("pie: drained");
        }
    }
    Ok(())
}

/// Returns once a drain (SIGTERM or `POST /v1/admin/drain`) has run its
/// course: no process left, or `[server] drain_timeout_ms` passed (what is
/// left is failed, naming the timeout). A controller moves the processes it
/// relays to other workers meanwhile.
async fn drained(rt: &Arc<Runtime>, state: &AppState) {
    let mut term = sigterm();
    tokio::select! {
        () = rt.drain_started() => {}
        () = next_signal(&mut term) => {
            if rt.start_drain() {
                tracing::info!(processes = rt.live_processes(), "SIGTERM: draining");
            }
        }
    }
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(50));
    let timeout_ms = state
        .config
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .server
        .drain_timeout_ms;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(timeout_ms);
    while rt.live_processes() > 0 && tokio::time::Instant::now() < deadline {
        tick.tick().await;
    }
    let left = rt.fail_live(&format!(
        "the worker drained: server.drain_timeout_ms ({timeout_ms} ms) passed"
    ));
    tracing::info!(failed = left, "drained");
}

#[cfg(unix)]
type Signal = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Signal = ();

#[cfg(unix)]
fn sigterm() -> Signal {
    use tokio::signal::unix::{signal, SignalKind};
    signal(SignalKind::terminate())
        .map_err(|e| {
            tracing::warn!("cannot listen for SIGTERM ({e}); drain with POST /v1/admin/drain")
        })
        .ok()
}

#[cfg(not(unix))]
fn sigterm() -> Signal {}

#[cfg(unix)]
async fn next_signal(s: &mut Signal) {
    if let Some(s) = s {
        if s.recv().await.is_some() {
            return;
        }
    }
    std::future::pending().await
}

#[cfg(not(unix))]
async fn next_signal(_: &mut Signal) {
    std::future::pending().await
}

/// `model` with the template in `[model] chat_template`, when set.
fn with_chat_template(model: Model, file: Option<&std::path::Path>) -> Result<Model> {
    let Some(file) = file else { return Ok(model) };
    let template = std::fs::read_to_string(file)
        .with_context(|| format!("model.chat_template: cannot read {}", file.display()))?;
    model
        .with_chat_template(template)
        .with_context(|| format!("model.chat_template {}", file.display()))
}

/// The name a model file is served under: its stem without a trailing
/// quantisation type (`SmolLM2-135M-Instruct.Q4_1.gguf` is
/// `SmolLM2-135M-Instruct`; `qwen2.5-0.5b-instruct-q4_k_m.gguf` keeps its
/// whole stem).
fn model_name_of(path: &std::path::Path) -> String {
    let stem = path
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned());
    let quant_type = |s: &str| {
        let s = s.to_ascii_lowercase();
        let digits = s.trim_start_matches(['i', 'q', 'f', 'b']);
        digits.len() < s.len() && digits.starts_with(|c: char| c.is_ascii_digit())
    };
    match stem.rsplit_once('.') {
        Some((name, suffix)) if !name.is_empty() && quant_type(suffix) => name.to_string(),
        _ => stem,
    }
}

/// Say the worker's memory bound, warning when it passes the machine's.
fn say_memory_bound(config: &Config, model: &std::path::Path, kv_bytes: u64) {
    let model_bytes = std::fs::metadata(model).map_or(0, |m| m.len());
    let bound = MemoryBound::of(config, model_bytes, kv_bytes);
    match machine_memory() {
        Some(machine) if bound.total() > machine => tracing::warn!(
            "memory bound {bound}, past this machine's {} MiB: lower \
             [runtime.inferlets] max_instances or max_memory (docs/tenancy-and-limits.md)",
            machine >> 20
        ),
        _ => tracing::info!("memory bound {bound}"),
    }
}

/// Load the model and start the runtime over it (`pie serve`, `pie run`).
pub fn start_runtime(config: &Config) -> Result<Arc<Runtime>> {
    let path: PathBuf = match &config.model.path {
        Some(p) => p.clone(),
        None => fetch::default_model()?,
    };
    let model = Model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let model = Arc::new(with_chat_template(
        model,
        config.model.chat_template.as_deref(),
    )?);
    tracing::info!(
        "architecture {}; tool calls: {} format; matmul kernel {}",
        model.config.arch.name,
        model.tokenizer.tool_format().name(),
        model.matmul_kernel()
    );
    if let Some(refusal) = model.matmul_refusal() {
        tracing::warn!("{refusal}");
    }
    if let Some(choice) = &model.matmul_choice {
        tracing::info!("{choice}");
    }
    match (model.config.sliding_window, model.config.arch.window) {
        (Some(window), Window::HoldsSequences) => tracing::warn!(
            "sequences are held to {} positions: the model's sliding window ({window}) is not applied to longer ones",
            model.config.context_length
        ),
        (Some(window), Window::Interleaved { global_every, .. }) => tracing::info!(
            "sliding-window attention: {} of every {global_every} layers see the last {window} positions",
            global_every - 1
        ),
        (None, _) => {}
    }
    if !model.widened.is_empty() {
        let types: Vec<String> = (model.widened.iter())
            .map(|(dtype, tensors)| format!("{dtype} ({tensors} tensors)"))
            .collect();
        tracing::warn!(
            "weights widened to 8 bits at load, no compact kernel for their type yet: {}",
            types.join(", ")
        );
    }
    let rt = &config.runtime;
    let page_bytes = model.kv_layout(rt.page_size).page_bytes(rt.kv_dtype);
    let engine_config = EngineConfig {
        page_size: rt.page_size,
        kv_pages: config.kv_pages(page_bytes),
        kv_dtype: rt.kv_dtype,
        max_batch_tokens: rt.max_batch_tokens,
        max_running: rt.max_running,
    };
    say_memory_bound(config, &path, (engine_config.kv_pages * page_bytes) as u64);
    let policies = WorkerPolicies::build(rt).map_err(anyhow::Error::msg)?;
    let model_name = (config.model.name.clone()).unwrap_or_else(|| model_name_of(&path));
    let engine = Engine::new(model, engine_config, Box::new(pie_policy::Fcfs));
    let trace = match &config.server.trace_file {
        Some(path) => Some(pie_workload::TraceRecorder::open(path).map_err(|e| {
            anyhow::anyhow!("server.trace_file: cannot open {}: {e}", path.display())
        })?),
        None => None,
    };
    let persist = open_persist(&config.runtime.persist, engine.page_format())?;
    let settings = RuntimeSettings {
        model_name,
        max_queued: config.server.max_queued.into(),
        shared: pie_core::auth::several_tenants(&config.api_keys()?).into(),
        trace,
        worker_key: config.worker_key()?,
        stage: config.runtime.stage,
        transfer: config.runtime.transfer.clone(),
        persist,
        pool: config.runtime.pool.clone(),
        stall_ms: config.server.stall_ms,
        max_sessions: config.server.max_sessions,
        records: crate::records::RecordLimits {
            max_finished: config.server.max_finished_processes,
            finished_ttl_ms: config.server.finished_ttl_ms,
            max_finished_bytes: config.server.max_finished_bytes.0 as usize,
            max_record_bytes: config.server.max_record_bytes.0 as usize,
        },
        step_log: config
            .server
            .step_log
            .as_deref()
            .map(crate::step_log::StepLog::create)
            .transpose()?,
    };
    let rt = Runtime::start(engine, settings, policies, Arc::new(Metrics::new()));
    rt.start_persist();
    rt.start_spills();
    Ok(rt)
}

/// `[runtime.persist]`: the disk tier, opened (torn writes deleted, over
/// budget evicted) and reported; a worker without a `dir` says it cannot
/// persist.
fn open_persist(
    config: &pie_core::worker_config::PersistConfig,
    format: pie_kv::transfer::PageFormat,
) -> anyhow::Result<Option<crate::runtime::PersistStore>> {
    match crate::runtime::PersistStore::open(config, format) {
        Ok(Some((store, opened))) => {
            tracing::info!(
                pages = opened.pages,
                bytes = opened.bytes,
                torn = opened.torn,
                "persisted KV pages found (runtime.persist.dir)"
            );
            Ok(Some(store))
        }
        Ok(None) => {
            tracing::info!("no [runtime.persist] dir: this worker cannot persist KV pages");
            Ok(None)
        }
        Err(e) => Err(anyhow::anyhow!("runtime.persist.dir: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::model_name_of;
    use std::path::Path;

    #[test]
    fn a_model_is_named_after_its_file_without_the_quantisation() {
        for (file, name) in [
            (
                "/m/SmolLM2-135M-Instruct.Q4_1.gguf",
                "SmolLM2-135M-Instruct",
            ),
            ("llama-3.2-1b-shaped.Q4_K_M.gguf", "llama-3.2-1b-shaped"),
            ("gemma-3-270m-it.IQ4_XS.gguf", "gemma-3-270m-it"),
            ("model.BF16.gguf", "model"),
            (
                "qwen2.5-0.5b-instruct-q4_k_m.gguf",
                "qwen2.5-0.5b-instruct-q4_k_m",
            ),
            ("Phi-3.5-mini-instruct.gguf", "Phi-3.5-mini-instruct"),
        ] {
            assert_eq!(model_name_of(Path::new(file)), name, "{file}");
        }
    }
}
