//! `rebalance` in the simulator: on `skewed-sessions` (most sessions opened on
//! one worker by a pin, kept there by session-affinity) it migrates processes
//! off the hot worker, every request still produces exactly its output, the
//! moved bytes are the pages' KV, and the intended effect: TTFT p99 drops.

use std::collections::HashSet;

use pie_policy::cluster::{Action, ActorConfigs, RebalanceSignal};
use pie_sim::disaggregate::kv_bytes_per_token;
use pie_sim::migrate::PAUSE_US;
use pie_sim::{run, CostProfile, PolicyName, RunMetrics, SimConfig, WorkloadSpec};

const WORKERS: usize = 8;
const REQUESTS: usize = 1200;
const PIPELINE: &str = "pin,session-affinity,least-loaded";

fn sim(rebalance: bool, dry_run: bool) -> RunMetrics {
    run_skewed(0.3, Some(32), rebalance, |c| c.rebalance.dry_run = dry_run)
}

/// `skewed-sessions` with `hot_fraction` of the sessions opened on `w0`, on
/// the GPU profile (its `max_running` replaced if given), with or without
/// `rebalance` configured by `configure`.
fn run_skewed(
    hot_fraction: f64,
    max_running: Option<usize>,
    rebalance: bool,
    configure: impl Fn(&mut ActorConfigs),
) -> RunMetrics {
    let mut spec = WorkloadSpec::named("skewed-sessions")
        .and_then(|w| w.with_overrides(&[format!("hot_fraction={hot_fraction}")]))
        .expect("valid override");
    spec.scale_rate(WORKERS as f64);
    let mut profile = CostProfile::gpu_a100_llama3_8b();
    profile.max_running = max_running.unwrap_or(profile.max_running);
    let router = match rebalance {
        true => format!("{PIPELINE},rebalance"),
        false => PIPELINE.to_string(),
    };
    let mut cfg = SimConfig::new(
        WORKERS,
        PolicyName::Fcfs,
        router.parse().expect("valid router"),
        profile,
    );
    configure(&mut cfg.actor_configs);
    let reqs = spec.generate(REQUESTS, 5);
    run(&cfg, spec.name(), &reqs).expect("simulation runs")
}

#[test]
fn rebalance_migrates_off_the_hot_worker_conserving_tokens_and_cuts_ttft_p99() {
    let plain = sim(false, false);
    let moved = sim(true, false);
    for m in [&plain, &moved] {
        assert_eq!(m.completed, REQUESTS, "{}", m.router);
        assert_eq!((m.rejected, m.aborted), (0, 0), "{}", m.router);
        assert_eq!(
            m.wrong_output_lengths, 0,
            "{}: tokens lost or repeated",
            m.router
        );
        assert_eq!(m.generated_tokens, m.requested_output_tokens);
    }
    assert!(plain.migrations.is_none(), "no actor, no migration figures");
    let mig = moved.migrations.as_ref().expect("an actor ran");
    assert!(mig.started >= 20, "{mig:?}");
    assert_eq!(mig.completed + mig.abandoned, mig.started, "{mig:?}");
    assert!(mig.pages > 0 && mig.stages >= mig.completed, "{mig:?}");
    let profile = CostProfile::gpu_a100_llama3_8b();
    assert_eq!(
        mig.bytes,
        mig.pages * 16 * kv_bytes_per_token(&profile, pie_core::KvDtype::F32)
    );
    // Every pause is the fixed part plus its last pages' copy.
    assert!(mig.mean_pause_ms >= PAUSE_US as f64 / 1000.0, "{mig:?}");
    assert!(mig.max_pause_ms < 1000.0, "{mig:?}");
    // The actions the run executed: migrations, never both ways in a tick.
    let mut pairs = HashSet::new();
    for a in &moved.actions {
        assert!(!a.dry_run);
        let Action::MigrateProcess { from, to, .. } = &a.action else {
            panic!("{a:?}");
        };
        assert_ne!(from, to);
        assert!(a.reason.starts_with("load: "), "{}", a.reason);
        pairs.insert((a.at_ms, from.clone(), to.clone()));
    }
    assert_eq!(moved.actions.len() as u64, mig.started);
    for (at, from, to) in &pairs {
        assert!(
            !pairs.contains(&(*at, to.clone(), from.clone())),
            "both ways at {at}"
        );
    }
    // The hot worker's queue drains onto the others.
    assert!(
        moved.ttft_ms.p99 < 0.6 * plain.ttft_ms.p99,
        "TTFT p99 {} with rebalance vs {} without",
        moved.ttft_ms.p99,
        plain.ttft_ms.p99
    );
    assert!(moved.e2e_ms.p99 < plain.e2e_ms.p99);
}

#[test]
fn a_dry_run_records_migrations_and_moves_nothing() {
    let plain = sim(false, false);
    let dry = sim(true, true);
    assert!(!dry.actions.is_empty());
    assert!(dry.actions.iter().all(|a| a.dry_run));
    assert_eq!(dry.migrations.as_ref().map(|m| m.started), Some(0));
    assert_eq!(dry.ttft_ms, plain.ttft_ms, "nothing moved");
    assert_eq!(dry.e2e_ms, plain.e2e_ms);
}

#[test]
fn runs_with_migrations_are_deterministic() {
    let a = sim(true, false);
    let b = sim(true, false);
    assert_eq!(a.migrations, b.migrations);
    assert_eq!((a.ttft_ms, a.e2e_ms), (b.ttft_ms, b.e2e_ms));
    assert_eq!(a.actions, b.actions);
}

/// With the profile's `max_running` (256) the hot worker runs out of KV pages
/// before it has 230 processes: the `kv` signal sees it and moves processes.
#[test]
fn the_kv_signal_sees_the_hot_worker_run_out_of_pages() {
    let plain = run_skewed(0.6, None, false, |_| {});
    let kv = run_skewed(0.6, None, true, |c| {
        c.rebalance.signal = RebalanceSignal::Kv
    });
    assert_eq!(kv.completed, REQUESTS);
    assert_eq!(kv.wrong_output_lengths, 0);
    let mig = kv.migrations.as_ref().expect("an actor ran");
    assert!(mig.completed >= 10, "{mig:?}");
    assert!(kv.actions.iter().all(|a| a.reason.starts_with("kv: ")));
    assert!(
        kv.ttft_ms.p99 < 0.5 * plain.ttft_ms.p99,
        "TTFT p99 {} with rebalance (kv) vs {} without",
        kv.ttft_ms.p99,
        plain.ttft_ms.p99
    );
}
