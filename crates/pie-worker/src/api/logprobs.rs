//! Token log-probabilities in OpenAI's two shapes: chat's
//! `logprobs.content` (one entry a token: `token`, `logprob`, `bytes`,
//! `top_logprobs`) and completions' parallel lists (`tokens`,
//! `token_logprobs`, `top_logprobs` as token-to-logprob maps,
//! `text_offset`). A leaf of the OpenAI routes.

use std::sync::Arc;

use pie_model::{TokenLogprobs, Tokenizer};
use serde_json::{json, Map, Value};

/// One sampled token and what the engine reported with it.
pub struct Scored {
    pub token: u32,
    pub logprobs: Arc<TokenLogprobs>,
    /// Where its text starts in the choice's text (completions).
    pub offset: usize,
}

/// The bytes a token stands for, and its text (lossy where a character
/// spans tokens, as OpenAI's `token` is).
fn token_text(tokenizer: &Tokenizer, id: u32) -> (Vec<u8>, String) {
    let bytes = tokenizer.token_bytes(id).unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    (bytes, text)
}

/// Chat's `logprobs` object for these tokens.
pub fn chat(tokenizer: &Tokenizer, scored: &[Scored]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (bytes, text) = token_text(tokenizer, id);
        json!({"token": text, "logprob": logprob, "bytes": bytes})
    };
    let content: Vec<Value> = scored
        .iter()
        .map(|s| {
            let mut e = entry(s.token, s.logprobs.logprob);
            let top: Vec<Value> = s.logprobs.top.iter().map(|&(t, lp)| entry(t, lp)).collect();
            e["top_logprobs"] = json!(top);
            e
        })
        .collect();
    json!({ "content": content })
}

/// Completions' `logprobs` object for these tokens.
pub fn completion(tokenizer: &Tokenizer, scored: &[Scored]) -> Value {
    let text = |id: u32| token_text(tokenizer, id).1;
    let top = |s: &Scored| {
        let map: Map<String, Value> = s
            .logprobs
            .top
            .iter()
            .map(|&(t, lp)| (text(t), json!(lp)))
            .collect();
        Value::Object(map)
    };
    json!({
        "tokens": scored.iter().map(|s| text(s.token)).collect::<Vec<_>>(),
        "token_logprobs": scored.iter().map(|s| s.logprobs.logprob).collect::<Vec<_>>(),
        "top_logprobs": scored.iter().map(top).collect::<Vec<_>>(),
        "text_offset": scored.iter().map(|s| s.offset).collect::<Vec<_>>(),
    })
}
