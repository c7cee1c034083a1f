//! Workers that share one host: `--workers-per-machine N` puts N simulated
//! workers on one machine of the cost profile. The profile is calibrated with one
//! worker owning every core; when several of the host's workers step at once,
//! they share its speed, as engine processes whose thread pools each span all
//! the cores do. A step demands the profile's `host_share` of the host (`pie
//! bench --calibrate --from-steps`: served steps that overlapped another
//! worker's took `k * host_share` their time alone with `k` in flight), so
//! overlapping steps slow each other by what they demand together, not by
//! their count: with steps of demands `u_i` in flight, each advances at
//! `min(1, 1 / sum(u_i))` of its speed alone. With every demand 1 (a profile
//! without the share) this is processor sharing: `k` steps each advance at `1/k`.
//!
//! Invariant (tested): the host's total work rate never exceeds one profile
//! machine (`sum(u_i * rate) <= 1`), and work done alone is not slowed.

/// A step in flight on the host.
#[derive(Debug)]
struct Running {
    worker: u32,
    /// Work left, in profile microseconds (its time alone).
    left: f64,
    /// The share of the machine it keeps busy alone, in (0, 1].
    demand: f64,
}

/// One host's steps in flight.
#[derive(Debug, Default)]
pub struct SharedMachine {
    active: Vec<Running>,
    /// When `active`'s work was last brought up to date.
    updated_us: u64,
}

impl SharedMachine {
    /// Start `worker`'s step of `work_us` profile microseconds at `now_us`,
    /// keeping `demand` of the machine busy when alone.
    pub fn start(&mut self, now_us: u64, worker: u32, work_us: u64, demand: f64) {
        self.advance(now_us);
        debug_assert!(self.active.iter().all(|r| r.worker != worker));
        self.active.push(Running {
            worker,
            left: work_us as f64,
            demand: demand.clamp(f64::MIN_POSITIVE, 1.0),
        });
    }

    /// `worker`'s step ended at `now_us` (the end [`Self::ends`] last gave it).
    pub fn finish(&mut self, now_us: u64, worker: u32) {
        self.advance(now_us);
        self.active.retain(|r| r.worker != worker);
    }

    /// Each step in flight and when it ends, if the steps in flight stay as they are.
    pub fn ends(&self, now_us: u64) -> impl Iterator<Item = (u32, u64)> + '_ {
        let rate = self.rate();
        self.active.iter().map(move |r| {
            let wall = (r.left.max(0.0) / rate).ceil() as u64;
            (r.worker, now_us + wall.max(1))
        })
    }

    /// The speed, relative to alone, at which every step in flight advances.
    fn rate(&self) -> f64 {
        let demand: f64 = self.active.iter().map(|r| r.demand).sum();
        if demand > 1.0 {
            1.0 / demand
        } else {
            1.0
        }
    }

    fn advance(&mut self, now_us: u64) {
        let done = now_us.saturating_sub(self.updated_us) as f64 * self.rate();
        for r in &mut self.active {
            r.left -= done;
        }
        self.updated_us = now_us;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ends(m: &SharedMachine, now: u64) -> Vec<(u32, u64)> {
        m.ends(now).collect()
    }

    #[test]
    fn a_step_alone_runs_at_the_profile_speed() {
        for demand in [1.0, 0.6] {
            let mut m = SharedMachine::default();
            m.start(1_000, 0, 500, demand);
            assert_eq!(ends(&m, 1_000), vec![(0, 1_500)]);
        }
    }

    #[test]
    fn overlapping_steps_share_the_machine() {
        let mut m = SharedMachine::default();
        m.start(0, 0, 1_000, 1.0);
        // 400 us alone: 600 left; then two share: 1,200 us more.
        m.start(400, 1, 300, 1.0);
        assert_eq!(ends(&m, 400), vec![(0, 1_600), (1, 1_000)]);
        // Worker 1 ends at 1,000 (300 of work at half speed); worker 0 has
        // 600 - 300 = 300 left, alone again.
        m.finish(1_000, 1);
        assert_eq!(ends(&m, 1_000), vec![(0, 1_300)]);
        // Total: 1,300 us of work in 1,300 us of wall time.
    }

    #[test]
    fn three_equal_steps_take_three_times_as_long() {
        let mut m = SharedMachine::default();
        for w in 0..3 {
            m.start(0, w, 100, 1.0);
        }
        assert!(ends(&m, 0).iter().all(|&(_, end)| end == 300));
    }

    #[test]
    fn steps_that_leave_cores_idle_slow_each_other_less() {
        // Two steps each keeping 0.6 of the machine busy: together they demand
        // 1.2, so each runs at 1 / 1.2 of its speed alone, not 1 / 2.
        let mut m = SharedMachine::default();
        m.start(0, 0, 600, 0.6);
        m.start(0, 1, 600, 0.6);
        assert_eq!(ends(&m, 0), vec![(0, 720), (1, 720)]);
        // The machine does 1.2 x 600 demand-weighted microseconds of work in
        // 720 us: exactly full, never more.
        // Two steps demanding 0.5 each fit side by side: neither slows.
        let mut m = SharedMachine::default();
        m.start(0, 0, 300, 0.5);
        m.start(0, 1, 400, 0.5);
        assert_eq!(ends(&m, 0), vec![(0, 300), (1, 400)]);
        // A third step tips them over: 1.5 demanded, each at 2/3 of its speed.
        m.start(150, 2, 100, 0.5);
        assert_eq!(ends(&m, 150), vec![(0, 375), (1, 525), (2, 300)]);
    }
}
