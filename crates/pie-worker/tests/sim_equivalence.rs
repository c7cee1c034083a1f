//! The simulator's worker plane against the real engine, by property: random
//! request sets (open arrivals, later turns, props, pools small enough to evict
//! and preempt), every ordering policy, with and without keep-session. The
//! simulator runs one worker and logs each step; the engine (tiny model) is
//! driven by `step(now_ms)` on the simulator's clock, admitting each request
//! before the step it joined there. Both must give the same schedule: the
//! tokens of every step, each request's first-token and finish time, its cached
//! prompt tokens, expiries, and the preemptions. `PROPTEST_CASES` raises the
//! number of cases (default 256).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use pie_core::{PropValue, Props, SeqId};
use pie_model::Model;
use pie_policy::{KeepSession, KeepSessionConfig};
use pie_sim::workload::{Follow, Request as SimRequest, Segment};
use pie_sim::{CostProfile, PolicyName, Schedule, SimConfig};
use pie_worker::engine::{Engine, EngineConfig, FinishReason, Request};
use proptest::prelude::*;
use proptest::strategy::ValueTree;

/// Tokens the test model's byte vocabulary holds (ids below its special tokens).
const VOCAB: u32 = 250;

fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| Arc::new(Model::load(&common::test_model()).expect("test model")))
        .clone()
}

/// One conversation: its system prompt group, arrival, client, props and turns
/// (new user tokens, output tokens, think time before it).
///
/// The engine sees the simulator's token ids modulo its small vocabulary, so
/// two contexts that share a prefix must part at a page boundary with at least
/// a page of their own: then a page that differs in the simulator differs on
/// the engine too (but for a 250^-4 chance). Hence system prompts of whole
/// pages of the largest page size, and at least that many new tokens per turn.
#[derive(Clone, Debug)]
struct Conversation {
    group: u64,
    system_len: u32,
    arrival_ms: u64,
    heavy_client: bool,
    priority: i64,
    deadline_ms: i64,
    keep_ms: i64,
    turns: Vec<(u32, u32, u64)>,
}

fn conversation() -> impl Strategy<Value = Conversation> {
    (
        (0u64..3, (0u32..4).prop_map(|pages| pages * 16), 0u64..2_000),
        (any::<bool>(), 0i64..3, 50i64..3_000, 0i64..3_000),
        prop::collection::vec((16u32..40, 1u32..12, 0u64..300), 1..4),
    )
        .prop_map(
            |(
                (group, system_len, arrival_ms),
                (heavy_client, priority, deadline_ms, keep_ms),
                turns,
            )| {
                Conversation {
                    group,
                    system_len,
                    arrival_ms,
                    heavy_client,
                    priority,
                    deadline_ms,
                    keep_ms,
                    turns,
                }
            },
        )
}

/// The simulator's requests: each turn repeats the one before it (prompt and
/// output) and adds new tokens, arriving a think time after it finished.
fn requests(conversations: &[Conversation]) -> Vec<SimRequest> {
    let mut reqs = Vec::new();
    for (i, c) in conversations.iter().enumerate() {
        let mut props = Props::new();
        let client = if c.heavy_client { "heavy" } else { "light" };
        for (key, value) in [
            ("priority", PropValue::Int(c.priority)),
            ("deadline-ms", PropValue::Int(c.deadline_ms)),
            ("keep-ms", PropValue::Int(c.keep_ms)),
            ("session", PropValue::Str(format!("conversation-{i}"))),
        ] {
            props.set(key, value).expect("valid prop");
        }
        let mut prompt = Vec::new();
        if c.system_len > 0 {
            prompt.push(Segment::named(
                &[1, c.group, c.system_len.into()],
                c.system_len,
            ));
        }
        for (t, &(user_len, output_len, think_ms)) in c.turns.iter().enumerate() {
            let follows = (t > 0).then(|| Follow {
                request: reqs.len() - 1,
                think_us: think_ms * 1000,
            });
            prompt.push(Segment::named(&[2, i as u64, t as u64], user_len));
            let output = Segment::named(&[3, i as u64, t as u64], output_len);
            reqs.push(SimRequest {
                arrival_us: c.arrival_ms * 1000,
                follows,
                client: client.into(),
                class: client.into(),
                prompt: prompt.clone(),
                output,
                props: props.clone(),
            });
            prompt.push(output);
        }
    }
    reqs
}

