//! Helpers for tests of uploaded inferlets: a store directory per server,
//! uploads, launches and messages.

use pie_testkit::inferlet_wasm;
use serde_json::{json, Value};

use super::Server;

/// A fresh directory for one server's installed inferlets.
pub fn store_dir() -> String {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "inferlets-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    dir.display().to_string()
}

/// A config with the inferlets stored in `dir`, and `extra` TOML after.
pub fn config(dir: &str, runtime: &str, inferlets: &str) -> String {
    format!("[runtime]\n{runtime}\n[runtime.inferlets]\ndir = {dir:?}\n{inferlets}\n")
}

pub async fn upload_as(s: &Server, key: Option<&str>, name: &str, guest: &str) -> (u16, Value) {
    let wasm = std::fs::read(inferlet_wasm(guest)).unwrap();
    // A fresh connection: a pooled one the server just closed fails the
    // body's write (a broken pipe, seen once in CI).
    let mut req = reqwest::Client::new()
        .post(s.url(&format!("/v1/inferlets?name={name}")))
        .body(wasm);
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

pub async fn upload(s: &Server, name: &str, guest: &str) {
    let (status, body) = upload_as(s, None, name, guest).await;
    assert_eq!(status, 201, "{body}");
}

pub async fn launch(s: &Server, inferlet: &str, args: Value, props: Value) -> String {
    s.launch(json!({"inferlet": inferlet, "args": args, "props": props}))
        .await
}

pub async fn message(s: &Server, id: &str, text: &str) -> (u16, Value) {
    s.post(
        &format!("/v1/processes/{id}/messages"),
        json!({ "message": text }),
    )
    .await
}

pub fn error_of(record: &Value) -> &str {
    record["error"].as_str().unwrap_or("")
}

/// The process's JSON events, until its end.
pub async fn json_events(s: &Server, id: &str) -> Vec<Value> {
    let r = s
        .client
        .get(s.url(&format!("/v1/processes/{id}/events")))
        .send()
        .await
        .unwrap();
    let mut events = Vec::new();
    let mut blocks = pie_client::sse::SseBlocks::default();
    let mut r = r;
    while let Some(chunk) = r.chunk().await.unwrap() {
        for block in blocks.push(&chunk).unwrap() {
            let block = String::from_utf8_lossy(&block).to_string();
            if block.contains("event: json") {
                let data = block
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .unwrap();
                events.push(serde_json::from_str(data).unwrap());
            }
        }
    }
    events
}
