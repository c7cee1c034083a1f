//! Running a workload against a URL (a worker or a controller): open-loop at
//! the requests' arrival times, or closed-loop with N requests in flight. A later
//! turn of a conversation is sent `think_us` after the turn it follows finished,
//! with that turn's prompt, the tokens it actually generated and its own new
//! tokens, so prefix caching and `keep-session` see what a real chat would send.
//! `/metrics` is scraped before and after for the server's prefix-cache counters.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pie_workload::{Request, Segment};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::{Client, ClientError, Completion};
use crate::prom;
use crate::report::{Record, Report, ServerCounters, Summary};

/// Worker counters (see `pie-worker`'s `metrics.rs`).
pub const HIT_TOKENS_METRIC: &str = "pie_prefix_cache_hit_tokens_total";
pub const PROMPT_TOKENS_METRIC: &str = "pie_prompt_tokens_total";

pub struct BenchConfig {
    pub url: String,
    pub requests: Vec<Request>,
    /// `None`: open loop at the arrival times; `Some(n)`: n requests in flight.
    pub concurrency: Option<usize>,
    /// Token ids are taken modulo this; `None`: the server's `vocab_size`.
    pub vocab: Option<u32>,
    /// Show a progress bar on stderr.
    pub progress: bool,
    /// What the requests came from, copied into the report.
    pub workload: Value,
}

/// Run every request and report.
pub async fn run(cfg: BenchConfig) -> Result<Report, String> {
    let client = Client::new(&cfg.url);
    let (model, served_vocab) = client
        .model()
        .await
        .map_err(|e| format!("{}/v1/models: {e}", cfg.url))?;
    let vocab = cfg
        .vocab
        .or(served_vocab)
        .filter(|v| *v > 0)
        .ok_or_else(|| {
            format!(
                "{} reports no vocab_size for `{model}`; pass --vocab",
                cfg.url
            )
        })?;
    let before = client.metrics().await.ok();
    let total = cfg.requests.len();
    let runner = Arc::new(Runner {
        client: client.clone(),
        model: model.clone(),
        vocab,
        start: Instant::now(),
        slots: cfg.concurrency.map(|n| Arc::new(Semaphore::new(n.max(1)))),
        progress: Progress::new(total, cfg.progress),
        children: children_of(&cfg.requests),
        requests: cfg.requests,
    });
    let records = runner.clone().run_all().await?;
    runner.progress.finish();
    let after = client.metrics().await.ok();
    let mut summary = Summary::of(&records);
    summary.url = cfg.url;
    summary.model = model;
    summary.mode = match cfg.concurrency {
        None => "open-loop".into(),
        Some(n) => format!("closed-loop (concurrency {n})"),
    };
    summary.server = server_counters(before.as_deref(), after.as_deref());
    Ok(Report {
        summary,
        workload: cfg.workload,
        records,
    })
}

fn server_counters(before: Option<&str>, after: Option<&str>) -> ServerCounters {
    let (Some(b), Some(a)) = (before, after) else {
        return ServerCounters::default();
    };
    ServerCounters::new(
        prom::delta(b, a, HIT_TOKENS_METRIC),
        prom::delta(b, a, PROMPT_TOKENS_METRIC),
    )
}

/// For each request, the later turns that follow it.
fn children_of(requests: &[Request]) -> Vec<Vec<usize>> {
    let mut children = vec![Vec::new(); requests.len()];
    for (i, r) in requests.iter().enumerate() {
        if let Some(f) = r.follows.filter(|f| f.request < i) {
            children[f.request].push(i);
        }
    }
    children
}

fn is_root(i: usize, r: &Request) -> bool {
    r.follows.is_none_or(|f| f.request >= i)
}

struct Runner {
    client: Client,
    model: String,
    vocab: u32,
    start: Instant,
    requests: Vec<Request>,
    children: Vec<Vec<usize>>,
    slots: Option<Arc<Semaphore>>,
    progress: Progress,
}

/// A finished request: its record and, if a later turn follows it, the
/// conversation so far (prompt + generated tokens).
struct Done {
    record: Record,
    conversation: Vec<u32>,
}

impl Runner {
    async fn run_all(self: Arc<Self>) -> Result<Vec<Record>, String> {
        let mut tasks = JoinSet::new();
        for (i, r) in self.requests.iter().enumerate() {
            if is_root(i, r) {
                let at = match self.slots {
                    None => self.start + Duration::from_micros(r.arrival_us),
                    Some(_) => self.start,
                };
                tasks.spawn(self.clone().turn(i, Vec::new(), at));
            }
        }
        let mut records: Vec<Option<Record>> = vec![None; self.requests.len()];
        while let Some(joined) = tasks.join_next().await {
            let done = joined.map_err(|e| format!("a request task failed: {e}"))?;
            let i = done.record.index;
            for &c in &self.children[i] {
                let think = self.requests[c].follows.map_or(0, |f| f.think_us);
                let at = Instant::now() + Duration::from_micros(think);
                tasks.spawn(self.clone().turn(c, done.conversation.clone(), at));
            }
            records[i] = Some(done.record);
        }
        Ok(records.into_iter().flatten().collect())
    }

    /// Send request `i` at `at` (after a free slot, closed-loop) and record it.
    async fn turn(self: Arc<Self>, i: usize, conversation: Vec<u32>, at: Instant) -> Done {
        tokio::time::sleep_until(at.into()).await;
        let slot = match &self.slots {
            Some(s) => s.clone().acquire_owned().await.ok(),
            None => None,
        };
        let req = &self.requests[i];
        let prompt = self.prompt(req, conversation);
        let sent = self.start.elapsed();
        let result = self.client.complete(&self.body(req, &prompt)).await;
        let record = self.record(i, sent, prompt.len(), &result);
        drop(slot);
        self.progress.tick(record.ok());
        let conversation = if self.children[i].is_empty() {
            Vec::new()
        } else {
            self.conversation(req, prompt, result.ok()).await
        };
        Done {
            record,
            conversation,
        }
    }

