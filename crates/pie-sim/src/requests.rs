//! The request list a run simulates: a named generator (`--workload NAME`, its
//! parameters overridden by `--set key=value`, its rates multiplied by the
//! workers and `--load`), or a JSONL trace (`--workload trace --trace FILE`,
//! replayed at `--load` times its speed).

use std::path::Path;

use anyhow::{Context, Result};
use pie_workload::{read_trace, trace_requests, Request, WorkloadSpec};

/// Requests when `--requests` is not given, for the generators.
pub const DEFAULT_REQUESTS: usize = 2000;

/// What to simulate.
pub struct Input<'a> {
    pub workload: &'a str,
    pub trace: Option<&'a Path>,
    pub overrides: &'a [String],
    /// A generator's count; a trace's first this many records (all if None).
    pub requests: Option<usize>,
    pub seed: u64,
    pub workers: usize,
    pub load: f64,
}

/// The workload's name and its requests.
pub fn load(input: &Input) -> Result<(String, Vec<Request>)> {
    anyhow::ensure!(
        input.load.is_finite() && input.load > 0.0,
        "--load must be positive"
    );
    match (input.workload, input.trace) {
        ("trace", Some(path)) => Ok(("trace".into(), replay(path, input)?)),
        ("trace", None) => anyhow::bail!("--workload trace needs --trace FILE"),
        (_, Some(_)) => anyhow::bail!("--trace is only read with --workload trace"),
        (name, None) => {
            let mut spec = WorkloadSpec::named(name)
                .and_then(|s| s.with_overrides(input.overrides))
                .map_err(anyhow::Error::msg)?;
            spec.scale_rate(input.load * input.workers as f64);
            let n = input.requests.unwrap_or(DEFAULT_REQUESTS);
            Ok((spec.name().into(), spec.generate(n, input.seed)))
        }
    }
}

fn replay(path: &Path, input: &Input) -> Result<Vec<Request>> {
    anyhow::ensure!(
        input.overrides.is_empty(),
        "--set does not apply to a trace"
    );
    let file = std::fs::File::open(path)
        .with_context(|| format!("opening trace file {}", path.display()))?;
    let mut records = read_trace(std::io::BufReader::new(file))
        .map_err(|e| anyhow::anyhow!("trace file {}: {e}", path.display()))?;
    if let Some(n) = input.requests {
        records.truncate(n);
    }
    let mut reqs = trace_requests(&records);
    for r in &mut reqs {
        r.arrival_us = (r.arrival_us as f64 / input.load) as u64;
    }
    Ok(reqs)
}
