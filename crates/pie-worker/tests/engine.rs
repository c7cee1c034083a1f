//! The engine on the synthesized test model: greedy generation gives the same
//! tokens however the KV got there (prefix hit, fork, preemption, page transfer,
//! batching), and no page leaks.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use pie_core::{block_hashes, SeqId};
use pie_kv::transfer::{export_page, import_page};
use pie_model::synth::{write_test_model, SynthSpec};
use pie_model::{Model, SamplingParams};
use pie_policy::Fcfs;
use pie_worker::engine::{AdmitError, Engine, EngineConfig, FinishReason, Request};

fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let path =
                std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("engine-test-model.gguf");
            write_test_model(
                &path,
                &SynthSpec {
                    seed: 1,
                    ..SynthSpec::default()
                },
            )
            .unwrap();
            Arc::new(Model::load(&path).unwrap())
        })
        .clone()
}

fn engine(kv_pages: usize, max_batch_tokens: usize) -> Engine {
    engine_on(model(), kv_pages, max_batch_tokens)
}

fn engine_on(model: Arc<Model>, kv_pages: usize, max_batch_tokens: usize) -> Engine {
    let config = EngineConfig {
        page_size: 4,
        kv_pages,
        max_batch_tokens,
        max_running: 64,
        ..EngineConfig::default()
    };
    Engine::new(model, config, Box::new(Fcfs))
}

fn request(prompt: &[u32], max_tokens: usize) -> Request {
    // Random weights may sample <|im_end|>; ignoring it keeps lengths fixed.
    Request::fixed_length(prompt.to_vec(), max_tokens)
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 37 + i * 11) % 250 + 1)
        .collect()
}

/// Run every sequence to the end; tokens per sequence, in generation order.
fn drain(engine: &mut Engine) -> HashMap<SeqId, Vec<u32>> {
    let mut out: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut steps = 0;
    while engine.has_work() {
        for (id, t) in engine.step(0).unwrap().tokens {
            out.entry(id).or_default().push(t);
        }
        steps += 1;
        assert!(steps < 10_000, "engine made no progress");
    }
    out
}

/// Run one request to the end; its tokens and its prefix-cache hit.
fn run_one(engine: &mut Engine, req: Request) -> (Vec<u32>, usize) {
    let id = engine.add(req).unwrap();
    let (mut tokens, mut cached) = (Vec::new(), None);
    while engine.has_work() {
        let out = engine.step(0).unwrap();
        tokens.extend(out.tokens.iter().filter(|t| t.0 == id).map(|t| t.1));
        cached = cached.or(out
            .finished
            .iter()
            .find(|f| f.0 == id)
            .map(|f| f.2.cached_tokens));
    }
    (tokens, cached.expect("the request finished"))
}

fn alone(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut e = engine(256, 512);
    let id = e.add(request(prompt, max_tokens)).unwrap();
    drain(&mut e).remove(&id).unwrap()
}

#[test]
fn generation_is_deterministic_and_sized() {
    let p = prompt(1, 13);
    let a = alone(&p, 12);
    assert_eq!(a, alone(&p, 12));
    assert_eq!(a.len(), 12);
    assert_ne!(
        a,
        alone(&prompt(2, 13), 12),
        "different prompts should generate differently"
    );
}

#[test]
fn prefix_cache_hit_gives_same_tokens() {
    let p = prompt(3, 18);
    let expected = alone(&p, 10);
    let mut e = engine(256, 512);
    e.add(request(&p, 10)).unwrap();
    drain(&mut e);
    let (got, cached) = run_one(&mut e, request(&p, 10));
    assert_eq!(
        cached, 16,
        "four full pages of the 18-token prompt were cached"
    );
    assert!(e.counters().prefix_hit_tokens >= 16);
    assert_eq!(got, expected);
}

/// Requests sharing a prefix, added together, compute it once: the first
/// prefills it, the others wait one step and attach its pages (cache hits),
/// and each gives the tokens it gives alone.
#[test]
fn a_prefix_shared_by_requests_added_together_is_computed_once() {
    let shared = prompt(40, 20);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| [shared.clone(), prompt(41 + i, 3)].concat())
        .collect();
    let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(p, 6)).collect();
    let mut e = engine(256, 512);
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| e.add(request(p, 6)).unwrap())
        .collect();
    let (mut out, mut cached) = (HashMap::<SeqId, Vec<u32>>::new(), HashMap::new());
    while e.has_work() {
        let step = e.step(0).unwrap();
        for (id, t) in step.tokens {
            out.entry(id).or_default().push(t);
        }
        cached.extend(step.finished.iter().map(|f| (f.0, f.2.cached_tokens)));
    }
    assert_eq!(cached[&ids[0]], 0, "the first computes the prefix");
    for id in &ids[1..] {
        assert_eq!(
            cached[id], 20,
            "the five shared pages were attached, not computed again"
        );
    }
    for (id, want) in ids.iter().zip(&expected) {
        assert_eq!(&out[id], want);
    }
}

