//! Percentiles of samples too many to keep (inter-token gaps: one per output
//! token, hundreds of millions in the largest runs): counts in log-spaced
//! buckets 1% wide, so a percentile is read to within 1% in constant memory.

use pie_workload::{nearest_rank, Percentiles};

/// Each bucket's upper edge is this factor above its lower one.
const RATIO: f64 = 1.01;
/// Buckets up to about 1.7e9 us (28 minutes); longer samples land in the last.
const BUCKETS: usize = 2144;

#[derive(Clone, Debug)]
pub struct LogHistogram {
    counts: Vec<u64>,
    total: u64,
    sum_us: u64,
}

impl Default for LogHistogram {
    fn default() -> Self {
        Self {
            counts: vec![0; BUCKETS],
            total: 0,
            sum_us: 0,
        }
    }
}

impl LogHistogram {
    /// Count a sample of `us` microseconds.
    pub fn add(&mut self, us: u64) {
        let bucket = if us <= 1 {
            0
        } else {
            ((us as f64).ln() / RATIO.ln()).ceil() as usize
        };
        self.counts[bucket.min(BUCKETS - 1)] += 1;
        self.total += 1;
        self.sum_us += us;
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Nearest-rank percentiles (`pie_workload::percentiles`' rule) in
    /// milliseconds, each the upper edge of its bucket (at most 1% above the
    /// sample); the mean is exact.
    pub fn percentiles_ms(&self) -> Percentiles {
        if self.total == 0 {
            return Percentiles::default();
        }
        let at = |p: f64| {
            let rank = nearest_rank(p, self.total);
            let mut seen = 0;
            let bucket = self
                .counts
                .iter()
                .position(|&c| {
                    seen += c;
                    seen >= rank
                })
                .unwrap_or(BUCKETS - 1);
            RATIO.powi(bucket as i32) / 1000.0
        };
        Percentiles {
            p50: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
            mean: self.sum_us as f64 / self.total as f64 / 1000.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_within_one_percent() {
        let mut h = LogHistogram::default();
        assert_eq!(h.percentiles_ms(), Percentiles::default());
        for us in 1..=100_000u64 {
            h.add(us);
        }
        let p = h.percentiles_ms();
        for (got, want) in [(p.p50, 50.0), (p.p90, 90.0), (p.p99, 99.0)] {
            assert!(got >= want && got <= want * RATIO, "{got} vs {want}");
        }
        assert!((p.mean - 50.0005).abs() < 1e-9, "{}", p.mean);
    }
}
