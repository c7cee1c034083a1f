//! The simulator's promises: reproducible workloads, conserved work, and the
//! policies' intended effects measured on the real `pie-policy` objects.

use pie_sim::requests::{self, Input};
use pie_sim::workload::{DeadlineMix, MultiTenant, SharedPrefix, WORKLOADS};
use pie_sim::{run, CostProfile, PolicyName, RouterSpec, RunMetrics, SimConfig, WorkloadSpec};

fn router(pipeline: &str) -> RouterSpec {
    pipeline.parse().expect("valid router")
}

fn sim(
    spec: &WorkloadSpec,
    requests: usize,
    workers: usize,
    policy: PolicyName,
    router: RouterSpec,
    profile: CostProfile,
) -> RunMetrics {
    let reqs = spec.generate(requests, 7);
    run(
        &SimConfig::new(workers, policy, router, profile),
        spec.name(),
        &reqs,
    )
    .expect("simulation runs")
}

#[test]
fn workloads_are_reproducible_by_seed() {
    for name in WORKLOADS {
        let spec = WorkloadSpec::named(name).unwrap();
        let a = spec.generate(300, 1);
        assert_eq!(a.len(), 300, "{name}");
        assert_eq!(a, spec.generate(300, 1), "{name}: same seed, same list");
        assert_ne!(a, spec.generate(300, 2), "{name}: another seed differs");
        let mut t = 0;
        for r in a.iter().filter(|r| r.follows.is_none()) {
            assert!(r.arrival_us >= t, "{name}: open-loop arrivals are sorted");
            t = r.arrival_us;
        }
    }
    assert!(WorkloadSpec::named("nope").is_err());
}

#[test]
fn every_request_completes_with_the_tokens_it_asked_for() {
    for name in WORKLOADS {
        for (workers, router) in [(1, router("round-robin")), (3, router("cache-aware"))] {
            let mut spec = WorkloadSpec::named(name).unwrap();
            spec.scale_rate(workers as f64);
            let mut profile = CostProfile::gpu_a100_llama3_8b();
            // A small pool so that eviction and preemption happen.
            profile.kv_pages = 300;
            let m = sim(&spec, 400, workers, PolicyName::Fcfs, router, profile);
            assert_eq!(m.completed, 400, "{name}");
            assert_eq!((m.rejected, m.aborted), (0, 0), "{name}");
            assert_eq!(m.generated_tokens, m.requested_output_tokens, "{name}");
            // Each prompt token is computed once or served from the cache, plus
            // recomputes after preemption.
            let covered = m.prefill_tokens_computed + m.prefix_hit_tokens;
            if m.preemptions == 0 {
                assert_eq!(covered, m.prompt_tokens, "{name}");
            } else {
                assert!(covered > m.prompt_tokens, "{name}");
            }
        }
    }
}

#[test]
fn runs_are_deterministic() {
    let spec = WorkloadSpec::named("multi-turn").unwrap();
    let reqs = spec.generate(300, 3);
    let mut cfg = SimConfig::new(
        2,
        PolicyName::Fair,
        router("least-loaded"),
        CostProfile::cpu_placeholder(),
    );
    cfg.keep_session = true;
    let strip = |mut m: RunMetrics| {
        m.wall_s = 0.0;
        m.events_per_s = 0.0;
        m
    };
    let a = strip(run(&cfg, "multi-turn", &reqs).unwrap());
    let b = strip(run(&cfg, "multi-turn", &reqs).unwrap());
    assert_eq!(a, b);
}

#[test]
fn fair_gives_light_clients_a_larger_share_than_fcfs() {
    let spec = WorkloadSpec::MultiTenant(MultiTenant {
        flood_rate_per_s: 40.0,
        light_clients: 2,
        light_rate_per_s: 2.0,
        light_weight: 1.0,
        input_len: 256,
        output_len: 64,
    });
    let light_share = |m: &RunMetrics| {
        let total: u64 = m.clients.values().map(|c| c.window_tokens).sum();
        let light: u64 = m
            .clients
            .iter()
            .filter(|(k, _)| k.starts_with("light"))
            .map(|(_, c)| c.window_tokens)
            .sum();
        light as f64 / total as f64
    };
    let profile = CostProfile::gpu_a100_llama3_8b;
    let fcfs = sim(
        &spec,
        3000,
        1,
        PolicyName::Fcfs,
        router("round-robin"),
        profile(),
    );
    let fair = sim(
        &spec,
        3000,
        1,
        PolicyName::Fair,
        router("round-robin"),
        profile(),
    );
    let (s_fcfs, s_fair) = (light_share(&fcfs), light_share(&fair));
    assert!(
        s_fair > 1.3 * s_fcfs,
        "light share fair {s_fair} fcfs {s_fcfs}"
    );
    let ttft = |m: &RunMetrics| m.classes["light-0"].ttft_ms.p50;
    assert!(
        ttft(&fair) < 0.5 * ttft(&fcfs),
        "light TTFT fair {} fcfs {}",
        ttft(&fair),
        ttft(&fcfs)
    );
}

