//! The simulation's event queue: open-loop arrivals (sorted once), later-turn
//! arrivals, ends of KV transfers (a disaggregated prefill's pages reaching the
//! decode worker, a migration's copy stage or pause ending, a prefix copy arriving, a
//! pull from the pool reaching its worker, a push reaching the pool, a started worker
//! done booting) and step ends. Step ends (at most one per worker) and the
//! rest (up to one per conversation or transfer) sit in two heaps, so the frequent step events
//! stay in a small heap that fits the cache. Order: earliest time first; an
//! open-loop arrival goes before queued events at the same time, and queued
//! events at the same time go in the order they were pushed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::workload::Request;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Event {
    StepEnd(u32),
    Arrive(u32),
    /// Request `r`'s prefilled pages reached its decode worker.
    Transferred(u32),
    /// A copy stage of request `r`'s migration reached its target.
    MigrationCopied(u32),
    /// Request `r`'s migration pause ended: it resumes on its target.
    Migrated(u32),
    /// Prefix copy `c` reached its target.
    PrefixCopied(u32),
    /// Request `r`'s pull from the pool reached its worker.
    Pulled(u32),
    /// Push `p` (a spill or a `CopyPrefixToPool`) reached the pool.
    PoolPushed(u32),
    /// Worker `w`'s start-up delay ended (`autoscale.rs`): it serves if it
    /// is still booting to this time.
    WorkerUp(u32),
    /// Write `d` (a persisted prefix or a spill) reached its worker's disk.
    DiskWritten(u32),
}

/// (time us, push number, worker)
type Entry = Reverse<(u64, u64, u32)>;
/// (time us, push number, event): arrivals and transfers.
type Queued = Reverse<(u64, u64, Event)>;

pub struct Events {
    open: Vec<u32>,
    next_open: usize,
    open_at: Vec<u64>,
    steps: BinaryHeap<Entry>,
    turns: BinaryHeap<Queued>,
    pushed: u64,
}

impl Events {
    /// The open-loop arrivals of `reqs` (those that follow no other request).
    pub fn new(reqs: &[Request]) -> Self {
        let mut open: Vec<u32> = (0..reqs.len() as u32)
            .filter(|&i| reqs[i as usize].follows.is_none())
            .collect();
        open.sort_by_key(|&i| (reqs[i as usize].arrival_us, i));
        let open_at = open.iter().map(|&i| reqs[i as usize].arrival_us).collect();
        Self {
            open,
            next_open: 0,
            open_at,
            steps: BinaryHeap::new(),
            turns: BinaryHeap::new(),
            pushed: 0,
        }
    }

    pub fn push(&mut self, at_us: u64, ev: Event) {
        self.pushed += 1;
        match ev {
            Event::StepEnd(w) => self.steps.push(Reverse((at_us, self.pushed, w))),
            other => self.turns.push(Reverse((at_us, self.pushed, other))),
        }
    }

    /// When the next event happens; None when none is left.
    pub fn next_at(&self) -> Option<u64> {
        let open = self.open_at.get(self.next_open).copied();
        let step = self.steps.peek().map(|Reverse(e)| e.0);
        let turn = self.turns.peek().map(|Reverse(e)| e.0);
        [open, step, turn].into_iter().flatten().min()
    }

    /// The next event and its time; None when none is left.
    pub fn pop(&mut self) -> Option<(u64, Event)> {
        let step = self.steps.peek().map(|Reverse(e)| (e.0, e.1));
        let turn = self.turns.peek().map(|Reverse(e)| (e.0, e.1));
        let queued = match (step, turn) {
            (Some(s), Some(t)) => Some(s.min(t).0),
            (s, t) => s.or(t).map(|e| e.0),
        };
        if let Some(&at) = self.open_at.get(self.next_open) {
            if queued.is_none_or(|q| at <= q) {
                self.next_open += 1;
                return Some((at, Event::Arrive(self.open[self.next_open - 1])));
            }
        }
        match (step, turn) {
            (Some(s), Some(t)) if t < s => self.pop_turn(),
            (Some(_), _) => self
                .steps
                .pop()
                .map(|Reverse((at, _, w))| (at, Event::StepEnd(w))),
            (None, _) => self.pop_turn(),
        }
    }

    fn pop_turn(&mut self) -> Option<(u64, Event)> {
        self.turns.pop().map(|Reverse((at, _, ev))| (at, ev))
    }
}
