//! The workspace's one percentile rule, shared by `pie bench` (measured
//! latencies) and `pie-sim` (simulated ones) so that their figures compare:
//! nearest rank (the smallest sample with at least p% of the samples at or
//! below it), no interpolation between samples.

use serde::{Deserialize, Serialize};

/// p50 / p90 / p99 and the mean of a sample (all 0 when it is empty).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

/// The 1-based nearest rank of percentile `p` (0..=100) among `n` samples:
/// `ceil(p / 100 * n)`, at least 1.
pub fn nearest_rank(p: f64, n: u64) -> u64 {
    (((p / 100.0) * n as f64).ceil() as u64).max(1)
}

impl Percentiles {
    /// Nearest-rank percentiles of `values` (zeros when empty).
    pub fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let at = |p: f64| values[(nearest_rank(p, n as u64) as usize).min(n) - 1];
        Self {
            p50: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
            mean: values.iter().sum::<f64>() / n as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(p.mean, 50.5);
        assert_eq!(Percentiles::of(vec![]).p99, 0.0);
    }

    #[test]
    fn no_interpolation_between_samples() {
        let p = Percentiles::of(vec![20.0, 10.0]);
        assert_eq!((p.p50, p.p90, p.p99), (10.0, 20.0, 20.0));
        let one = Percentiles::of(vec![7.0]);
        assert_eq!((one.p50, one.p99, one.mean), (7.0, 7.0, 7.0));
        assert_eq!((nearest_rank(0.0, 10), nearest_rank(100.0, 10)), (1, 10));
    }
}
