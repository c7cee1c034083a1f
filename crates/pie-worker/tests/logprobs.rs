//! OpenAI `logprobs` (completions: a number of alternatives; chat:
//! `logprobs` and `top_logprobs`): each sampled token's log-probability and
//! its most likely alternatives', whole and streamed.

mod common;

use common::Server;
use serde_json::{json, Value};

#[tokio::test]
async fn completions_report_each_tokens_logprob_and_alternatives() {
    let s = Server::start("", &[]).await;
    let body = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
        "ignore_eos": true, "logprobs": 3});
    let (status, r) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    let lp = &choice["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 8);
    let text_len = choice["text"].as_str().unwrap().len() as u64;
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    assert!(offsets.iter().all(|&o| o <= text_len));
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3);
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        // Alternatives that spell alike share a key: the map may hold fewer.
        assert!(
            chosen >= best - 1e-4,
            "greedy takes the most likely: {chosen} vs {best}"
        );
    }
}

/// On the real default model a completion's tokens spell its text.
#[tokio::test]
async fn on_the_default_model_the_tokens_spell_the_text() {
    let Some(model) = common::cached_default_model() else {
        return;
    };
    let s = Server::start_model(&model, "", &[]).await;
    let body = json!({"prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0, "logprobs": 2});
    let (status, r) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    let tokens = choice["logprobs"]["tokens"].as_array().unwrap();
    let spelled: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(spelled, choice["text"].as_str().unwrap());
    assert!(spelled.contains("Paris"), "{spelled}");
}

#[tokio::test]
async fn chat_streams_logprobs_with_each_token() {
    let s = Server::start("", &[]).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2, "stream": true});
    let chunks = s.stream_chunks("/v1/chat/completions", body).await;
    let mut entries = Vec::new();
    let mut text = String::new();
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        text += choice["delta"]["content"].as_str().unwrap_or("");
        if let Some(content) = choice["logprobs"]["content"].as_array() {
            entries.extend(content.iter().cloned());
        }
    }
    assert_eq!(entries.len(), 6, "one entry a token");
    let mut bytes = Vec::new();
    for e in &entries {
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2);
        bytes.extend(
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    // The text holds back a character the last tokens have not finished.
    let spelled = String::from_utf8_lossy(&bytes);
    assert!(
        spelled.starts_with(&text),
        "the tokens' bytes {spelled:?} spell {text:?}"
    );
}

#[tokio::test]
async fn logprobs_requests_are_checked() {
    let s = Server::start("", &[]).await;
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 2})),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 2, "logprobs": 99}),
            "logprobs",
        ),
    ] {
        let (status, r) = s.post(path, body).await;
        assert_eq!(
            (status, r["error"]["param"].as_str()),
            (400, Some(param)),
            "{r}"
        );
    }
    let (status, r) = s
        .post("/v1/chat/completions", chat(json!({"logprobs": false})))
        .await;
    assert_eq!(status, 200);
    assert!(r["choices"][0]["logprobs"].is_null());
}
