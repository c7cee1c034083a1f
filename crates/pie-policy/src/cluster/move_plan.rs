//! The protocol of a live move (`MigrateProcess`, a drain, a relocation, a
//! patched `pin`): one pure plan that the controller's flows and the
//! simulator both drive, as `Scheduler` is for steps. Its rule:
//!
//! 1. **Copy.** The first stage copies the pages the source holds of the
//!    process to the target while the source keeps running it.
//! 2. **Again or wait.** When a stage ended, the pages computed since it
//!    began are copied in another stage if there are more than
//!    [`RESTAGE_PAGES`] of them; otherwise the plan awaits the hand-off point.
//! 3. **Hand-off point.** The source stops the process when its KV ends at a
//!    page boundary (between two steps, so no partial page is left behind to
//!    copy or recompute); a process its source is not stepping (queued,
//!    preempted) stops at once, and so does one whose progress or page size
//!    the executor does not know (a native process: its prompt as the worker
//!    tokenized it is the worker's).
//! 4. **Pause.** The pages computed since the last stage cross while the
//!    process runs nowhere ([`MovePlan::pause_pages`]); then it joins the
//!    target's queue with every token it had.
//!
//! It reads no props and has no config keys. The executor reports
//! [`Progress`] (the tokens whose KV the source will hold when its current
//! step ends) after a stage and at each step or token; what "copy" means is
//! the executor's (the relay asks the target to prefetch the tokens so far,
//! the simulator books the target's link for the pages it lacks).
//! Invariant (tested): a plan hands off once, only at a page boundary or for
//! a process that is not running, and the pages it copies, the pause's
//! included, are each copied once and cover every computed page.

use std::ops::Range;

/// More pages than this computed during a stage make another stage: copying
/// them in the pause would lengthen it.
pub const RESTAGE_PAGES: usize = 1;

/// What the executor knows of the process on its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Tokens whose KV the source holds once its current step ends.
    pub kv_tokens: usize,
    /// Whether the source is stepping it (so it will reach a page boundary).
    pub running: bool,
}

/// What the executor does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MoveStep {
    /// Copy these leading pages (those the target lacks) while the source
    /// runs on; report [`MovePlan::next`] when the copy ended.
    Copy(Range<usize>),
    /// Report [`MovePlan::next`] at the source's next step or token.
    Await,
    /// Stop the process on its source now.
    HandOff,
}

/// One live move's plan.
#[derive(Clone, Copy, Debug)]
pub struct MovePlan {
    /// The source's page size; 0 when unknown.
    page_size: usize,
    /// Leading pages copied by the stages so far.
    copied_pages: usize,
    handed_off: bool,
}

impl MovePlan {
    pub fn new(page_size: usize) -> Self {
        Self {
            page_size,
            copied_pages: 0,
            handed_off: false,
        }
    }

    /// The first step: a copy of what the source holds, or (progress
    /// unknown) the hand-off at once.
    pub fn start(&mut self, progress: Option<Progress>) -> MoveStep {
        match progress {
            Some(p) => self.copy(p),
            None => self.hand_off(),
        }
    }

    /// The step after a copy ended or the process progressed.
    pub fn next(&mut self, p: Progress) -> MoveStep {
        if self.handed_off {
            return MoveStep::Await;
        }
        if self.full_pages(p).saturating_sub(self.copied_pages) > RESTAGE_PAGES {
            return self.copy(p);
        }
        if self.at_hand_off_point(p) {
            return self.hand_off();
        }
        MoveStep::Await
    }

    /// The pages that cross during the pause of a process handed off at
    /// `p`: those computed since the last stage, a partial last page
    /// included.
    pub fn pause_pages(&self, p: Progress) -> Range<usize> {
        let pages = match self.page_size {
            0 => 0,
            ps => p.kv_tokens.div_ceil(ps),
        };
        self.copied_pages.min(pages)..pages
    }

    pub fn handed_off(&self) -> bool {
        self.handed_off
    }

    fn copy(&mut self, p: Progress) -> MoveStep {
        let upto = self.full_pages(p).max(self.copied_pages);
        let stage = self.copied_pages..upto;
        self.copied_pages = upto;
        MoveStep::Copy(stage)
    }

