//! `pie-sim compare`'s markdown tables, one row per run: the summary
//! ([`markdown_table`]) and one table per feature (transfers, migrations,
//! copies, pool, disk, fleet, classes), each empty when no run has it.

use crate::disaggregate::Disaggregation;
use crate::metrics::RunMetrics;

/// One row per run, for `pie-sim compare`.
pub fn markdown_table(runs: &[RunMetrics]) -> String {
    let mut s = String::from(
        "| policy | router | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | e2e p50 / p99 ms | output tok/s | prefix hit | Jain (window) | deadline misses | preemptions | events/s |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        s.push_str(&format!(
            "| {} | {}{} | {:.0} / {:.0} / {:.0} | {:.1} / {:.1} | {:.0} / {:.0} | {:.0} | {:.1}% | {:.3} | {} / {} | {} | {:.2e} |\n",
            r.policy,
            r.router,
            if r.keep_session { " +keep-session" } else { "" },
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.itl_ms.p99,
            r.e2e_ms.p50,
            r.e2e_ms.p99,
            r.output_tokens_per_s,
            100.0 * r.prefix_hit_rate,
            r.jain_window,
            r.deadline_misses,
            r.deadline_requests,
            r.preemptions,
            r.events_per_s,
        ));
    }
    s
}

/// One row per run with prefill-stage workers (empty when none has them).
pub fn transfer_table(runs: &[RunMetrics]) -> String {
    let staged: Vec<(&RunMetrics, &Disaggregation)> = runs
        .iter()
        .filter_map(|r| r.disaggregation.as_ref().map(|d| (r, d)))
        .collect();
    if staged.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "| router | workers (prefill + decode) | remote prefills | remote TTFT p50 / p99 ms | transferred pages | transferred GB | transfer s (summed) | link wait s (summed) |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for (r, d) in staged {
        s.push_str(&format!(
            "| {} | {} + {} | {} | {:.0} / {:.0} | {} | {:.1} | {:.1} | {:.1} |\n",
            r.router,
            d.prefill_workers,
            r.workers - d.prefill_workers,
            d.remote_prefills,
            d.remote_ttft_ms.p50,
            d.remote_ttft_ms.p99,
            d.transferred_pages,
            d.transferred_bytes as f64 / 1e9,
            d.transfer_s,
            d.transfer_wait_s,
        ));
    }
    s
}

/// One row per run whose router runs actors, when any of them migrated a
/// process (empty otherwise): the runs with and without migrations side by side.
pub fn migration_table(runs: &[RunMetrics]) -> String {
    if !runs
        .iter()
        .any(|r| r.migrations.as_ref().is_some_and(|m| m.started > 0))
    {
        return String::new();
    }
    let mut s = String::from(
        "| router | TTFT p50 / p99 ms | e2e p50 / p99 ms | migrations (done / abandoned) | copy stages | moved pages | moved GB | pause mean / max ms |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let m = r.migrations.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {} | {:.0} / {:.0} | {:.0} / {:.0} | {} ({} / {}) | {} | {} | {:.2} | {:.1} / {:.1} |\n",
            r.router,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.e2e_ms.p50,
            r.e2e_ms.p99,
            m.started,
            m.completed,
            m.abandoned,
            m.stages,
            m.pages,
            m.bytes as f64 / 1e9,
            m.mean_pause_ms,
            m.max_pause_ms,
        ));
    }
    s
}

/// One row per run whose router runs actors, when any of them copied a
/// prefix (empty otherwise).
pub fn copy_table(runs: &[RunMetrics]) -> String {
    if !runs
        .iter()
        .any(|r| r.copies.as_ref().is_some_and(|c| c.copies > 0))
    {
        return String::new();
    }
    let mut s = String::from(
        "| router | TTFT p50 / p90 / p99 ms | e2e p50 / p99 ms | prefix copies | pages sent | GB sent |\n\
         |---|---|---|---|---|---|\n",
    );
    for r in runs {
        let c = r.copies.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} | {} | {} | {:.2} |\n",
            r.router,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.e2e_ms.p50,
            r.e2e_ms.p99,
            c.copies,
            c.pages,
            c.bytes as f64 / 1e9,
        ));
    }
    s
}