/// What one side observed of each request: first-token time, finish time (µs,
/// simulated), cached prompt tokens, generated tokens, expired.
type Observed = Vec<Option<(u64, u64, u32, u32, bool)>>;

/// The engine replaying the simulator's steps: admissions before the step they
/// joined, `step(start)`; a step's tokens take effect at its end time. Also the
/// tokens and the free and cached pages of each step, the preemptions, and the sequences left at the end.
fn on_engine(
    config: &EngineConfig,
    policy: PolicyName,
    keep: bool,
    reqs: &[SimRequest],
    schedule: &Schedule,
) -> (Observed, Vec<(usize, usize, usize)>, u64, usize) {
    let mut engine = Engine::new(model(), config.clone(), policy.build());
    engine.set_keep_session(keep.then(|| KeepSession::new(KeepSessionConfig::default())));
    let mut ids: HashMap<SeqId, usize> = HashMap::new();
    let mut first: HashMap<usize, u64> = HashMap::new();
    let mut observed: Observed = vec![None; reqs.len()];
    let mut batches = Vec::new();
    let mut admissions = schedule.admissions.iter().peekable();
    // Each request's tokens on the engine: its prompt, then what it generated.
    let mut contexts: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
    let mut tokens = Vec::new();
    for (k, step) in schedule.steps.iter().enumerate() {
        while let Some(&&(r, _)) = admissions.peek().filter(|(_, before)| *before == k) {
            admissions.next();
            let prompt = engine_prompt(reqs, r, &contexts, &mut tokens);
            contexts[r] = prompt.clone();
            let mut req = Request::fixed_length(prompt, reqs[r].output_len());
            req.client = reqs[r].client.clone();
            req.props = reqs[r].props.clone();
            req.arrival_ms = schedule.records[r].arrival_us / 1000;
            ids.insert(engine.add(req).expect("the simulator admitted it"), r);
        }
        let out = engine.step(step.start_us / 1000).expect("step");
        let pool = engine.pool_stats();
        batches.push((out.shape.batch_tokens, pool.free, pool.cached));
        for (id, token) in &out.tokens {
            first.entry(ids[id]).or_insert(step.end_us);
            contexts[ids[id]].push(*token);
        }
        for (id, reason, info) in &out.finished {
            let r = ids[id];
            let expired = *reason == FinishReason::Expired;
            let at = if expired { step.start_us } else { step.end_us };
            observed[r] = Some((
                first.get(&r).copied().unwrap_or(0),
                at,
                info.cached_tokens as u32,
                info.generated_tokens as u32,
                expired,
            ));
        }
    }
    (
        observed,
        batches,
        engine.counters().preemptions,
        engine.len(),
    )
}

/// Request `r`'s prompt for the engine: the simulator's tokens, except that a
/// later turn repeats the tokens the engine generated for the turn before it
/// (where the simulator repeats that turn's output segment), so both see the
/// same prefix structure.
fn engine_prompt(
    reqs: &[SimRequest],
    r: usize,
    contexts: &[Vec<u32>],
    tokens: &mut Vec<u32>,
) -> Vec<u32> {
    reqs[r].tokens(tokens);
    tokens.truncate(reqs[r].prompt_len());
    let mut prompt: Vec<u32> = match reqs[r].follows {
        Some(f) if reqs[r].continues(&reqs[f.request]) => contexts[f.request].clone(),
        _ => Vec::new(),
    };
    let from = prompt.len();
    prompt.extend(tokens[from..].iter().map(|t| t % VOCAB));
    prompt
}

