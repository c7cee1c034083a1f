//! The disk tier in the simulator (`--disk-pages`, `disk.rs`): `retain-all`
//! with `to = "disk"` (or `any` without a pool) spills the retained sessions
//! a worker evicts early to its own disk and later turns load them back
//! (the multi-turn eviction-pressure workload of `tests/retain.rs`: more
//! prefix hits, lower later-turn TTFT than keep-session alone); a small disk
//! evicts its least recently used pages and never holds more than its
//! capacity; `persist-prefix` writes hot system prompts to their holders'
//! disks and arrivals whose worker evicted them load them from there; every
//! page written arrives and its bytes are its KV; the disk actors without a
//! disk are refused; runs are deterministic.

mod common;

use common::{multi_turn_with, page_bytes, whole, KEEP, WORKERS};
use pie_policy::cluster::{Action, Tier};
use pie_sim::disk::DiskCounters;
use pie_sim::{run, CostProfile, PolicyName, RunMetrics, SimConfig, WorkloadSpec};

/// `multi-turn` under eviction pressure with keep-session (as
/// `tests/retain.rs`), each worker with a disk of `disk_pages`.
fn multi_turn(router: &str, disk_pages: usize, to: Tier) -> RunMetrics {
    multi_turn_with(router, |cfg| {
        cfg.disk_pages = disk_pages;
        cfg.actor_configs.retain_all.to = to;
    })
}

/// Every page written reached the disk, and bytes are the pages' KV.
fn accounted(d: &DiskCounters) {
    assert_eq!(
        d.spilled_pages + d.persisted_pages,
        d.stored_pages + d.already_held_pages,
        "every page written arrived: {d:?}"
    );
    assert_eq!(d.spilled_bytes, d.spilled_pages * page_bytes());
    assert_eq!(d.persisted_bytes, d.persisted_pages * page_bytes());
    assert_eq!(d.loaded_bytes, d.loaded_pages * page_bytes());
    assert!(d.max_held_pages <= d.capacity_pages, "{d:?}");
    assert!(d.unfit_pages <= d.loaded_pages, "{d:?}");
}

#[test]
fn retain_all_spills_to_disk_and_later_turns_load_it_back() {
    let keep = multi_turn(KEEP, 20_000, Tier::Disk);
    let disk = multi_turn(&format!("{KEEP},retain-all"), 20_000, Tier::Disk);
    whole(&keep);
    whole(&disk);
    assert!(disk.pool.is_none(), "no pool");
    let d = disk.disk.as_ref().expect("a disk tier");
    accounted(d);
    assert!(d.spills > 0 && d.spilled_pages > 0, "{d:?}");
    assert!(d.loads > 0 && d.loaded_pages > 0, "{d:?}");
    assert_eq!(d.evicted_pages, 0, "the disks hold every spill: {d:?}");
    assert_eq!(
        keep.disk.as_ref().map(|d| d.loads),
        Some(0),
        "nothing written"
    );
    for a in &disk.actions {
        assert!(
            matches!(a.action, Action::RetainSpill { to: Tier::Disk, .. }),
            "{a:?}"
        );
    }
    assert!(
        disk.prefix_hit_rate > keep.prefix_hit_rate + 0.05,
        "prefix hits {} vs {}",
        disk.prefix_hit_rate,
        keep.prefix_hit_rate
    );
    let (a, b) = (&disk.later_turns_ttft_ms, &keep.later_turns_ttft_ms);
    assert!(
        a.p50 < b.p50 && a.p90 < b.p90,
        "later turns' TTFT {a:?} vs {b:?}"
    );
    // `any` without a pool spills to the disk as well.
    let any = multi_turn(&format!("{KEEP},retain-all"), 20_000, Tier::Any);
    let d_any = any.disk.as_ref().expect("a disk tier");
    assert_eq!((d_any.spills, d_any.loads), (d.spills, d.loads));
}

