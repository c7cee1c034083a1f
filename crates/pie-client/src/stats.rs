//! Percentiles of latency samples.

use serde::{Deserialize, Serialize};

/// p50 / p90 / p99 and the mean of a sample (all 0 when it is empty).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub count: usize,
}

/// The `q`-quantile (0..=1) of sorted `xs` by linear interpolation between
/// closest ranks; 0 for an empty sample.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let pos = q.clamp(0.0, 1.0) * (n - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
        }
    }
}

impl Percentiles {
    pub fn of(mut xs: Vec<f64>) -> Self {
        xs.retain(|x| x.is_finite());
        xs.sort_by(f64::total_cmp);
        let mean = if xs.is_empty() {
            0.0
        } else {
            xs.iter().sum::<f64>() / xs.len() as f64
        };
        Self {
            p50: quantile(&xs, 0.5),
            p90: quantile(&xs, 0.9),
            p99: quantile(&xs, 0.99),
            mean,
            count: xs.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_between_ranks() {
        let xs: Vec<f64> = (1..=101).map(f64::from).collect();
        let p = Percentiles::of(xs);
        assert_eq!((p.p50, p.p90, p.p99), (51.0, 91.0, 100.0));
        assert_eq!(p.mean, 51.0);
        assert_eq!(quantile(&[10.0, 20.0], 0.5), 15.0);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
    }

    #[test]
    fn order_and_non_finite_values_do_not_matter() {
        let p = Percentiles::of(vec![3.0, f64::NAN, 1.0, 2.0]);
        assert_eq!((p.p50, p.count), (2.0, 3));
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
    }
}
