//! Every call the controller makes to a worker: [`WorkerClient`] holds the
//! HTTP client (connect and read timeouts) and the `[cluster] worker_key`
//! that authenticates the controller; [`Upstream`] is a worker's response
//! before its body is relayed. Failures are strings that name the timeout
//! that ended them ([`describe`]).

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::Response;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use serde_json::Value;

use crate::caller::Acting;
use crate::respond::error_event;

/// `req` authenticated with the controller's `[cluster] worker_key`, if any.
pub fn with_worker_key(req: reqwest::RequestBuilder, key: Option<&str>) -> reqwest::RequestBuilder {
    match key {
        Some(k) => req.bearer_auth(k),
        None => req,
    }
}

/// A worker request's failure, naming the timeout that ended it.
pub fn describe(e: &reqwest::Error) -> String {
    if e.is_connect() && e.is_timeout() {
        format!("no connection within connect_timeout_ms ({e})")
    } else if e.is_timeout() {
        format!("silent past read_timeout_ms ({e})")
    } else {
        e.to_string()
    }
}

/// The client for proxied requests, polls and internal calls to workers.
#[derive(Clone)]
pub struct WorkerClient {
    pub http: reqwest::Client,
    /// `[cluster] worker_key`: workers trust the controller's fields under it.
    pub key: Option<String>,
}

impl WorkerClient {
    /// A request to a worker under the worker key.
    pub fn request(&self, method: Method, url: &str) -> reqwest::RequestBuilder {
        with_worker_key(self.http.request(method, url), self.key.as_deref())
    }

    /// A request to a worker for `acting`'s client, under the worker key.
    pub fn acting(&self, acting: &Acting, method: Method, url: &str) -> reqwest::RequestBuilder {
        acting.apply(self.request(method, url))
    }

    /// Send one request to a worker; Err only when no response arrived at all.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &HeaderMap,
        acting: &Acting,
        body: Bytes,
    ) -> Result<Upstream, String> {
        let mut req = self.acting(acting, method, url).body(body);
        if let Some(ct) = headers.get("content-type") {
            req = req.header("content-type", ct);
        }
        let resp = req.send().await.map_err(|e| describe(&e))?;
        let relayed = ["content-type", "retry-after"]
            .into_iter()
            .filter_map(|name| Some((name.parse().ok()?, resp.headers().get(name)?.clone())))
            .collect();
        Ok(Upstream {
            status: resp.status(),
            relayed,
            body: resp.bytes_stream().boxed(),
        })
    }

    /// Send and relay the answer unbuffered.
    pub async fn forward(
        &self,
        method: Method,
        url: &str,
        headers: &HeaderMap,
        acting: &Acting,
        body: Bytes,
    ) -> Result<Response, String> {
        self.send(method, url, headers, acting, body)
            .await
            .map(Upstream::into_response)
    }

    /// POST `body` to a worker's internal route, acting for a stream's
    /// client (its cache salt): the status and JSON answer of any response.
    pub async fn post(
        self,
        url: String,
        acting: Acting,
        body: Value,
    ) -> Result<(StatusCode, Value), String> {
        let resp = self
            .acting(&acting, Method::POST, &url)
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        Ok((status, resp.json().await.unwrap_or(Value::Null)))
    }
}

/// A worker's response before its body is relayed.
pub struct Upstream {
    pub status: StatusCode,
    /// The worker's headers the client needs (`content-type`, `retry-after`).
    pub relayed: HeaderMap,
    pub body: BoxStream<'static, reqwest::Result<Bytes>>,
}

impl Upstream {
    /// Wait for the first bytes of the body: a worker that dies before sending
    /// any (e.g. while the request waited in its queue) is an Err, so the
    /// request can still go elsewhere; nothing has reached the client yet.
    pub async fn first_bytes(mut self) -> Result<Self, String> {
        match self.body.next().await {
            Some(Ok(first)) => {
                self.body = futures_util::stream::once(async move { Ok(first) })
                    .chain(self.body)
                    .boxed();
                Ok(self)
            }
            Some(Err(e)) => Err(format!(
                "the worker failed before responding: {}",
                describe(&e)
            )),
            None => {
                self.body = futures_util::stream::empty().boxed();
                Ok(self)
            }
        }
    }

    /// A response with the worker's status and relayed headers, its body
    /// made of the worker's by `relay`.
    pub fn relay_with(
        self,
        relay: impl FnOnce(BoxStream<'static, reqwest::Result<Bytes>>) -> Body,
    ) -> Response {
        let mut out = Response::new(relay(self.body));
        *out.status_mut() = self.status;
        out.headers_mut().extend(self.relayed);
        out
    }

    /// Relay unbuffered; a stream that breaks or stalls midway ends with an
    /// error event (and ends there: a stalled body would time out again).
    pub fn into_response(self) -> Response {
        self.relay_with(|body| {
            Body::from_stream(body.scan(false, |broken, chunk| {
                let out = match chunk {
                    _ if *broken => None,
                    Ok(b) => Some(b),
                    Err(e) => {
                        *broken = true;
                        Some(error_event(&format!(
                            "the worker's stream broke: {}",
                            describe(&e)
                        )))
                    }
                };
                std::future::ready(out.map(Ok::<Bytes, std::convert::Infallible>))
            }))
        })
    }
}
