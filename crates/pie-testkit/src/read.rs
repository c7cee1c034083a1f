//! Reading what servers answer, as clients do: SSE bodies and Prometheus
//! text through the production parsers, and polling until a condition holds.

use std::time::{Duration, Instant};

use pie_client::sse::SseParser;

/// Poll `f` every 20 ms until it holds; panic naming `what` after `within`.
pub async fn wait_for(what: &str, within: Duration, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An SSE body's `data:` payloads, in order, to its end.
pub async fn sse_data(mut resp: reqwest::Response) -> Vec<String> {
    let mut parser = SseParser::default();
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.expect("the stream reads") {
        out.extend(parser.push(&chunk).expect("events within the cap"));
    }
    out
}

/// One metric's value in Prometheus text, summed over its label sets (a
/// name with labels picks that series); 0 when absent.
pub fn metric_value(text: &str, name: &str) -> f64 {
    pie_client::prom::sum(text, name).unwrap_or(0.0)
}