fn on_simulator(schedule: &Schedule) -> (Observed, Vec<(usize, usize, usize)>) {
    let observed = schedule
        .records
        .iter()
        .map(|r| {
            (!r.rejected).then(|| {
                (
                    r.first_token_us.unwrap_or(0),
                    r.finish_us.expect("finished"),
                    r.cached_tokens.unwrap_or(0),
                    r.generated_tokens,
                    r.expired,
                )
            })
        })
        .collect();
    let batches = schedule
        .steps
        .iter()
        .map(|s| (s.batch_tokens, s.free_pages, s.cached_pages))
        .collect();
    (observed, batches)
}

/// One simulated worker with the engine's limits, its schedule logged.
fn simulate(
    config: &EngineConfig,
    policy: PolicyName,
    keep: bool,
    reqs: &[SimRequest],
) -> Schedule {
    let profile = CostProfile {
        page_size: config.page_size,
        kv_pages: config.kv_pages,
        max_batch_tokens: config.max_batch_tokens,
        max_running: config.max_running,
        ..CostProfile::cpu_placeholder()
    };
    let mut cfg = SimConfig::new(1, policy, "round-robin".parse().expect("router"), profile);
    cfg.keep_session = keep;
    pie_sim::run_schedule(&cfg, reqs, &|| policy.build()).expect("simulates")
}

const POLICIES: [PolicyName; 5] = [
    PolicyName::Fcfs,
    PolicyName::Fair,
    PolicyName::Priority,
    PolicyName::Deadline,
    PolicyName::DeadlineAbort,
];

fn engine_config() -> impl Strategy<Value = EngineConfig> {
    (
        prop_oneof![Just(4usize), Just(8), Just(16)],
        16usize..64,
        prop_oneof![Just(8usize), Just(16), Just(48), Just(256)],
        1usize..6,
    )
        .prop_map(
            |(page_size, kv_pages, max_batch_tokens, max_running)| EngineConfig {
                page_size,
                kv_pages,
                max_batch_tokens,
                max_running,
                ..EngineConfig::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_simulator_schedules_as_the_engine_does(
        config in engine_config(),
        policy in 0..POLICIES.len(),
        keep in any::<bool>(),
        conversations in prop::collection::vec(conversation(), 1..7),
    ) {
        let policy = POLICIES[policy];
        let reqs = requests(&conversations);
        let schedule = simulate(&config, policy, keep, &reqs);
        let (engine, engine_batches, preemptions, left) = on_engine(&config, policy, keep, &reqs, &schedule);
        let (sim, sim_batches) = on_simulator(&schedule);
        prop_assert_eq!(engine_batches, sim_batches, "tokens, free and cached pages per step");
        for (r, (e, s)) in engine.iter().zip(&sim).enumerate() {
            prop_assert_eq!(e, s, "request {} (first token, finish, cached, generated, expired)", r);
        }
        prop_assert_eq!(preemptions, schedule.preemptions);
        prop_assert_eq!(left, 0, "sequences left on the engine after the last step");
    }
}

/// The property above must see what it is about: over a fixed set of cases,
/// pools tight enough to preempt, retained sessions hit by a later turn, and
/// deadlines that expire.
#[test]
fn the_generated_cases_preempt_retain_and_expire() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut preempted, mut retained_hits, mut expired) = (0, 0, 0);
    for _ in 0..64 {
        let config = engine_config()
            .new_tree(&mut runner)
            .expect("config")
            .current();
        let conversations = prop::collection::vec(conversation(), 1..7)
            .new_tree(&mut runner)
            .expect("conversations")
            .current();
        let reqs = requests(&conversations);
        for (policy, keep) in [(PolicyName::DeadlineAbort, false), (PolicyName::Fcfs, true)] {
            let s = simulate(&config, policy, keep, &reqs);
            preempted += usize::from(s.preemptions > 0);
            expired += s.records.iter().filter(|r| r.expired).count();
            if keep {
                retained_hits += reqs
                    .iter()
                    .zip(&s.records)
                    .filter(|(q, r)| q.follows.is_some() && r.cached_tokens.unwrap_or(0) > 0)
                    .count();
            }
        }
    }
    assert!(preempted > 5, "{preempted} runs preempted");
    assert!(
        retained_hits > 5,
        "{retained_hits} later turns found cached tokens"
    );
    assert!(expired > 5, "{expired} requests expired");
}
