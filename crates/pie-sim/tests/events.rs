//! Cluster events in the simulator, delivered to the actors as the
//! controller delivers them (`health_events` whenever the fleet changes,
//! `ActionFailed` when an action fails): on the autoscaled `diurnal` day of
//! `tests/autoscale.rs`, a drained worker's processes get `drain-migrate`'s
//! `MigrateProcess` at the drain, not a tick later; a worker that comes up
//! gets `retain-all`'s `RetainSpill` as it joins; with `replicate` on an
//! autoscaled `shared-prefix` fleet, a copy whose target stopped before it
//! arrived fails and the actors hear `ActionFailed`; and that event, handed
//! to `replicate` through the simulator's actors, frees the prefix's place
//! at once (copied again, elsewhere, long before its `pending_ms`).

use std::collections::HashMap;

use pie_core::BlockHash;
use pie_policy::cluster::{
    Action, ActionRecord, ActorConfigs, ClusterEvent, ClusterSnapshot, HotPrefix, WorkerState,
};
use pie_sim::actors::SimActors;
use pie_sim::autoscale::{AutoscaleConfig, FleetEvent};
use pie_sim::{run, CostProfile, PolicyName, RunMetrics, SimConfig, WorkloadSpec};

/// The autoscaled `diurnal` day (peak fleet 4) on `router`, its config
/// changed by `configure`.
fn diurnal(router: &str, configure: impl Fn(&mut SimConfig)) -> RunMetrics {
    let mut spec = WorkloadSpec::named("diurnal")
        .and_then(|w| w.with_overrides(&["day_ms=600000".to_string()]))
        .expect("valid override");
    spec.scale_rate(4.0);
    let mut cfg = SimConfig::new(
        1,
        PolicyName::Fcfs,
        router.parse().expect("valid router"),
        CostProfile::gpu_a100_llama3_8b(),
    );
    let s = &mut cfg.actor_configs.scale_by_prop;
    s.target_load_per_worker = 32.0;
    s.pending_timeout_ms = 30_000;
    cfg.autoscale = Some(AutoscaleConfig {
        start_ms: 20_000,
        min_workers: 1,
        max_workers: 8,
        down_window_ms: 60_000,
    });
    configure(&mut cfg);
    let reqs = spec.generate(13_000, 11);
    run(&cfg, spec.name(), &reqs).expect("simulation runs")
}

fn fleet_events<'a>(m: &'a RunMetrics, kind: &str) -> Vec<&'a FleetEvent> {
    let f = m.fleet.as_ref().expect("an autoscaled fleet");
    f.events.iter().filter(|e| e.kind == kind).collect()
}

fn whole(m: &RunMetrics) {
    assert_eq!(m.completed, m.requests, "{}", m.router);
    assert_eq!(m.wrong_output_lengths, 0, "{}: tokens lost", m.router);
}

#[test]
fn a_drain_yields_drain_migrates_moves_at_once() {
    let m = diurnal("least-loaded,scale-by-prop,drain-migrate", |_| {});
    whole(&m);
    let drains = fleet_events(&m, "drain");
    assert!(!drains.is_empty(), "the fleet shrank");
    // The first move off each drained worker, by the time it drained.
    let mut first: HashMap<(&str, u64), u64> = HashMap::new();
    for a in &m.actions {
        if let Action::MigrateProcess { from, .. } = &a.action {
            assert_eq!(a.actor, "drain-migrate");
            let drained = (drains.iter())
                .filter(|d| d.worker == *from && d.at_ms as u64 <= a.at_ms)
                .map(|d| d.at_ms as u64)
                .max()
                .expect("moves only off a drained worker");
            first.entry((from.as_str(), drained)).or_insert(a.at_ms);
        }
    }
    assert!(!first.is_empty(), "drained workers had processes to move");
    for ((worker, drained), at) in first {
        assert_eq!(at, drained, "{worker}'s moves came at its drain");
    }
}

#[test]
fn a_join_yields_retain_alls_spill_at_once() {
    let m = diurnal("least-loaded,scale-by-prop,retain-all", |cfg| {
        cfg.pool_pages = 20_000;
        cfg.keep_session = true;
    });
    whole(&m);
    let ups = fleet_events(&m, "up");
    assert!(ups.len() >= 3, "the fleet grew");
    for up in ups {
        let asked = m.actions.iter().any(|a| {
            a.at_ms == up.at_ms as u64
                && matches!(&a.action, Action::RetainSpill { worker, .. } if *worker == up.worker)
        });
        assert!(asked, "{} asked to spill when it joined", up.worker);
    }
}

