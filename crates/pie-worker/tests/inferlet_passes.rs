//! The `pie:inferlet@0.3.0` world on one worker (the tiny test model):
//! speculative decoding by prompt lookup gives plain greedy decoding's
//! tokens; beam search with one pass per beam in flight at once equals a
//! reference over full distributions, in a quarter of the engine steps; a
//! tree-of-thought level's siblings share engine steps; a greenlist
//! watermark is detected and unwatermarked text is not;
//! contrastive decoding at alpha 0 is greedy; and a component built by the
//! 0.2.0 SDK still loads and runs.

mod common;

use common::guests::{config, json_events, launch, store_dir, upload};
use common::Server;
use serde_json::{json, Value};

/// Run `inferlet` to its end; its last JSON event.
async fn report(s: &Server, inferlet: &str, args: Value) -> Value {
    let id = launch(s, inferlet, args.clone(), json!({})).await;
    let events = json_events(s, &id).await;
    let record = s.wait_done(&id).await;
    assert_eq!(record["state"], "finished", "{inferlet} {args}: {record}");
    events.last().cloned().expect("a JSON report")
}

fn tokens(v: &Value) -> Vec<u64> {
    (v["tokens"].as_array().expect("tokens").iter())
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The built-in's greedy output tokens for `prompt`.
async fn greedy(s: &Server, prompt: &str, max_tokens: u32) -> Vec<u64> {
    let args = json!({"prompt": prompt, "max_tokens": max_tokens});
    let id = launch(s, "text-completion", args, json!({})).await;
    tokens(&json!({"tokens": s.wait_done(&id).await["output_tokens"]}))
}

#[tokio::test]
async fn speculative_decoding_by_prompt_lookup_is_exactly_greedy_decoding() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "spec-decode", "spec-decode").await;
    let repetitive = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,";
    let mut accepted = 0;
    for prompt in [repetitive, "Once upon a time", "The capital of France is"] {
        let want = greedy(&s, prompt, 48).await;
        for draft in [0, 8] {
            let args = json!({"prompt": prompt, "max_tokens": 48, "draft": draft});
            let spec = report(&s, "spec-decode", args).await;
            assert_eq!(tokens(&spec), want, "{prompt}, draft {draft}: {spec}");
            let n = |k: &str| spec[k].as_u64().unwrap();
            assert!(n("accepted") <= n("drafted"), "{spec}");
            assert!(n("passes") <= want.len() as u64 + 1, "{spec}");
            accepted += n("accepted");
        }
        let plain = report(
            &s,
            "spec-decode",
            json!({"prompt": prompt, "max_tokens": 48, "plain": true}),
        )
        .await;
        assert_eq!(tokens(&plain), want, "{prompt}, plain");
    }
    assert!(accepted > 0, "some drafts were accepted");
    s.eventually("the contexts' pages released", async || {
        s.metric("pie_kv_pages_used").await == 0.0
    })
    .await;
}

/// A server with a step log (its path), with `guest` installed.
async fn logged_server(guest: &str) -> (Server, std::path::PathBuf) {
    let log = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{guest}-steps-{}.jsonl", rand::random::<u32>()));
    let server = format!("[server]\nstep_log = {:?}\n", log.display().to_string());
    let s = Server::start(&(server + &config(&store_dir(), "", "")), &[]).await;
    upload(&s, guest, guest).await;
    (s, log)
}

/// Lines of the step log so far.
fn steps_logged(log: &std::path::Path) -> usize {
    std::fs::read_to_string(log).map_or(0, |l| l.lines().count())
}

