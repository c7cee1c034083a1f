//! A client of the Pie HTTP API: streaming `/v1/completions`, the served
//! model and its vocabulary (`/v1/models`), a finished process's generated token
//! ids (`/v1/processes/{id}`), and `/metrics`. Works against a worker and a
//! controller alike (through a controller, process ids become `WORKER~ID`).

use std::fmt;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::Value;

use crate::sse::SseParser;

/// Why a request did not complete.
#[derive(Clone, Debug, PartialEq)]
pub enum ClientError {
    /// The server answered with an HTTP error status.
    Status { status: u16, message: String },
    /// Connecting, sending or reading failed.
    Transport(String),
    /// The stream carried an error event, was malformed, or ended early.
    Stream(String),
}

impl ClientError {
    /// A short label to count errors by: `http 429`, `transport`, `stream`.
    pub fn kind(&self) -> String {
        match self {
            Self::Status { status, .. } => format!("http {status}"),
            Self::Transport(_) => "transport".into(),
            Self::Stream(_) => "stream".into(),
        }
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Status { status, message } => write!(f, "HTTP {status}: {message}"),
            Self::Transport(m) => write!(f, "transport: {m}"),
            Self::Stream(m) => write!(f, "stream: {m}"),
        }
    }
}

impl std::error::Error for ClientError {}

fn transport(e: reqwest::Error) -> ClientError {
    ClientError::Transport(e.to_string())
}

/// Token counts from the final usage chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    #[serde(default)]
    pub prompt_tokens_details: CachedTokens,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct CachedTokens {
    #[serde(default)]
    pub cached_tokens: usize,
}

/// One streamed completion, timed from the moment it was sent.
#[derive(Clone, Debug, Default)]
pub struct Completion {
    /// The process id (`proc-3`, or `w1~proc-3` through a controller).
    pub process: Option<String>,
    /// The worker that served it (`x-pie-worker`, set by a controller).
    pub worker: Option<String>,
    /// Arrival of each streamed text chunk.
    pub chunk_times: Vec<Duration>,
    /// Until `[DONE]`.
    pub e2e: Duration,
    pub usage: Option<Usage>,
}

impl Completion {
    pub fn ttft(&self) -> Option<Duration> {
        self.chunk_times.first().copied()
    }

