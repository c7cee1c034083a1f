//! End-to-end checks on the real default model (SmolLM2-135M-Instruct Q4_1).
//!
//! They run when the model is in the cache (`pie model fetch`; CI fetches it and
//! sets PIE_REQUIRE_DEFAULT_MODEL=1 so a missing model fails instead of skipping).

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use pie_model::{ChatMessage, Model};
use pie_policy::Fcfs;
use pie_worker::engine::{Engine, EngineConfig, Request};
use pie_worker::fetch;

fn default_model() -> Option<Arc<Model>> {
    let path = common::cached_default_model()?;
    Some(Arc::new(Model::load(&path).unwrap()))
}

fn greedy(model: &Arc<Model>, text: &str, max_tokens: usize) -> String {
    let mut e = Engine::new(model.clone(), EngineConfig::default(), Box::new(Fcfs));
    let prompt = model.tokenizer.encode(text).unwrap();
    let id = e
        .add(Request::new(
            prompt,
            max_tokens,
            String::new(),
            Default::default(),
            0,
        ))
        .unwrap();
    let mut out: HashMap<_, Vec<u32>> = HashMap::new();
    while e.has_work() {
        for (sid, t) in e.step(0).unwrap().tokens {
            out.entry(sid).or_default().push(t);
        }
    }
    model
        .tokenizer
        .decode(&out.remove(&id).unwrap_or_default())
        .unwrap()
}

#[test]
fn tokenizer_matches_smollm2() {
    let Some(model) = default_model() else { return };
    let tk = &model.tokenizer;
    assert_eq!(
        tk.encode("The").unwrap(),
        vec![504],
        "no spurious prefix space"
    );
    // Digits are split one by one (tokenizer.ggml.pre = smollm).
    let ids = tk.encode("2024").unwrap();
    assert_eq!(ids.len(), 4);
    assert_eq!(tk.decode(&ids).unwrap(), "2024");
    let chat = tk.encode("<|im_start|>user").unwrap();
    assert_eq!(chat[0], 1, "<|im_start|> is one special token");
}

#[test]
fn completes_paris() {
    let Some(model) = default_model() else { return };
    let text = greedy(&model, "The capital of France is", 16);
    assert!(text.contains("Paris"), "completion was {text:?}");
}

#[test]
fn chat_template_answers_paris() {
    let Some(model) = default_model() else { return };
    let prompt = model
        .tokenizer
        .apply_chat_template(
            &[
                ChatMessage::text("system", "You are a helpful assistant.".into()),
                ChatMessage::text("user", "What is the capital of France?".into()),
            ],
            None,
        )
        .unwrap();
    assert!(prompt.starts_with("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"));
    assert!(prompt.ends_with("<|im_start|>assistant\n"));
    let text = greedy(&model, &prompt, 32);
    assert!(text.contains("Paris"), "answer was {text:?}");
}

#[tokio::test]
async fn pie_serve_answers_paris_over_http() {
    if default_model().is_none() {
        return;
    }
    let s = common::Server::start_model(&fetch::cached_default_model(), "", &[]).await;
    let body = serde_json::json!({
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}
        ],
        "temperature": 0,
        "max_tokens": 32
    });
    let (status, resp) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{resp}");
    let answer = resp["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "answer was {answer:?}");
}

#[tokio::test]
async fn a_disaggregated_prefill_on_the_default_model_answers_as_one_engine() {
    let Some(model) = default_model() else {
        return;
    };
    let path = fetch::cached_default_model();
    let prefill = common::Server::start_model(&path, "", &["--stage", "prefill"]).await;
    let decode = common::Server::start_model(&path, "", &["--stage", "decode"]).await;
    let text = "The lighthouse keeper climbed the stairs every evening to light the lamp. "
        .repeat(12)
        + "One night the lamp would not light, so the keeper";
    let expected = greedy(&model, &text, 24);
    let (status, resp) = decode
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": text, "max_tokens": 24, "temperature": 0, "pie_prefill_from": prefill.url}),
        )
        .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["choices"][0]["text"], expected.as_str());
    assert!(decode.metric("pie_kv_transfer_pages_total").await >= 10.0);
    assert_eq!(decode.metric("pie_kv_transfer_fallbacks_total").await, 0.0);
}

