//! `pie-sim compare --plots DIR`: the comparison's SVG charts, one series per
//! run: TTFT CDF, output throughput, prefix hit rate, deadline misses, and per
//! run the per-client service over time (fairness); with an autoscaled run
//! (or fleets of several sizes), the started workers over time and the
//! arrival rate the fleet followed.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::metrics::RunMetrics;
use crate::svg::{bar_chart, line_chart, Chart, Series};
use crate::tables::fleet_label;

/// A run's name in legends: policy / router, and keep-session when on.
pub fn run_label(r: &RunMetrics) -> String {
    let keep = if r.keep_session { " +keep-session" } else { "" };
    format!("{} / {}{keep}", r.policy, r.router)
}

/// Whether the runs differ in their fleets (an autoscaled one, or fixed ones
/// of several sizes): their labels then name it.
fn fleets_differ(runs: &[RunMetrics]) -> bool {
    runs.iter().any(|r| r.fleet.is_some()) || runs.iter().any(|r| r.workers != runs[0].workers)
}

/// The runs' names in legends: [`run_label`], and the fleet where fleets
/// differ.
pub fn labels(runs: &[RunMetrics]) -> Vec<String> {
    let fleets = fleets_differ(runs);
    (runs.iter())
        .map(|r| match fleets {
            true => format!("{} / {}", run_label(r), fleet_label(r)),
            false => run_label(r),
        })
        .collect()
}

fn ttft_cdf(runs: &[RunMetrics]) -> String {
    let labels = labels(runs);
    let series: Vec<Series> = runs
        .iter()
        .zip(labels)
        .map(|(r, label)| Series {
            label,
            // Up to p99: the last percent would flatten the rest.
            points: (r.ttft_cdf_ms.iter().enumerate().take(100))
                .map(|(p, &ms)| (ms, p as f64 / 100.0))
                .collect(),
        })
        .collect();
    let title = format!("TTFT CDF (to p99): {}", runs[0].workload);
    let chart = Chart {
        title: &title,
        x_label: "time to first token (ms)",
        y_label: "fraction of requests",
    };
    line_chart(&chart, &series)
}

fn bars(runs: &[RunMetrics], title: &str, y_label: &str, f: fn(&RunMetrics) -> f64) -> String {
    let bars: Vec<(String, f64)> = (labels(runs).into_iter())
        .zip(runs)
        .map(|(label, r)| (label, f(r)))
        .collect();
    let title = format!("{title}: {}", runs[0].workload);
    let chart = Chart {
        title: &title,
        x_label: "",
        y_label,
    };
    bar_chart(&chart, &bars)
}

fn miss_percent(r: &RunMetrics) -> f64 {
    if r.deadline_requests == 0 {
        return 0.0;
    }
    100.0 * r.deadline_misses as f64 / r.deadline_requests as f64
}

fn service(r: &RunMetrics) -> String {
    let s = &r.service_over_time;
    let series: Vec<Series> = s
        .clients
        .iter()
        .map(|(client, rates)| Series {
            label: client.clone(),
            points: (rates.iter().enumerate())
                .map(|(i, &v)| ((i as f64 + 0.5) * s.bucket_s, v))
                .collect(),
        })
        .collect();
    let title = format!("Per-client service: {}", run_label(r));
    let chart = Chart {
        title: &title,
        x_label: "simulated time (s)",
        y_label: "tokens/s served",
    };
    line_chart(&chart, &series)
}

/// Started workers over time, one step line per run (a fixed fleet is flat).
fn fleet(runs: &[RunMetrics]) -> String {
    let series: Vec<Series> = (labels(runs).into_iter())
        .zip(runs)
        .map(|(label, r)| {
            let mut points = Vec::new();
            let mut started = match &r.fleet {
                Some(f) => f.initial_workers,
                None => r.workers,
            } as f64;
            points.push((0.0, started));
            for e in r.fleet.iter().flat_map(|f| &f.events) {
                let t = e.at_ms / 1000.0;
                points.push((t, started));
                started = e.started as f64;
                points.push((t, started));
            }
            points.push((r.sim_time_s, started));
            Series { label, points }
        })
        .collect();
    let title = format!("Workers started: {}", runs[0].workload);
    let chart = Chart {
        title: &title,
        x_label: "simulated time (s)",
        y_label: "workers (booting, serving, draining)",
    };
    line_chart(&chart, &series)
}

/// The arrival rate the fleet followed (the first autoscaled run's).
fn arrivals(runs: &[RunMetrics]) -> Option<String> {
    let f = runs.iter().find_map(|r| r.fleet.as_ref())?;
    let series = [Series {
        label: "arrivals".into(),
        points: (f.arrivals_per_s.iter().enumerate())
            .map(|(i, &v)| ((i as f64 + 0.5) * f.arrivals_bucket_s, v))
            .collect(),
    }];
    let title = format!("Arrival rate: {}", runs[0].workload);
    let chart = Chart {
        title: &title,
        x_label: "simulated time (s)",
        y_label: "requests/s",
    };
    Some(line_chart(&chart, &series))
}

/// Write the charts of `runs` into `dir` (created if missing); returns the paths.
pub fn write(dir: &Path, runs: &[RunMetrics]) -> Result<Vec<PathBuf>> {
    anyhow::ensure!(!runs.is_empty(), "no runs to plot");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut files = vec![
        ("ttft-cdf.svg".to_string(), ttft_cdf(runs)),
        (
            "throughput.svg".into(),
            bars(runs, "Output throughput", "tokens/s", |r| {
                r.output_tokens_per_s
            }),
        ),
        (
            "prefix-hit.svg".into(),
            bars(runs, "Prefix cache hit rate", "% of prompt tokens", |r| {
                100.0 * r.prefix_hit_rate
            }),
        ),
        (
            "deadline-misses.svg".into(),
            bars(
                runs,
                "Deadline misses",
                "% of requests with deadline-ms",
                miss_percent,
            ),
        ),
    ];
    for (i, r) in runs.iter().enumerate() {
        files.push((format!("service-{i}.svg"), service(r)));
    }
    if fleets_differ(runs) {
        files.push(("fleet.svg".into(), fleet(runs)));
        if let Some(svg) = arrivals(runs) {
            files.push(("arrivals.svg".into(), svg));
        }
    }
    files
        .into_iter()
        .map(|(name, svg)| {
            let path = dir.join(name);
            std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        })
        .collect()
}
