//! The pool tier in the simulator: `retain-all` and `pool-replicate` over a
//! shared page pool (`--pool-pages`). On `multi-turn` with eviction pressure
//! between turns (1,000 KV pages per worker, 20 s think times, keep-ms 60 s:
//! retained sessions are evicted before their next turn), keep-session alone
//! loses them and retain-all spills them to the pool, from which the next
//! turn pulls them: more prefix hits and a lower TTFT for later turns, every
//! spilled page accounted for, the pool never above its capacity, at most 4
//! spills on their way per worker (more dropped), outputs whole, runs
//! deterministic. On `shared-prefix` with one hot system prompt,
//! `pool-replicate` pushes it, workers that did not push it pull it, and TTFT
//! p99 drops as with `replicate`.

mod common;

use common::{hot_system_prompt, multi_turn_with, page_bytes, whole, KEEP};
use pie_policy::cluster::{Action, Tier};
use pie_sim::pool::PoolCounters;
use pie_sim::{run, CostProfile, PolicyName, RunMetrics, SimConfig, WorkloadSpec};

/// `multi-turn` under eviction pressure with keep-session, on `router`, with
/// a pool of `pool_pages` (0: none).
fn multi_turn(router: &str, pool_pages: usize) -> RunMetrics {
    multi_turn_with(router, |cfg| cfg.pool_pages = pool_pages)
}

/// Every page a push sent reached the pool, and its bytes are its KV.
fn accounted(p: &PoolCounters) {
    let page_bytes = page_bytes();
    assert_eq!(
        p.spilled_pages + p.replicated_pages,
        p.stored_pages + p.already_held_pages,
        "every page sent arrived: {p:?}"
    );
    assert_eq!(p.spilled_bytes, p.spilled_pages * page_bytes);
    assert_eq!(p.replicated_bytes, p.replicated_pages * page_bytes);
    assert_eq!(p.pulled_bytes, p.pulled_pages * page_bytes);
    assert!(p.max_held_pages <= p.capacity_pages, "{p:?}");
    assert!(p.held_pages <= p.capacity_pages, "{p:?}");
    assert_eq!(p.pulls_by_worker.iter().sum::<u64>(), p.pulls);
    assert!(p.short_pulls <= p.pulls && p.unfit_pages <= p.pulled_pages);
}

#[test]
fn retain_all_spills_evicted_sessions_and_later_turns_pull_them() {
    let keep = multi_turn(KEEP, 0);
    let retain = multi_turn(&format!("{KEEP},retain-all"), 40_000);
    whole(&keep);
    whole(&retain);
    assert!(keep.pool.is_none(), "no pool, no pool figures");
    let p = retain.pool.as_ref().expect("a pool");
    accounted(p);
    assert!(p.spills > 0 && p.spilled_pages > 0, "{p:?}");
    assert!(p.pulls > 0 && p.pulled_pages > 0, "{p:?}");
    assert_eq!(p.evicted_pages, 0, "the pool holds every spill: {p:?}");
    // Every worker was asked once and spilled from then on.
    let mut asked: Vec<&str> = (retain.actions.iter())
        .map(|a| match &a.action {
            Action::RetainSpill { worker, to } => {
                assert_eq!(*to, Tier::Any);
                worker.as_str()
            }
            other => panic!("{other:?}"),
        })
        .collect();
    asked.sort_unstable();
    assert_eq!(asked, ["w0", "w1", "w2", "w3"]);
    // The intended effect: later turns find their context.
    assert!(
        retain.prefix_hit_rate > keep.prefix_hit_rate + 0.05,
        "prefix hits {} vs {}",
        retain.prefix_hit_rate,
        keep.prefix_hit_rate
    );
    let (a, b) = (&retain.later_turns_ttft_ms, &keep.later_turns_ttft_ms);
    assert!(
        a.p50 < b.p50 && a.p90 < b.p90,
        "later turns' TTFT {a:?} vs {b:?}"
    );
}

