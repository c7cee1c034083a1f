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
