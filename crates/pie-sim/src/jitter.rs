//! Step-time variance: the real engine's steps of one shape do not all take
//! the fit's time. `pie bench --calibrate` steps a few shapes again and again
//! and writes what it sees into the profile: their mean over the fit
//! (`step_mean_over_fit`: the fit keeps each grid shape's faster time of two,
//! so a typical step is slower), their spread (`step_cv`) and how long a slow
//! spell lasts (`step_corr_ms`: a neighbour's burst, a frequency change, slows
//! several steps in a row). A queue's tail grows with the variance of its
//! service times, and more when slow steps come together, not only with their
//! mean.
//!
//! Each step's cost from the profile is multiplied by a log-normal draw whose
//! mean and coefficient of variation the caller gives (`CostProfile::step_draw`:
//! the step kind's mean over the fit, times `after_idle_factor` when the step
//! meets an idle worker, and the kind's cv, `prefill_cv` or `step_cv`). Its logarithm
//! follows an Ornstein-Uhlenbeck process per worker: a step `dt` after the
//! worker's previous one keeps `exp(-dt / step_corr_ms)` of that one's
//! deviation (0 ms: every step drawn afresh). Right-skewed, as measured step
//! times are (a step is rarely much faster than usual, sometimes much slower).
//!
//! Invariant (tested): a profile without these terms changes nothing (no draw
//! is made); the draws are seeded from the run's seed and the worker, so a run
//! is reproducible and one worker's draws do not depend on the others' steps;
//! the draws' mean is the mean asked for.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::cost::{CostProfile, StepDraw};

/// `ln(multiplier) = ln(mean) - sigma^2 / 2 + sigma * x`, `x` standard normal
/// at any one step, drawn per worker.
pub struct StepJitter {
    /// Correlation time of `x` (us); 0: independent steps.
    corr_us: f64,
    seed: u64,
    /// Per worker slot, made on its first step.
    workers: Vec<Option<Walk>>,
}

/// One worker's process: its generator, last `x` and when it was drawn.
struct Walk {
    rng: StdRng,
    x: f64,
    at_us: u64,
}

impl StepJitter {
    pub fn new(profile: &CostProfile, seed: u64) -> Self {
        Self {
            corr_us: profile.step_corr_ms * 1000.0,
            seed,
            workers: Vec::new(),
        }
    }

    /// `work_us` of profile time for worker `w`'s step starting at `now_us`,
    /// times a draw of `draw`'s mean and cv (at least 1).
    pub fn apply(&mut self, w: usize, now_us: u64, work_us: u64, draw: StepDraw) -> u64 {
        let StepDraw { mean, cv } = draw;
        let factor = if cv > 0.0 {
            // A log-normal of mean m and variance (m cv)^2: sigma^2 = ln(1 + cv^2),
            // mu = ln(m) - sigma^2 / 2.
            let sigma = (1.0 + cv * cv).ln().sqrt();
            mean * (sigma * self.next_x(w, now_us) - sigma * sigma / 2.0).exp()
        } else if mean != 1.0 {
            mean
        } else {
            return work_us;
        };
        ((work_us as f64 * factor).round() as u64).max(1)
    }