#[test]
fn cache_aware_routing_hits_the_prefix_cache_more_than_round_robin() {
    let spec = WorkloadSpec::SharedPrefix(SharedPrefix {
        groups: 16,
        system_len: 512,
        question_len: 32,
        output_len: 32,
        // Random groups: with `None` groups take turns, which round-robin over 4
        // workers would align with (each worker seeing 4 groups).
        zipf: Some(0.5),
        rate_per_s: 4.0 * 20.0,
    });
    let mut profile = CostProfile::gpu_a100_llama3_8b();
    // Room for about a quarter of the groups' prompts per worker.
    profile.kv_pages = 200;
    let rr = sim(
        &spec,
        2000,
        4,
        PolicyName::Fcfs,
        router("round-robin"),
        profile.clone(),
    );
    let ca = sim(
        &spec,
        2000,
        4,
        PolicyName::Fcfs,
        router("cache-aware"),
        profile,
    );
    assert!(
        ca.prefix_hit_rate > rr.prefix_hit_rate + 0.2,
        "cache-aware {} round-robin {}",
        ca.prefix_hit_rate,
        rr.prefix_hit_rate
    );
    assert_eq!(ca.completed, 2000);
}

#[test]
fn session_affinity_with_keep_session_reuses_each_conversation() {
    let mut spec = WorkloadSpec::named("multi-turn").expect("built-in");
    spec.scale_rate(8.0);
    let reqs = spec.generate(2000, 7);
    let hit_rate = |pipeline: &str| {
        let mut cfg = SimConfig::new(
            8,
            PolicyName::Fcfs,
            router(pipeline),
            CostProfile::gpu_a100_llama3_8b(),
        );
        cfg.keep_session = true;
        let m = run(&cfg, spec.name(), &reqs).expect("simulation runs");
        assert_eq!(m.completed, 2000, "{pipeline}");
        m.prefix_hit_rate
    };
    let (sticky, spread) = (
        hit_rate("session-affinity,least-loaded"),
        hit_rate("round-robin"),
    );
    // Turns after the first find the whole conversation cached on their worker.
    assert!(sticky > 0.8, "session-affinity {sticky}");
    assert!(
        sticky > spread + 0.3,
        "session-affinity {sticky} round-robin {spread}"
    );
}

#[test]
fn deadline_misses_fewer_deadlines_than_fcfs() {
    let spec = WorkloadSpec::DeadlineMix(DeadlineMix {
        tight_fraction: 0.3,
        tight_ms: 15_000,
        loose_ms: 120_000,
        input_len: 256,
        output_len: 128,
        rate_per_s: 30.0,
    });
    let profile = CostProfile::gpu_a100_llama3_8b;
    let fcfs = sim(
        &spec,
        800,
        1,
        PolicyName::Fcfs,
        router("round-robin"),
        profile(),
    );
    let edf = sim(
        &spec,
        800,
        1,
        PolicyName::Deadline,
        router("round-robin"),
        profile(),
    );
    assert_eq!(fcfs.deadline_requests, 800);
    assert!(
        edf.deadline_misses < fcfs.deadline_misses,
        "deadline {} fcfs {}",
        edf.deadline_misses,
        fcfs.deadline_misses
    );
}

#[test]
fn priority_serves_high_priority_first() {
    let mut spec = WorkloadSpec::named("priority-mix").unwrap();
    spec.scale_rate(1.5);
    let profile = CostProfile::gpu_a100_llama3_8b;
    let fcfs = sim(
        &spec,
        800,
        1,
        PolicyName::Fcfs,
        router("round-robin"),
        profile(),
    );
    let prio = sim(
        &spec,
        800,
        1,
        PolicyName::Priority,
        router("round-robin"),
        profile(),
    );
    let high = |m: &RunMetrics| m.classes["high"].ttft_ms.p50;
    assert!(
        high(&prio) < 0.5 * high(&fcfs),
        "{} vs {}",
        high(&prio),
        high(&fcfs)
    );
}

