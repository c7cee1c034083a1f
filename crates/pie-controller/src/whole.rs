//! Non-streamed OpenAI requests that can move. The client asked for one JSON
//! answer, but only a stream can be moved (its chunks carry the token ids
//! the controller resumes from; see `relay`): the request goes to the
//! workers streamed, is relayed like any movable stream, and is gathered
//! here into the answer the worker itself would have given (same `id`,
//! `created`, `model`, choice shape and `usage`).
//!
//! Invariant: the client gets either that answer or an error status with an
//! OpenAI error body (the relay's error event's own status), never a partial
//! text presented as a result.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::{json, Value};

use pie_client::sse::SseBlocks;

use crate::respond::error;

/// The OpenAI answer a gathered stream becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Completion,
    Chat,
}

impl Answer {
    /// The answer a non-streamed request to `path` expects, if it is one.
    pub fn of(path: &str, body: &Value) -> Option<Self> {
        if body["stream"].as_bool() == Some(true) {
            return None;
        }
        match path {
            "/v1/completions" => Some(Answer::Completion),
            "/v1/chat/completions" => Some(Answer::Chat),
            _ => None,
        }
    }

    /// Ask the workers for a stream with its usage instead.
    pub fn stream_instead(body: &mut Value) {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }

    fn object(self) -> &'static str {
        match self {
            Answer::Completion => "text_completion",
            Answer::Chat => "chat.completion",
        }
    }

    fn choice(self, text: &str, finish_reason: &Value) -> Value {
        match self {
            Answer::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason})
            }
            Answer::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish_reason
            }),
        }
    }

    /// Read the relayed stream `resp` to its end and answer as one JSON
    /// object. A response that is not a 2xx stream passes as it is.
    pub async fn gather(self, resp: Response) -> Response {
        if !resp.status().is_success() {
            return resp;
        }
        let (mut parts, body) = resp.into_parts();
        let mut gathered = Gathered::default();
        let mut blocks = SseBlocks::default();
        let mut chunks = body.into_data_stream();
        while let Some(chunk) = chunks.next().await {
            let Ok(bytes) = chunk else {
                return error(StatusCode::BAD_GATEWAY, "the relayed stream broke");
            };
            let events = match blocks.push(&bytes) {
                Ok(events) => events,
                Err(e) => return error(StatusCode::BAD_GATEWAY, e.to_string()),
            };
            for block in events {
                if let Some(failed) = gathered.take(&block) {
                    return failed;
                }
            }
        }
        let Some(answer) = gathered.answer(self) else {
            return error(
                StatusCode::BAD_GATEWAY,
                "the worker's stream ended without a finish reason",
            );
        };
        parts.headers.remove(header::CONTENT_LENGTH);
        parts.headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        Response::from_parts(parts, Body::from(answer.to_string()))
    }
}

/// What the chunks so far say.
#[derive(Default)]
struct Gathered {
    /// `id`, `created` and `model` of the first chunk.
    head: Option<(Value, Value, Value)>,
    text: String,
    finish_reason: Option<Value>,
    usage: Option<Value>,
}

impl Gathered {
    /// Take one SSE event; an error event ends the gathering with its status.
    fn take(&mut self, block: &[u8]) -> Option<Response> {
        let text = String::from_utf8_lossy(block);
        let data = text.lines().find_map(|l| l.strip_prefix("data:"))?.trim();
        let chunk: Value = serde_json::from_str(data).ok()?;
        if let Some(e) = chunk.get("error") {
            let status = e["code"]
                .as_u64()
                .and_then(|c| StatusCode::from_u16(u16::try_from(c).ok()?).ok())
                .filter(|s| s.is_client_error() || s.is_server_error())
                .unwrap_or(StatusCode::BAD_GATEWAY);
            let mut resp = Response::new(Body::from(chunk.to_string()));
            *resp.status_mut() = status;
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return Some(resp);
        }
        if self.head.is_none() {
            self.head = Some((
                chunk["id"].clone(),
                chunk["created"].clone(),
                chunk["model"].clone(),
            ));
        }
        if !chunk["usage"].is_null() {
            self.usage = Some(chunk["usage"].clone());
        }
        if let Some(choice) = chunk["choices"].get(0) {
            let piece = choice["text"]
                .as_str()
                .or_else(|| choice["delta"]["content"].as_str());
            self.text.push_str(piece.unwrap_or_default());
            if !choice["finish_reason"].is_null() {
                self.finish_reason = Some(choice["finish_reason"].clone());
            }
        }
        None
    }

    fn answer(self, kind: Answer) -> Option<Value> {
        let (id, created, model) = self.head?;
        let finish_reason = self.finish_reason?;
        let mut v = json!({
            "id": id,
            "object": kind.object(),
            "created": created,
            "model": model,
            "choices": [kind.choice(&self.text, &finish_reason)],
        });
        if let Some(usage) = self.usage {
            v["usage"] = usage;
        }
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(events: &[Value]) -> Response {
        let mut body = String::new();
        for e in events {
            body.push_str(&format!("data: {e}\n\n"));
        }
        body.push_str("data: [DONE]\n\n");
        Response::new(Body::from(body))
    }

    async fn json_of(resp: Response) -> (StatusCode, Value) {
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .expect("body");
        (status, serde_json::from_slice(&bytes).expect("json"))
    }

    #[tokio::test]
    async fn chat_chunks_gather_into_the_workers_whole_answer() {
        let head = |choices: Value| json!({"id": "chatcmpl-p1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": choices});
        let resp = streamed(&[
            head(
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
            ),
            head(json!([{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}])),
            head(json!([{"index": 0, "delta": {"content": "lo"}, "finish_reason": null}])),
            head(json!([{"index": 0, "delta": {}, "finish_reason": "length"}])),
            json!({"id": "chatcmpl-p1", "created": 7, "model": "m", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
        ]);
        let (status, v) = json_of(Answer::Chat.gather(resp).await).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["id"], "chatcmpl-p1");
        assert_eq!(v["created"], 7);
        assert_eq!(v["choices"][0]["message"]["content"], "Hello");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 2);
    }

    #[tokio::test]
    async fn an_error_event_is_the_answers_status_and_body() {
        let resp = streamed(&[
            json!({"id": "cmpl-p1", "created": 1, "model": "m", "choices": [{"index": 0, "text": "a", "finish_reason": null}]}),
            pie_core::api_error::error_body(502, "no worker could resume the stream", None),
        ]);
        let (status, v) = json_of(Answer::Completion.gather(resp).await).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(v["error"]["message"], "no worker could resume the stream");
    }

    #[tokio::test]
    async fn a_stream_without_a_finish_is_no_result() {
        let resp = streamed(&[
            json!({"id": "cmpl-p1", "created": 1, "model": "m", "choices": [{"index": 0, "text": "a", "finish_reason": null}]}),
        ]);
        let (status, v) = json_of(Answer::Completion.gather(resp).await).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("without a finish reason")));
    }

    #[test]
    fn only_unstreamed_openai_generations_are_gathered() {
        assert_eq!(
            Answer::of("/v1/completions", &json!({"prompt": "x"})),
            Some(Answer::Completion)
        );
        assert_eq!(
            Answer::of("/v1/chat/completions", &json!({"stream": false})),
            Some(Answer::Chat)
        );
        assert_eq!(
            Answer::of("/v1/completions", &json!({"stream": true})),
            None
        );
        assert_eq!(Answer::of("/v1/processes", &json!({})), None);
    }
}
