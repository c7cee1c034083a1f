//! What the simulator's actor tests share: `multi-turn` under eviction
//! pressure (1,000 KV pages per worker, 20 s think times, keep-ms 60 s,
//! keep-session on: retained sessions are evicted before their next turn) on
//! four workers (`retain.rs`, `disk.rs`); `shared-prefix` with one hot
//! system prompt on 32 workers (`replicate.rs`, `retain.rs`); the check that
//! a run's outputs are whole.

#![allow(dead_code)]

use pie_sim::disaggregate::kv_bytes_per_token;
use pie_sim::{run, CostProfile, PolicyName, RunMetrics, SimConfig, WorkloadSpec};

pub const WORKERS: usize = 4;
pub const REQUESTS: usize = 2000;
/// keep-session's own router, without any tier.
pub const KEEP: &str = "session-affinity,cache-aware";

/// The eviction-pressure workload on `router`, its config changed by
/// `configure` (a pool, a disk, actor keys).
pub fn multi_turn_with(router: &str, configure: impl Fn(&mut SimConfig)) -> RunMetrics {
    let mut spec = WorkloadSpec::named("multi-turn")
        .and_then(|w| {
            w.with_overrides(&["think_ms=20000".to_string(), "keep_ms=60000".to_string()])
        })
        .expect("valid overrides");
    spec.scale_rate(WORKERS as f64);
    let mut profile = CostProfile::gpu_a100_llama3_8b();
    profile.kv_pages = 1000;
    let mut cfg = SimConfig::new(
        WORKERS,
        PolicyName::Fcfs,
        router.parse().expect("valid router"),
        profile,
    );
    cfg.keep_session = true;
    configure(&mut cfg);
    let reqs = spec.generate(REQUESTS, 7);
    run(&cfg, spec.name(), &reqs).expect("simulation runs")
}

/// Requests of `hot_system_prompt` runs.
pub const HOT_REQUESTS: usize = 12000;

/// `shared-prefix` with one system prompt taking about half the traffic and
/// a small `max_running` (so its holders are crowded), on 32 workers at load
/// 0.2, actors ticking every 250 ms, the config changed by `configure`.
pub fn hot_system_prompt(router: &str, configure: impl Fn(&mut SimConfig)) -> RunMetrics {
    const HOT_WORKERS: usize = 32;
    let mut spec = WorkloadSpec::named("shared-prefix")
        .and_then(|w| w.with_overrides(&["zipf=1.6".to_string()]))
        .expect("valid override");
    spec.scale_rate(HOT_WORKERS as f64 * 0.2);
    let mut profile = CostProfile::gpu_a100_llama3_8b();
    profile.max_running = 8;
    let mut cfg = SimConfig::new(
        HOT_WORKERS,
        PolicyName::Fcfs,
        router.parse().expect("valid router"),
        profile,
    );
    cfg.actor_tick_ms = 250;
    configure(&mut cfg);
    let reqs = spec.generate(HOT_REQUESTS, 3);
    run(&cfg, spec.name(), &reqs).expect("simulation runs")
}

/// Every request produced exactly its output; none refused or lost.
pub fn whole(m: &RunMetrics) {
    assert_eq!(m.completed, m.requests, "{}", m.router);
    assert_eq!((m.rejected, m.aborted), (0, 0), "{}", m.router);
    assert_eq!(m.wrong_output_lengths, 0, "{}: tokens lost", m.router);
}

/// Bytes of one 16-token page of the profile's KV.
pub fn page_bytes() -> u64 {
    16 * kv_bytes_per_token(&CostProfile::gpu_a100_llama3_8b(), pie_core::KvDtype::F32)
}