    /// Worker `w`'s `x` at `now_us`: the previous one decayed over the time
    /// since, plus fresh noise that keeps its variance 1.
    fn next_x(&mut self, w: usize, now_us: u64) -> f64 {
        if self.workers.len() <= w {
            self.workers.resize_with(w + 1, || None);
        }
        let seed = self.seed ^ (w as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let corr_us = self.corr_us;
        let walk = self.workers[w].get_or_insert_with(|| {
            let mut rng = StdRng::seed_from_u64(seed);
            let x = normal(&mut rng);
            Walk {
                rng,
                x,
                at_us: now_us,
            }
        });
        let dt = now_us.saturating_sub(walk.at_us) as f64;
        let keep = if corr_us > 0.0 {
            (-dt / corr_us).exp()
        } else {
            0.0
        };
        let z = normal(&mut walk.rng);
        walk.x = keep * walk.x + (1.0 - keep * keep).sqrt() * z;
        walk.at_us = now_us;
        walk.x
    }
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = 1.0 - rng.gen::<f64>(); // (0, 1]: ln is finite
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::StepKind;

    fn profile(mean: f64, cv: f64, corr_ms: f64) -> CostProfile {
        CostProfile {
            step_mean_over_fit: mean,
            step_cv: cv,
            step_corr_ms: corr_ms,
            ..CostProfile::cpu_placeholder()
        }
    }

    fn decode(p: &CostProfile) -> StepDraw {
        p.step_draw(StepKind::Decode, false)
    }

    /// Multipliers of `n` steps of worker 0, one every `gap_us`.
    fn draws(p: &CostProfile, seed: u64, n: usize, gap_us: u64) -> Vec<f64> {
        let mut j = StepJitter::new(p, seed);
        (0..n as u64)
            .map(|i| j.apply(0, i * gap_us, 100_000, decode(p)) as f64 / 100_000.0)
            .collect()
    }

    fn mean_sd(v: &[f64]) -> (f64, f64) {
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        (mean, var.sqrt())
    }

    fn lag1(v: &[f64]) -> f64 {
        let (mean, sd) = mean_sd(v);
        let cov = v
            .windows(2)
            .map(|w| (w[0] - mean) * (w[1] - mean))
            .sum::<f64>();
        cov / (v.len() - 1) as f64 / (sd * sd)
    }

    #[test]
    fn no_terms_change_nothing() {
        let placeholder = CostProfile::cpu_placeholder();
        let mut j = StepJitter::new(&placeholder, 7);
        let draws = [true, false].map(|woke| {
            [StepKind::Prefill, StepKind::Decode].map(|k| placeholder.step_draw(k, woke))
        });
        assert!(
            (0..100).all(|i| j.apply(i % 3, i as u64, 12_345, draws[i % 2][i % 3 % 2]) == 12_345)
        );
        assert!(j.workers.is_empty(), "no draw was made");
        // A profile from before the per-kind means: one mean for both kinds.
        let old = profile(1.1, 0.0, 0.0);
        let mut slower = StepJitter::new(&old, 7);
        let mut step = |kind| slower.apply(0, 0, 1000, old.step_draw(kind, true));
        assert_eq!(step(StepKind::Prefill), 1100);
        assert_eq!(step(StepKind::Decode), 1100);
    }

    #[test]
    fn each_kind_of_step_has_its_own_mean() {
        let p = CostProfile {
            prefill_mean_over_fit: Some(0.95),
            ..profile(1.2, 0.0, 0.0)
        };
        let mut j = StepJitter::new(&p, 7);
        let mut step = |kind| j.apply(0, 0, 1000, p.step_draw(kind, false));
        assert_eq!(step(StepKind::Prefill), 950);
        assert_eq!(step(StepKind::Decode), 1200);
        let spread = CostProfile { step_cv: 0.2, ..p };
        let mut j = StepJitter::new(&spread, 7);
        let mut mean = |kind| {
            (0..100_000u64)
                .map(|i| {
                    j.apply(0, i * 1000, 100_000, spread.step_draw(kind, false)) as f64 / 100_000.0
                })
                .sum::<f64>()
                / 100_000.0
        };
        let (prefill, decode) = (mean(StepKind::Prefill), mean(StepKind::Decode));
        assert!((prefill - 0.95).abs() < 0.006, "{prefill}");
        assert!((decode - 1.2).abs() < 0.008, "{decode}");
    }

    #[test]
    fn each_kind_of_step_has_its_own_spread_and_waking_its_own_mean() {
        let p = CostProfile {
            prefill_cv: Some(0.1),
            after_idle_factor: Some(1.5),
            ..profile(1.0, 0.4, 0.0)
        };
        let mut j = StepJitter::new(&p, 9);
        let mut stats = |kind, woke| {
            let v: Vec<f64> = (0..100_000u64)
                .map(|i| j.apply(0, i * 1000, 100_000, p.step_draw(kind, woke)) as f64 / 100_000.0)
                .collect();
            let (mean, sd) = mean_sd(&v);
            (mean, sd / mean)
        };
        let (mean, cv) = stats(StepKind::Prefill, false);
        assert!(
            (mean - 1.0).abs() < 0.005 && (cv - 0.1).abs() < 0.005,
            "{mean} {cv}"
        );
        let (mean, cv) = stats(StepKind::Prefill, true);
        assert!(
            (mean - 1.5).abs() < 0.008 && (cv - 0.1).abs() < 0.005,
            "{mean} {cv}"
        );
        let (mean, cv) = stats(StepKind::Decode, false);
        assert!(
            (mean - 1.0).abs() < 0.01 && (cv - 0.4).abs() < 0.02,
            "{mean} {cv}"
        );
    }

    #[test]
    fn the_mean_stays_and_the_tail_grows() {
        let v = draws(&profile(1.0, 0.2, 0.0), 1, 200_000, 1000);
        let (mean, sd) = mean_sd(&v);
        assert!((mean - 1.0).abs() < 0.005, "mean {mean}");
        assert!((sd - 0.2).abs() < 0.01, "cv {sd}");
        let mut sorted = v.clone();
        sorted.sort_by(f64::total_cmp);
        // Right-skewed: the median below the mean, p90 about 1.26.
        assert!(sorted[v.len() / 2] < 1.0);
        let p90 = sorted[v.len() * 9 / 10];
        assert!((1.2..1.3).contains(&p90), "p90 {p90}");
        assert!(lag1(&v).abs() < 0.01, "independent: {}", lag1(&v));
        let (slow_mean, _) = mean_sd(&draws(&profile(1.1, 0.2, 0.0), 1, 200_000, 1000));
        assert!((slow_mean - 1.1).abs() < 0.006, "mean {slow_mean}");
    }

    #[test]
    fn slow_spells_last_the_correlation_time() {
        // Steps 10 ms apart, 50 ms correlation: lag-1 of x is exp(-0.2) = 0.82
        // (of the multiplier a little less); 500 ms apart: about none.
        let p = profile(1.0, 0.1, 50.0);
        let close = draws(&p, 2, 100_000, 10_000);
        assert!((0.75..0.83).contains(&lag1(&close)), "{}", lag1(&close));
        let (mean, sd) = mean_sd(&close);
        assert!(
            (mean - 1.0).abs() < 0.01 && (sd - 0.1).abs() < 0.01,
            "{mean} {sd}"
        );
        let apart = draws(&p, 2, 100_000, 500_000);
        assert!(lag1(&apart).abs() < 0.02, "{}", lag1(&apart));
    }

    #[test]
    fn draws_follow_the_seed_and_each_worker_has_its_own() {
        let p = profile(1.0, 0.1, 20.0);
        assert_eq!(draws(&p, 3, 50, 1000), draws(&p, 3, 50, 1000));
        assert_ne!(draws(&p, 3, 50, 1000), draws(&p, 4, 50, 1000));
        // Worker 1's draws are the same however many steps worker 0 took.
        let (mut a, mut b) = (StepJitter::new(&p, 3), StepJitter::new(&p, 3));
        for t in 0..10 {
            a.apply(0, t, 1000, decode(&p));
        }
        let x: Vec<u64> = (0..5).map(|t| a.apply(1, t, 1000, decode(&p))).collect();
        let y: Vec<u64> = (0..5).map(|t| b.apply(1, t, 1000, decode(&p))).collect();
        assert_eq!(x, y);
    }
}
