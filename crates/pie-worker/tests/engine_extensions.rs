//! The OpenAI extensions of vLLM's and SGLang's servers that Pie serves
//! (`pie_core::openai_fields`): `stop_token_ids`, `min_tokens`,
//! `no_stop_trim` / `include_stop_str_in_output`, `skip_special_tokens`, and
//! on chat `continue_final_message` / `add_generation_prompt`; each checked
//! against a plain greedy run of the tiny model.

mod common;

use common::{read_stream, Server, Streamed};
use serde_json::{json, Value};

const PROMPT: &str = "The engine extensions";

/// A greedy completion of `PROMPT` with `extra` fields, streamed with each
/// token's id.
async fn greedy(s: &Server, extra: Value) -> Streamed {
    let mut body = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": true, "stream": true, "pie_stream_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    read_stream(s.stream(body).await, None).await.0
}

/// The first position from `from` whose token differs from every earlier
/// one (so stopping at it cuts the output exactly there).
fn first_new_token(ids: &[u32], from: usize) -> usize {
    (from..ids.len())
        .find(|&i| !ids[..i].contains(&ids[i]))
        .expect("a token not seen before")
}

#[tokio::test]
async fn stop_token_ids_end_the_output_before_that_token() {
    let s = Server::start("", &[]).await;
    let base = greedy(&s, json!({})).await;
    let at = first_new_token(&base.ids(), 1);
    let stop = base.ids()[at];
    let cut = greedy(&s, json!({"stop_token_ids": [stop]})).await;
    assert_eq!(cut.ids(), base.ids()[..at], "stops before token {stop}");
    let (status, body) = s
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "stop_token_ids": [stop]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let (status, body) = s
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "stop_token_ids": [1_000_000]}),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "stop_token_ids", "{body}");
}

#[tokio::test]
async fn min_tokens_holds_stop_tokens_off_until_reached() {
    let s = Server::start("", &[]).await;
    let base = greedy(&s, json!({})).await;
    let stop = base.ids()[0];
    let early = greedy(&s, json!({"stop_token_ids": [stop]})).await;
    assert!(early.ids().is_empty(), "the first token stops it");
    let held = greedy(&s, json!({"stop_token_ids": [stop], "min_tokens": 3})).await;
    assert!(held.ids().len() >= 3, "{:?}", held.ids());
    assert!(
        !held.ids()[..3].contains(&stop),
        "masked before 3: {:?}",
        held.ids()
    );
    let (status, body) = s
        .post(
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3}),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "min_tokens", "{body}");
}

#[tokio::test]
async fn a_kept_stop_string_ends_the_text_and_a_trimmed_one_does_not() {
    let s = Server::start("", &[]).await;
    let base = greedy(&s, json!({})).await;
    let text = base.text();
    let at = text.char_indices().nth(3).map(|(i, _)| i).expect("4 chars");
    let stop = text[at..].chars().next().unwrap().to_string();
    let before = &text[..text.find(&stop).unwrap()];
    for (field, keep) in [
        ("no_stop_trim", false),
        ("no_stop_trim", true),
        ("include_stop_str_in_output", true),
    ] {
        let got = greedy(&s, json!({"stop": [stop], field: keep})).await;
        let want = match keep {
            true => format!("{before}{stop}"),
            false => before.to_string(),
        };
        assert_eq!(got.text(), want, "{field}: {keep}");
    }
}

#[tokio::test]
async fn special_tokens_are_text_only_when_not_skipped() {
    let s = Server::start("", &[]).await;
    // `<|im_start|>` (the tiny model's token 257) made certain by a bias.
    let forced = json!({"logit_bias": {"257": 100}, "max_tokens": 2});
    let skipped = greedy(&s, forced.clone()).await;
    assert_eq!(skipped.ids(), [257, 257]);
    assert_eq!(skipped.text(), "");
    let mut kept = forced;
    kept["skip_special_tokens"] = json!(false);
    assert_eq!(greedy(&s, kept).await.text(), "<|im_start|><|im_start|>");
}

#[tokio::test]
async fn a_chat_continues_its_final_assistant_message() {
    let s = Server::start("", &[]).await;
    let chat = |extra: Value| {
        let mut body = json!({"messages": [
            {"role": "user", "content": "Name a city."},
            {"role": "assistant", "content": "The city is"}],
            "max_tokens": 1, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let prompt_tokens = async |extra: Value| {
        let (status, body) = s.post("/v1/chat/completions", chat(extra)).await;
        assert_eq!(status, 200, "{body}");
        body["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let new_turn = prompt_tokens(json!({})).await;
    let last = prompt_tokens(json!({"add_generation_prompt": false})).await;
    let continued = prompt_tokens(json!({"continue_final_message": true,
        "add_generation_prompt": false}))
    .await;
    // "<|im_end|>\n" (2 tokens) after the message; then "<|im_start|>assistant\n".
    assert_eq!(last, continued + 2);
    assert!(new_turn > last, "{new_turn} > {last}");
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            chat(json!({"continue_final_message": true, "add_generation_prompt": true})),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "continue_final_message");
}
