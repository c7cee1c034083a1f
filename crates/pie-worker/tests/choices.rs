//! `n` choices of one OpenAI request: one process each over the one prompt,
//! whose pages are computed once (the others find them in the prefix cache)
//! and whose decodes share the engine's steps; returned as `choices[i]`,
//! streamed with their `index`.

mod common;

use common::Server;
use serde_json::json;

/// A prompt of several full pages (the tiny model: one token a byte).
const PROMPT: &str = "In the quiet harbour town the lighthouse keeper kept a log of every ship.";

#[tokio::test]
async fn four_choices_prefill_the_prompt_once_and_come_back_indexed() {
    let s = Server::start("[runtime]\nmax_running = 16\n", &[]).await;
    let before = s.metric("pie_prompt_tokens_total").await;
    let body = json!({"model": null, "prompt": PROMPT, "max_tokens": 12, "n": 4,
        "temperature": 1.0, "seed": 5, "ignore_eos": true});
    let (status, r) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{r}");
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
    }
    let texts: Vec<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert!(
        texts.iter().any(|t| *t != texts[0]),
        "seeds differ per choice: {texts:?}"
    );
    assert_eq!(r["usage"]["completion_tokens"], 48);
    let prompt = r["usage"]["prompt_tokens"].as_f64().unwrap();
    let computed = s.metric("pie_prompt_tokens_total").await - before;
    // The first computes the prompt; each other at most its last partial page.
    assert!(
        computed <= prompt + 3.0 * 16.0,
        "{computed} prompt tokens computed for {prompt}"
    );

    let (_, again) = s.post("/v1/completions", body).await;
    assert_eq!(
        again["choices"], r["choices"],
        "the same seed, the same choices"
    );

    let chat = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
        "n": 3, "stream": true, "stream_options": {"include_usage": true}, "temperature": 0});
    let chunks = s.stream_chunks("/v1/chat/completions", chat).await;
    let mut texts = vec![String::new(); 3];
    let mut finished = 0;
    for c in &chunks {
        for choice in c["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            texts[i] += choice["delta"]["content"].as_str().unwrap_or("");
            finished += usize::from(choice["finish_reason"].is_string());
        }
    }
    assert_eq!(finished, 3);
    assert!(
        texts.iter().all(|t| t == &texts[0]),
        "greedy choices agree: {texts:?}"
    );
    let usage = chunks
        .iter()
        .find(|c| c["usage"].is_object())
        .expect("a usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 24);
}

#[tokio::test]
async fn choices_are_bounded() {
    let s = Server::start("", &[]).await;
    for n in [0, 17] {
        let (status, r) = s
            .post("/v1/completions", json!({"prompt": "hi", "n": n}))
            .await;
        assert_eq!(status, 400, "{r}");
        assert_eq!(r["error"]["param"], "n");
    }
}

/// `best_of` 4, `n` 2: the two candidates with the highest log-probability
/// per token, of the four that seeds 5 to 8 draw, in that order; every
/// candidate's tokens are in `usage`; streaming above `n` is a 400.
#[tokio::test]
async fn best_of_returns_the_likeliest_per_token_of_its_candidates() {
    let s = Server::start("[runtime]\nmax_running = 16\n", &[]).await;
    let base = json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5});
    let mut body = base.clone();
    body["n"] = json!(4);
    body["logprobs"] = json!(0);
    let (status, all) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{all}");
    let mean = |c: &serde_json::Value| {
        let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
        lps.iter().map(|l| l.as_f64().unwrap()).sum::<f64>() / lps.len() as f64
    };
    let mut candidates: Vec<(f64, String)> = (all["choices"].as_array().unwrap().iter())
        .map(|c| (mean(c), c["text"].as_str().unwrap().to_string()))
        .collect();
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut body = base.clone();
    body["n"] = json!(2);
    body["best_of"] = json!(4);
    let (status, best) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{best}");
    let texts: Vec<&str> = (best["choices"].as_array().unwrap().iter())
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, [&candidates[0].1, &candidates[1].1]);
    assert!(best["choices"][0]["logprobs"].is_null(), "not asked for");
    assert_eq!(
        best["usage"]["completion_tokens"],
        all["usage"]["completion_tokens"]
    );
    let mut body = base.clone();
    body["best_of"] = json!(3);
    body["stream"] = json!(true);
    let (status, r) = s.post("/v1/completions", body).await;
    assert_eq!(
        (status, r["error"]["param"].clone()),
        (400, json!("best_of")),
        "{r}"
    );
}

/// `echo` puts the prompt before the completion, whole and as a stream's
/// first chunk; with `logprobs` it is a 400 naming it.
#[tokio::test]
async fn echo_puts_the_prompt_first() {
    let s = Server::start("", &[]).await;
    let body = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0});
    let (_, plain) = s.post("/v1/completions", body.clone()).await;
    let mut echoed = body.clone();
    echoed["echo"] = json!(true);
    let (status, r) = s.post("/v1/completions", echoed.clone()).await;
    assert_eq!(status, 200, "{r}");
    let completion = plain["choices"][0]["text"].as_str().unwrap();
    assert_eq!(r["choices"][0]["text"], format!("{PROMPT}{completion}"));
    echoed["stream"] = json!(true);
    let chunks = s.stream_chunks("/v1/completions", echoed.clone()).await;
    assert_eq!(chunks[0]["choices"][0]["text"], PROMPT);
    let streamed: String = (chunks.iter())
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, format!("{PROMPT}{completion}"));
    echoed["stream"] = json!(false);
    echoed["logprobs"] = json!(1);
    let (status, r) = s.post("/v1/completions", echoed).await;
    assert_eq!(
        (status, r["error"]["param"].clone()),
        (400, json!("echo")),
        "{r}"
    );
}
