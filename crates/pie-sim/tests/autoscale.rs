//! The autoscaler in the simulator (`--autoscale`, `autoscale.rs`) on the
//! `diurnal` workload (a 10-minute day, rates for a 4-worker peak fleet):
//! the fleet follows scale-by-prop's hints one step at a time (the actor's
//! rule: no step while the previous one is pending, until its timeout),
//! started workers get no request before their start-up delay, a drained
//! worker finishes every request it has and then stops, and the autoscaled
//! fleet costs fewer worker-hours than the peak-sized fixed fleet at an SLO
//! attainment within a point of it; runs are deterministic.

use std::collections::HashMap;

use pie_policy::cluster::Action;
use pie_sim::autoscale::{AutoscaleConfig, FleetEvent};
use pie_sim::Record;
use pie_sim::{run, run_records, CostProfile, PolicyName, RunMetrics, SimConfig, WorkloadSpec};

const PEAK_FLEET: usize = 4;
const REQUESTS: usize = 13_000;
const START_MS: u64 = 20_000;
const PENDING_MS: u64 = 30_000;

fn workload() -> Vec<pie_sim::Request> {
    let mut spec = WorkloadSpec::named("diurnal")
        .and_then(|w| w.with_overrides(&["day_ms=600000".to_string()]))
        .expect("valid override");
    spec.scale_rate(PEAK_FLEET as f64);
    spec.generate(REQUESTS, 11)
}

fn config(workers: usize, autoscale: bool) -> SimConfig {
    let mut cfg = SimConfig::new(
        workers,
        PolicyName::Fcfs,
        "least-loaded,scale-by-prop".parse().expect("valid router"),
        CostProfile::gpu_a100_llama3_8b(),
    );
    let s = &mut cfg.actor_configs.scale_by_prop;
    s.target_load_per_worker = 32.0;
    s.pending_timeout_ms = PENDING_MS;
    cfg.autoscale = autoscale.then_some(AutoscaleConfig {
        start_ms: START_MS,
        min_workers: 1,
        max_workers: 8,
        down_window_ms: 60_000,
    });
    cfg
}

fn autoscaled() -> (RunMetrics, Vec<Record>) {
    run_records(&config(1, true), "diurnal", &workload()).expect("simulation runs")
}

fn whole(m: &RunMetrics) {
    assert_eq!(m.completed, m.requests);
    assert_eq!((m.rejected, m.aborted), (0, 0));
    assert_eq!(m.wrong_output_lengths, 0, "tokens lost or repeated");
    assert_eq!(m.generated_tokens, m.requested_output_tokens);
}

fn events(m: &RunMetrics) -> &[FleetEvent] {
    &m.fleet.as_ref().expect("an autoscaled fleet").events
}

fn us(ms: f64) -> u64 {
    (ms * 1000.0).round() as u64
}

/// Each worker's serving intervals (us): from `up` (or the start, for the
/// initial fleet) to its `drain`.
fn serving(m: &RunMetrics, initial: usize) -> HashMap<String, Vec<(u64, u64)>> {
    let mut open: HashMap<String, u64> = (0..initial).map(|w| (format!("w{w}"), 0)).collect();
    let mut out: HashMap<String, Vec<(u64, u64)>> = HashMap::new();
    for e in events(m) {
        match e.kind {
            "up" => {
                assert!(open.insert(e.worker.clone(), us(e.at_ms)).is_none());
            }
            "drain" => {
                let from = open.remove(&e.worker).expect("a serving worker drains");
                out.entry(e.worker.clone())
                    .or_default()
                    .push((from, us(e.at_ms)));
            }
            _ => {}
        }
    }
    for (w, from) in open {
        out.entry(w).or_default().push((from, u64::MAX));
    }
    out
}

#[test]
fn the_fleet_follows_the_hints_one_step_at_a_time() {
    let (m, _) = autoscaled();
    whole(&m);
    let f = m.fleet.as_ref().expect("fleet stats");
    assert!(f.starts >= 3 && f.drains >= 3, "it rose and fell: {f:?}");
    assert!(f.max_started >= 3 && f.max_started <= 8, "{f:?}");
    // The actor's rule, as its hints show it.
    let hints: Vec<(u64, usize, usize)> = (m.actions.iter())
        .filter_map(|a| match &a.action {
            Action::ScaleHint(h) => Some((a.at_ms, h.current, h.recommended)),
            _ => None,
        })
        .collect();
    assert!(hints.len() > 5, "{hints:?}");
    let mut last_step: Option<(u64, usize)> = None;
    let mut rec = 1;
    for &(at, current, recommended) in &hints {
        assert!(recommended.abs_diff(rec) <= 1, "one step: {hints:?}");
        if recommended != rec {
            if let Some((t, r)) = last_step {
                assert!(
                    at - t >= PENDING_MS || current == r,
                    "a step at {at} ms while the one at {t} ms was pending"
                );
            }
            last_step = Some((at, recommended));
        }
        rec = recommended;
    }
    // The fleet: its target moves by one at a time, up only on a step up,
    // and the active workers (booting + serving) meet it.
    let mut target = 1;
    for e in events(&m) {
        assert!(e.target.abs_diff(target) <= 1, "{e:?}");
        if e.target > target {
            let stepped = hints
                .iter()
                .any(|&(at, _, r)| r == e.target && at <= us(e.at_ms) / 1000);
            assert!(stepped, "a start without a hint: {e:?}");
        }
        target = e.target;
    }
    let ups = events(&m).iter().filter(|e| e.kind == "start").count();
    assert_eq!(ups, f.starts);
}