#[test]
fn fork_continues_like_the_parent() {
    let p = prompt(4, 10);
    let expected = alone(&p, 12);
    let mut e = engine(256, 512);
    let parent = e.add(request(&p, 12)).unwrap();
    let first = e.step(0).unwrap().tokens;
    assert_eq!(first, vec![(parent, expected[0])]);
    let child = e.fork(parent, 11, SamplingParams::default(), 0).unwrap();
    let out = drain(&mut e);
    assert_eq!(out[&parent], expected[1..]);
    assert_eq!(out[&child], expected[1..]);
}

#[test]
fn preemption_and_recompute_give_same_tokens() {
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(10 + i, 9 + i as usize)).collect();
    let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(p, 16)).collect();
    // 14 pages of 4 tokens: each sequence needs up to 8 pages alone, five need ~40.
    let mut e = engine(14, 64);
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| e.add(request(p, 16)).unwrap())
        .collect();
    let out = drain(&mut e);
    assert!(
        e.counters().preemptions > 0,
        "the pool was sized to force preemption"
    );
    for (id, want) in ids.iter().zip(&expected) {
        assert_eq!(&out[id], want);
    }
    assert_eq!(e.pool_stats().used, 0, "no page leaked");
}

#[test]
fn batched_and_chunked_prefill_give_same_tokens() {
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(20 + i, 5 + 7 * i as usize)).collect();
    let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(p, 10)).collect();
    // A 16-token budget splits the longer prompts into chunks across steps.
    let mut e = engine(256, 16);
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| e.add(request(p, 10)).unwrap())
        .collect();
    let out = drain(&mut e);
    for (id, want) in ids.iter().zip(&expected) {
        assert_eq!(&out[id], want);
    }
    let stats = e.pool_stats();
    assert_eq!(stats.used, 0);
    assert_eq!(stats.cached + stats.free, stats.total);
}

/// Prompt `p` served on an engine of its own (`max_tokens` generated): its
/// full pages' block hashes and the pages exported in the transfer format.
fn served_pages(p: &[u32], max_tokens: usize) -> (Vec<pie_core::BlockHash>, Vec<Vec<u8>>) {
    let mut a = engine(64, 512);
    a.add(request(p, max_tokens)).unwrap();
    drain(&mut a);
    let hashes = block_hashes(model().fingerprint, p, 4);
    let pages = hashes
        .iter()
        .map(|h| export_page(a.pool(), a.pool().lookup(*h).unwrap()).unwrap())
        .collect();
    (hashes, pages)
}

#[test]
fn imported_prefix_pages_give_same_tokens() {
    let p = prompt(30, 21);
    let expected = alone(&p, 8);
    let (_, pages) = served_pages(&p, 8);
    let mut b = engine(64, 512);
    for bytes in &pages {
        import_page(b.pool_mut(), bytes).unwrap();
    }
    let (got, cached) = run_one(&mut b, request(&p, 8));
    assert_eq!(cached, 20);
    assert_eq!(got, expected);
}

/// With keep-session on, 8 tokens after `prompt` for session `s` (kept for
/// a minute), run to the end: its pages are retained.
fn retain_session(e: &mut Engine, prompt: &[u32]) {
    use pie_core::PropValue;
    e.set_keep_session(Some(pie_policy::KeepSession::new(Default::default())));
    let mut kept = request(prompt, 8);
    kept.props
        .set("session", PropValue::Str("s".into()))
        .unwrap();
    kept.props.set("keep-ms", PropValue::Int(60_000)).unwrap();
    e.add(kept).unwrap();
    drain(e);
}

