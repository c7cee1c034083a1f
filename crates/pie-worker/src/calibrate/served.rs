//! `pie bench --calibrate --from-steps LOG...`: the same cost model fitted to
//! the steps serving workers logged (`[server] step_log`), so the simulator
//! runs at the speed the machine had while it served. On a machine whose
//! speed drifts by 20% over minutes, a calibration minutes before or after a
//! run misses by that much; these steps are the run's own.
//!
//! The spread comes from the same steps: each kind's mean over the fit, the
//! cv of every step's time over its prediction, and the lag-1
//! autocorrelation over consecutive steps of a kind that ran back to back
//! (the next one started within `BACK_TO_BACK_MS` of the last one's end; a
//! pair across an idle spell says nothing about slow swings). Prefills are
//! split by what came before them: an idle spell of `AFTER_IDLE_MS` or more
//! (the simulator's waking from idle) or a step sooner; with at least
//! `MIN_SPLIT` of each, the latter give the prefill mean and the former over
//! it the profile's `after_idle_factor`.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use pie_model::Model;
use pie_workload::{CostProfile, StepKind, AFTER_IDLE_MS};

use super::{
    describe, fit, pool, profile, series_spread, serve_engine_config, write_profile, Fit,
    KindSpread, Sample, Spread, ALL_TERMS,
};
use crate::step_log::{self, StepRecord};

/// A step that started this soon after the last one ended ran back to back.
const BACK_TO_BACK_MS: f64 = 2.0;
/// A step overlapped for at least this share of its time measures the host share.
const MOSTLY_SHARED: f64 = 0.75;
/// Prefills needed on each side of the idle split to measure it.
const MIN_SPLIT: usize = 3;