/// One row per run, when any run has a disk tier (empty otherwise): later
/// turns' TTFT, prefix hits, and what went to and came from the disks.
pub fn disk_table(runs: &[RunMetrics]) -> String {
    if !runs.iter().any(|r| r.disk.is_some()) {
        return String::new();
    }
    let mut s = String::from(
        "| router | disk pages | later turns TTFT p50 / p90 / p99 ms | prefix hit | persists (pages) | spills (pages) / dropped | loads (pages) | loaded GB | unfit pages | evicted | max held |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let t = &r.later_turns_ttft_ms;
        let d = r.disk.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {}{} | {} | {:.0} / {:.0} / {:.0} | {:.1}% | {} ({}) | {} ({}) / {} | {} ({}) | {:.1} | {} | {} | {} |\n",
            r.router,
            if r.keep_session { " +keep-session" } else { "" },
            d.capacity_pages,
            t.p50,
            t.p90,
            t.p99,
            100.0 * r.prefix_hit_rate,
            d.persists,
            d.persisted_pages,
            d.spills,
            d.spilled_pages,
            d.dropped_spills,
            d.loads,
            d.loaded_pages,
            d.loaded_bytes as f64 / 1e9,
            d.unfit_pages,
            d.evicted_pages,
            d.max_held_pages,
        ));
    }
    s
}

/// A run's fleet in a table: `autoscaled (start 2, 1..16, boot 60 s)` or
/// `fixed 8`.
pub fn fleet_label(r: &RunMetrics) -> String {
    match &r.fleet {
        Some(f) => format!(
            "autoscaled (start {}, {}..{}, boot {} s)",
            f.initial_workers,
            f.min_workers,
            f.max_workers,
            f.start_ms as f64 / 1000.0
        ),
        None => format!("fixed {}", r.workers),
    }
}

/// One row per run: its fleet, worker-hours and SLO attainment (for
/// `--autoscale` against fixed fleets).
pub fn fleet_table(runs: &[RunMetrics]) -> String {
    let mut s = String::from(
        "| router | fleet | workers min / max | worker-hours | SLO attainment (TTFT <= ms) | TTFT p50 / p90 / p99 ms | starts / drains | sim time s |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let (min, max, starts, drains) = match &r.fleet {
            Some(f) => (f.min_started, f.max_started, f.starts, f.drains),
            None => (r.workers, r.workers, 0, 0),
        };
        s.push_str(&format!(
            "| {} | {} | {min} / {max} | {:.2} | {:.2}% ({:.0}) | {:.0} / {:.0} / {:.0} | {starts} / {drains} | {:.0} |\n",
            r.router,
            fleet_label(r),
            r.worker_hours,
            100.0 * r.slo_attainment,
            r.slo_ttft_ms,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.sim_time_s,
        ));
    }
    s
}

/// Classes beyond which [`class_table`] is left out (e.g. one per prefix group).
pub const MAX_TABLE_CLASSES: usize = 12;

/// One row per run and request class (client, deadline class, priority, turn),
/// when the runs have 2 to [`MAX_TABLE_CLASSES`] classes; empty otherwise.
pub fn class_table(runs: &[RunMetrics]) -> String {
    let classes = runs.first().map_or(0, |r| r.classes.len());
    if !(2..=MAX_TABLE_CLASSES).contains(&classes) {
        return String::new();
    }
    let mut s = String::from(
        "| policy | router | class | requests | TTFT p50 / p90 ms | e2e p50 / p99 ms | deadline misses |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let keep = if r.keep_session { " +keep-session" } else { "" };
        for (class, c) in &r.classes {
            s.push_str(&format!(
                "| {} | {}{keep} | {class} | {} | {:.0} / {:.0} | {:.0} / {:.0} | {} |\n",
                r.policy,
                r.router,
                c.requests,
                c.ttft_ms.p50,
                c.ttft_ms.p90,
                c.e2e_ms.p50,
                c.e2e_ms.p99,
                c.deadline_misses,
            ));
        }
    }
    s
}

/// One row per run, when any run has a pool (empty otherwise): later turns'
/// TTFT, prefix hits, and what went to and came from the pool.
pub fn pool_table(runs: &[RunMetrics]) -> String {
    if !runs.iter().any(|r| r.pool.is_some()) {
        return String::new();
    }
    let mut s = String::from(
        "| router | pool pages | later turns TTFT p50 / p90 / p99 ms | prefix hit | spills (pages) / dropped | replicated (pages) | pulls (pages) | pulled GB | short pulls (unfit pages) | evicted (pinned) | max held |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let t = &r.later_turns_ttft_ms;
        let p = r.pool.clone().unwrap_or_default();
        s.push_str(&format!(
            "| {}{} | {} | {:.0} / {:.0} / {:.0} | {:.1}% | {} ({}) / {} | {} ({}) | {} ({}) | {:.1} | {} ({}) | {} ({}) | {} |\n",
            r.router,
            if r.keep_session { " +keep-session" } else { "" },
            p.capacity_pages,
            t.p50,
            t.p90,
            t.p99,
            100.0 * r.prefix_hit_rate,
            p.spills,
            p.spilled_pages,
            p.dropped_spills,
            p.replicated,
            p.replicated_pages,
            p.pulls,
            p.pulled_pages,
            p.pulled_bytes as f64 / 1e9,
            p.short_pulls,
            p.unfit_pages,
            p.evicted_pages,
            p.evicted_pinned_pages,
            p.max_held_pages,
        ));
    }
    s
}
