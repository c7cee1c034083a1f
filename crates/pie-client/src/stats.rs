//! Percentiles of latency samples, by the workspace's one rule
//! (`pie_workload::percentiles`: nearest rank, as `pie-sim` reports them),
//! with the sample's size.

use serde::{Deserialize, Serialize};

/// p50 / p90 / p99 and the mean of a sample (all 0 when it is empty), and
/// how many finite values it had.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub count: usize,
}

impl Percentiles {
    /// The finite values of `xs`, by [`pie_workload::Percentiles::of`].
    pub fn of(mut xs: Vec<f64>) -> Self {
        xs.retain(|x| x.is_finite());
        let count = xs.len();
        let pie_workload::Percentiles {
            p50,
            p90,
            p99,
            mean,
        } = pie_workload::Percentiles::of(xs);
        Self {
            p50,
            p90,
            p99,
            mean,
            count,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_without_interpolation() {
        let xs: Vec<f64> = (1..=101).map(f64::from).collect();
        let p = Percentiles::of(xs);
        assert_eq!((p.p50, p.p90, p.p99), (51.0, 91.0, 100.0));
        assert_eq!(p.mean, 51.0);
        // Nearest rank: a sample, never a value between two.
        assert_eq!(Percentiles::of(vec![10.0, 20.0]).p50, 10.0);
        assert_eq!(Percentiles::of(vec![7.0]).p99, 7.0);
    }

    #[test]
    fn order_and_non_finite_values_do_not_matter() {
        let p = Percentiles::of(vec![3.0, f64::NAN, 1.0, 2.0]);
        assert_eq!((p.p50, p.count), (2.0, 3));
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
    }
}
