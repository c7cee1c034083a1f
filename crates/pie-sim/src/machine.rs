//! Workers that share one host: `--workers-per-machine N` puts N simulated
//! workers on one machine of the cost profile. The profile is calibrated with one
//! worker owning every core; when several of the host's workers step at once,
//! they share its speed equally (processor sharing), as engine processes whose
//! thread pools each span all the cores do. A step alone on its host runs at the
//! profile's speed; with `k` steps in flight each advances at `1/k` of it.
//!
//! Invariant (tested): the host's total work rate never exceeds one profile
//! machine, and work done alone is not slowed.

/// One host's steps in flight: (worker, work left in profile microseconds).
#[derive(Debug, Default)]
pub struct SharedMachine {
    active: Vec<(u32, f64)>,
    /// When `active`'s work was last brought up to date.
    updated_us: u64,
}

impl SharedMachine {
    /// Start `worker`'s step of `work_us` profile microseconds at `now_us`.
    pub fn start(&mut self, now_us: u64, worker: u32, work_us: u64) {
        self.advance(now_us);
        debug_assert!(self.active.iter().all(|&(w, _)| w != worker));
        self.active.push((worker, work_us as f64));
    }

    /// `worker`'s step ended at `now_us` (the end [`Self::ends`] last gave it).
    pub fn finish(&mut self, now_us: u64, worker: u32) {
        self.advance(now_us);
        self.active.retain(|&(w, _)| w != worker);
    }

    /// Each step in flight and when it ends, if the steps in flight stay as they are.
    pub fn ends(&self, now_us: u64) -> impl Iterator<Item = (u32, u64)> + '_ {
        let share = self.active.len() as f64;
        self.active.iter().map(move |&(w, left)| {
            let wall = (left.max(0.0) * share).ceil() as u64;
            (w, now_us + wall.max(1))
        })
    }

    fn advance(&mut self, now_us: u64) {
        let elapsed = now_us.saturating_sub(self.updated_us) as f64;
        if !self.active.is_empty() {
            let done = elapsed / self.active.len() as f64;
            for (_, left) in &mut self.active {
                *left -= done;
            }
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
        let mut m = SharedMachine::default();
        m.start(1_000, 0, 500);
        assert_eq!(ends(&m, 1_000), vec![(0, 1_500)]);
    }

    #[test]
    fn overlapping_steps_share_the_machine() {
        let mut m = SharedMachine::default();
        m.start(0, 0, 1_000);
        // 400 us alone: 600 left; then two share: 1,200 us more.
        m.start(400, 1, 300);
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
            m.start(0, w, 100);
        }
        assert!(ends(&m, 0).iter().all(|&(_, end)| end == 300));
    }
}
