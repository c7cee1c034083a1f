//! What happened to each request of a run ([`Record`]: arrival, first
//! token, finish, worker, tokens), kept by the simulation and summarised by
//! `metrics.rs`; `pie-sim run --records` writes them ([`write_records`]).

/// What happened to one request (times in microseconds since the start).
#[derive(Clone, Debug, Default)]
pub struct Record {
    pub arrival_us: u64,
    pub first_token_us: Option<u64>,
    pub finish_us: Option<u64>,
    pub worker: u32,
    /// The prefill-stage worker that prefilled it (`disaggregate`).
    pub prefill_worker: Option<u32>,
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    /// Prompt tokens served from the prefix cache at first scheduling.
    pub cached_tokens: Option<u32>,
    /// Stopped by the policy (`deadline-abort`).
    pub expired: bool,
    /// Could not fit the page pool.
    pub rejected: bool,
}

/// Microseconds as milliseconds.
pub fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// `pie-sim run --records FILE`: one JSON line per request, in workload order,
/// with the fields `pie bench --out` gives each request (times in ms), so a
/// simulated run can be set beside a real one request by request.
pub fn write_records(path: &std::path::Path, records: &[Record]) -> anyhow::Result<()> {
    use std::io::Write;
    let file = std::fs::File::create(path)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for (index, r) in records.iter().enumerate() {
        let since = |t: Option<u64>| t.map(|t| ms(t - r.arrival_us));
        let line = serde_json::json!({
            "index": index,
            "arrival_ms": ms(r.arrival_us),
            "ttft_ms": since(r.first_token_us),
            "e2e_ms": since(r.finish_us),
            "worker": r.worker,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.generated_tokens,
            "cached_tokens": r.cached_tokens,
        });
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    Ok(())
}