#[tokio::test]
async fn beam_search_over_concurrent_passes_equals_a_full_distribution_reference() {
    let (s, log) = logged_server("beam-search").await;
    let (width, length) = (4, 12);
    let mut runs = Vec::new();
    for mode in ["concurrent", "reference"] {
        let before = steps_logged(&log);
        let args =
            json!({"prompt": "Once upon a time", "width": width, "length": length, "mode": mode});
        let found = report(&s, "beam-search", args).await;
        runs.push((found, steps_logged(&log) - before));
    }
    let (concurrent, reference) = (&runs[0].0, &runs[1].0);
    assert_eq!(concurrent["beams"], reference["beams"]);
    let beams = concurrent["beams"].as_array().unwrap();
    assert_eq!(beams.len(), width);
    let scores: Vec<f64> = beams.iter().map(|b| b["score"].as_f64().unwrap()).collect();
    assert!(
        scores.windows(2).all(|w| w[0] >= w[1]) && scores[0] <= 0.0,
        "{scores:?}"
    );
    for b in beams {
        assert_eq!(tokens(b).len(), length);
    }
    // The concurrent search's beams share each step: about one per token.
    let (together, one_by_one) = (runs[0].1, runs[1].1);
    assert!(
        together <= length + 3,
        "{together} steps for {length} tokens"
    );
    assert!(
        one_by_one >= 3 * together,
        "{one_by_one} against {together}"
    );
}

/// A tree-of-thought level's sibling thoughts generate in the same engine
/// steps: all eight of the second level share a step.
#[tokio::test]
async fn tree_of_thought_expands_a_levels_siblings_in_the_same_steps() {
    let (s, log) = logged_server("tree-of-thought").await;
    let args = json!({"prompt": "Plan a trip:", "depth": 2, "branches": 4, "keep": 2, "thought_tokens": 12});
    let found = report(&s, "tree-of-thought", args).await;
    assert_eq!(found["thoughts"].as_array().unwrap().len(), 2, "{found}");
    assert_eq!(
        (found["expanded"].as_u64(), found["generations"].as_u64()),
        (Some(3), Some(12))
    );
    let widest = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|r| r["sequences"].as_u64())
        .max();
    assert_eq!(widest, Some(8), "the second level's 8 siblings in one step");
}

#[tokio::test]
async fn a_greenlist_watermark_is_detected_and_plain_text_is_not() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "watermark", "watermark").await;
    let generate = |plain: bool| json!({"prompt": "Once upon a time", "max_tokens": 200, "seed": 7, "key": 42, "plain": plain, "ignore_eos": true});
    let marked = report(&s, "watermark", generate(false)).await;
    let again = report(&s, "watermark", generate(false)).await;
    assert_eq!(tokens(&marked), tokens(&again), "seeded: the same tokens");
    let plain = report(&s, "watermark", generate(true)).await;
    let z = async |of: &Value, key: u64| {
        let args = json!({"mode": "detect", "tokens": of["tokens"], "key": key});
        report(&s, "watermark", args).await["z"].as_f64().unwrap()
    };
    let (z_marked, z_plain, z_other_key) = (
        z(&marked, 42).await,
        z(&plain, 42).await,
        z(&marked, 7).await,
    );
    eprintln!(
        "z: {z_marked} watermarked ({} tokens), {z_plain} plain, {z_other_key} under another key",
        tokens(&marked).len()
    );
    assert!(z_marked > 4.0, "watermarked: z = {z_marked}");
    assert!(z_plain < 2.0, "plain: z = {z_plain}");
    assert!(z_other_key < 2.0, "another key: z = {z_other_key}");
    let nll = |v: &Value| v["nll"].as_f64().unwrap();
    let perplexity_ratio = (nll(&marked) - nll(&plain)).exp();
    assert!(
        perplexity_ratio < 1.5,
        "perplexity {perplexity_ratio}x the plain text's"
    );
}

#[tokio::test]
async fn contrastive_decoding_at_alpha_zero_is_greedy() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "contrastive", "contrastive").await;
    let prompt = "The capital of France is";
    let want = greedy(&s, prompt, 24).await;
    let args = json!({"prompt": prompt, "alpha": 0.0, "max_tokens": 24});
    assert_eq!(tokens(&report(&s, "contrastive", args).await), want);
    let same = json!({"prompt": prompt, "amateur_prompt": prompt, "max_tokens": 24});
    assert_eq!(tokens(&report(&s, "contrastive", same).await), want);
    let bad = launch(
        &s,
        "contrastive",
        json!({"prompt": prompt, "alpha": -1.0}),
        json!({}),
    )
    .await;
    let record = s.wait_done(&bad).await;
    assert_eq!(record["state"], "failed", "{record}");
}

