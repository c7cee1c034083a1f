//! `pie-sim compare --plots DIR`: the comparison's SVG charts, one series per
//! run: TTFT CDF, output throughput, prefix hit rate, deadline misses, and per
//! run the per-client service over time (fairness).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::metrics::RunMetrics;
use crate::svg::{bar_chart, line_chart, Chart, Series};

/// A run's name in legends: policy / router, and keep-session when on.
pub fn run_label(r: &RunMetrics) -> String {
    let keep = if r.keep_session { " +keep-session" } else { "" };
    format!("{} / {}{keep}", r.policy, r.router)
}

fn ttft_cdf(runs: &[RunMetrics]) -> String {
    let series: Vec<Series> = runs
        .iter()
        .map(|r| Series {
            label: run_label(r),
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
    let bars: Vec<(String, f64)> = runs.iter().map(|r| (run_label(r), f(r))).collect();
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
    files
        .into_iter()
        .map(|(name, svg)| {
            let path = dir.join(name);
            std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        })
        .collect()
}
