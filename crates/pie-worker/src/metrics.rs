//! Prometheus metrics of a worker (`GET /metrics`).

use std::sync::atomic::{AtomicU64, Ordering};

use pie_model::GrammarCounts;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    pub status: String,
}

/// "in" (pulled from a peer) or "out" (sent to one).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabel {
    pub direction: &'static str,
}

/// What happened to a persisted page: written, loaded, refused (damaged,
/// foreign: deleted and recomputed), evicted, expired, deleted, failed, torn
/// (a write a crash interrupted, deleted at start-up).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    pub event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

pub struct Metrics {
    registry: Registry,
    /// Finished requests by final state (finished, failed, killed) or HTTP rejection.
    pub requests: Family<StatusLabel, Counter>,
    pub queued: Gauge,
    pub running: Gauge,
    pub pages_used: Gauge,
    pub pages_cached: Gauge,
    pub pages_free: Gauge,
    pub prefix_hit_tokens: Counter,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub preemptions: Counter,
    pub tokens_per_second: Gauge<f64, AtomicU64>,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub config_reload_failures: Counter,
    pub deadline_misses: Counter,
    pub offloaded_prefills: Counter,
    pub transfer_pages: Family<DirectionLabel, Counter>,
    pub transfer_bytes: Family<DirectionLabel, Counter>,
    /// Transfers refused or cut short, by reason (checksum, chain, handshake,
    /// torn, timeout, bytes, peer, ...).
    pub transfer_refusals: Family<ReasonLabel, Counter>,
    /// Pulls that ended incomplete: the rest of the prompt was prefilled here.
    pub transfer_fallbacks: Counter,
    pub transfer_seconds: Histogram,
    /// One constrained sequence's token mask (computed beside the forward).
    pub constraint_mask_seconds: Histogram,
    /// Grammars compiled, and copied from the model's cache of them.
    pub grammars_compiled: Counter,
    pub inferlet_log_lines_dropped: Counter,
    pub grammars_reused: Counter,
    /// Pages pinned by leases of transfers to peers.
    pub transfer_leased_pages: Gauge,
    /// `[runtime.persist]` pages by what happened to them.
    pub persist_pages: Family<EventLabel, Counter>,
    /// Pages and bytes on disk now.
    pub persisted_pages: Gauge,
    pub persisted_bytes: Gauge,
    /// 1 while the engine thread is alive and making progress (see `supervisor`).
    pub engine_healthy: Gauge,
    pub engine_panics: Counter,
    pub engine_stalls: Counter,
    /// Finished process records kept for the API (bounded).
    pub finished_records: Gauge,
    /// Chat sessions kept (bounded).
    pub chat_sessions: Gauge,
    pub policy_clients: Gauge,
    /// Requests whose prompt tokens a controller forwarded (not tokenized here).
    pub pretokenized: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Self {
            requests: Family::default(),
            queued: Gauge::default(),
            running: Gauge::default(),
            pages_used: Gauge::default(),
            pages_cached: Gauge::default(),
            pages_free: Gauge::default(),
            prefix_hit_tokens: Counter::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            preemptions: Counter::default(),
            tokens_per_second: Gauge::default(),
            ttft: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            inter_token: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            config_reload_failures: Counter::default(),
            deadline_misses: Counter::default(),
            offloaded_prefills: Counter::default(),
            transfer_pages: Family::default(),
            transfer_bytes: Family::default(),
            transfer_refusals: Family::default(),
            transfer_fallbacks: Counter::default(),
            transfer_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            constraint_mask_seconds: Histogram::new(exponential_buckets(0.000_01, 1.5, 30)),
            grammars_compiled: Counter::default(),
            inferlet_log_lines_dropped: Counter::default(),
            grammars_reused: Counter::default(),
            transfer_leased_pages: Gauge::default(),
            persist_pages: Family::default(),
            persisted_pages: Gauge::default(),
            persisted_bytes: Gauge::default(),
            engine_healthy: Gauge::default(),
            engine_panics: Counter::default(),
            engine_stalls: Counter::default(),
            finished_records: Gauge::default(),
            chat_sessions: Gauge::default(),
            policy_clients: Gauge::default(),
            pretokenized: Counter::default(),
            registry: Registry::with_prefix("pie"),
        };
        m.registry
            .register("requests", "Requests by final status", m.requests.clone());
        m.registry.register(
            "queue_depth",
            "Processes waiting for their first scheduling",
            m.queued.clone(),
        );
        m.registry.register(
            "running_processes",
            "Processes being computed",
            m.running.clone(),
        );
        m.registry.register(
            "kv_pages_used",
            "KV pages referenced by live contexts",
            m.pages_used.clone(),
        );
        m.registry.register(
            "kv_pages_cached",
            "Unreferenced KV pages kept for prefix reuse",
            m.pages_cached.clone(),
        );
        m.registry
            .register("kv_pages_free", "Empty KV pages", m.pages_free.clone());
        m.registry.register(
            "prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            m.prefix_hit_tokens.clone(),
        );
        m.registry.register(
            "prompt_tokens",
            "Prompt tokens computed (prefill)",
            m.prompt_tokens.clone(),
        );
        m.registry.register(
            "generated_tokens",
            "Tokens generated",
            m.generated_tokens.clone(),
        );
        m.registry.register(
            "preemptions",
            "Sequences preempted for KV pages",
            m.preemptions.clone(),
        );
        m.registry.register(
            "tokens_per_second",
            "Generated tokens per second over the last few seconds",
            m.tokens_per_second.clone(),
        );
        m.registry.register(
            "time_to_first_token_seconds",
            "Time from arrival to the first token",
            m.ttft.clone(),
        );
        m.registry.register(
            "inter_token_latency_seconds",
            "Time between consecutive tokens of a process",
            m.inter_token.clone(),
        );
        m.registry.register(
            "config_reload_failures",
            "Config reloads refused as invalid",
            m.config_reload_failures.clone(),
        );
        m.registry.register(
            "deadline_misses",
            "Processes that ended after their deadline-ms",
            m.deadline_misses.clone(),
        );
        m.registry.register(
            "offloaded_prefills",
            "Prefills computed by a peer worker",
            m.offloaded_prefills.clone(),
        );
        m.registry.register(
            "kv_transfer_pages",
            "KV pages moved between workers, by direction (in: pulled, out: sent)",
            m.transfer_pages.clone(),
        );
        m.registry.register(
            "kv_transfer_bytes",
            "KV page bytes moved between workers, by direction",
            m.transfer_bytes.clone(),
        );
        m.registry.register(
            "kv_transfer_refusals",
            "KV transfers refused or cut short, by reason",
            m.transfer_refusals.clone(),
        );
        m.registry.register(
            "kv_persist_pages",
            "Persisted KV pages by event: written, loaded, refused (damaged or foreign, deleted), evicted, expired, deleted, failed, torn (an interrupted write, deleted at start-up); spilled, spill_failed, spill_dropped (retain-all: retained sessions evicted early, kept in the pool or on disk, or not)",
            m.persist_pages.clone(),
        );
        m.registry.register(
            "kv_persisted_pages",
            "KV pages on disk ([runtime.persist])",
            m.persisted_pages.clone(),
        );
        m.registry.register(
            "kv_persisted_bytes",
            "Bytes of KV pages on disk ([runtime.persist])",
            m.persisted_bytes.clone(),
        );
        m.registry.register(
            "kv_transfer_fallbacks",
            "KV pulls that ended incomplete; the rest of the prompt was prefilled locally",
            m.transfer_fallbacks.clone(),
        );
        m.registry.register(
            "kv_transfer_seconds",
            "Time of one KV pull, the peer's prefill included",
            m.transfer_seconds.clone(),
        );
        m.registry.register(
            "constraint_mask_seconds",
            "Time to compute one constrained sequence's token mask (response_format)",
            m.constraint_mask_seconds.clone(),
        );
        m.registry.register(
            "grammars_compiled",
            "Grammars compiled (response_format, tools, an inferlet's constrained generation)",
            m.grammars_compiled.clone(),
        );
        m.registry.register(
            "inferlet_log_lines_dropped",
            "Guest log lines dropped past a log rate limit or the process's output budget",
            m.inferlet_log_lines_dropped.clone(),
        );
        m.registry.register(
            "grammars_reused",
            "Grammars copied from the model's cache of recently compiled ones instead of compiled",
            m.grammars_reused.clone(),
        );
        m.registry.register(
            "kv_leased_pages",
            "KV pages pinned while they are sent to peers",
            m.transfer_leased_pages.clone(),
        );
        m.registry.register(
            "engine_healthy",
            "1 while the engine thread is alive and making progress, else 0 (/health says why)",
            m.engine_healthy.clone(),
        );
        m.registry.register(
            "engine_panics",
            "Engine thread panics (the worker stays unhealthy until restarted)",
            m.engine_panics.clone(),
        );
        m.registry.register(
            "engine_stalls",
            "Times the engine made no progress for server.stall_ms with work pending",
            m.engine_stalls.clone(),
        );
        m.registry.register(
            "finished_process_records",
            "Finished process records kept (server.max_finished_processes, finished_ttl_ms)",
            m.finished_records.clone(),
        );
        m.registry.register(
            "chat_sessions",
            "Chat sessions kept (server.max_sessions, least recently used go)",
            m.chat_sessions.clone(),
        );
        m.registry.register(
            "policy_clients",
            "Clients whose state the ordering policy keeps (fair: runtime.fair.max_idle_clients bounds the idle ones)",
            m.policy_clients.clone(),
        );
        m.registry.register(
            "pretokenized_requests",
            "Requests whose prompt token ids a controller forwarded (pie_prompt_tokens) and the worker used instead of tokenizing",
            m.pretokenized.clone(),
        );
        m
    }

    pub fn count_request(&self, status: &str) {
        self.requests
            .get_or_create(&StatusLabel {
                status: status.to_string(),
            })
            .inc();
    }

    pub fn count_transfer(&self, direction: &'static str, pages: usize, bytes: u64) {
        let label = DirectionLabel { direction };
        self.transfer_pages
            .get_or_create(&label)
            .inc_by(pages as u64);
        self.transfer_bytes.get_or_create(&label).inc_by(bytes);
    }

    pub fn count_persist(&self, event: &'static str, pages: usize) {
        self.persist_pages
            .get_or_create(&EventLabel { event })
            .inc_by(pages as u64);
    }

    pub fn count_transfer_refusal(&self, reason: &'static str) {
        self.transfer_refusals
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    /// Bring the grammar counters up to the model's own counts (a maximum,
    /// so scrapes at once never count twice).
    pub fn sync_grammar_counts(&self, counts: GrammarCounts) {
        let raise = |counter: &Counter, to: u64| counter.inner().fetch_max(to, Ordering::Relaxed);
        raise(&self.grammars_compiled, counts.compiled);
        raise(&self.grammars_reused, counts.reused);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
