//! The `pie-pool` binary on its own: pages pushed by their block hashes come
//! back from a pull by the same hashes, byte for byte, and only as a leading
//! run; a page that does not match its hash is refused; keys and roles; a
//! pool never prefills.

use std::path::Path;

use pie_core::{BlockHash, ModelFingerprint};
use pie_kv::stream::{frame, FrameReader, StreamHeader, END_FRAME};
use pie_kv::transfer::{export_page, PageFormat};
use pie_kv::{KvLayout, KvPool};
use pie_testkit::{spawn, Proc};
use serde_json::{json, Value};

/// The pool binary on a free port, killed on drop.
fn pool(args: &[&str]) -> Proc {
    let mut all = vec!["--port", "0"];
    all.extend_from_slice(args);
    spawn(
        Path::new(env!("CARGO_BIN_EXE_pie-pool")),
        &all,
        "pie-pool: listening on ",
    )
}

const LAYOUT: KvLayout = KvLayout {
    layers: 2,
    page_size: 4,
    kv_dim: 3,
};

/// A worker-side pool holding `n` published pages with the hashes 500, 501, ...
fn pages(n: usize) -> (KvPool, Vec<BlockHash>) {
    let mut kv = KvPool::new(LAYOUT, n, ModelFingerprint(42));
    let mut chain = Vec::new();
    for i in 0..n {
        let page = kv.allocate().expect("room");
        for layer in 0..LAYOUT.layers {
            for slot in 0..LAYOUT.page_size {
                let x = (i * 13 + layer * 5 + slot) as f32;
                kv.write(layer, page, slot, &[x, -x, 0.25], &[x; 3]);
            }
        }
        let hash = BlockHash(500 + i as u64);
        kv.publish(page, hash);
        chain.push(hash);
    }
    (kv, chain)
}

fn exported(kv: &KvPool, hash: BlockHash) -> Vec<u8> {
    export_page(kv, kv.lookup(hash).expect("published")).expect("exports")
}

/// A push of `bodies` as the pages of `chain`.
fn push_body(format: PageFormat, chain: &[BlockHash], bodies: &[Vec<u8>]) -> Vec<u8> {
    let header = json!({"blocks": chain.iter().map(|h| h.0).collect::<Vec<_>>()});
    let mut out = frame(&serde_json::to_vec(&header).expect("json"));
    out.extend(StreamHeader::new(format).frame());
    for body in bodies {
        out.extend(frame(body));
    }
    out.extend_from_slice(&END_FRAME);
    out
}

/// The page bodies of a pull stream (its header checked).
fn stream_pages(bytes: &[u8], format: PageFormat) -> Vec<Vec<u8>> {
    let mut frames = FrameReader::new(1 << 20);
    frames.push(bytes);
    let header = frames.next_frame().ok().flatten().expect("a header");
    let header: StreamHeader = serde_json::from_slice(&header).expect("a stream header");
    assert_eq!(header.format, format);
    let mut out = Vec::new();
    loop {
        match frames.next_frame() {
            Ok(Some(f)) if f.is_empty() => return out,
            Ok(Some(f)) => out.push(f),
            Ok(None) => panic!("the stream has no end frame"),
            Err(e) => panic!("bad stream: {e}"),
        }
    }
}

async fn pull(
    http: &reqwest::Client,
    url: &str,
    format: PageFormat,
    blocks: &[u64],
) -> Vec<Vec<u8>> {
    let body = json!({"format": format, "blocks": blocks, "max_bytes": 1u64 << 30});
    let resp = http
        .post(format!("{url}/v1/internal/kv/pull"))
        .json(&body)
        .send()
        .await
        .expect("pull sent");
    assert_eq!(resp.status(), 200);
    stream_pages(&resp.bytes().await.expect("body"), format)
}

#[tokio::test]
async fn pages_pushed_by_hash_come_back_byte_for_byte_and_only_as_a_leading_run() {
    let p = pool(&[]);
    let http = reqwest::Client::new();
    let (kv, chain) = pages(3);
    let format = PageFormat::of(&kv);
    let bodies: Vec<_> = chain[..2].iter().map(|&h| exported(&kv, h)).collect();
    let pushed: Value = http
        .post(format!("{}/v1/internal/kv/push", p.url))
        .body(push_body(format, &chain[..2], &bodies))
        .send()
        .await
        .expect("push sent")
        .json()
        .await
        .expect("json");
    assert_eq!(pushed["pages"], 2, "{pushed}");

    let all: Vec<u64> = chain.iter().map(|h| h.0).collect();
    assert_eq!(pull(&http, &p.url, format, &all).await, bodies);
    assert!(
        pull(&http, &p.url, format, &[all[2], all[0]])
            .await
            .is_empty(),
        "a held page after one that is not held is not sent"
    );

    let swapped = push_body(format, &chain[2..], &[bodies[0].clone()]);
    let refused = http
        .post(format!("{}/v1/internal/kv/push", p.url))
        .body(swapped)
        .send()
        .await
        .expect("push sent");
    assert_eq!(refused.status(), 422, "a page under another page's hash");
    assert_eq!(
        pull(&http, &p.url, format, &all).await.len(),
        2,
        "the refused page is not kept"
    );
}