#[test]
fn a_mooncake_trace_replays_with_its_prefix_sharing() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mooncake.jsonl");
    let input = Input {
        workload: "trace",
        trace: Some(&path),
        overrides: &[],
        requests: None,
        seed: 0,
        workers: 2,
        load: 1.0,
    };
    let (name, reqs) = requests::load(&input).expect("fixture loads");
    assert_eq!((name.as_str(), reqs.len()), ("trace", 60));
    let m = run(
        &SimConfig::new(
            2,
            PolicyName::Fcfs,
            router("cache-aware"),
            CostProfile::gpu_a100_llama3_8b(),
        ),
        &name,
        &reqs,
    )
    .expect("simulation runs");
    assert_eq!(m.completed, 60);
    assert_eq!(m.generated_tokens, m.requested_output_tokens);
    assert_eq!(m.clients.len(), 2, "the `client` prop names a client");
    // Three system prompts of 1-3 blocks shared by 20 requests each.
    assert!(m.prefix_hit_rate > 0.2, "{}", m.prefix_hit_rate);
    let missing = Input {
        trace: None,
        ..input
    };
    assert!(requests::load(&missing).is_err());
}

/// Three identical requests at time 0, one per worker (round-robin).
fn three_at_once() -> Vec<pie_sim::Request> {
    (0..3u64)
        .map(|i| pie_sim::Request {
            arrival_us: 0,
            follows: None,
            client: "c".into(),
            class: "c".into(),
            prompt: vec![pie_sim::Segment::named(&[i], 100)],
            output: pie_sim::Segment::named(&[i, 1], 4),
            props: Default::default(),
        })
        .collect()
}

#[test]
fn workers_on_one_machine_share_its_speed() {
    let reqs = three_at_once();
    let profile = CostProfile::cpu_placeholder();
    let mut cfg = SimConfig::new(3, PolicyName::Fcfs, router("round-robin"), profile.clone());
    let apart = run(&cfg, "three", &reqs).expect("runs");
    cfg.workers_per_machine = 3;
    let shared = run(&cfg, "three", &reqs).expect("runs");
    // Alone, the first token takes one 100-token prefill step.
    let prefill_ms = profile.step_ms(&pie_sim::cost::StepShape::of(&[(0, 100)]));
    assert!((apart.ttft_ms.p50 - prefill_ms).abs() < 0.01, "{apart:?}");
    // Three equal steps in flight on one machine each take three times as long,
    // and so does the whole run.
    assert!(
        (shared.ttft_ms.p50 - 3.0 * prefill_ms).abs() < 0.01,
        "{shared:?}"
    );
    assert!((shared.sim_time_s / apart.sim_time_s - 3.0).abs() < 1e-3);
    assert_eq!(shared.generated_tokens, apart.generated_tokens);
    // Two machines (2 + 1 workers): the lone worker is not slowed.
    cfg.workers_per_machine = 2;
    let two = run(&cfg, "three", &reqs).expect("runs");
    assert!((two.ttft_cdf_ms[0] - prefill_ms).abs() < 0.01, "{two:?}");
    assert!(
        (two.ttft_cdf_ms[100] - 2.0 * prefill_ms).abs() < 0.01,
        "{two:?}"
    );
}

/// Actors run in the simulator as in the controller (the same `ActorRunner`),
/// on a tick of simulated time: scale-by-prop's hints come one step at a time
/// per group, dry run records the same decisions unexecuted, and actors only
/// observe (the schedule is the same with and without them).
#[test]
fn actors_tick_on_simulated_time_and_only_observe() {
    let spec = WorkloadSpec::named("priority-mix").unwrap();
    let reqs = spec.generate(2_000, 3);
    let run_with = |pipeline: &str, dry_run: bool| {
        let mut cfg = SimConfig::new(
            4,
            PolicyName::Priority,
            router(pipeline),
            CostProfile::gpu_a100_llama3_8b(),
        );
        cfg.actor_configs.scale_by_prop.prop = "priority".into();
        cfg.actor_configs.scale_by_prop.target_load_per_worker = 4.0;
        cfg.actor_configs.scale_by_prop.pending_timeout_ms = 2_000;
        cfg.actor_configs.scale_by_prop.dry_run = dry_run;
        cfg.actor_tick_ms = 500;
        run(&cfg, spec.name(), &reqs).expect("simulation runs")
    };
    let plain = run_with("round-robin", false);
    let acting = run_with("round-robin,scale-by-prop", false);
    let dry = run_with("round-robin,scale-by-prop", true);
    assert!(plain.actions.is_empty());
    assert_eq!(acting.router, "round-robin,scale-by-prop");
    assert_eq!(acting.ttft_ms, plain.ttft_ms, "actors only observe");
    assert!(acting.actions.len() > 3, "{:?}", acting.actions);
    let mut last: std::collections::HashMap<String, usize> = Default::default();
    for a in &acting.actions {
        assert_eq!(a.action.kind(), "scale-hint");
        assert_eq!(a.at_ms % 500, 0, "on the tick");
        assert!(!a.dry_run);
        let pie_policy::cluster::Action::ScaleHint(h) = &a.action else {
            panic!("{a:?}");
        };
        if let Some(prev) = last.insert(h.group.clone(), h.recommended) {
            assert!(
                prev.abs_diff(h.recommended) <= 1,
                "one step at a time: {a:?}"
            );
        }
    }
    assert!(last.len() > 1, "a group per priority value: {last:?}");
    assert_eq!(dry.actions.len(), acting.actions.len());
    assert!(dry.actions.iter().all(|a| a.dry_run));
}

