//! Running a simulation for its metrics: [`run`] and its variants simulate
//! a workload on a configuration (`sim`) and summarise it (`metrics`).

use std::time::Instant;

use pie_policy::WorkerPolicy;

use crate::config::SimConfig;
use crate::metrics::RunMetrics;
use crate::records::Record;
use crate::sim::simulate;
use crate::workload::Request;

/// Simulate `reqs` on the configured cluster; every request finishes (or is
/// rejected or aborted), and the metrics say so.
pub fn run(cfg: &SimConfig, workload: &str, reqs: &[Request]) -> anyhow::Result<RunMetrics> {
    run_with(cfg, workload, reqs, &|| cfg.policy.build_with(&cfg.runtime))
}

/// [`run`] with each worker's ordering policy made by `policy` instead of
/// `cfg.policy` (the metrics still name `cfg.policy`): any `WorkerPolicy` object.
pub fn run_with(
    cfg: &SimConfig,
    workload: &str,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<RunMetrics> {
    run_records_with(cfg, workload, reqs, policy).map(|(m, _)| m)
}

/// [`run`], with what happened to each request (the worker that served it,
/// its arrival, first token and finish).
pub fn run_records(
    cfg: &SimConfig,
    workload: &str,
    reqs: &[Request],
) -> anyhow::Result<(RunMetrics, Vec<Record>)> {
    run_records_with(cfg, workload, reqs, &|| cfg.policy.build_with(&cfg.runtime))
}

fn run_records_with(
    cfg: &SimConfig,
    workload: &str,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<(RunMetrics, Vec<Record>)> {
    let started = Instant::now();
    let outcome = simulate(cfg, reqs, policy)?;
    let wall_s = started.elapsed().as_secs_f64();
    let metrics = RunMetrics::compute(cfg, workload, reqs, &outcome, wall_s);
    Ok((metrics, outcome.records))
}