/// Pages imported for an arriving prompt take the room a retained session
/// holds (soonest expiry first): the session is evicted, spilled whole when
/// spilling is on (`retain-all`), and every page is imported.
#[test]
fn imported_pages_evict_a_retained_session_which_spills() {
    let p = prompt(31, 48);
    let (_, pages) = served_pages(&p, 4);
    assert_eq!(pages.len(), 12);
    for spill in [false, true] {
        let mut b = engine(16, 512);
        b.set_spill(spill);
        retain_session(&mut b, &prompt(32, 20));
        assert_eq!(b.retained_sessions().len(), 1, "7 pages retained");
        assert!(b.pool_stats().free + b.pool_stats().cached < pages.len());
        assert_eq!(
            b.import_pages(&[], &pages),
            12,
            "every page, in the retained room"
        );
        assert!(b.retained_sessions().is_empty(), "the session made room");
        let spills = b.take_spills();
        match spill {
            false => assert!(spills.is_empty()),
            true => {
                // 27 tokens computed (the last one sampled is not): 6 full pages.
                assert_eq!(spills.len(), 1);
                let key = pie_policy::keep_session::retention_key("", "s");
                assert_eq!(
                    (spills[0].session.as_str(), spills[0].pages.len()),
                    (key.as_str(), 6)
                );
            }
        }
        let (got, cached) = run_one(&mut b, request(&p, 4));
        assert_eq!(cached, 44, "the imported prefix (all but the last token)");
        assert_eq!(got, alone(&p, 4));
    }
}

/// Importing a chain's tail into a full pool keeps the chain's head the
/// pool already holds, even when the head is the least recently used: the
/// room comes from other pages. (Evicting the head to make room for its own
/// tail left a prompt with no prefix at all: a disk-tier load on a worker
/// whose groups take turns thrashed so, at hit rate 0.47.)
#[test]
fn importing_a_chains_tail_into_a_full_pool_keeps_its_head() {
    let (chain, pages) = served_pages(&prompt(33, 48), 4);
    let (_, filler) = served_pages(&prompt(34, 48), 4);
    let (head, tail) = (&pages[..4], &pages[4..8]);
    for keep_head in [false, true] {
        let mut b = engine(16, 512);
        // The head first (least recently used), then 12 other pages: full.
        for bytes in head.iter().chain(&filler[..12]) {
            import_page(b.pool_mut(), bytes).unwrap();
        }
        assert_eq!(b.pool_stats().free, 0);
        assert_eq!(b.cached_pages(&chain), 4);
        let named = if keep_head { &chain[..] } else { &[][..] };
        assert_eq!(b.import_pages(named, tail), 4, "every page of the tail");
        let expected = if keep_head { 8 } else { 0 };
        assert_eq!(
            b.cached_pages(&chain),
            expected,
            "keep_head: {keep_head}: the chain's leading pages held"
        );
    }
}

