//! The simulator's worker plane against the real engine: the same requests, the
//! same policy object and the same limits give the same schedule. Both run every
//! request from time 0; the engine steps by hand, and each request's first token
//! and finish are compared as orders (which requests came in the same step, and
//! which earlier), together with the prompt tokens each found cached.

mod common;

use std::sync::Arc;

use pie_core::{PropValue, Props};
use pie_model::Model;
use pie_policy::WorkerPolicy;
use pie_sim::workload::{Request as SimRequest, Segment};
use pie_sim::{CostProfile, PolicyName, SimConfig};
use pie_worker::engine::{Engine, EngineConfig, Request};

/// Tokens the test model's byte vocabulary holds (ids below its special tokens).
const VOCAB: u32 = 250;

/// Twelve requests: three groups sharing a 64-token system prompt, prompts of
/// 70 to 200 tokens, 3 to 24 output tokens, two clients, priorities and deadlines.
fn requests() -> Vec<SimRequest> {
    (0..12u64)
        .map(|i| {
            let mut props = Props::new();
            let deadline_ms = 1000 + ((i * 7) % 5) as i64 * 300;
            props
                .set("priority", PropValue::Int((i % 3) as i64))
                .expect("valid prop");
            props
                .set("deadline-ms", PropValue::Int(deadline_ms))
                .expect("valid prop");
            let client = if i % 4 == 0 { "heavy" } else { "light" };
            SimRequest {
                arrival_us: 0,
                follows: None,
                client: client.into(),
                class: client.into(),
                prompt: vec![
                    Segment::named(&[1, i % 3], 64),
                    Segment::named(&[2, i], 6 + 12 * (i as u32 % 12)),
                ],
                output: Segment::named(&[3, i], 3 + 2 * (i as u32 % 11)),
                props,
            }
        })
        .collect()
}

/// When each request got its first token and finished (step numbers), and its
/// cached prompt tokens, on the real engine; and how many preemptions it made.
fn on_engine(
    config: &EngineConfig,
    policy: Box<dyn WorkerPolicy>,
    reqs: &[SimRequest],
) -> (Vec<(u64, u64, u32)>, u64) {
    let model = Arc::new(Model::load(&common::test_model()).expect("test model"));
    let mut engine = Engine::new(model, config.clone(), policy);
    let mut tokens = Vec::new();
    let ids: Vec<_> = reqs
        .iter()
        .map(|r| {
            r.tokens(&mut tokens);
            tokens.truncate(r.prompt_len());
            let prompt = tokens.iter().map(|t| t % VOCAB).collect();
            let mut req = Request::fixed_length(prompt, r.output_len());
            req.client = r.client.clone();
            req.props = r.props.clone();
            engine.add(req).expect("admitted")
        })
        .collect();
    let mut at = vec![(0, 0, 0); reqs.len()];
    let index = |id| ids.iter().position(|&x| x == id).expect("our sequence");
    let mut step = 0;
    while engine.has_work() {
        step += 1;
        let out = engine.step(0).expect("step");
        for &(id, _) in &out.tokens {
            let i = index(id);
            if at[i].0 == 0 {
                at[i].0 = step;
            }
        }
        for (id, _, info) in &out.finished {
            let i = index(*id);
            at[i].1 = step;
            at[i].2 = info.cached_tokens as u32;
        }
    }
    (at, engine.counters().preemptions)
}

/// The same from the simulator (times in simulated microseconds).
fn on_simulator(
    config: &EngineConfig,
    policy: PolicyName,
    reqs: &[SimRequest],
) -> Vec<(u64, u64, u32)> {
    let profile = CostProfile {
        page_size: config.page_size,
        kv_pages: config.kv_pages,
        max_batch_tokens: config.max_batch_tokens,
        max_running: config.max_running,
        ..CostProfile::cpu_placeholder()
    };
    let cfg = SimConfig::new(1, policy, "round-robin".parse().expect("router"), profile);
    pie_sim::run_records(&cfg, reqs, &|| policy.build())
        .expect("simulates")
        .iter()
        .map(|r| {
            (
                r.first_token_us.expect("first token"),
                r.finish_us.expect("finished"),
                r.cached_tokens.unwrap_or(0),
            )
        })
        .collect()
}

/// Request pairs ordered differently by `a` and `b` (ties must tie in both).
fn disagreements(a: &[u64], b: &[u64]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for i in 0..a.len() {
        for j in i + 1..a.len() {
            if a[i].cmp(&a[j]) != b[i].cmp(&b[j]) {
                out.push((i, j));
            }
        }
    }
    out
}

#[test]
fn the_simulator_schedules_as_the_engine_does() {
    let reqs = requests();
    let roomy = EngineConfig {
        page_size: 16,
        kv_pages: 400,
        max_batch_tokens: 256,
        max_running: 4,
    };
    // Too few pages for everyone: cached pages are evicted and sequences preempted.
    let tight = EngineConfig {
        kv_pages: 24,
        ..roomy.clone()
    };
    for config in [roomy, tight] {
        for policy in [
            PolicyName::Fcfs,
            PolicyName::Priority,
            PolicyName::Fair,
            PolicyName::Deadline,
        ] {
            let (engine, preemptions) = on_engine(&config, policy.build(), &reqs);
            assert_eq!(
                preemptions > 0,
                config.kv_pages < 100,
                "{preemptions} preemptions"
            );
            let sim = on_simulator(&config, policy, &reqs);
            let what = format!("{} with {} pages", policy.label(), config.kv_pages);
            let column = |v: &[(u64, u64, u32)], k: usize| -> Vec<u64> {
                v.iter().map(|t| [t.0, t.1, u64::from(t.2)][k]).collect()
            };
            assert_eq!(
                disagreements(&column(&engine, 0), &column(&sim, 0)),
                vec![],
                "{what}: first tokens, engine steps {engine:?} vs sim {sim:?}"
            );
            assert_eq!(
                disagreements(&column(&engine, 1), &column(&sim, 1)),
                vec![],
                "{what}: finishes, engine steps {engine:?} vs sim {sim:?}"
            );
            assert_eq!(
                column(&engine, 2),
                column(&sim, 2),
                "{what}: cached prompt tokens"
            );
        }
    }
}