#[test]
fn a_small_pool_evicts_down_to_its_watermark_and_never_holds_more_than_its_capacity() {
    let m = multi_turn(&format!("{KEEP},retain-all"), 3_000);
    whole(&m);
    let p = m.pool.as_ref().expect("a pool");
    accounted(p);
    assert!(p.evicted_pages > 0, "{p:?}");
    assert!(p.max_held_pages <= 2_700, "high watermark 0.9: {p:?}");
}

#[test]
fn a_worker_drops_spills_beyond_four_on_their_way() {
    let fast = multi_turn(&format!("{KEEP},retain-all"), 40_000);
    // KV 1,000 times as large: a spill takes seconds to cross the link.
    let slow = multi_turn_with(&format!("{KEEP},retain-all"), |c| {
        c.pool_pages = 40_000;
        c.kv_bytes_per_token *= 1000;
    });
    whole(&slow);
    let (f, s) = (fast.pool.expect("a pool"), slow.pool.expect("a pool"));
    assert_eq!(f.dropped_spills, 0, "{f:?}");
    assert!(s.dropped_spills > 0 && s.dropped_spill_pages > 0, "{s:?}");
    assert!(s.spills < f.spills, "{s:?}");
}

#[test]
fn a_pool_alone_changes_nothing_and_pool_actors_need_one() {
    let keep = multi_turn(KEEP, 0);
    let pool = multi_turn(KEEP, 40_000);
    assert_eq!(
        (keep.ttft_ms, keep.prefix_hit_rate),
        (pool.ttft_ms, pool.prefix_hit_rate)
    );
    assert_eq!(
        pool.pool.as_ref().map(|p| p.pulls),
        Some(0),
        "nothing pushed"
    );
    let spec = WorkloadSpec::named("multi-turn").expect("built-in");
    let reqs = spec.generate(10, 1);
    for actor in ["retain-all", "pool-replicate"] {
        let cfg = SimConfig::new(
            1,
            PolicyName::Fcfs,
            format!("round-robin,{actor}").parse().expect("valid"),
            CostProfile::gpu_a100_llama3_8b(),
        );
        let err = run(&cfg, spec.name(), &reqs)
            .expect_err("no pool")
            .to_string();
        assert!(err.contains("--pool-pages"), "{err}");
    }
}

#[test]
fn retain_all_runs_are_deterministic() {
    let a = multi_turn(&format!("{KEEP},retain-all"), 3_000);
    let b = multi_turn(&format!("{KEEP},retain-all"), 3_000);
    assert_eq!(a.pool, b.pool);
    assert_eq!((a.ttft_ms, a.e2e_ms), (b.ttft_ms, b.e2e_ms));
    assert_eq!(a.actions, b.actions);
}

/// `hot_system_prompt` with a pool.
fn shared_prefix(router: &str) -> RunMetrics {
    hot_system_prompt(router, |cfg| cfg.pool_pages = 100_000)
}

#[test]
fn pool_replicate_pushes_the_hot_prefix_and_other_workers_pull_it() {
    let plain = shared_prefix("cache-aware");
    let pushed = shared_prefix("cache-aware,pool-replicate");
    whole(&plain);
    whole(&pushed);
    let p = pushed.pool.as_ref().expect("a pool");
    accounted(p);
    let pushers: Vec<&str> = (pushed.actions.iter())
        .map(|a| match &a.action {
            Action::CopyPrefixToPool { from, .. } => from.as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(!pushers.is_empty(), "a push");
    assert_eq!(p.replicated, pushers.len() as u64);
    assert!(p.replicated_pages > 0 && p.stored_pages > 0, "{p:?}");
    let pulled_elsewhere = (p.pulls_by_worker.iter().enumerate())
        .any(|(w, &n)| n > 0 && !pushers.contains(&format!("w{w}").as_str()));
    assert!(pulled_elsewhere, "a worker that did not push pulled: {p:?}");
    assert_eq!(p.spills, 0, "no retain-all, no spill");
    // As `replicate` (tests/replicate.rs): the crowded holders' queue drains.
    assert!(
        pushed.ttft_ms.p99 < 0.8 * plain.ttft_ms.p99,
        "TTFT p99 with pool-replicate {} vs {}",
        pushed.ttft_ms.p99,
        plain.ttft_ms.p99
    );
}
