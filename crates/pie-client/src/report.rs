//! What `pie bench` reports: one [`Record`] per request, the [`Summary`]
//! (latency percentiles, throughput, prefix hits, per-client service, deadline
//! misses, errors by kind), its text table, and the JSON [`Report`].

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::stats::Percentiles;

/// What one request experienced (times in ms; `sent_ms` since the bench start).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub index: usize,
    pub client: String,
    pub class: String,
    /// The worker that served it, when a controller said (`x-pie-worker`).
    pub worker: Option<String>,
    pub sent_ms: f64,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    /// Gaps between streamed chunks.
    pub itl_ms: Vec<f64>,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub cached_tokens: usize,
    /// The `deadline-ms` prop, if any; missed when `e2e_ms` exceeds it (the
    /// worker's rule: finished later than arrival + `deadline-ms`).
    pub deadline_ms: Option<i64>,
    pub deadline_missed: bool,
    /// `http 429`, `transport`, `stream`: why it failed.
    pub error_kind: Option<String>,
    pub error: Option<String>,
}

impl Record {
    pub fn ok(&self) -> bool {
        self.error_kind.is_none()
    }

    fn end_ms(&self) -> f64 {
        self.sent_ms + self.e2e_ms
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClientService {
    pub requests: usize,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
}

/// Prefix-cache counters from the server's `/metrics`, before/after deltas
/// (absent when the server does not export them, e.g. a controller).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerCounters {
    pub prefix_hit_tokens: Option<f64>,
    /// Prompt tokens the server computed (prefill).
    pub prompt_tokens_computed: Option<f64>,
    pub prefix_hit_rate: Option<f64>,
}

impl ServerCounters {
    pub fn new(prefix_hit_tokens: Option<f64>, prompt_tokens_computed: Option<f64>) -> Self {
        let prefix_hit_rate = match (prefix_hit_tokens, prompt_tokens_computed) {
            (Some(h), Some(p)) if h + p > 0.0 => Some(h / (h + p)),
            _ => None,
        };
        Self {
            prefix_hit_tokens,
            prompt_tokens_computed,
            prefix_hit_rate,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub url: String,
    pub model: String,
    /// `open-loop` or `closed-loop (concurrency N)`.
    pub mode: String,
    pub requests: usize,
    pub completed: usize,
    /// Failed requests by kind (`http 503`, `transport`, `stream`).
    pub errors: BTreeMap<String, usize>,
    /// From the start until the last request ended.
    pub duration_s: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub cached_tokens: usize,
    pub output_tok_per_s: f64,
    /// Streamed tokens per second while every completed request was decoding
    /// at once (from the latest first token to the earliest last one): with
    /// all requests sent together, the serving path's counterpart of
    /// `pie engine-bench`'s aggregate decode. `None` when they never overlapped.
    #[serde(default)]
    pub all_decoding_tok_per_s: Option<f64>,
    pub req_per_s: f64,
    /// `cached_tokens / prompt_tokens` from the responses' usage.
    pub prefix_hit_rate: f64,
    pub server: ServerCounters,
    pub per_client: BTreeMap<String, ClientService>,
    pub deadline_requests: usize,
    pub deadline_misses: usize,
}

/// Each streamed text chunk's arrival (ms since the bench start): one per token,
/// except bytes held back until they form a character, which arrive with the next.
fn chunk_arrivals(r: &Record) -> Vec<f64> {
    let Some(ttft) = r.ttft_ms else {
        return Vec::new();
    };
    let mut t = r.sent_ms + ttft;
    let mut out = vec![t];
    for gap in &r.itl_ms {
        t += gap;
        out.push(t);
    }
    out
}

/// See [`Summary::all_decoding_tok_per_s`]: chunks that arrived after the
/// latest first token, up to the earliest last one, over that window.
fn all_decoding_tok_per_s(done: &[&Record]) -> Option<f64> {
    let streams: Vec<Vec<f64>> = done.iter().map(|r| chunk_arrivals(r)).collect();
    if streams.is_empty() || streams.iter().any(|s| s.len() < 2) {
        return None;
    }
    let start = streams.iter().map(|s| s[0]).fold(f64::MIN, f64::max);
    let end = streams
        .iter()
        .map(|s| s[s.len() - 1])
        .fold(f64::MAX, f64::min);
    if end <= start {
        return None;
    }
    let chunks = streams
        .iter()
        .flatten()
        .filter(|&&t| t > start && t <= end)
        .count();
    Some(chunks as f64 / ((end - start) / 1000.0))
}

impl Summary {
    /// Summarise `records` (completed ones for latencies and tokens).
    pub fn of(records: &[Record]) -> Self {
        let done: Vec<&Record> = records.iter().filter(|r| r.ok()).collect();
        let mut s = Summary {
            requests: records.len(),
            completed: done.len(),
            duration_s: records.iter().map(Record::end_ms).fold(0.0, f64::max) / 1000.0,
            ttft_ms: Percentiles::of(done.iter().filter_map(|r| r.ttft_ms).collect()),
            itl_ms: Percentiles::of(done.iter().flat_map(|r| r.itl_ms.clone()).collect()),
            e2e_ms: Percentiles::of(done.iter().map(|r| r.e2e_ms).collect()),
            ..Summary::default()
        };
        for r in records {
            if let Some(kind) = &r.error_kind {
                *s.errors.entry(kind.clone()).or_default() += 1;
            }
        }
        for r in &done {
            s.prompt_tokens += r.prompt_tokens;
            s.output_tokens += r.output_tokens;
            s.cached_tokens += r.cached_tokens;
            let c = s.per_client.entry(r.client.clone()).or_default();
            c.requests += 1;
            c.prompt_tokens += r.prompt_tokens;
            c.output_tokens += r.output_tokens;
        }
        let with_deadline = records.iter().filter(|r| r.deadline_ms.is_some());
        s.deadline_requests = with_deadline.clone().count();
        s.deadline_misses = with_deadline.filter(|r| r.deadline_missed).count();
        if s.duration_s > 0.0 {
            s.output_tok_per_s = s.output_tokens as f64 / s.duration_s;
            s.req_per_s = s.completed as f64 / s.duration_s;
        }
        s.all_decoding_tok_per_s = all_decoding_tok_per_s(&done);
        if s.prompt_tokens > 0 {
            s.prefix_hit_rate = s.cached_tokens as f64 / s.prompt_tokens as f64;
        }
        s
    }

    fn all_decoding_line(&self) -> String {
        match self.all_decoding_tok_per_s {
            Some(rate) => format!(
                "; {rate:.1} tok/s while all {} streams decoded",
                self.completed
            ),
            None => String::new(),
        }
    }

    /// The human-readable table `pie bench` prints.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "pie bench: {} ({}), {}\n{} requests, {} completed, {:.1} s",
            self.url, self.model, self.mode, self.requests, self.completed, self.duration_s
        );
        let _ = writeln!(
            t,
            "{:<10} {:>10} {:>10} {:>10} {:>10}",
            "ms", "p50", "p90", "p99", "mean"
        );
        for (name, p) in [
            ("ttft", &self.ttft_ms),
            ("itl", &self.itl_ms),
            ("e2e", &self.e2e_ms),
        ] {
            let _ = writeln!(
                t,
                "{name:<10} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                p.p50, p.p90, p.p99, p.mean
            );
        }
        let _ = writeln!(
            t,
            "throughput: {:.1} output tok/s, {:.2} req/s{}",
            self.output_tok_per_s,
            self.req_per_s,
            self.all_decoding_line()
        );
        let _ = writeln!(
            t,
            "prefix hits: {}/{} prompt tokens cached ({:.1}%){}",
            self.cached_tokens,
            self.prompt_tokens,
            100.0 * self.prefix_hit_rate,
            self.server_line()
        );
        self.tail(&mut t);
        t
    }