/// The hot-system-prompt fleet of `tests/replicate.rs` (32 workers,
/// `max_running` 8), autoscaled down from 32 as `scale-by-prop` asks, with
/// copies slow enough (huge pages) that a copy's idle target is drained and
/// stopped before its pages arrive.
fn shrinking_fleet_with_slow_copies() -> RunMetrics {
    const WORKERS: usize = 32;
    let mut spec = WorkloadSpec::named("shared-prefix")
        .and_then(|w| w.with_overrides(&["zipf=1.6".to_string()]))
        .expect("valid override");
    spec.scale_rate(WORKERS as f64 * 0.2);
    let mut profile = CostProfile::gpu_a100_llama3_8b();
    profile.max_running = 8;
    let mut cfg = SimConfig::new(
        WORKERS,
        PolicyName::Fcfs,
        "cache-aware,scale-by-prop,replicate"
            .parse()
            .expect("valid"),
        profile,
    );
    cfg.actor_tick_ms = 250;
    cfg.kv_bytes_per_token = 1 << 27;
    let s = &mut cfg.actor_configs.scale_by_prop;
    s.target_load_per_worker = 16.0;
    s.pending_timeout_ms = 250;
    cfg.autoscale = Some(AutoscaleConfig {
        start_ms: 5_000,
        min_workers: 1,
        max_workers: WORKERS,
        down_window_ms: 0,
    });
    let reqs = spec.generate(12_000, 3);
    run(&cfg, spec.name(), &reqs).expect("simulation runs")
}

#[test]
fn a_copy_whose_target_stopped_fails_and_the_actors_hear_it() {
    let m = shrinking_fleet_with_slow_copies();
    whole(&m);
    let c = m.copies.as_ref().expect("an actor ran");
    assert!(c.failed > 0, "a copy's target stopped first: {c:?}");
    assert_eq!(m.failed_actions.len() as u64, c.failed);
    let stops = fleet_events(&m, "stop");
    for f in &m.failed_actions {
        let Action::CopyPrefix { to, .. } = &f.action else {
            panic!("only copies fail: {f:?}");
        };
        assert_eq!(f.error, format!("{to} stopped before the copy arrived"));
        let asked = (m.actions.iter())
            .filter(|a| a.action == f.action)
            .map(|a| a.at_ms)
            .max()
            .expect("a failed copy was asked for");
        let stopped = (stops.iter())
            .any(|s| s.worker == *to && (asked..=f.at_ms).contains(&(s.at_ms as u64)));
        assert!(stopped, "{to} stopped between the copy and its failure");
    }
}

/// One hot prefix (blocks 1..=3, asked for 5 times each at 10/s) that
/// `w0`, at its `max_running`, holds; `w1` and `w2` idle.
fn crowded_snapshot() -> ClusterSnapshot {
    let worker = |name: &str, load: usize| WorkerState {
        name: name.into(),
        healthy: true,
        load,
        max_running: 8,
        ..WorkerState::default()
    };
    ClusterSnapshot {
        workers: vec![worker("w0", 8), worker("w1", 0), worker("w2", 0)],
        hot_prefixes: vec![HotPrefix {
            blocks: (1..=3).map(BlockHash).collect(),
            hits: vec![5, 5, 5],
            page_size: 16,
            holders: vec![("w0".into(), 3)],
            persisted: Vec::new(),
            requests_per_s: 10.0,
        }],
        ..ClusterSnapshot::default()
    }
}

#[test]
fn a_failed_copy_frees_replicates_place() {
    let mut configs = ActorConfigs::default();
    configs.replicate.pending_ms = 3_600_000;
    let mut actors = SimActors::new(&["replicate"], &configs, 250, false, false)
        .expect("replicate runs")
        .expect("an actor");
    let snapshot = crowded_snapshot();
    let copies = |records: Vec<ActionRecord>| -> Vec<(String, String)> {
        (records.into_iter())
            .map(|r| match r.action {
                Action::CopyPrefix { from, to, .. } => (from, to),
                other => panic!("{other:?}"),
            })
            .collect()
    };
    let first = actors.tick(0, &snapshot);
    assert_eq!(copies(first.clone()), [("w0".into(), "w1".into())]);
    // Pending: the prefix is not copied again while its copy is on its way.
    assert!(actors.tick(250_000, &snapshot).is_empty());
    let failed = ClusterEvent::ActionFailed {
        action: first[0].action.clone(),
        error: "w1 stopped before the copy arrived".into(),
    };
    assert!(actors.event(300_000, &failed, &snapshot).is_empty());
    assert_eq!(actors.failures.len(), 1);
    assert_eq!(actors.failures[0].at_ms, 300);
    // Its place is free at once, and the target that failed is avoided.
    assert_eq!(
        copies(actors.tick(500_000, &snapshot)),
        [("w0".into(), "w2".into())]
    );
}