#[test]
fn abort_frees_pages_and_admission_checks_sizes() {
    let mut e = engine(8, 512);
    assert_eq!(e.add(request(&[], 4)).unwrap_err(), AdmitError::EmptyPrompt);
    let err = e.add(request(&prompt(1, 40), 4)).unwrap_err();
    assert_eq!(
        err,
        AdmitError::TooLong {
            prompt: 40,
            limit: 32,
            what: "KV pool capacity"
        }
    );
    // A request that asks for more than fits is capped, not failed.
    let id = e.add(request(&prompt(1, 20), 100)).unwrap();
    e.step(0).unwrap();
    assert!(e.pool_stats().used > 0);
    assert!(e.abort(id));
    assert_eq!(e.pool_stats().used, 0);
    let id = e.add(request(&prompt(1, 20), 100)).unwrap();
    let mut finished = None;
    while e.has_work() {
        if let Some(f) = e.step(0).unwrap().finished.into_iter().find(|f| f.0 == id) {
            finished = Some(f);
        }
    }
    let (_, reason, info) = finished.unwrap();
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(info.prompt_tokens + info.generated_tokens, 32);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let run = |seed| {
        let mut e = engine(64, 512);
        let sampling = SamplingParams {
            temperature: 1.0,
            top_k: 50,
            top_p: 0.95,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let id = e
            .add(Request {
                sampling,
                ..request(&prompt(5, 8), 16)
            })
            .unwrap();
        drain(&mut e).remove(&id).unwrap()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn expired_sequences_stop_before_computing_and_free_their_pages() {
    use pie_policy::{Deadline, DeadlineConfig, OnMiss};
    let config = EngineConfig {
        page_size: 4,
        kv_pages: 64,
        max_batch_tokens: 512,
        max_running: 64,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(
        model(),
        config,
        Box::new(Deadline::new(DeadlineConfig {
            on_miss: OnMiss::Abort,
        })),
    );
    let mut late = request(&prompt(6, 9), 8);
    late.props
        .set("deadline-ms", pie_core::PropValue::Int(5))
        .unwrap();
    let late = e.add(late).unwrap();
    let on_time = e.add(request(&prompt(7, 9), 8)).unwrap();
    let out = e.step(10).unwrap();
    assert_eq!(
        out.finished.iter().map(|f| (f.0, f.1)).collect::<Vec<_>>(),
        vec![(late, FinishReason::Expired)]
    );
    assert_eq!(
        out.tokens,
        vec![(on_time, out.tokens[0].1)],
        "only the live sequence produced a token"
    );
    let started: Vec<SeqId> = out.started.iter().map(|&(id, _)| id).collect();
    assert_eq!(started, vec![on_time]);
    drain(&mut e);
    assert_eq!(e.pool_stats().used, 0);
}

/// A sequence whose own input would fail the batched forward fails alone:
/// the sequence batched with it generates what it generates alone.
#[test]
fn a_sequence_with_a_bad_token_fails_alone_and_the_batch_goes_on() {
    let good = prompt(3, 9);
    let expected = alone(&good, 6);
    let mut e = engine(64, 512);
    let outside = model().config.vocab as u32;
    let bad = e.add(request(&[1, 2, outside], 6)).unwrap();
    let ok = e.add(request(&good, 6)).unwrap();
    let first = e.step(0).unwrap();
    assert_eq!(first.failed.len(), 1);
    assert_eq!(first.failed[0].0, bad);
    assert!(
        first.failed[0].1.contains("outside the vocabulary"),
        "{}",
        first.failed[0].1
    );
    let mut tokens: Vec<u32> = first
        .tokens
        .iter()
        .filter(|t| t.0 == ok)
        .map(|t| t.1)
        .collect();
    let rest = drain(&mut e);
    assert!(!rest.contains_key(&bad), "the failed sequence ran no more");
    tokens.extend(rest.get(&ok).cloned().unwrap_or_default());
    assert_eq!(tokens, expected);
    assert_eq!(e.pool_stats().used, 0, "no page leaked");
}

/// Greedy output of `prompt` for 200 tokens under `shape` (penalties, biases).
fn greedy_with(shape: impl FnOnce(&mut SamplingParams)) -> Vec<u32> {
    let mut sampling = SamplingParams::default();
    shape(&mut sampling);
    let mut e = engine(64, 512);
    run_one(
        &mut e,
        Request {
            sampling,
            ..request(&prompt(3, 8), 200)
        },
    )
    .0
}

fn repeats(tokens: &[u32]) -> usize {
    let distinct: std::collections::HashSet<&u32> = tokens.iter().collect();
    tokens.len() - distinct.len()
}

/// The sampling step's penalties and biases, on the model: a token biased
/// to -100 never comes; a frequency penalty of 2 lowers the repeats of a
/// repetitive greedy continuation; a repetition penalty keeps the prompt's
/// tokens out where they would come.
#[test]
fn penalties_and_biases_shape_the_greedy_output() {
    let plain = greedy_with(|_| {});
    let most = *plain
        .iter()
        .max_by_key(|t| plain.iter().filter(|u| u == t).count())
        .unwrap();
    let biased = greedy_with(|s| s.logit_bias = vec![(most, -100.0)]);
    assert!(!biased.contains(&most), "{most} in {biased:?}");
    let penalised = greedy_with(|s| s.frequency_penalty = 2.0);
    assert!(
        2 * repeats(&penalised) < repeats(&plain),
        "repeats {} with the penalty, {} without: {penalised:?} / {plain:?}",
        repeats(&penalised),
        repeats(&plain)
    );
    let from_prompt = |out: &[u32]| out.iter().filter(|t| prompt(3, 8).contains(t)).count();
    let kept_out = greedy_with(|s| s.repetition_penalty = 10.0);
    assert!(
        from_prompt(&kept_out) < from_prompt(&plain),
        "{kept_out:?} / {plain:?}"
    );
}

/// A model whose every projection is rows of whole 256-value groups (hidden
/// 256, FFN 512, Q6_K down projections), so an AMX CPU runs it on the AMX
/// kernel.
fn whole_group_model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join("engine-whole-group-model.gguf");
            let spec = SynthSpec {
                seed: 4,
                hidden: 256,
                intermediate: 512,
                ffn_down_type: candle_core::quantized::GgmlDType::Q6K,
                ..SynthSpec::default()
            };
            write_test_model(&path, &spec).unwrap();
            Arc::new(Model::load(&path).unwrap())
        })
        .clone()
}

/// A 64-token prompt prefilled in one step runs its projections on the AMX
/// kernel; four tokens a step, on the AVX-512 kernel (calls under 32 rows).
/// Its KV pages and its tokens are the same bits either way.
#[test]
fn amx_prefill_gives_the_pages_and_tokens_of_small_steps() {
    let model = whole_group_model();
    if model.matmul_kernel() != "amx" {
        eprintln!(
            "SKIPPED: AMX prefill not tested end to end: the {} kernel runs here",
            model.matmul_kernel()
        );
        return;
    }
    let p = prompt(40, 64);
    let served = |budget| {
        let mut e = engine_on(model.clone(), 64, budget);
        let id = e.add(request(&p, 8)).unwrap();
        let tokens = drain(&mut e).remove(&id).unwrap();
        let pages: Vec<Vec<u8>> = block_hashes(model.fingerprint, &p, 4)
            .iter()
            .map(|h| export_page(e.pool(), e.pool().lookup(*h).unwrap()).unwrap())
            .collect();
        (tokens, pages)
    };
    let (whole, small) = (served(512), served(4));
    assert_eq!((whole.0.len(), whole.1.len()), (8, 16));
    assert!(whole == small, "one 64-token step and 4-token steps differ");
}

/// A pass reports, after each position asked, the token greedy decoding
/// sampled there, though the prefix cache holds those positions and the
/// pass is split over several steps; positions not asked are not reported.
#[test]
fn a_pass_reports_what_greedy_decoding_chose_even_over_cached_pages() {
    use pie_worker::engine::Score;
    let p = prompt(41, 10);
    let mut e = engine(64, 3);
    let (decoded, _) = run_one(&mut e, request(&p, 6));
    let mut all = p.clone();
    all.extend_from_slice(&decoded[..5]);
    let positions: Vec<usize> = (p.len() - 1..all.len()).step_by(2).collect();
    let mut pass = request(&all, 1);
    pass.score = Some(Score {
        positions: positions.clone(),
        top: 3,
        full: true,
    });
    let id = e.add(pass).unwrap();
    let mut scored = Vec::new();
    while e.has_work() {
        let out = e.step(0).unwrap();
        scored.extend(out.scored.into_iter().filter(|s| s.0 == id).map(|s| s.1));
    }
    let got: Vec<(usize, u32)> = scored.iter().map(|s| (s.position, s.greedy.0)).collect();
    let want: Vec<(usize, u32)> = (positions.iter())
        .map(|&at| (at, decoded[at + 1 - p.len()]))
        .collect();
    assert_eq!(got, want);
    for s in &scored {
        assert_eq!((s.top.len(), s.top[0].0), (3, s.greedy.0));
        assert_eq!(s.full[s.greedy.0 as usize], s.greedy.1);
    }
    assert_eq!(e.pool_stats().used, 0, "no page leaked");
}

/// Truncating a retained session keeps its pages up to the new length and
/// releases the rest.
#[test]
fn truncating_a_retained_session_releases_the_pages_past_its_length() {
    let mut e = engine(32, 512);
    retain_session(&mut e, &prompt(35, 20));
    // 27 tokens computed: 6 full pages and 3 slots of a seventh.
    assert_eq!(e.retained_sessions()[0].1, 7);
    let key = pie_policy::keep_session::retention_key("", "s");
    e.truncate_session(&key, 26);
    assert_eq!(
        e.retained_sessions()[0].1,
        7,
        "the private partial page stays"
    );
    e.truncate_session(&key, 10);
    assert_eq!(
        e.retained_sessions()[0].1,
        2,
        "a shared page it cuts into goes"
    );
    assert_eq!(e.pool_stats().used, 2);
    e.release_session(&key);
    assert_eq!(e.pool_stats().used, 0);
}

/// A generation under token sets samples only allowed tokens never banned.
#[test]
fn token_sets_bound_what_greedy_samples() {
    let sets = pie_model::TokenSets::new(Some(vec![5, 6, 7]), vec![6]).unwrap();
    let tokens = greedy_with(|s| s.token_sets = sets);
    assert_eq!(tokens.len(), 200);
    assert!(tokens.iter().all(|t| [5, 7].contains(t)), "{tokens:?}");
}
