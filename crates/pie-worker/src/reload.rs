//! Reloading the configuration (SIGHUP or `POST /v1/admin/reload`): read it
//! again, apply what is reloadable to the runtime and the API keys, report
//! what needs a restart.
//!
//! Invariant: an invalid configuration changes nothing (the running one
//! stays, and the failure is counted).

use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

use anyhow::Result;
use pie_policy::runtime::WorkerPolicies;
use serde_json::{json, Value};

use crate::config::{ApiKey, Config};
use crate::runtime::Runtime;

/// Reads the configuration again (the file plus the command line's overrides).
pub type Reloader = Arc<dyn Fn() -> Result<Config> + Send + Sync>;

/// Run `reload` on every SIGHUP (it logs its own failures).
#[cfg(unix)]
pub async fn reload_on_sighup(reload: impl Fn() + Send + 'static) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; use POST /v1/admin/reload");
        return;
    };
    while hup.recv().await.is_some() {
        reload();
    }
}

#[cfg(not(unix))]
pub async fn reload_on_sighup(_reload: impl Fn() + Send + 'static) {}

/// Apply a fresh configuration. Reloadable: `[runtime] worker_policy` and the
/// policy sections, `[server] max_queued`, the API keys. Other changes are
/// reported and need a restart. An invalid file keeps everything as it was.
pub fn reload(
    rt: &Runtime,
    reloader: &Reloader,
    in_force: &RwLock<Config>,
    api_keys: &RwLock<Vec<ApiKey>>,
) -> Result<Value, String> {
    let fresh = reloader().and_then(|c| c.api_keys().map(|k| (c, k)).map_err(anyhow::Error::from));
    let (config, keys) = match fresh {
        Ok(v) => v,
        Err(e) => {
            rt.metrics.config_reload_failures.inc();
            tracing::error!("config reload refused, keeping the running configuration: {e:#}");
            return Err(format!("{e:#}"));
        }
    };
    let policies = WorkerPolicies::build(&config.runtime).map_err(|e| e.to_string())?;
    let old = in_force.read().unwrap_or_else(|e| e.into_inner()).clone();
    let restart_needed = restart_only_changes(&old, &config);
    for key in &restart_needed {
        tracing::warn!("config reload: `{key}` changed but needs a restart to apply");
    }
    rt.apply_policies(policies);
    rt.settings
        .max_queued
        .store(config.server.max_queued, Ordering::Relaxed);
    rt.settings
        .shared
        .store(pie_core::auth::several_tenants(&keys), Ordering::Relaxed);
    *api_keys.write().unwrap_or_else(|e| e.into_inner()) = keys;
    *in_force.write().unwrap_or_else(|e| e.into_inner()) = config.clone();
    tracing::info!(policies = ?config.runtime.worker_policy.names(), "config reloaded");
    Ok(
        json!({"reloaded": true, "worker_policy": config.runtime.worker_policy.names(), "needs_restart": restart_needed}),
    )
}

fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let (o, n) = (&old.runtime, &new.runtime);
    [
        ("server.host", old.server.host != new.server.host),
        ("server.port", old.server.port != new.server.port),
        (
            "server.max_body_bytes",
            old.server.max_body_bytes != new.server.max_body_bytes,
        ),
        (
            "server.stall_ms",
            old.server.stall_ms != new.server.stall_ms,
        ),
        (
            "server.max_sessions",
            old.server.max_sessions != new.server.max_sessions,
        ),
        (
            "server.max_finished_processes",
            old.server.max_finished_processes != new.server.max_finished_processes,
        ),
        (
            "server.finished_ttl_ms",
            old.server.finished_ttl_ms != new.server.finished_ttl_ms,
        ),
        (
            "server.max_finished_bytes",
            old.server.max_finished_bytes != new.server.max_finished_bytes,
        ),
        (
            "server.max_record_bytes",
            old.server.max_record_bytes != new.server.max_record_bytes,
        ),
        (
            "server.trace_file",
            old.server.trace_file != new.server.trace_file,
        ),
        (
            "server.step_log",
            old.server.step_log != new.server.step_log,
        ),
        ("model", old.model != new.model),
        ("runtime.page_size", o.page_size != n.page_size),
        (
            "runtime.kv_pages",
            o.kv_pages != n.kv_pages || o.kv_memory != n.kv_memory,
        ),
        (
            "runtime.max_batch_tokens",
            o.max_batch_tokens != n.max_batch_tokens,
        ),
        ("runtime.max_running", o.max_running != n.max_running),
    ]
    .into_iter()
    .filter_map(|(k, changed)| changed.then_some(k))
    .collect()
}