    fn tokens(&self, segments: &[Segment]) -> Vec<u32> {
        let mut out = Vec::new();
        for s in segments {
            s.push_tokens(&mut out);
        }
        out.iter_mut().for_each(|t| *t %= self.vocab);
        out
    }

    /// The prompt: for a later turn, the conversation so far and the new segments.
    fn prompt(&self, req: &Request, conversation: Vec<u32>) -> Vec<u32> {
        let parent = req.follows.map(|f| &self.requests[f.request]);
        match parent.and_then(|p| new_segments(req, p)) {
            Some(new) if !conversation.is_empty() => {
                let mut prompt = conversation;
                prompt.extend(self.tokens(new));
                prompt
            }
            _ => self.tokens(&req.prompt),
        }
    }

    /// Prompt + generated tokens (the workload's output tokens if the server
    /// cannot say which it generated).
    async fn conversation(
        &self,
        req: &Request,
        mut prompt: Vec<u32>,
        done: Option<Completion>,
    ) -> Vec<u32> {
        let generated = match done.and_then(|c| c.process) {
            Some(p) => self.client.output_tokens(&p).await.ok(),
            None => None,
        };
        prompt.extend(generated.unwrap_or_else(|| self.tokens(&[req.output])));
        prompt
    }

    fn body(&self, req: &Request, prompt: &[u32]) -> Value {
        json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": req.output_len().max(1),
            "ignore_eos": true,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "props": req.props,
        })
    }

    fn record(
        &self,
        i: usize,
        sent: Duration,
        prompt_len: usize,
        result: &Result<Completion, ClientError>,
    ) -> Record {
        let req = &self.requests[i];
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let mut r = Record {
            index: i,
            client: req.client.clone(),
            class: req.class.clone(),
            sent_ms: ms(sent),
            prompt_tokens: prompt_len,
            deadline_ms: req.props.int("deadline-ms"),
            ..Record::default()
        };
        match result {
            Ok(c) => {
                r.worker = c.worker.clone();
                r.ttft_ms = c.ttft().map(ms);
                r.e2e_ms = ms(c.e2e);
                r.itl_ms = c.inter_chunk().into_iter().map(ms).collect();
                let usage = c.usage.unwrap_or_default();
                r.output_tokens = c.usage.map_or(c.chunk_times.len(), |u| u.completion_tokens);
                r.cached_tokens = usage.prompt_tokens_details.cached_tokens;
            }
            Err(e) => {
                r.e2e_ms = ms(self.start.elapsed().saturating_sub(sent));
                r.error_kind = Some(e.kind());
                r.error = Some(e.to_string());
            }
        }
        // A request that did not finish in time, or at all, missed its deadline.
        r.deadline_missed = r
            .deadline_ms
            .is_some_and(|d| !r.ok() || r.e2e_ms > d as f64);
        r
    }
}

/// The segments a later turn adds to the turn it follows (whose prompt and
/// output it starts with), or `None` if it does not extend that turn.
fn new_segments<'a>(req: &'a Request, parent: &Request) -> Option<&'a [Segment]> {
    let k = parent.prompt.len();
    let extends = req.prompt.len() > k
        && req.prompt[..k] == parent.prompt[..]
        && req.prompt[k] == parent.output;
    extends.then(|| &req.prompt[k + 1..])
}

/// Completed / failed counts on stderr: a bar redrawn in place on a terminal,
/// a line every tenth of the run otherwise.
struct Progress {
    total: usize,
    done: AtomicUsize,
    failed: AtomicUsize,
    start: Instant,
    show: bool,
    tty: bool,
}

impl Progress {
    fn new(total: usize, show: bool) -> Self {
        Self {
            total,
            done: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            start: Instant::now(),
            show,
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn tick(&self, ok: bool) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if !ok {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        if !self.show {
            return;
        }
        let total = self.total.max(1);
        let line = self.line(done, total);
        if self.tty {
            eprint!("\r{line}");
        } else if done * 10 / total != (done - 1) * 10 / total {
            eprintln!("{line}");
        }
    }

    fn line(&self, done: usize, total: usize) -> String {
        const WIDTH: usize = 30;
        let filled = done * WIDTH / total;
        format!(
            "[{}{}] {done}/{total} requests, {} failed, {:.1} s",
            "#".repeat(filled),
            "-".repeat(WIDTH - filled.min(WIDTH)),
            self.failed.load(Ordering::Relaxed),
            self.start.elapsed().as_secs_f64()
        )
    }

    fn finish(&self) {
        if self.show && self.tty {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_workload::WorkloadSpec;

    #[test]
    fn later_turns_extend_the_turn_they_follow() {
        let spec = WorkloadSpec::named("multi-turn")
            .and_then(|w| w.with_overrides(&["turns=3".to_string()]))
            .expect("built-in workload");
        let reqs = spec.generate(6, 1);
        let children = children_of(&reqs);
        assert_eq!(children[0], vec![1]);
        assert_eq!(children[1], vec![2]);
        assert!(is_root(0, &reqs[0]) && !is_root(1, &reqs[1]));
        let new = new_segments(&reqs[1], &reqs[0]).expect("turn 1 extends turn 0");
        assert_eq!(new, &reqs[1].prompt[reqs[0].prompt.len() + 1..]);
        assert_eq!(new.len(), 1, "one new user message per turn");
        assert!(
            new_segments(&reqs[3], &reqs[0]).is_none(),
            "another conversation"
        );
    }
}