#[test]
fn started_workers_get_no_requests_before_their_delay() {
    let (m, records) = autoscaled();
    let mut started: HashMap<&str, u64> = HashMap::new();
    for e in events(&m) {
        match e.kind {
            "start" => {
                started.insert(&e.worker, us(e.at_ms));
            }
            "up" => {
                let at = started.remove(e.worker.as_str()).expect("started first");
                assert_eq!(us(e.at_ms) - at, START_MS * 1000, "{e:?}");
            }
            "cancel" => {
                started
                    .remove(e.worker.as_str())
                    .expect("stopped while booting");
            }
            _ => {}
        }
    }
    let intervals = serving(&m, 1);
    for (i, r) in records.iter().enumerate() {
        let name = format!("w{}", r.worker);
        let ok = intervals[&name]
            .iter()
            .any(|&(from, to)| from <= r.arrival_us && r.arrival_us < to);
        assert!(
            ok,
            "request {i} routed to {name} at {} us while it did not serve",
            r.arrival_us
        );
    }
}

#[test]
fn a_drained_worker_finishes_its_requests_and_then_stops() {
    let (m, records) = autoscaled();
    whole(&m);
    let evs = events(&m);
    let mut drained = 0;
    for (i, e) in evs.iter().enumerate().filter(|(_, e)| e.kind == "drain") {
        let stop = evs[i..]
            .iter()
            .find(|s| s.worker == e.worker && s.kind != "drain")
            .expect("a drained worker stops");
        assert_eq!(stop.kind, "stop", "{stop:?}");
        let (drain_us, stop_us) = (us(e.at_ms), us(stop.at_ms));
        // Its requests (routed before the drain) all finished, by the stop.
        let w: u32 = e.worker[1..].parse().expect("a worker name");
        let mut had = 0;
        for r in records.iter().filter(|r| r.worker == w) {
            if r.arrival_us < drain_us && r.finish_us.expect("finished") > drain_us {
                had += 1;
                assert!(r.finish_us.expect("finished") <= stop_us, "{r:?}");
            }
        }
        drained += usize::from(had > 0);
    }
    assert!(drained > 0, "some drain had requests to finish");
}

#[test]
fn autoscaling_costs_fewer_worker_hours_than_the_peak_fleet_at_about_its_slo() {
    let reqs = workload();
    let fixed = |n| run(&config(n, false), "diurnal", &reqs).expect("simulation runs");
    let (peak, small) = (fixed(PEAK_FLEET), fixed(1));
    let (auto, _) = autoscaled();
    whole(&peak);
    whole(&auto);
    assert!(peak.fleet.is_none() && auto.fleet.is_some());
    let hours = PEAK_FLEET as f64 * peak.sim_time_s / 3600.0;
    assert!(
        (peak.worker_hours - hours).abs() < 1e-9,
        "a fixed fleet's hours"
    );
    assert!(
        auto.worker_hours < 0.8 * peak.worker_hours,
        "worker-hours {} vs {}",
        auto.worker_hours,
        peak.worker_hours
    );
    // Within one point of the peak fleet's attainment (TTFT <= 500 ms).
    assert!(
        auto.slo_attainment >= peak.slo_attainment - 0.01,
        "SLO attainment {} vs {}",
        auto.slo_attainment,
        peak.slo_attainment
    );
    // Not for free: one worker all day misses it.
    assert!(
        small.slo_attainment < auto.slo_attainment - 0.2,
        "{}",
        small.slo_attainment
    );
}

#[test]
fn autoscaled_runs_are_deterministic() {
    let strip = |mut m: RunMetrics| {
        m.wall_s = 0.0;
        m.events_per_s = 0.0;
        m
    };
    let (a, _) = autoscaled();
    let (b, _) = autoscaled();
    assert_eq!(strip(a), strip(b));
}

#[test]
fn autoscaling_follows_scale_by_prop_only() {
    let mut cfg = config(1, true);
    cfg.router = "least-loaded".parse().expect("valid router");
    let err = run(&cfg, "diurnal", &workload()[..10])
        .expect_err("nothing to follow")
        .to_string();
    assert!(err.contains("scale-by-prop"), "{err}");
}
