//! `pie bench` from its arguments: build the request list (a named workload
//! with `key=value` overrides, seeded), run it, print the table, write the JSON.
//! The `pie` binary parses the flags into [`BenchCommand`] and calls [`BenchCommand::run`].

use std::path::PathBuf;

use pie_workload::WorkloadSpec;

use crate::bench::{self, BenchConfig};
use crate::report::Report;

#[derive(Clone, Debug)]
pub struct BenchCommand {
    pub url: String,
    pub workload: String,
    /// `key=value` overrides of the workload's parameters.
    pub set: Vec<String>,
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
        let spec = WorkloadSpec::named(&self.workload)?.with_overrides(&self.set)?;
        let config = BenchConfig {
            url: self.url.clone(),
            requests: spec.generate(self.requests, self.seed),
            concurrency: self.concurrency,
            vocab: self.vocab,
            progress: self.progress,
            workload: serde_json::json!({"spec": spec, "requests": self.requests, "seed": self.seed}),
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
}