#[tokio::test]
async fn the_pool_checks_keys_and_refuses_bad_pushes() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let cfg = dir.join(format!("pool-keys-{}.toml", std::process::id()));
    std::fs::write(
        &cfg,
        "[server]\napi_keys = [{ name = \"w\", key = \"sk-w\", role = \"worker\" }, \
         { name = \"c\", key = \"sk-c\" }]\n",
    )
    .expect("config written");
    let p = pool(&["--config", cfg.to_str().expect("utf-8 path")]);
    let http = reqwest::Client::new();
    let pull = json!({"format": {"fingerprint": 1, "dtype": 0,
        "layout": {"layers": 1, "page_size": 16, "kv_dim": 2}},
        "tokens": [1, 2, 3], "max_bytes": 1000});
    let status = |key: Option<&'static str>| {
        let mut req = http
            .post(format!("{}/v1/internal/kv/pull", p.url))
            .json(&pull);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        async move { req.send().await.expect("sent").status().as_u16() }
    };
    assert_eq!(status(None).await, 401);
    assert_eq!(status(Some("sk-c")).await, 403, "a client key may not pull");
    assert_eq!(status(Some("sk-w")).await, 200);
    let health = http
        .get(format!("{}/health", p.url))
        .send()
        .await
        .expect("sent");
    assert_eq!(health.status(), 200, "health needs no key");
    let bad = http
        .post(format!("{}/v1/internal/kv/push", p.url))
        .bearer_auth("sk-w")
        .body(b"\x05\x00\x00\x00hello".to_vec())
        .send()
        .await
        .expect("sent");
    assert_eq!(bad.status(), 400, "a push header that is not JSON");
    let prefill = http
        .post(format!("{}/v1/internal/kv/pull", p.url))
        .bearer_auth("sk-w")
        .json(&json!({"format": pull["format"], "tokens": [1], "max_bytes": 10, "prefill": true}))
        .send()
        .await
        .expect("sent");
    assert_eq!(prefill.status(), 400, "a pool cannot prefill");
    let _ = std::fs::remove_file(cfg);
}

/// Server-sent events read from a response: (name, data) in order.
struct Events {
    resp: reqwest::Response,
    buf: String,
}

impl Events {
    async fn open(url: &str, fingerprint: u64) -> Events {
        let resp = reqwest::get(format!(
            "{url}/v1/internal/kv-events?fingerprint={fingerprint}"
        ))
        .await
        .expect("subscribed");
        assert_eq!(resp.status(), 200);
        Events {
            resp,
            buf: String::new(),
        }
    }

    /// The next named event (keep-alive comments skipped).
    async fn next(&mut self) -> (String, Value) {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..end + 2).collect();
                let field = |name: &str| {
                    block
                        .lines()
                        .find_map(|l| l.strip_prefix(name).map(str::trim).map(String::from))
                };
                if let (Some(event), Some(data)) = (field("event:"), field("data:")) {
                    let data = serde_json::from_str(&data).unwrap_or(Value::String(data));
                    return (event, data);
                }
                continue;
            }
            let chunk = tokio::time::timeout(std::time::Duration::from_secs(10), self.resp.chunk())
                .await
                .expect("an event within 10 s")
                .expect("stream readable")
                .expect("stream open");
            self.buf.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

/// The KV events a controller follows: a snapshot of what the pool holds for
/// one model, then numbered batches as pages arrive and go; another model's
/// subscriber sees none of them.
#[tokio::test]
async fn kv_events_report_what_the_pool_holds_for_one_model() {
    let p = pool(&[]);
    let http = reqwest::Client::new();
    let (kv, chain) = pages(2);
    let format = PageFormat::of(&kv);
    let mut events = Events::open(&p.url, 42).await;
    let (name, snapshot) = events.next().await;
    assert_eq!(
        (name.as_str(), &snapshot["hashes"]),
        ("snapshot", &json!([]))
    );
    let bodies: Vec<_> = chain.iter().map(|&h| exported(&kv, h)).collect();
    let pushed = http
        .post(format!("{}/v1/internal/kv/push", p.url))
        .body(push_body(format, &chain, &bodies))
        .send()
        .await
        .expect("push sent");
    assert_eq!(pushed.status(), 200);
    let mut stored = Vec::new();
    let mut seq = 0;
    while stored.len() < 2 {
        let (name, batch) = events.next().await;
        assert_eq!(name, "kv", "{batch}");
        seq += 1;
        assert_eq!(batch["seq"], seq, "numbered without gaps");
        stored.extend(batch["stored"].as_array().expect("stored").iter().cloned());
    }
    assert_eq!(stored, json!([500, 501]).as_array().expect("array").clone());
    let (_, other) = Events::open(&p.url, 43).await.next().await;
    assert_eq!(
        other["hashes"],
        json!([]),
        "another model's pages are apart"
    );
    let (_, again) = Events::open(&p.url, 42).await.next().await;
    assert_eq!(again["hashes"], json!([500, 501]));
    let deleted: Value = http
        .post(format!("{}/v1/admin/pages/delete", p.url))
        .json(&json!({"older_than_ms": 0}))
        .send()
        .await
        .expect("delete sent")
        .json()
        .await
        .expect("json");
    assert_eq!(deleted["deleted"], 2);
    let (name, batch) = events.next().await;
    assert_eq!(name, "kv");
    let mut removed: Vec<u64> = batch["removed"]
        .as_array()
        .expect("removed")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    removed.sort_unstable();
    assert_eq!(removed, [500, 501], "in any order: {batch}");
    let bad = http
        .get(format!("{}/v1/internal/kv-events", p.url))
        .send()
        .await
        .expect("sent");
    assert_eq!(bad.status(), 400, "the model's fingerprint is required");
}