/// A live move on the default model, as a controller drives it: the source
/// streams 16 tokens, the target prefetches the source's pages, the source
/// hands the process off, the target resumes it pulling the rest: greedy
/// output is the in-process engine's, token for token.
#[tokio::test]
async fn a_process_moved_between_workers_on_the_default_model_answers_as_one_engine() {
    let Some(model) = default_model() else {
        return;
    };
    let path = fetch::cached_default_model();
    let source = common::Server::start_model(&path, "", &[]).await;
    let target = common::Server::start_model(&path, "", &[]).await;
    let text = "The lighthouse keeper climbed the stairs every evening to light the lamp. "
        .repeat(12)
        + "One night the lamp would not light, so the keeper";
    let expected = greedy(&model, &text, 48);
    let body = serde_json::json!({"prompt": text, "max_tokens": 48, "temperature": 0,
        "stream": true, "pie_stream_ids": true});
    let r = source
        .client
        .post(source.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let (first, r) = common::read_stream(r, Some(16)).await;
    let prompt = model.tokenizer.encode(&text).unwrap();
    let mut so_far = prompt.clone();
    so_far.extend(first.ids());
    let (status, v) = target
        .post(
            "/v1/internal/kv/prefetch",
            serde_json::json!({"from": source.url, "tokens": so_far}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let id = first.process.clone().unwrap();
    let (status, _) = source
        .post(
            &format!("/v1/internal/processes/{id}/handoff"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(status, 200);
    let (rest_on_source, _) = common::read_stream(r, None).await;
    assert!(rest_on_source.handed_off);
    let generated: Vec<(u32, String)> = first
        .tokens
        .iter()
        .chain(&rest_on_source.tokens)
        .cloned()
        .collect();
    let mut resumed = body.clone();
    resumed["pie_resume"] = serde_json::json!({
        "tokens": generated.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        "from": source.url
    });
    let r = target
        .client
        .post(target.url("/v1/completions"))
        .json(&resumed)
        .send()
        .await
        .unwrap();
    let (rest, _) = common::read_stream(r, None).await;
    let sent: String = generated.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(sent + &rest.text(), expected);
    assert!(
        target
            .metric("pie_kv_transfer_pages_total{direction=\"in\"}")
            .await
            >= 10.0
    );
    assert_eq!(target.metric("pie_kv_transfer_fallbacks_total").await, 0.0);
}

/// `persist-prefix` on the default model: a 1,000-token system prompt
/// persisted by one worker process comes back after `kill -9` as
/// `cached_tokens` (at least 90% of it) with the in-process engine's greedy
/// output.
#[tokio::test]
async fn a_persisted_system_prompt_survives_kill_9_on_the_default_model() {
    let Some(model) = default_model() else {
        return;
    };
    let path = fetch::cached_default_model();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("persist-default-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = format!("[runtime.persist]\ndir = {:?}\n", dir.display().to_string());
    let system =
        "You are the archivist of a seaside library. Answer briefly and kindly. ".repeat(70);
    let text = system.clone() + "Question: what is the capital of France? Answer:";
    let prompt_tokens = model.tokenizer.encode(&text).unwrap().len();
    assert!(prompt_tokens >= 1000, "{prompt_tokens} tokens");
    let expected = greedy(&model, &text, 16);
    let body = |persist: bool| {
        serde_json::json!({"prompt": text, "max_tokens": 16, "temperature": 0,
            "props": {"persist": persist}})
    };
    let mut first = common::Server::start_model(&path, &config, &[]).await;
    let (status, v) = first.post("/v1/completions", body(true)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], expected);
    let pages = (prompt_tokens / 16) as f64;
    first
        .eventually("the prompt's pages persisted", async || {
            first
                .metric("pie_kv_persist_pages_total{event=\"written\"}")
                .await
                >= pages
        })
        .await;
    first.kill();
    let second = common::Server::start_model(&path, &config, &[]).await;
    let (status, v) = second.post("/v1/completions", body(false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], expected, "identical greedy output");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached as f64 >= 0.9 * prompt_tokens as f64,
        "cached_tokens {cached} of {prompt_tokens}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// `replicate`'s data path on the default model: worker B pulls the pages of
/// a system prompt worker A computed (`POST /v1/internal/kv/prefetch`, as the
/// controller's copy asks), computes nothing of it, and answers a question
/// after it with the in-process engine's greedy output.
#[tokio::test]
async fn a_prefix_copied_to_another_worker_on_the_default_model_answers_as_one_engine() {
    let Some(model) = default_model() else {
        return;
    };
    let path = fetch::cached_default_model();
    let system = "You keep the harbour's ledger of ships, cargo and tides. ".repeat(30);
    let text = system.clone() + "Question: what is the capital of France? Answer:";
    let expected = greedy(&model, &text, 16);
    let source = common::Server::start_model(&path, "", &[]).await;
    let target = common::Server::start_model(&path, "", &[]).await;
    let (status, v) = source
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": system, "max_tokens": 1, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let tokens = model.tokenizer.encode(&system).unwrap();
    let (status, v) = target
        .post(
            "/v1/internal/kv/prefetch",
            serde_json::json!({"from": source.url(""), "tokens": tokens}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let pages = v["pages"].as_u64().unwrap();
    assert_eq!(pages, (tokens.len() / 16) as u64, "{v}");
    let (status, v) = target
        .post(
            "/v1/completions",
            serde_json::json!({"prompt": text, "max_tokens": 16, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], expected.as_str());
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= pages * 16,
        "cached_tokens {cached}, {pages} pages copied"
    );
    assert_eq!(target.metric("pie_kv_transfer_fallbacks_total").await, 0.0);
}

/// `retain-all`'s worker side on the default model: with 24 pages of 16
/// tokens, a session's first turn is retained (keep-session), two long
/// requests then need the pages, so the session is spilled to the disk tier
/// instead of dropped; its second turn loads turn one's pages back (all but
/// the last as `cached_tokens`) and answers with the in-process engine's
/// greedy output.
#[tokio::test]
async fn a_session_spilled_under_pressure_comes_back_on_the_default_model() {
    let Some(model) = default_model() else {
        return;
    };
    let path = fetch::cached_default_model();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("spill-default-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = format!(
        "[runtime]\nworker_policy = [\"fcfs\", \"keep-session\"]\nkv_pages = 24\npage_size = 16\n\
         [runtime.persist]\ndir = {:?}\n",
        dir.display().to_string()
    );
    let s = common::Server::start_model(&path, &config, &[]).await;
    let (status, v) = s
        .post("/v1/internal/retain", serde_json::json!({"spill": "disk"}))
        .await;
    assert_eq!(
        (status, &v["keep_session"]),
        (200, &serde_json::json!(true)),
        "{v}"
    );
    let turn1 = "The lighthouse keeper writes down every ship that passes the cape. ".repeat(10);
    let turn1_tokens = model.tokenizer.encode(&turn1).unwrap().len();
    let session = serde_json::json!({"session": "keeper", "keep-ms": 60_000});
    let complete = |prompt: &str, props: &serde_json::Value| serde_json::json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "props": props});
    let (status, v) = s.post("/v1/completions", complete(&turn1, &session)).await;
    assert_eq!(status, 200, "{v}");
    for topic in ["orchard", "quarry"] {
        let filler = format!("A long note about the {topic} and its seasons. ").repeat(25);
        let (status, v) = s
            .post("/v1/completions", complete(&filler, &serde_json::json!({})))
            .await;
        assert_eq!(status, 200, "{v}");
    }
    let full_pages = (turn1_tokens / 16) as f64;
    s.eventually("turn one spilled to disk", async || {
        s.metric("pie_kv_persist_pages_total{event=\"spilled\"}")
            .await
            >= full_pages
    })
    .await;
    let turn2 = turn1.clone() + "Question: what is the capital of France? Answer:";
    let (status, v) = s.post("/v1/completions", complete(&turn2, &session)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], greedy(&model, &turn2, 8));
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Its last page may end in a token the question's text merges with.
    let comparable = (turn1_tokens / 16 - 1) * 16;
    assert!(
        cached as usize >= comparable,
        "cached_tokens {cached} of turn one's {turn1_tokens}"
    );
    assert!(
        s.metric("pie_kv_persist_pages_total{event=\"loaded\"}")
            .await
            >= 1.0
    );
    std::fs::remove_dir_all(dir).unwrap();
}