#[test]
fn a_small_disk_evicts_its_least_recently_used_pages() {
    let m = multi_turn(&format!("{KEEP},retain-all"), 300, Tier::Disk);
    whole(&m);
    let d = m.disk.as_ref().expect("a disk tier");
    accounted(d);
    assert!(d.evicted_pages > 0, "{d:?}");
    assert_eq!(d.max_held_pages, 300, "full, never above: {d:?}");
}

/// `shared-prefix` on workers whose memory holds a fraction of the system
/// prompts (32 prompts of 64 pages, 1,500 pages a worker), round-robin: the
/// prompts are evicted and computed again and again.
fn shared_prefix(router: &str, disk_pages: usize) -> RunMetrics {
    let mut spec = WorkloadSpec::named("shared-prefix").expect("built-in");
    spec.scale_rate(WORKERS as f64 * 0.3);
    let mut profile = CostProfile::gpu_a100_llama3_8b();
    profile.kv_pages = 1500;
    let mut cfg = SimConfig::new(
        WORKERS,
        PolicyName::Fcfs,
        router.parse().expect("valid router"),
        profile,
    );
    cfg.disk_pages = disk_pages;
    cfg.actor_tick_ms = 250;
    let reqs = spec.generate(4000, 5);
    run(&cfg, spec.name(), &reqs).expect("simulation runs")
}

#[test]
fn persist_prefix_writes_hot_prompts_that_arrivals_load_back() {
    let plain = shared_prefix("round-robin", 10_000);
    let persist = shared_prefix("round-robin,persist-prefix", 10_000);
    whole(&plain);
    whole(&persist);
    let d = persist.disk.as_ref().expect("a disk tier");
    accounted(d);
    let asks = (persist.actions.iter())
        .filter(|a| matches!(a.action, Action::PersistPrefix { .. }))
        .count() as u64;
    assert!(asks > 0 && d.persists == asks, "{asks} asks, {d:?}");
    assert!(d.persisted_pages > 0 && d.spills == 0, "{d:?}");
    assert!(d.loads > 0 && d.loaded_pages > 0, "{d:?}");
    assert!(
        persist.prefix_hit_rate > plain.prefix_hit_rate + 0.05,
        "prefix hits {} vs {}",
        persist.prefix_hit_rate,
        plain.prefix_hit_rate
    );
    assert!(
        persist.ttft_ms.p90 < 0.8 * plain.ttft_ms.p90,
        "TTFT p90 {} vs {}",
        persist.ttft_ms.p90,
        plain.ttft_ms.p90
    );
    assert!(
        persist.prefill_tokens_computed < plain.prefill_tokens_computed,
        "{} vs {}",
        persist.prefill_tokens_computed,
        plain.prefill_tokens_computed
    );
}

#[test]
fn disk_actors_without_a_disk_are_refused() {
    let spec = WorkloadSpec::named("multi-turn").expect("built-in");
    let reqs = spec.generate(10, 1);
    for (router, to) in [
        ("round-robin,persist-prefix", Tier::Any),
        ("round-robin,retain-all", Tier::Disk),
    ] {
        let mut cfg = SimConfig::new(
            1,
            PolicyName::Fcfs,
            router.parse().expect("valid"),
            CostProfile::gpu_a100_llama3_8b(),
        );
        cfg.actor_configs.retain_all.to = to;
        let err = run(&cfg, spec.name(), &reqs)
            .expect_err("no disk")
            .to_string();
        assert!(err.contains("--disk-pages"), "{err}");
    }
}

#[test]
fn disk_runs_are_deterministic() {
    let a = multi_turn(&format!("{KEEP},retain-all"), 300, Tier::Disk);
    let b = multi_turn(&format!("{KEEP},retain-all"), 300, Tier::Disk);
    assert_eq!(a.disk, b.disk);
    assert_eq!((a.ttft_ms, a.e2e_ms), (b.ttft_ms, b.e2e_ms));
    assert_eq!(a.actions, b.actions);
}