    fn server_line(&self) -> String {
        match (self.server.prefix_hit_tokens, self.server.prefix_hit_rate) {
            (Some(h), Some(r)) => {
                format!("; server /metrics: {h:.0} hit tokens ({:.1}%)", 100.0 * r)
            }
            _ => "; server /metrics: no prefix-cache counters".into(),
        }
    }

    fn tail(&self, t: &mut String) {
        if self.per_client.len() > 1 {
            let _ = writeln!(t, "per client (requests, prompt + output tokens):");
            for (name, c) in &self.per_client {
                let _ = writeln!(
                    t,
                    "  {name:<16} {:>6} {:>10}",
                    c.requests,
                    c.prompt_tokens + c.output_tokens
                );
            }
        }
        if self.deadline_requests > 0 {
            let _ = writeln!(
                t,
                "deadline misses: {}/{}",
                self.deadline_misses, self.deadline_requests
            );
        }
        if !self.errors.is_empty() {
            let list: Vec<String> = self
                .errors
                .iter()
                .map(|(k, n)| format!("{k}: {n}"))
                .collect();
            let _ = writeln!(t, "errors: {}", list.join(", "));
        }
    }
}

/// Everything `--out` writes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub summary: Summary,
    /// The workload spec (or trace file) the requests came from.
    pub workload: serde_json::Value,
    pub records: Vec<Record>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: usize, client: &str, e2e: f64, deadline: Option<i64>) -> Record {
        Record {
            index: i,
            client: client.into(),
            sent_ms: 1000.0 * i as f64,
            ttft_ms: Some(e2e / 4.0),
            e2e_ms: e2e,
            itl_ms: vec![10.0, 20.0],
            prompt_tokens: 100,
            output_tokens: 10,
            cached_tokens: 50,
            deadline_ms: deadline,
            deadline_missed: deadline.is_some_and(|d| e2e > d as f64),
            ..Record::default()
        }
    }

    #[test]
    fn summary_counts_tokens_clients_deadlines_and_errors() {
        let mut failed = record(3, "b", 0.0, None);
        failed.error_kind = Some("http 429".into());
        let records = vec![
            record(0, "a", 400.0, Some(300)),
            record(1, "a", 200.0, Some(300)),
            record(2, "b", 1000.0, None),
            failed,
        ];
        let s = Summary::of(&records);
        assert_eq!((s.requests, s.completed), (4, 3));
        assert_eq!(s.errors.get("http 429"), Some(&1));
        assert_eq!(s.output_tokens, 30);
        assert_eq!(s.prefix_hit_rate, 0.5);
        assert_eq!(s.duration_s, 3.0, "the failed request ended at 3000 ms");
        assert_eq!(s.output_tok_per_s, 10.0);
        assert_eq!(s.per_client["a"].requests, 2);
        assert_eq!((s.deadline_requests, s.deadline_misses), (2, 1));
        assert_eq!(s.e2e_ms.p50, 400.0);
        assert!(s.table().contains("errors: http 429: 1"), "{}", s.table());
    }

    #[test]
    fn all_decoding_rate_counts_only_the_window_where_every_stream_ran() {
        let stream = |sent: f64, ttft: f64, gaps: usize| Record {
            sent_ms: sent,
            ttft_ms: Some(ttft),
            itl_ms: vec![10.0; gaps],
            ..Record::default()
        };
        // First tokens at 100 and 150 ms; last tokens at 200 and 250 ms:
        // the window is (150, 200], where each stream sent 5 chunks.
        let s = Summary::of(&[stream(0.0, 100.0, 10), stream(50.0, 100.0, 10)]);
        let rate = s.all_decoding_tok_per_s.expect("the streams overlapped");
        assert!((rate - 10.0 / 0.05).abs() < 1e-6, "{rate}");
        assert!(s
            .table()
            .contains("200.0 tok/s while all 2 streams decoded"));
        // One after the other: no moment where both decoded.
        let s = Summary::of(&[stream(0.0, 10.0, 2), stream(500.0, 10.0, 2)]);
        assert_eq!(s.all_decoding_tok_per_s, None);
        assert!(!s.table().contains("while all"));
    }

    #[test]
    fn server_hit_rate_needs_both_counters() {
        assert_eq!(
            ServerCounters::new(Some(30.0), Some(70.0)).prefix_hit_rate,
            Some(0.3)
        );
        assert_eq!(ServerCounters::new(Some(30.0), None).prefix_hit_rate, None);
    }
}
