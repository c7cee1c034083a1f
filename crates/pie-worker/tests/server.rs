//! `pie serve` over real HTTP on the synthesized test model.

mod common;

use common::Server;
use pie_testkit::sse_data;
use serde_json::{json, Value};

const LONG: usize = 100_000;

#[tokio::test]
async fn completion_reports_usage_and_obeys_max_tokens() {
    let s = Server::start("", &[]).await;
    let (status, body) = s
        .post(
            "/v1/completions",
            json!({"prompt": "hello there", "max_tokens": 5, "ignore_eos": true, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    // Byte-level test vocabulary with a BOS-free prompt: one token per byte.
    assert_eq!(body["usage"]["prompt_tokens"], 11);
    assert_eq!(body["usage"]["total_tokens"], 16);
    // The same prompt again is answered from the prefix cache (page_size 16 > 11, so
    // use a longer prompt to fill a page).
    let long = "a".repeat(40);
    s.post("/v1/completions", json!({"prompt": long, "max_tokens": 2}))
        .await;
    let (_, again) = s
        .post("/v1/completions", json!({"prompt": long, "max_tokens": 2}))
        .await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    let (_, models) = s.get("/v1/models").await;
    assert!(
        models["data"][0]["id"]
            .as_str()
            .unwrap()
            .starts_with("test-model-"),
        "{models}"
    );
}

#[tokio::test]
async fn greedy_is_deterministic_and_seeded_sampling_reproducible() {
    let s = Server::start("", &[]).await;
    let req = |extra: Value| {
        let mut b = json!({"prompt": "abc", "max_tokens": 12, "ignore_eos": true});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let text = |b: &Value| b["choices"][0]["text"].as_str().unwrap().to_string();
    let (_, a) = s
        .post("/v1/completions", req(json!({"temperature": 0})))
        .await;
    let (_, b) = s
        .post("/v1/completions", req(json!({"temperature": 0})))
        .await;
    assert_eq!(text(&a), text(&b));
    let (_, c) = s
        .post(
            "/v1/completions",
            req(json!({"temperature": 1.0, "seed": 5})),
        )
        .await;
    let (_, d) = s
        .post(
            "/v1/completions",
            req(json!({"temperature": 1.0, "seed": 5})),
        )
        .await;
    assert_eq!(text(&c), text(&d));
}

#[tokio::test]
async fn chat_applies_the_template() {
    let s = Server::start("", &[]).await;
    let (status, body) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": true})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    // ChatML with the template's default system prompt: every byte is a token, and
    // each of the five special tokens is one.
    let text = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    let specials = ["<|im_start|>", "<|im_end|>"];
    let plain = specials
        .iter()
        .fold(text.to_string(), |t, sp| t.replace(sp, ""));
    assert_eq!(body["usage"]["prompt_tokens"], plain.len() + 5);
}

#[tokio::test]
async fn streaming_sends_chunks_before_the_end() {
    let s = Server::start("", &[]).await;
    let mut resp = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "stream me", "max_tokens": 600, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let first = resp.chunk().await.unwrap().unwrap();
    let first: Value = serde_json::from_str(
        String::from_utf8_lossy(&first)
            .trim()
            .strip_prefix("data: ")
            .unwrap(),
    )
    .unwrap();
    let id = first["id"]
        .as_str()
        .unwrap()
        .strip_prefix("cmpl-")
        .unwrap()
        .to_string();
    let (_, p) = s.get(&format!("/v1/processes/{id}")).await;
    assert_eq!(
        p["state"], "running",
        "a chunk arrived while the process was still running"
    );
    let rest = sse_data(resp).await;
    assert_eq!(rest.last().unwrap(), "[DONE]");
    let usage: Value = serde_json::from_str(&rest[rest.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 600);
    let finish: Value = serde_json::from_str(&rest[rest.len() - 3]).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn native_launch_events_patch_and_kill() {
    let s = Server::start("", &[]).await;
    let (status, body) = s.post("/v1/processes", json!({"inferlet": "text-completion", "args": {"prompt": "go", "max_tokens": LONG, "ignore_eos": true}, "props": {"priority": 1, "tag": "x"}})).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    let path = format!("/v1/processes/{id}");
    // Text, not just tokens: the random test model's first bytes may not form
    // UTF-8 yet, and the events below must replay some text before the end.
    s.eventually("first output text", async || {
        s.get(&path).await.1["output"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    })
    .await;
    assert!(s.metric("pie_kv_pages_used").await > 0.0);

    let (status, patched) = s
        .client
        .patch(s.url(&path))
        .json(&json!({"props": {"priority": 7, "tag": null}}))
        .send()
        .await
        .map(|r| (r.status().as_u16(), r))
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        patched.json::<Value>().await.unwrap()["props"],
        json!({"priority": 7})
    );
    let bad = s
        .client
        .patch(s.url(&path))
        .json(&json!({"props": {"priority": "urgent"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert!(bad.json::<Value>().await.unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("priority"));
    assert_eq!(
        s.get(&path).await.1["props"]["priority"],
        7,
        "a refused patch changes nothing"
    );

    let (_, list) = s.get("/v1/processes?state=running").await;
    assert!(list["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["id"] == id));

    let events = s
        .client
        .get(s.url(&format!("{path}/events")))
        .send()
        .await
        .unwrap();
    let killed = s
        .client
        .delete(s.url(&path))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(killed["killed"], true);
    let data = sse_data(events).await;
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(last["state"], "killed");
    assert!(data.len() >= 2, "text before the final status");
    s.eventually("pages released", async || {
        s.metric("pie_kv_pages_used").await == 0.0
    })
    .await;
    assert_eq!(s.get(&path).await.1["state"], "killed");
}

#[tokio::test]
async fn native_chat_resumes_its_session() {
    let s = Server::start("", &[]).await;
    let turn = |content: &str| json!({"inferlet": "chat", "args": {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": true}, "props": {"session": "conv-1"}});
    let finished = async |id: &str| {
        let path = format!("/v1/processes/{id}");
        s.eventually("turn finished", async || {
            s.get(&path).await.1["state"] == "finished"
        })
        .await;
        s.get(&path).await.1
    };
    let (_, a) = s.post("/v1/processes", turn("first question")).await;
    let first = finished(a["id"].as_str().unwrap()).await;
    let (_, b) = s.post("/v1/processes", turn("second")).await;
    let second = finished(b["id"].as_str().unwrap()).await;
    assert_eq!(second["props"]["turn"], 2);
    // The second prompt holds the whole first turn, so it is longer than the first
    // prompt plus its answer, and its start came from the prefix cache.
    let (p1, p2) = (
        first["usage"]["prompt_tokens"].as_u64().unwrap(),
        second["usage"]["prompt_tokens"].as_u64().unwrap(),
    );
    assert!(p2 > p1 + 4, "{p1} then {p2}");
    assert!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 16
    );
}

async fn error_of(resp: reqwest::Response) -> (u16, String) {
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap();
    (
        status,
        body["error"]["message"].as_str().unwrap().to_string(),
    )
}

#[tokio::test]
async fn bad_requests_get_json_errors_that_name_the_problem() {
    let s = Server::start(
        "[server]\nmax_body_bytes = 4096\n",
        &["--kv-pages", "8", "--page-size", "16"],
    )
    .await;
    let post = |path: &'static str, body: Value| s.client.post(s.url(path)).json(&body).send();
    let (status, msg) = error_of(
        post(
            "/v1/completions",
            json!({"prompt": "x", "props": {"weight": "heavy"}}),
        )
        .await
        .unwrap(),
    )
    .await;
    assert_eq!((status, msg.contains("weight")), (400, true), "{msg}");
    let (status, msg) = error_of(
        post("/v1/completions", json!({"prompt": "x".repeat(200)}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        msg.contains("200") && msg.contains("128"),
        "sizes named: {msg}"
    );
    let (status, msg) = error_of(
        post("/v1/completions", json!({"prompt": "x", "n": 17}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, msg.contains("n must be 1 to 16")),
        (400, true),
        "{msg}"
    );
    for (body, field) in [
        (
            json!({"prompt": "x", "logit_bias": {"99999999": 1}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "x", "logit_bias": {"one": 1}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "x", "frequency_penalty": 3}),
            "frequency_penalty",
        ),
        (json!({"prompt": "x", "min_p": 1.5}), "min_p"),
    ] {
        let (status, msg) = error_of(post("/v1/completions", body).await.unwrap()).await;
        assert_eq!((status, msg.contains(field)), (400, true), "{msg}");
    }
    // A native process's args: an unknown key is refused by name.
    let launch = json!({"inferlet": "text-completion", "args": {"prompt": "x", "temprature": 0.5}});
    let r = post("/v1/processes", launch).await.unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "args.temprature", "{body}");
    let (status, msg) = error_of(
        post("/v1/completions", json!({"prompt": "x", "temperature": 9}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, msg.contains("temperature")), (400, true), "{msg}");
    let (status, msg) = error_of(
        post("/v1/completions", json!({"max_tokens": 1}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, msg.contains("prompt")), (422, true), "{msg}");
    let (status, msg) = error_of(
        post("/v1/completions", json!({"prompt": "x", "no_prompt": 1}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, msg.contains("no_prompt")), (400, true), "{msg}");
    let (status, msg) = error_of(
        post("/v1/processes", json!({"inferlet": "nope"}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, msg.contains("nope")), (400, true), "{msg}");
    let (status, msg) = error_of(
        post("/v1/completions", json!({"prompt": "x".repeat(10_000)}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, msg.contains("max_body_bytes")),
        (413, true),
        "{msg}"
    );
    let (status, msg) = error_of(
        s.client
            .get(s.url("/v1/processes/proc-999"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, msg.contains("proc-999")), (404, true), "{msg}");
    let (status, msg) = error_of(
        post("/v1/completions", json!({"prompt": "x", "model": "gpt-9"}))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, msg.contains("gpt-9")), (404, true), "{msg}");
}

#[tokio::test]
async fn api_keys_guard_every_route_but_health() {
    let cfg = "[server]\napi_keys = [{ name = \"alice\", key = \"sk-a\" }]\n";
    let s = Server::start(cfg, &[]).await;
    assert_eq!(
        s.client
            .get(s.url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let (status, msg) = error_of(s.client.get(s.url("/v1/models")).send().await.unwrap()).await;
    assert_eq!((status, msg.contains("missing")), (401, true));
    let (status, msg) = error_of(
        s.client
            .get(s.url("/metrics"))
            .bearer_auth("sk-wrong")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, msg.contains("invalid")), (401, true));
    let r = s.client.post(s.url("/v1/processes")).bearer_auth("sk-a").json(&json!({"inferlet": "text-completion", "args": {"prompt": "hi", "max_tokens": 1}, "props": {"client": "bob"}})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let p: Value = s
        .client
        .get(s.url(&format!("/v1/processes/{id}")))
        .bearer_auth("sk-a")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        p["client"], "alice",
        "the key's name wins over the client prop"
    );
}

#[tokio::test]
async fn overload_answers_429_with_retry_after() {
    let s = Server::start("", &["--max-running", "1", "--max-queued", "1"]).await;
    let long = json!({"inferlet": "text-completion", "args": {"prompt": "busy", "max_tokens": LONG, "ignore_eos": true}});
    let (status, _) = s.post("/v1/processes", long.clone()).await;
    assert_eq!(status, 201);
    s.eventually("first process running", async || {
        s.get("/v1/processes?state=running").await.1["data"]
            .as_array()
            .unwrap()
            .len()
            == 1
    })
    .await;
    let (status, _) = s.post("/v1/processes", long.clone()).await;
    assert_eq!(status, 201, "one may queue");
    let r = s
        .client
        .post(s.url("/v1/processes"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["retry-after"], "1");
    let (status, msg) = error_of(r).await;
    assert_eq!((status, msg.contains("queued")), (429, true), "{msg}");
    assert_eq!(s.metric("pie_queue_depth").await, 1.0);
    assert_eq!(
        s.metric("pie_requests_total").await,
        1.0,
        "the rejection is counted"
    );
}

#[tokio::test]
async fn disconnect_mid_stream_kills_the_process_and_frees_pages() {
    let s = Server::start("", &[]).await;
    // The pool's gauges are published by the engine loop, which may not have
    // run yet when /health first answers (seen under load).
    s.eventually("the pool's gauges", async || {
        s.metric("pie_kv_pages_free").await > 0.0
    })
    .await;
    let baseline = s.metric("pie_kv_pages_free").await;
    let mut resp = s.client.post(s.url("/v1/completions")).json(&json!({"prompt": "x".repeat(50), "max_tokens": LONG, "ignore_eos": true, "stream": true})).send().await.unwrap();
    resp.chunk().await.unwrap().unwrap();
    // The gauge follows the engine's next iteration, not the first chunk.
    s.eventually("pages in use", async || {
        s.metric("pie_kv_pages_used").await > 0.0
    })
    .await;
    drop(resp);
    s.eventually("process killed", async || {
        s.get("/v1/processes?state=killed").await.1["data"]
            .as_array()
            .unwrap()
            .len()
            == 1
    })
    .await;
    s.eventually("pages released", async || {
        s.metric("pie_kv_pages_used").await == 0.0
    })
    .await;
    // Full pages stay cached for reuse; together with free pages they are the whole pool.
    let total = s.metric("pie_kv_pages_free").await + s.metric("pie_kv_pages_cached").await;
    assert_eq!(total, baseline);
}

#[tokio::test]
async fn concurrent_streams_all_complete_and_metrics_stay_consistent() {
    let s = Server::start("", &[]).await;
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (client, url) = (s.client.clone(), s.url("/v1/chat/completions"));
            tokio::spawn(async move {
                let body = json!({"messages": [{"role": "user", "content": format!("request {i}")}], "max_tokens": 20, "ignore_eos": true, "stream": true});
                let data = sse_data(client.post(url).json(&body).send().await.unwrap()).await;
                assert_eq!(data.last().unwrap(), "[DONE]");
                data.len()
            })
        })
        .collect();
    for t in tasks {
        // Role chunk + up to 20 content chunks + finish chunk + [DONE].
        assert!(t.await.unwrap() >= 3);
    }
    let text = s.metrics_text().await;
    for (name, value) in pie_client::prom::samples(&text) {
        assert!(value >= 0.0, "negative metric: {name} {value}");
    }
    assert_eq!(pie_testkit::metric_value(&text, "pie_requests_total"), 32.0);
    assert_eq!(
        pie_testkit::metric_value(&text, "pie_generated_tokens_total"),
        640.0
    );
    assert_eq!(pie_testkit::metric_value(&text, "pie_kv_pages_used"), 0.0);
    assert_eq!(
        pie_testkit::metric_value(&text, "pie_running_processes"),
        0.0
    );
    assert_eq!(
        pie_testkit::metric_value(&text, "pie_time_to_first_token_seconds_count"),
        32.0
    );
}

#[tokio::test]
async fn trace_file_records_lengths_block_ids_and_props_but_no_tokens() {
    let path = std::env::temp_dir().join(format!("pie-trace-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let s = Server::start(
        &format!("[server]\ntrace_file = {:?}\n", path.to_str().unwrap()),
        &[],
    )
    .await;
    // Byte vocabulary: 600 characters are 600 tokens; the two prompts share
    // their first 520, so their first 512-token block.
    let shared = "x".repeat(520);
    for tail in ["a", "b"] {
        let (status, body) = s
            .post(
                "/v1/completions",
                json!({"prompt": format!("{shared}{}", tail.repeat(80)), "max_tokens": 3,
                       "ignore_eos": true, "props": {"priority": 2}}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    for l in &lines {
        // serde_json keeps insertion order (llguidance needs `preserve_order`).
        let mut keys: Vec<&str> = l.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "hash_ids",
                "input_length",
                "output_length",
                "props",
                "timestamp"
            ],
            "lengths, block ids and props only: {l}"
        );
        assert_eq!(l["input_length"], 600);
        assert_eq!(l["output_length"], 3);
        assert_eq!(l["props"]["priority"], 2);
        assert_eq!(
            l["hash_ids"].as_array().unwrap().len(),
            2,
            "512 + 88 tokens"
        );
    }
    assert_eq!(
        lines[0]["hash_ids"][0], lines[1]["hash_ids"][0],
        "shared block"
    );
    assert_ne!(lines[0]["hash_ids"][1], lines[1]["hash_ids"][1]);
    let records = pie_workload::trace::read_trace(text.as_bytes()).expect("replayable");
    assert_eq!(records[1].input_length, 600);
    let _ = std::fs::remove_file(&path);
}

/// Qwen 2, Qwen 3 (heads wider than hidden / heads) and Phi-3 files serve
/// as a Llama one does, and the tokenizer a controller reads from the
/// worker names the file's split, so both split text alike.
#[tokio::test]
async fn qwen_and_phi3_models_serve_and_hand_out_their_split() {
    for (arch, head_dim) in [("qwen2", None), ("qwen3", Some(32)), ("phi3", None)] {
        let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{arch}-{}.gguf", std::process::id()));
        let spec = pie_model::synth::SynthSpec {
            arch,
            head_dim,
            ..Default::default()
        };
        pie_model::synth::write_test_model(&path, &spec).unwrap();
        let s = Server::start_model(&path, "", &[]).await;
        let chat = json!({"messages": [{"role": "user", "content": "hi 123"}], "max_tokens": 4, "ignore_eos": true});
        let (status, body) = s.post("/v1/chat/completions", chat).await;
        assert_eq!(status, 200, "{arch}: {body}");
        assert_eq!(body["usage"]["completion_tokens"], 4);
        let (status, served) = s.get("/v1/internal/tokenizer").await;
        assert_eq!(status, 200, "{served}");
        assert_eq!(served["tokenizer"]["pre"], "qwen2");
    }
}
