//! KV pages moved between real workers (`runtime::transfer`): a decode worker
//! pulls a prompt's pages from the prefill worker named in `pie_prefill_from`
//! (what the controller's `disaggregate` sends) and generates exactly what one
//! worker alone does; a peer serves its cached pages as a checked stream; and
//! every failure (a dead peer, another model, a flipped byte, a tear, a
//! timeout) ends in the same output, recomputed here, with the refusal counted.

mod common;

use common::Server;
use pie_core::{hash::chain_from, ModelFingerprint};
use pie_kv::stream::{Checked, FrameReader, StreamCheck};
use pie_kv::transfer::PageFormat;
use pie_kv::KvLayout;
use serde_json::{json, Value};

/// The test model's page format at the default page size of 16.
const PAGE: usize = 16;

/// A token-id prompt of `len` tokens, distinct per `seed`.
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 31 + i * 7) % 250 + 1)
        .collect()
}

fn completion(prompt: &[u32]) -> Value {
    json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true})
}

/// `completion` with the prefill pulled from `peer`.
fn disaggregated(prompt: &[u32], peer: &str) -> Value {
    let mut body = completion(prompt);
    body["pie_prefill_from"] = json!(peer);
    body
}

async fn text_of(s: &Server, body: Value) -> (String, Value) {
    let (status, resp) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{resp}");
    (
        resp["choices"][0]["text"].as_str().unwrap().to_string(),
        resp,
    )
}

fn refusals(text: &str, reason: &str) -> f64 {
    pie_testkit::metric_value(
        text,
        &format!("pie_kv_transfer_refusals_total{{reason=\"{reason}\"}}"),
    )
}