/// A calibrated profile of the default model on two cores
/// (docs/benchmarks/simulator.md).
fn calibrated(step_cv: f64) -> CostProfile {
    CostProfile {
        a_ms: 13.78,
        b_ms_per_token: 2.08,
        c_ms_per_context_token: 0.00201,
        d_ms_per_pair: 0.00697,
        step_cv,
        ..CostProfile::cpu_placeholder()
    }
}

fn fidelity_run(step_cv: f64, seed: u64) -> RunMetrics {
    fidelity_run_on(calibrated(step_cv), seed)
}

/// `scripts/fidelity.sh`'s one-worker run: shared-prefix, 4 groups of 256-token
/// system prompts, 32-token questions and outputs, 0.5 requests/s (workload
/// seed 1); the simulator's own draws from `seed`.
fn fidelity_run_on(profile: CostProfile, seed: u64) -> RunMetrics {
    let overrides: Vec<String> = [
        "groups=4",
        "zipf=null",
        "system_len=256",
        "question_len=32",
        "output_len=32",
        "rate_per_s=0.5",
    ]
    .map(String::from)
    .to_vec();
    let input = Input {
        workload: "shared-prefix",
        trace: None,
        overrides: &overrides,
        requests: Some(400),
        seed: 1,
        workers: 1,
        load: 1.0,
    };
    let (name, reqs) = requests::load(&input).expect("workload");
    let mut cfg = SimConfig::new(1, PolicyName::Fcfs, router("round-robin"), profile);
    cfg.seed = seed;
    let mut m = run(&cfg, &name, &reqs).expect("simulation runs");
    m.wall_s = 0.0;
    m.events_per_s = 0.0;
    m
}

#[test]
fn step_variance_raises_the_ttft_tail_not_the_mean() {
    let still = fidelity_run(0.0, 1);
    let varied = fidelity_run(0.3, 1);
    // Below saturation every request finishes either way: the same work.
    assert_eq!(
        (still.completed, still.generated_tokens),
        (varied.completed, varied.generated_tokens)
    );
    // Steps cost the fit's time on average: a request's whole life (31 decode
    // steps and a prefill) moves by little, its first token's tail by more.
    let rel = |a: f64, b: f64| b / a - 1.0;
    let e2e_mean = rel(still.e2e_ms.mean, varied.e2e_ms.mean);
    assert!(e2e_mean.abs() < 0.04, "e2e mean moved {e2e_mean:.3}");
    let p90 = rel(still.ttft_ms.p90, varied.ttft_ms.p90);
    assert!(p90 > 0.1, "TTFT p90 rose only {p90:.3}");
    assert!(
        p90 > 2.0 * e2e_mean.abs(),
        "p90 {p90:.3}, e2e mean {e2e_mean:.3}"
    );
}

#[test]
fn only_a_step_that_meets_an_idle_worker_costs_the_after_idle_factor() {
    let plain = fidelity_run(0.0, 1);
    let woken = fidelity_run_on(
        CostProfile {
            after_idle_factor: Some(1.5),
            ..calibrated(0.0)
        },
        1,
    );
    // At 0.5 requests/s most requests find the worker idle: the median TTFT
    // is a prefill after idle.
    let ttft = woken.ttft_ms.p50 / plain.ttft_ms.p50;
    assert!((ttft - 1.5).abs() < 0.01, "TTFT p50 x{ttft:.3}");
    // A decode step follows the step before it at once.
    let itl = woken.itl_ms.p50 / plain.itl_ms.p50;
    assert!((itl - 1.0).abs() < 0.01, "inter-token p50 x{itl:.3}");
}

#[test]
fn runs_with_step_variance_follow_the_seed() {
    assert_eq!(fidelity_run(0.2, 5), fidelity_run(0.2, 5));
    // Same workload: another seed draws other step times; without variance
    // there is nothing to draw and the seed changes nothing.
    assert_ne!(fidelity_run(0.2, 5).ttft_ms, fidelity_run(0.2, 6).ttft_ms);
    assert_eq!(fidelity_run(0.0, 5), fidelity_run(0.0, 6));
}