/// Fit the steps in `logs` (the engine limits from the model at `path`, as
/// `pie serve` runs it by default), print the fit, write the profile to `out`.
pub fn run(path: &Path, logs: &[PathBuf], out: &Path) -> Result<CostProfile> {
    let model = Model::load(path).with_context(|| format!("loading {}", path.display()))?;
    let serve = serve_engine_config(&model);
    let logged = step_log::read(logs)?;
    let overlaps = overlap_ms(&logged);
    let steps = alone(&logged, &overlaps);
    let dropped =
        logged.iter().map(Vec::len).sum::<usize>() - steps.iter().map(Vec::len).sum::<usize>();
    if dropped > 0 {
        println!("  {dropped} steps left out: they overlapped another worker's step");
    }
    let samples = samples(&steps);
    ensure!(
        !samples.is_empty(),
        "no steps in {}",
        logs.iter()
            .map(|l| l.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let fit = fit(&samples, ALL_TERMS).context("fitting the served steps")?;
    println!(
        "fitted {} served steps from {} log(s):\n  {}",
        samples.len(),
        logs.len(),
        describe(&fit)
    );
    let prefill = kind_spread(&steps, &fit, StepKind::Prefill);
    let decode = kind_spread(&steps, &fit, StepKind::Decode);
    for (name, (n, s)) in [("prefill", prefill), ("decode", decode)] {
        println!(
            "  {name} ({n} steps): cv {:.3}, p90/p50 {:.3}, lag-1 {:.2} (correlation time {:.1} ms), mean / fit {:.3}",
            s.cv, s.p90_over_p50, s.lag1, s.corr_ms, s.mean_over_fit
        );
    }
    let split = PrefillSplit::of(&steps, &fit);
    println!(
        "  prefills after {AFTER_IDLE_MS} ms idle or more: {} steps, mean / fit {:.3}; after a step sooner: {} steps, {:.3}",
        split.after_idle.0, split.after_idle.1, split.busy.0, split.busy.1
    );
    let (prefill_mean, after_idle_factor) = match split.factor() {
        Some(factor) => (split.busy.1, Some(factor)),
        None => {
            println!(
                "  too few of either to tell them apart: one prefill mean, no after-idle factor"
            );
            (prefill.1.mean_over_fit, None)
        }
    };
    let kind_mean = |kind| match kind {
        StepKind::Prefill => prefill.1.mean_over_fit,
        StepKind::Decode => decode.1.mean_over_fit,
    };
    let host_share = host_share(&logged, &overlaps, &fit, kind_mean);
    if let Some((n, share)) = host_share {
        println!("  host share: {share:.3} (from {n} steps overlapped for {MOSTLY_SHARED} of their time or more)");
    }
    let measured = KindSpread {
        pooled: pool(vec![
            (prefill.0 as f64, prefill.1),
            (decode.0 as f64, decode.1),
        ]),
        prefill: Spread {
            mean_over_fit: prefill_mean,
            ..prefill.1
        },
        decode: decode.1,
        after_idle_factor,
        host_share: host_share.map(|(_, share)| share),
    };
    let names: Vec<String> = logs
        .iter()
        .map(|l| {
            l.file_name()
                .map_or_else(|| l.display().to_string(), |f| f.to_string_lossy().into())
        })
        .collect();
    let how = format!(
        "pie bench --calibrate --from-steps ({} served steps: {})",
        samples.len(),
        names.join(", ")
    );
    write_profile(profile(path, &how, &serve, &fit, &measured), out)
}

/// For each step of each log, the time (ms) it overlapped steps of the other
/// logs, summed over them.
fn overlap_ms(logs: &[Vec<StepRecord>]) -> Vec<Vec<f64>> {
    let end = |r: &StepRecord| r.start_unix_ms + r.ms;
    logs.iter()
        .enumerate()
        .map(|(i, log)| {
            log.iter()
                .map(|r| {
                    logs.iter()
                        .enumerate()
                        .filter(|&(j, _)| j != i)
                        .flat_map(|(_, other)| other)
                        .map(|o| {
                            (end(r).min(end(o)) - r.start_unix_ms.max(o.start_unix_ms)).max(0.0)
                        })
                        .sum()
                })
                .collect()
        })
        .collect()
}

/// Each log's steps that overlapped no step of another log: workers sharing a
/// machine slow each other's overlapping steps, which the simulator adds
/// again (`host_share`), so the profile is fitted to a step's time alone.
fn alone(logs: &[Vec<StepRecord>], overlaps: &[Vec<f64>]) -> Vec<Vec<StepRecord>> {
    logs.iter()
        .zip(overlaps)
        .map(|(log, ov)| {
            log.iter()
                .zip(ov)
                .filter(|(_, &o)| o == 0.0)
                .map(|(r, _)| *r)
                .collect()
        })
        .collect()
}

/// The share of the host a step demands, from the steps that overlapped
/// others for at least `MOSTLY_SHARED` of their time: with `k` steps in
/// flight on average over its time (itself and the overlap), a step that
/// demands `u` takes `k * u` its time alone (when `k * u > 1`); the mean of
/// `time / (alone * k)`, clamped to (0, 1]. None without such steps.
fn host_share(
    logs: &[Vec<StepRecord>],
    overlaps: &[Vec<f64>],
    fit: &Fit,
    mean: impl Fn(StepKind) -> f64,
) -> Option<(usize, f64)> {
    let shares: Vec<f64> = logs
        .iter()
        .zip(overlaps)
        .flat_map(|(log, ov)| log.iter().zip(ov))
        .filter(|(r, &o)| o >= MOSTLY_SHARED * r.ms)
        .map(|(r, &o)| {
            let in_flight = 1.0 + o / r.ms;
            over_fit(r, fit) / mean(r.shape().kind()) / in_flight
        })
        .collect();
    (!shares.is_empty()).then(|| {
        let share = shares.iter().sum::<f64>() / shares.len() as f64;
        (shares.len(), share.clamp(f64::MIN_POSITIVE, 1.0))
    })
}

fn samples(steps: &[Vec<StepRecord>]) -> Vec<Sample> {
    steps
        .iter()
        .flatten()
        .map(|r| Sample::of(&r.shape(), r.ms))
        .collect()
}

fn over_fit(r: &StepRecord, fit: &Fit) -> f64 {
    r.ms / fit.predict(&Sample::of(&r.shape(), r.ms))
}

/// The spread of one kind's steps over the fit (with how many there were);
/// consecutive pairs only within one log and back to back.
fn kind_spread(steps: &[Vec<StepRecord>], fit: &Fit, kind: StepKind) -> (usize, Spread) {
    let mut ratios = Vec::new();
    let mut consecutive = Vec::new();
    let mut gaps = Vec::new();
    for log in steps {
        let mut previous: Option<(usize, &StepRecord)> = None;
        for r in log {
            if r.shape().kind() != kind {
                previous = None;
                continue;
            }
            let i = ratios.len();
            ratios.push(over_fit(r, fit));
            let back_to_back = r.idle_ms.is_some_and(|idle| idle < BACK_TO_BACK_MS);
            if let Some((j, p)) = previous.filter(|_| back_to_back) {
                consecutive.push((j, i));
                gaps.push(r.start_unix_ms - p.start_unix_ms);
            }
            previous = Some((i, r));
        }
    }
    if ratios.is_empty() {
        return (0, series_spread(&[1.0], &[], 0.0));
    }
    let dt = gaps.iter().sum::<f64>() / gaps.len().max(1) as f64;
    (ratios.len(), series_spread(&ratios, &consecutive, dt))
}

/// Prefills by what came before them: (steps, mean over the fit) each.
struct PrefillSplit {
    /// An idle spell of `AFTER_IDLE_MS` or more.
    after_idle: (usize, f64),
    /// Another step, sooner.
    busy: (usize, f64),
}

impl PrefillSplit {
    fn of(steps: &[Vec<StepRecord>], fit: &Fit) -> Self {
        let idle_limit = AFTER_IDLE_MS as f64;
        let mean_of = |woke: bool| {
            let ratios: Vec<f64> = steps
                .iter()
                .flatten()
                .filter(|r| r.shape().kind() == StepKind::Prefill)
                .filter(|r| r.idle_ms.is_some_and(|idle| (idle >= idle_limit) == woke))
                .map(|r| over_fit(r, fit))
                .collect();
            let n = ratios.len();
            (n, ratios.iter().sum::<f64>() / n.max(1) as f64)
        };
        Self {
            after_idle: mean_of(true),
            busy: mean_of(false),
        }
    }

    /// Prefills after idle over the others, when there are enough of both.
    fn factor(&self) -> Option<f64> {
        (self.after_idle.0 >= MIN_SPLIT && self.busy.0 >= MIN_SPLIT)
            .then(|| self.after_idle.1 / self.busy.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_workload::StepShape;

    const FLAT: Fit = Fit::flat(10.0);

    fn record(start: f64, ms: f64, idle_ms: Option<f64>, seqs: &[(usize, usize)]) -> StepRecord {
        let s = StepShape::of(seqs);
        StepRecord {
            start_unix_ms: start,
            ms,
            idle_ms,
            batch_tokens: s.batch_tokens,
            context_tokens: s.context_tokens,
            attention_pairs: s.attention_pairs,
            sequences: s.sequences,
        }
    }

    #[test]
    fn each_kind_is_measured_over_the_fit_and_pairs_across_idle_do_not_count() {
        // One log: a prefill after idle (15 ms), then decodes back to back
        // alternating 9 and 11 ms (anti-correlated), then an idle spell and
        // decodes alternating the other way round, so a pair across the
        // spell (11 then 11) would pull the lag-1 up.
        let mut log = vec![record(0.0, 15.0, Some(500.0), &[(256, 32)])];
        let mut t = 15.0;
        for i in 0..10 {
            let ms = if i % 2 == 0 { 9.0 } else { 11.0 };
            log.push(record(t, ms, Some(0.1), &[(288 + i, 1)]));
            t += ms + 0.1;
        }
        for i in 0..10 {
            let ms = if i % 2 == 0 { 11.0 } else { 9.0 };
            let idle = if i == 0 { 1000.0 } else { 0.1 };
            log.push(record(t + idle, ms, Some(idle), &[(300 + i, 1)]));
            t += idle + ms;
        }
        let (n, decode) = kind_spread(std::slice::from_ref(&log), &FLAT, StepKind::Decode);
        assert_eq!(n, 20);
        assert!((decode.mean_over_fit - 1.0).abs() < 1e-9, "{decode:?}");
        assert!((decode.cv - 0.1).abs() < 1e-9, "{decode:?}");
        assert!((decode.lag1 + 1.0).abs() < 1e-9, "{decode:?}");
        let (n, prefill) = kind_spread(std::slice::from_ref(&log), &FLAT, StepKind::Prefill);
        assert_eq!(n, 1);
        assert_eq!(prefill.cv, 0.0);
        let split = PrefillSplit::of(std::slice::from_ref(&log), &FLAT);
        assert_eq!((split.after_idle.0, split.busy.0), (1, 0));
        assert!((split.after_idle.1 - 1.5).abs() < 1e-9);
        assert_eq!(split.factor(), None, "one prefill measures no split");
    }

    #[test]
    fn prefills_after_idle_over_the_others_give_the_factor() {
        // Prefills after 500 ms idle take 12 ms, after 50 ms 10 ms (and the
        // first step, with no idle time known, counts as neither).
        let mut log = vec![record(0.0, 99.0, None, &[(0, 32)])];
        for i in 0..4 {
            let t = 1000.0 * (i + 1) as f64;
            log.push(record(t, 12.0, Some(500.0), &[(256, 32)]));
            log.push(record(t + 62.0, 10.0, Some(50.0), &[(256, 32)]));
        }
        let split = PrefillSplit::of(&[log], &FLAT);
        assert_eq!((split.after_idle.0, split.busy.0), (4, 4));
        assert!((split.busy.1 - 1.0).abs() < 1e-9);
        let factor = split.factor().expect("enough of both");
        assert!((factor - 1.2).abs() < 1e-9, "{factor}");
    }

    #[test]
    fn steps_overlapping_another_workers_are_left_out() {
        let a = vec![
            record(0.0, 10.0, None, &[(0, 32)]),
            record(20.0, 10.0, Some(10.0), &[(32, 1)]),
        ];
        let b = vec![
            record(5.0, 10.0, None, &[(0, 32)]),
            record(31.0, 10.0, Some(16.0), &[(32, 1)]),
        ];
        let logs = [a.clone(), b.clone()];
        let overlaps = overlap_ms(&logs);
        assert_eq!(overlaps, vec![vec![5.0, 0.0], vec![5.0, 0.0]]);
        assert_eq!(alone(&logs, &overlaps), vec![vec![a[1]], vec![b[1]]]);
        let one = std::slice::from_ref(&a);
        assert_eq!(alone(one, &overlap_ms(one)), vec![a]);
    }

    #[test]
    fn overlapped_steps_measure_the_host_share() {
        // Two workers' 10 ms steps (alone) fully overlapped, each taking 16 ms:
        // two in flight, 16 / (10 * 2) = 0.8 of the host each. A third log's
        // step alone measures nothing.
        let a = vec![record(0.0, 16.0, None, &[(288, 1)])];
        let b = vec![record(0.0, 16.0, None, &[(300, 1)])];
        let c = vec![record(100.0, 10.0, None, &[(300, 1)])];
        let logs = [a, b, c];
        let overlaps = overlap_ms(&logs);
        let (n, share) = host_share(&logs, &overlaps, &FLAT, |_| 1.0).expect("measured");
        assert_eq!(n, 2);
        assert!((share - 0.8).abs() < 1e-9, "{share}");
        let alone_only = [logs[2].clone()];
        assert_eq!(
            host_share(&alone_only, &overlap_ms(&alone_only), &FLAT, |_| 1.0),
            None
        );
    }

    #[test]
    fn served_steps_fit_the_model_they_were_made_by() {
        // Steps timed by a known linear model, from two workers' logs.
        let truth = |s: &StepShape| {
            5.0 + 0.2 * s.batch_tokens as f64
                + 0.004 * s.context_tokens as f64
                + 1e-4 * s.attention_pairs as f64
        };
        let shapes: [&[(usize, usize)]; 5] = [
            &[(0, 288)],
            &[(256, 32)],
            &[(288, 1)],
            &[(300, 1), (290, 1), (310, 1)],
            &[(256, 32), (290, 1)],
        ];
        let log = |offset: f64| -> Vec<StepRecord> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, seqs)| {
                    let s = StepShape::of(seqs);
                    record(offset + 100.0 * i as f64, truth(&s), Some(1.0), seqs)
                })
                .collect()
        };
        let steps = vec![log(0.0), log(50.0)];
        let f = fit(&samples(&steps), ALL_TERMS).expect("fits");
        assert!(
            (f.a - 5.0).abs() < 1e-6 && (f.b - 0.2).abs() < 1e-8,
            "{f:?}"
        );
        let (_, prefill) = kind_spread(&steps, &f, StepKind::Prefill);
        assert!((prefill.mean_over_fit - 1.0).abs() < 1e-9, "{prefill:?}");
    }
}