    /// Gaps between consecutive chunks (one chunk is usually one token; bytes
    /// that do not yet form a character are held back and arrive with the next).
    pub fn inter_chunk(&self) -> Vec<Duration> {
        self.chunk_times.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    /// A client of `base`, reusing connections, with `TCP_NODELAY` so a small
    /// write is never held back for a delayed ACK (the servers set it too;
    /// before they did, a reused connection added 40 ms to every TTFT).
    pub fn new(base: &str) -> Self {
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        Self {
            http,
            base: base.trim_end_matches('/').to_string(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn get_ok(&self, path: &str) -> Result<reqwest::Response, ClientError> {
        let resp = self
            .http
            .get(self.url(path))
            .send()
            .await
            .map_err(transport)?;
        check_status(resp).await
    }

    /// The served model's id and, when the server reports it, its vocabulary size.
    pub async fn model(&self) -> Result<(String, Option<u32>), ClientError> {
        let v: Value = self
            .get_ok("/v1/models")
            .await?
            .json()
            .await
            .map_err(transport)?;
        let m = &v["data"][0];
        let id = m["id"]
            .as_str()
            .ok_or_else(|| ClientError::Stream(format!("/v1/models has no model id: {v}")))?;
        let vocab = m["vocab_size"].as_u64().and_then(|n| u32::try_from(n).ok());
        Ok((id.to_string(), vocab))
    }

    /// `GET /metrics` as text.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        self.get_ok("/metrics")
            .await?
            .text()
            .await
            .map_err(transport)
    }

    /// The token ids a finished process generated.
    pub async fn output_tokens(&self, process: &str) -> Result<Vec<u32>, ClientError> {
        let v: Value = self
            .get_ok(&format!("/v1/processes/{process}"))
            .await?
            .json()
            .await
            .map_err(transport)?;
        serde_json::from_value(v["output_tokens"].clone())
            .map_err(|e| ClientError::Stream(format!("process {process}: output_tokens: {e}")))
    }

    /// POST a streaming `/v1/completions` body and read the stream to `[DONE]`.
    pub async fn complete(&self, body: &Value) -> Result<Completion, ClientError> {
        let start = Instant::now();
        let resp = self
            .http
            .post(self.url("/v1/completions"))
            .json(body)
            .send()
            .await
            .map_err(transport)?;
        let resp = check_status(resp).await?;
        let mut c = Completion {
            worker: header(&resp, "x-pie-worker"),
            ..Completion::default()
        };
        let mut parser = SseParser::default();
        let mut bytes = resp.bytes_stream();
        let mut done = false;
        // Read to the end of the body even after `[DONE]`, so the connection
        // goes back to the pool instead of being dropped mid-response.
        while let Some(chunk) = bytes.next().await {
            let chunk = chunk.map_err(|e| ClientError::Stream(e.to_string()))?;
            let events = parser
                .push(&chunk)
                .map_err(|e| ClientError::Stream(e.to_string()))?;
            for data in events {
                if data == "[DONE]" {
                    c.e2e = start.elapsed();
                    done = true;
                } else if !done {
                    read_chunk(&mut c, &data, start.elapsed())?;
                }
            }
        }
        if done {
            Ok(c)
        } else {
            Err(ClientError::Stream("the stream ended before [DONE]".into()))
        }
    }
}

fn header(resp: &reqwest::Response, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn check_status(resp: reqwest::Response) -> Result<reqwest::Response, ClientError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let text = resp.text().await.unwrap_or_default();
    let message = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or(text);
    Err(ClientError::Status {
        status: status.as_u16(),
        message,
    })
}

/// Fold one SSE data payload (a completion chunk) into `c`.
pub fn read_chunk(c: &mut Completion, data: &str, at: Duration) -> Result<(), ClientError> {
    let v: Value = serde_json::from_str(data)
        .map_err(|e| ClientError::Stream(format!("bad chunk {data:?}: {e}")))?;
    if let Some(err) = v.get("error") {
        let message = err["message"].as_str().unwrap_or("error event");
        return Err(ClientError::Stream(message.to_string()));
    }
    if c.process.is_none() {
        c.process = v["id"]
            .as_str()
            .map(|id| process_id(id, c.worker.as_deref()));
    }
    if !v["usage"].is_null() {
        c.usage = Some(
            serde_json::from_value(v["usage"].clone())
                .map_err(|e| ClientError::Stream(format!("bad usage in {data:?}: {e}")))?,
        );
    }
    let text = v["choices"][0]["text"].as_str().unwrap_or("");
    if !text.is_empty() {
        c.chunk_times.push(at);
    }
    Ok(())
}

/// `cmpl-proc-3` -> `proc-3`, or `w1~proc-3` when a controller named worker `w1`.
fn process_id(completion_id: &str, worker: Option<&str>) -> String {
    let local = completion_id.strip_prefix("cmpl-").unwrap_or(completion_id);
    match worker {
        Some(w) if !local.contains('~') => format!("{w}~{local}"),
        _ => local.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_give_times_process_and_usage() {
        let mut c = Completion {
            worker: Some("w2".into()),
            ..Completion::default()
        };
        let ms = Duration::from_millis;
        let text =
            r#"{"id":"cmpl-proc-7","choices":[{"index":0,"text":"a","finish_reason":null}]}"#;
        read_chunk(&mut c, text, ms(40)).unwrap();
        read_chunk(&mut c, &text.replace("\"a\"", "\"b\""), ms(55)).unwrap();
        let stop =
            r#"{"id":"cmpl-proc-7","choices":[{"index":0,"text":"","finish_reason":"length"}]}"#;
        read_chunk(&mut c, stop, ms(56)).unwrap();
        let usage = r#"{"id":"cmpl-proc-7","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        read_chunk(&mut c, usage, ms(57)).unwrap();
        assert_eq!(c.process.as_deref(), Some("w2~proc-7"));
        assert_eq!(c.ttft(), Some(ms(40)));
        assert_eq!(c.inter_chunk(), vec![ms(15)]);
        let u = c.usage.unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (9, 2));
        assert_eq!(u.prompt_tokens_details.cached_tokens, 4);
    }

    #[test]
    fn error_events_and_garbage_are_stream_errors() {
        let mut c = Completion::default();
        let err = r#"{"error":{"message":"the process was killed","code":500}}"#;
        assert_eq!(
            read_chunk(&mut c, err, Duration::ZERO),
            Err(ClientError::Stream("the process was killed".into()))
        );
        let bad = read_chunk(&mut c, "not json", Duration::ZERO).unwrap_err();
        assert_eq!(bad.kind(), "stream");
        assert_eq!(process_id("cmpl-proc-1", None), "proc-1");
    }
}
