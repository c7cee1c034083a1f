//! A rate over a sliding window (tokens per second), a leaf helper of the
//! engine thread.

use std::collections::VecDeque;
use std::time::Instant;

/// Generated-token rate over a sliding window.
#[derive(Default)]
pub(super) struct RateWindow {
    samples: VecDeque<(Instant, u64)>,
}

impl RateWindow {
    const SPAN_SECS: f64 = 5.0;

    pub(super) fn record(&mut self, now: Instant, total: u64) -> f64 {
        self.samples.push_back((now, total));
        while self.samples.len() > 2
            && now.duration_since(self.samples[0].0).as_secs_f64() > Self::SPAN_SECS
        {
            self.samples.pop_front();
        }
        let (t0, n0) = self.samples[0];
        let dt = now.duration_since(t0).as_secs_f64();
        if dt > 0.0 {
            (total - n0) as f64 / dt
        } else {
            0.0
        }
    }
}
