//! The reference `agent` inferlet (`inferlets/agent`) on the tiny model:
//! each step's output keeps the ReAct format whatever the weights favour
//! (constrained), each tool call is an event the client answers with a
//! message, the last step answers, and the context stays live across the
//! calls (each step computes only its new turn: the rest is found cached).

mod common;

use common::Server;
use serde_json::{json, Value};

#[tokio::test]
async fn the_agent_calls_tools_by_events_and_answers_within_its_steps() {
    let s = Server::start("", &[]).await;
    let wasm = std::fs::read(pie_testkit::inferlet_wasm("agent")).unwrap();
    let r = s
        .client
        .post(s.url("/v1/inferlets?name=agent"))
        .body(wasm)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let (hits, computed) = (
        s.metric("pie_prefix_cache_hit_tokens_total").await,
        s.metric("pie_prompt_tokens_total").await,
    );
    let id = s
        .launch(json!({"inferlet": "agent", "args": {"question": "How tall is the tower?", "max_steps": 4, "min_actions": 2}}))
        .await;
    let mut events = s
        .client
        .get(s.url(&format!("/v1/processes/{id}/events")))
        .send()
        .await
        .unwrap();
    let mut blocks = pie_client::sse::SseBlocks::default();
    let (mut calls, mut last) = (Vec::new(), Value::Null);
    while let Some(chunk) = events.chunk().await.unwrap() {
        for block in blocks.push(&chunk).unwrap() {
            let block = String::from_utf8_lossy(&block).to_string();
            let Some(data) = block.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if !block.contains("event: json") {
                continue;
            }
            let event: Value = serde_json::from_str(data).unwrap();
            if event["type"] == "tool_call" {
                assert!(
                    ["search", "calculate"].contains(&event["tool"].as_str().unwrap()),
                    "{event}"
                );
                calls.push(event.clone());
                let reply = json!({"message": format!("result {}", calls.len())});
                let (status, _) = s.post(&format!("/v1/processes/{id}/messages"), reply).await;
                assert_eq!(status, 200);
            }
            last = event;
        }
    }
    assert_eq!(last["type"], "final", "{last}");
    assert!(!last["answer"].as_str().unwrap().is_empty());
    assert_eq!(
        last["steps"],
        calls.len() + 1,
        "every step but the last called a tool"
    );
    assert!(calls.len() <= 3, "the last of 4 steps answers");
    let record = s.wait_done(&id).await;
    assert_eq!(record["state"], "finished", "{record}");
    let hits = s.metric("pie_prefix_cache_hit_tokens_total").await - hits;
    let computed = s.metric("pie_prompt_tokens_total").await - computed;
    assert!(calls.len() >= 2, "min_actions: 2");
    assert!(
        hits > computed,
        "later steps find the conversation cached: {hits} hit, {computed} computed"
    );
}
