//! `pie bench` from its arguments: build the request list (a named workload
//! with `key=value` overrides, seeded, or the first records of a JSONL trace),
//! run it, print the table, write the JSON.
//! The `pie` binary parses the flags into [`BenchCommand`] and calls [`BenchCommand::run`].

use std::path::PathBuf;

use pie_workload::{read_trace, trace_requests, Request, WorkloadSpec};
use serde_json::{json, Value};

use crate::bench::{self, BenchConfig};
use crate::report::Report;

#[derive(Clone, Debug)]
pub struct BenchCommand {
    pub url: String,
    pub workload: String,
    /// `key=value` overrides of the workload's parameters.
    pub set: Vec<String>,
    /// Replay this JSONL trace (Mooncake format) instead of a workload.
    pub trace: Option<PathBuf>,
    pub requests: usize,
    pub seed: u64,
    pub concurrency: Option<usize>,
    pub vocab: Option<u32>,
    pub out: Option<PathBuf>,
    pub progress: bool,
}

impl BenchCommand {
    /// Run the benchmark on a new tokio runtime; print the table; write `out`.
    pub fn run(&self) -> Result<Report, String> {
        let (requests, workload) = self.requests()?;
        let config = BenchConfig {
            url: self.url.clone(),
            requests,
            concurrency: self.concurrency,
            vocab: self.vocab,
            progress: self.progress,
            workload,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("starting the async runtime: {e}"))?;
        let report = rt.block_on(bench::run(config))?;
        print!("{}", report.summary.table());
        if let Some(path) = &self.out {
            let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
            std::fs::write(path, json).map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        Ok(report)
    }

    /// The requests and a description of where they came from.
    fn requests(&self) -> Result<(Vec<Request>, Value), String> {
        let Some(path) = &self.trace else {
            let spec = WorkloadSpec::named(&self.workload)?.with_overrides(&self.set)?;
            let described = json!({"spec": spec, "requests": self.requests, "seed": self.seed});
            return Ok((spec.generate(self.requests, self.seed), described));
        };
        if !self.set.is_empty() {
            return Err("--set does not apply to a trace".into());
        }
        let file = std::fs::File::open(path)
            .map_err(|e| format!("opening trace file {}: {e}", path.display()))?;
        let mut records = read_trace(std::io::BufReader::new(file))
            .map_err(|e| format!("trace file {}: {e}", path.display()))?;
        records.truncate(self.requests);
        let described = json!({"trace": path, "requests": records.len()});
        Ok((trace_requests(&records), described))
    }
}