#[tokio::test]
async fn a_decode_worker_pulls_the_prefill_and_generates_what_one_worker_does() {
    let prefill = Server::start("[runtime]\nstage = \"prefill\"\n", &[]).await;
    let decode = Server::start("[runtime]\nstage = \"decode\"\n", &[]).await;
    let alone = Server::start("", &[]).await;
    let tokens = prompt(1, 20 * PAGE + 5);

    let (expected, _) = text_of(&alone, completion(&tokens)).await;
    let (got, resp) = text_of(&decode, disaggregated(&tokens, &prefill.url)).await;
    assert_eq!(got, expected, "token-for-token the same as one worker");

    assert_eq!(
        prefill.get("/v1/internal/state").await.1["stage"],
        "prefill"
    );
    assert_eq!(decode.metric("pie_kv_transfer_pages_total").await, 20.0);
    assert_eq!(
        prefill.metric("pie_kv_transfer_pages_total").await,
        20.0,
        "sent what arrived"
    );
    assert_eq!(decode.metric("pie_kv_transfer_fallbacks_total").await, 0.0);
    assert!(
        resp["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 20 * PAGE as u64 - PAGE as u64,
        "the decode worker attached the pulled pages: {resp}"
    );
    assert!(
        decode.metric("pie_prompt_tokens_total").await <= (2 * PAGE) as f64,
        "the decode worker computed only the tail of the prompt"
    );
    prefill
        .eventually("the lease released", async || {
            prefill.metric("pie_kv_leased_pages").await == 0.0
        })
        .await;

    // A second turn finds the pages local: nothing moves again.
    let (again, _) = text_of(&decode, disaggregated(&tokens, &prefill.url)).await;
    assert_eq!(again, expected);
    assert_eq!(decode.metric("pie_kv_transfer_pages_total").await, 20.0);
}

/// Pull `tokens`' cached pages from `s` with `format`; the HTTP status and,
/// on 200, the chain indices of the verified pages.
async fn pull(s: &Server, tokens: &[u32], format: PageFormat, skip: usize) -> (u16, Vec<usize>) {
    let resp = s
        .client
        .post(s.url("/v1/internal/kv/pull"))
        .json(&json!({"format": format, "tokens": tokens, "skip_pages": skip, "max_bytes": 1u64 << 30}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    if status != 200 {
        let body = resp.text().await.unwrap();
        assert!(body.contains("\"message\""), "a JSON error: {body}");
        return (status, Vec::new());
    }
    let bytes = resp.bytes().await.unwrap();
    let chain = chain_from(format.fingerprint.root(), tokens, PAGE);
    let mut check = StreamCheck::new(format, chain, skip);
    let mut frames = FrameReader::new(check.max_frame());
    frames.push(&bytes);
    let mut pages = Vec::new();
    while let Some(frame) = frames.next_frame().unwrap() {
        if let Checked::Page(at, _) = check.frame(frame).unwrap() {
            pages.push(at);
        }
    }
    assert!(check.ended(), "the stream has its end frame");
    (status, pages)
}

#[tokio::test]
async fn a_peer_serves_its_cached_pages_as_a_checked_stream_and_refuses_another_format() {
    let s = Server::start("", &[]).await;
    let tokens = prompt(2, 6 * PAGE + 3);
    text_of(&s, completion(&tokens)).await;
    let format = format_of(&s).await;
    assert_eq!(pull(&s, &tokens, format, 0).await, (200, (0..6).collect()));
    assert_eq!(pull(&s, &tokens, format, 4).await, (200, vec![4, 5]));

    let other = PageFormat {
        layout: KvLayout {
            page_size: 32,
            ..format.layout
        },
        ..format
    };
    assert_eq!(pull(&s, &tokens, other, 0).await.0, 409);
    let refused = s
        .client
        .post(s.url("/v1/internal/kv/pull"))
        .json(&json!({"format": other, "tokens": tokens, "max_bytes": 1}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(refused.contains("page_size differs"), "{refused}");
    assert_eq!(pull(&s, &[999], format, 0).await.0, 400);

    let f32 = PageFormat {
        dtype: pie_kv::KvDtype::F32.code(),
        ..format
    };
    let refused = s
        .client
        .post(s.url("/v1/internal/kv/pull"))
        .json(&json!({"format": f32, "tokens": tokens, "max_bytes": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 409);
    let refused = refused.text().await.unwrap();
    assert!(refused.contains("kv dtype differs"), "{refused}");
}

/// Workers of one KV dtype move pages as workers of the default do; a worker
/// of the other dtype is refused at the handshake and the prompt recomputed.
#[tokio::test]
async fn f16_workers_move_pages_between_them_and_refuse_f32_ones() {
    const F16: &str = "[runtime]\nkv_dtype = \"f16\"\n";
    let prefill = Server::start(F16, &[]).await;
    let decode = Server::start(F16, &[]).await;
    let alone = Server::start(F16, &[]).await;
    let tokens = prompt(5, 10 * PAGE + 3);
    let (expected, _) = text_of(&alone, completion(&tokens)).await;
    let (got, _) = text_of(&decode, disaggregated(&tokens, &prefill.url)).await;
    assert_eq!(got, expected, "token-for-token the same as one f16 worker");
    assert_eq!(decode.metric("pie_kv_transfer_pages_total").await, 10.0);
    let f16 = PageFormat {
        dtype: pie_kv::KvDtype::F16.code(),
        ..format_of(&prefill).await
    };
    assert_eq!(
        pull(&prefill, &tokens, f16, 0).await,
        (200, (0..10).collect())
    );

    let f32_worker = Server::start("[runtime]\nkv_dtype = \"f32\"\n", &[]).await;
    let tokens = prompt(6, 10 * PAGE);
    let (expected, _) = text_of(&alone, completion(&tokens)).await;
    let (got, _) = text_of(&decode, disaggregated(&tokens, &f32_worker.url)).await;
    assert_eq!(got, expected, "recomputed, same output");
    let metrics = decode.metrics_text().await;
    assert_eq!(refusals(&metrics, "handshake"), 1.0, "{metrics}");
    assert_eq!(decode.metric("pie_kv_transfer_pages_total").await, 10.0);
    assert_eq!(
        f32_worker.metric("pie_prompt_tokens_total").await,
        0.0,
        "refused before the f32 worker computed anything"
    );
}

#[tokio::test]
async fn client_keys_can_neither_pull_pages_nor_name_a_prefill_worker() {
    let cfg = "[server]\napi_keys = [{ name = \"alice\", key = \"sk-a\" }, { name = \"ctl\", key = \"sk-w\", role = \"worker\" }]\n";
    let s = Server::start(cfg, &[]).await;
    let post = |key: &'static str, path: &'static str, body: Value| {
        let req = s.client.post(s.url(path)).bearer_auth(key).json(&body);
        async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let tokens = prompt(3, 40);
    let (status, body) = post("sk-a", "/v1/internal/kv/pull", json!({"tokens": tokens})).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = post("sk-a", "/v1/completions", disaggregated(&tokens, &s.url)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("pie_prefill_from"), "{body}");
    let (status, body) = post(
        "sk-w",
        "/v1/completions",
        disaggregated(&tokens, "file:///etc"),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("http(s) URL"), "{body}");
}

/// A TCP relay to `target` that flips one byte of the response stream at
/// `offset`; returns its URL.
async fn flipping_relay(target: &str, offset: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let target = target.trim_start_matches("http://").to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let upstream = tokio::net::TcpStream::connect(&target).await.unwrap();
            let (mut cr, mut cw) = client.into_split();
            let (mut ur, mut uw) = upstream.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut cr, &mut uw).await });
            tokio::spawn(async move {
                let (mut seen, mut buf) = (0usize, vec![0u8; 16 * 1024]);
                while let Ok(n) = ur.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if (seen..seen + n).contains(&offset) {
                        buf[offset - seen] ^= 0x40;
                    }
                    seen += n;
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    url
}

#[tokio::test]
async fn a_dead_peer_another_model_or_a_flipped_byte_falls_back_to_identical_output() {
    let decode = Server::start("", &[]).await;
    let alone = Server::start("", &[]).await;
    let fallback = async |seed: u32, peer: &str, reason: &str| {
        let tokens = prompt(seed, 12 * PAGE);
        let (expected, _) = text_of(&alone, completion(&tokens)).await;
        let (got, _) = text_of(&decode, disaggregated(&tokens, peer)).await;
        assert_eq!(got, expected, "{reason}: recomputed, same output");
        let metrics = decode.metrics_text().await;
        assert_eq!(refusals(&metrics, reason), 1.0, "{reason} counted once");
    };

    let mut dead = Server::start("", &[]).await;
    let dead_url = dead.url.clone();
    dead.kill();
    fallback(10, &dead_url, "peer").await;

    let other_model = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("transfer-other-model-{}.gguf", std::process::id()));
    pie_model::synth::write_test_model(
        &other_model,
        &pie_model::synth::SynthSpec {
            seed: 3,
            ..Default::default()
        },
    )
    .unwrap();
    let foreign = Server::start_model(&other_model, "", &[]).await;
    fallback(11, &foreign.url, "handshake").await;
    assert_eq!(
        foreign.metric("pie_prompt_tokens_total").await,
        0.0,
        "refused before the foreign worker computed anything"
    );

    let peer = Server::start("", &[]).await;
    // Past the response's headers and the stream's header frame: inside page 0.
    let relay = flipping_relay(&peer.url, 3000).await;
    fallback(12, &relay, "checksum").await;
    assert_eq!(decode.metric("pie_kv_transfer_fallbacks_total").await, 3.0);
}

#[cfg(feature = "fault-injection")]
mod faults {
    use super::*;

    async fn slow_peer(delay_ms: u64) -> Server {
        let s = Server::start("", &[]).await;
        let (status, body) = s
            .post(
                "/v1/admin/fault",
                json!({"fault": "slow-transfer", "delay_ms": delay_ms}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        s
    }

    #[tokio::test]
    async fn a_transfer_slower_than_the_timeout_is_abandoned_and_recomputed() {
        let decode = Server::start("[runtime.transfer]\ntimeout_ms = 800\n", &[]).await;
        let alone = Server::start("", &[]).await;
        let peer = slow_peer(300).await;
        let tokens = prompt(20, 12 * PAGE);
        let (expected, _) = text_of(&alone, completion(&tokens)).await;
        let (got, _) = text_of(&decode, disaggregated(&tokens, &peer.url)).await;
        assert_eq!(got, expected);
        let metrics = decode.metrics_text().await;
        assert_eq!(refusals(&metrics, "timeout"), 1.0, "{metrics}");
        let pulled = pie_testkit::metric_value(&metrics, "pie_kv_transfer_pages_total");
        assert!(
            (1.0..12.0).contains(&pulled),
            "the pages that arrived before the timeout were kept: {pulled}"
        );
        peer.eventually("the abandoned lease released", async || {
            peer.metric("pie_kv_leased_pages").await == 0.0
        })
        .await;
    }

    #[tokio::test]
    async fn a_prefill_worker_killed_mid_transfer_leaves_a_torn_stream_and_the_same_output() {
        let decode = Server::start("", &[]).await;
        let alone = Server::start("", &[]).await;
        let mut peer = slow_peer(150).await;
        let tokens = prompt(21, 12 * PAGE);
        let (expected, _) = text_of(&alone, completion(&tokens)).await;
        let body = disaggregated(&tokens, &peer.url);
        let request = {
            let url = decode.url("/v1/completions");
            let client = decode.client.clone();
            tokio::spawn(async move {
                let r = client.post(url).json(&body).send().await.unwrap();
                r.json::<Value>().await.unwrap()
            })
        };
        peer.eventually("pages on their way", async || {
            peer.metric("pie_kv_transfer_pages_total").await >= 2.0
        })
        .await;
        peer.kill();
        let resp = request.await.unwrap();
        assert_eq!(resp["choices"][0]["text"], expected.as_str(), "{resp}");
        let metrics = decode.metrics_text().await;
        assert_eq!(refusals(&metrics, "torn"), 1.0, "{metrics}");
    }
}

/// The page format of the test model at `PAGE` tokens per page.
async fn format_of(s: &Server) -> PageFormat {
    let state = s.get("/v1/internal/state").await.1;
    PageFormat {
        fingerprint: ModelFingerprint(state["fingerprint"].as_u64().unwrap()),
        // The servers here run the default dtype unless a test says otherwise.
        dtype: pie_kv::KvDtype::default().code(),
        // The test model: 2 layers, 2 KV heads of 16.
        layout: KvLayout {
            layers: 2,
            page_size: PAGE,
            kv_dim: 32,
        },
    }
}

#[tokio::test]
async fn pushed_pages_are_checked_and_kept_up_to_a_refusal() {
    let source = Server::start("", &[]).await;
    let tokens = prompt(4, 8 * PAGE + 1);
    text_of(&source, completion(&tokens)).await;
    let format = format_of(&source).await;
    let stream = source
        .client
        .post(source.url("/v1/internal/kv/pull"))
        .json(&json!({"format": format, "tokens": tokens, "max_bytes": 1u64 << 30}))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let push = |to: &Server, stream: Vec<u8>| {
        let mut body =
            pie_kv::stream::frame(&serde_json::to_vec(&json!({"tokens": tokens})).unwrap());
        body.extend(stream);
        let req = to.client.post(to.url("/v1/internal/kv/push")).body(body);
        async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };

    let whole = Server::start("", &[]).await;
    assert_eq!(
        push(&whole, stream.to_vec()).await,
        (200, json!({"pages": 8}))
    );
    let (_, resp) = text_of(&whole, completion(&tokens)).await;
    assert_eq!(
        resp["usage"]["prompt_tokens_details"]["cached_tokens"],
        8 * PAGE,
        "the pushed pages serve the prompt"
    );

    let damaged = Server::start("", &[]).await;
    let page_frame = pie_kv::transfer::page_bytes_len(&format) + 4;
    let mut flipped = stream.to_vec();
    let in_page_3 = stream.len() - 4 - 5 * page_frame + 100;
    flipped[in_page_3] ^= 1;
    let (status, body) = push(&damaged, flipped).await;
    assert_eq!(status, 422, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("after 3 pages") && message.contains("checksum"),
        "{message}"
    );
    assert_eq!(
        damaged
            .metric("pie_kv_transfer_refusals_total{reason=\"checksum\"}")
            .await,
        1.0
    );
}