    fn hand_off(&mut self) -> MoveStep {
        self.handed_off = true;
        MoveStep::HandOff
    }

    fn full_pages(&self, p: Progress) -> usize {
        match self.page_size {
            0 => 0,
            ps => p.kv_tokens / ps,
        }
    }

    fn at_hand_off_point(&self, p: Progress) -> bool {
        self.page_size == 0 || !p.running || p.kv_tokens.is_multiple_of(self.page_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(kv_tokens: usize) -> Progress {
        Progress {
            kv_tokens,
            running: true,
        }
    }

    #[test]
    fn a_running_process_is_copied_then_handed_off_at_a_page_boundary() {
        let mut plan = MovePlan::new(16);
        assert_eq!(plan.start(Some(running(40))), MoveStep::Copy(0..2));
        assert_eq!(plan.next(running(41)), MoveStep::Await);
        assert_eq!(plan.next(running(47)), MoveStep::Await);
        assert_eq!(plan.next(running(48)), MoveStep::HandOff);
        assert_eq!(plan.pause_pages(running(48)), 2..3);
        assert!(plan.handed_off());
        assert_eq!(plan.next(running(64)), MoveStep::Await, "hands off once");
    }

    #[test]
    fn pages_computed_during_a_stage_make_another_stage() {
        let mut plan = MovePlan::new(16);
        assert_eq!(plan.start(Some(running(40))), MoveStep::Copy(0..2));
        assert_eq!(plan.next(running(90)), MoveStep::Copy(2..5));
        assert_eq!(plan.next(running(96)), MoveStep::HandOff);
        assert_eq!(plan.pause_pages(running(96)), 5..6);
    }

    #[test]
    fn a_process_not_running_leaves_at_once_with_its_partial_page() {
        let mut plan = MovePlan::new(16);
        assert_eq!(plan.start(Some(running(20))), MoveStep::Copy(0..1));
        let queued = Progress {
            kv_tokens: 27,
            running: false,
        };
        assert_eq!(plan.next(queued), MoveStep::HandOff);
        assert_eq!(plan.pause_pages(queued), 1..2);
    }

    #[test]
    fn unknown_progress_or_page_size_hands_off_at_once() {
        let mut plan = MovePlan::new(16);
        assert_eq!(plan.start(None), MoveStep::HandOff);
        let mut plan = MovePlan::new(0);
        assert_eq!(plan.start(Some(running(40))), MoveStep::Copy(0..0));
        assert_eq!(plan.next(running(41)), MoveStep::HandOff);
        assert_eq!(plan.pause_pages(running(41)), 0..0);
    }

    proptest::proptest! {
        /// Whatever the progress reports, the stages and the pause copy
        /// every computed page exactly once, and the hand-off comes only at a
        /// page boundary or for a process not running.
        #[test]
        fn stages_and_pause_cover_every_page_once(
            page_size in 1usize..40,
            start in 0usize..500,
            steps in proptest::collection::vec((0usize..60, proptest::bool::ANY), 1..40),
        ) {
            let mut plan = MovePlan::new(page_size);
            let mut kv = start;
            let mut copied = Vec::new();
            let mut step = plan.start(Some(running(kv)));
            for (grow, running) in steps {
                if let MoveStep::Copy(r) = &step {
                    copied.extend(r.clone());
                }
                if step == MoveStep::HandOff {
                    break;
                }
                kv += grow;
                let p = Progress { kv_tokens: kv, running };
                step = plan.next(p);
                if step == MoveStep::HandOff {
                    proptest::prop_assert!(!running || kv % page_size == 0);
                    copied.extend(plan.pause_pages(p));
                }
            }
            if plan.handed_off() {
                let expected: Vec<usize> = (0..kv.div_ceil(page_size)).collect();
                proptest::prop_assert_eq!(copied, expected);
            } else {
                let sorted = copied.windows(2).all(|w| w[0] + 1 == w[1]);
                proptest::prop_assert!(sorted && copied.len() <= kv / page_size);
            }
        }
    }
}