/// A component the 0.2.0 SDK built (`tests/fixtures`, `text-completion`
/// at ffc19b5: it imports `shaping@0.2.0` and 0.1.0's interfaces) loads
/// and gives the built-in's output.
#[tokio::test]
async fn a_component_built_for_0_2_0_still_runs() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    let wasm = include_bytes!("fixtures/text-completion-0.2.0.wasm").to_vec();
    let r = reqwest::Client::new()
        .post(s.url("/v1/inferlets?name=old"))
        .body(wasm)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let args = json!({"prompt": "Once upon a time", "max_tokens": 16});
    let id = launch(&s, "old", args.clone(), json!({})).await;
    let old = s.wait_done(&id).await;
    let id = launch(&s, "text-completion", args, json!({})).await;
    assert_eq!(
        old["output_tokens"],
        s.wait_done(&id).await["output_tokens"]
    );
}

/// End to end on the real default model: speculative decoding of a code
/// edit equals plain greedy decoding and accepts drafts; the watermark's
/// z passes 4 on 200 tokens, plain text stays under 2, and its perplexity
/// stays within 1.5x the plain text's.
#[tokio::test]
async fn on_the_default_model_spec_decode_is_greedy_and_the_watermark_holds() {
    let Some(model) = common::cached_default_model() else {
        return;
    };
    let s = Server::start_model(&model, &config(&store_dir(), "", ""), &[]).await;
    upload(&s, "spec-decode", "spec-decode").await;
    upload(&s, "watermark", "watermark").await;
    let code = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n";
    let prompt = format!("{code}\nRename `width` to `w` in this code and return the whole file.");
    let args =
        |plain: bool| json!({"prompt": prompt, "chat": true, "max_tokens": 96, "plain": plain});
    let plain = report(&s, "spec-decode", args(true)).await;
    let spec = report(&s, "spec-decode", args(false)).await;
    assert_eq!(tokens(&spec), tokens(&plain), "{spec}");
    assert!(spec["accepted"].as_u64().unwrap() > 10, "{spec}");

    // Four seeds at temperature 0.7: the perplexity of one 200-token sample
    // varies by 2x from seed to seed (1.35x on average over six).
    let (mut marked_nll, mut plain_nll) = (0.0, 0.0);
    for seed in 1..=4 {
        let generate = |plain: bool| {
            json!({"prompt": "Write a short story about a lighthouse.", "chat": true,
                   "max_tokens": 200, "seed": seed, "key": 9, "plain": plain,
                   "ignore_eos": true, "temperature": 0.7})
        };
        let marked = report(&s, "watermark", generate(false)).await;
        let unmarked = report(&s, "watermark", generate(true)).await;
        let z = async |of: &Value| {
            let args = json!({"mode": "detect", "tokens": of["tokens"], "key": 9});
            report(&s, "watermark", args).await["z"].as_f64().unwrap()
        };
        let (z_marked, z_plain) = (z(&marked).await, z(&unmarked).await);
        eprintln!("default model, seed {seed}: z {z_marked} marked, {z_plain} plain");
        assert!(
            z_marked > 4.0 && z_plain < 2.0,
            "z {z_marked}, plain {z_plain}"
        );
        marked_nll += marked["nll"].as_f64().unwrap() / 4.0;
        plain_nll += unmarked["nll"].as_f64().unwrap() / 4.0;
    }
    let ratio = (marked_nll - plain_nll).exp();
    eprintln!("default model: perplexity {ratio}x the plain text's");
    assert!(ratio < 1.5, "perplexity {ratio}x the plain text's");
}
