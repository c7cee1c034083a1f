//! A worker's step, as `pie-worker`'s engine plans it: the policy orders
//! every sequence, each gets a prefill chunk or a decode token while the
//! batch lasts; the step's tokens take effect when it ends (pages published,
//! tokens counted, the policy charged, finished sequences closed). Workers
//! sharing a host split its speed (`crate::machine`).

use pie_policy::scheduler::prefill_share;

use crate::cost::{StepShape, AFTER_IDLE_MS};
use crate::events::Event;
use crate::pages::{slot, Seq};
use crate::schedule::{LoggedStep, MAX_SCHEDULE_STEPS};

use super::Sim;

impl Sim<'_> {
    pub(super) fn step_ended(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        self.workers[w].step_end = None;
        if let Some(m) = self.machine_of(w) {
            self.machines[m].finish(now, w as u32);
        }
        self.end_step(w, now);
        self.migration_boundary(w, now)?;
        let started = self.start_step(w, now)?;
        match self.machine_of(w) {
            Some(m) if !started => self.schedule_machine(m, now),
            _ => {}
        }
        if !started {
            self.stop_if_drained(w, now)?;
        }
        Ok(())
    }

    pub(super) fn machine_of(&self, w: usize) -> Option<usize> {
        (!self.machines.is_empty()).then(|| w / self.cfg.workers_per_machine)
    }

    /// Schedule the end of `w`'s step of `work_us` (profile time) begun at
    /// `now`, keeping the profile's `host_share` of its host busy (`machine.rs`).
    pub(super) fn schedule_step(&mut self, w: usize, now: u64, work_us: u64) {
        match self.machine_of(w) {
            None => self.set_step_end(w, now + work_us),
            Some(m) => {
                let demand = self.cfg.profile.host_share.unwrap_or(1.0);
                self.machines[m].start(now, w as u32, work_us, demand);
                self.schedule_machine(m, now);
            }
        }
    }

    /// (Re)schedule the ends of every step in flight on machine `m`.
    pub(super) fn schedule_machine(&mut self, m: usize, now: u64) {
        let ends: Vec<(u32, u64)> = self.machines[m].ends(now).collect();
        for (w, end) in ends {
            self.set_step_end(w as usize, end);
        }
    }

    pub(super) fn set_step_end(&mut self, w: usize, end: u64) {
        self.workers[w].step_end = Some(end);
        self.events.push(end, Event::StepEnd(w as u32));
    }

    /// Plan and start `w`'s next step; false when it has nothing to run.
    pub(super) fn start_step(&mut self, w: usize, now: u64) -> anyhow::Result<bool> {
        let now_ms = now / 1000;
        let (scheduler, mut kv, _) = self.split(w);
        scheduler.expire_retained(&mut kv, now_ms);
        self.abort_expired(w, now);
        let (scheduler, mut kv, plan) = self.split(w);
        scheduler.plan(&mut kv, now_ms, plan);
        let mut shape = StepShape::default();
        for p in plan.iter() {
            shape.add(kv.pages.seq(slot(p.seq)).len as usize, p.tokens);
        }
        let planned = !plan.is_empty();
        if !self.workers[w].pages.spilled.is_empty() {
            self.spill(w, now)?;
        }
        self.sync_index(w);
        let step_us = if planned {
            let profile = &self.cfg.profile;
            let woke = self.workers[w]
                .last_step_end
                .is_none_or(|end| now.saturating_sub(end) >= AFTER_IDLE_MS * 1000);
            let draw = profile.step_draw(shape.kind(), woke);
            self.jitter.apply(w, now, profile.step_us(&shape), draw)
        } else {
            0
        };
        if let Some(log) = &mut self.log {
            anyhow::ensure!(
                log.steps.len() < MAX_SCHEDULE_STEPS,
                "no end after {MAX_SCHEDULE_STEPS} steps: the schedule does not progress"
            );
            let pages = &self.workers[w].pages;
            log.steps.push(LoggedStep {
                start_us: now,
                end_us: now + step_us,
                batch_tokens: shape.batch_tokens,
                free_pages: pages.free_pages(),
                cached_pages: pages.cache.evictable(),
            });
        }
        if !planned {
            let waiting = self.workers[w].scheduler.len();
            anyhow::ensure!(
                waiting == 0,
                "worker {w} stalled with {waiting} sequences at {now} us"
            );
            return Ok(false);
        }
        self.counters.steps += 1;
        self.counters.batch_tokens += shape.batch_tokens as u64;
        self.schedule_step(w, now, step_us);
        Ok(true)
    }

    pub(super) fn abort_expired(&mut self, w: usize, now: u64) {
        let expired = self.workers[w].scheduler.expired(now / 1000);
        if !expired.is_empty() {
            self.finish(w, &expired, now, false);
        }
    }

    /// The running step's tokens take effect at `now`.
    pub(super) fn end_step(&mut self, w: usize, now: u64) {
        if !self.workers[w].plan.is_empty() {
            self.workers[w].last_step_end = Some(now);
        }
        let ps = self.cfg.profile.page_size as u32;
        let plan = std::mem::take(&mut self.workers[w].plan);
        let mut published = std::mem::take(&mut self.published);
        let mut done = Vec::new();
        let in_window = now <= self.window_end_us;
        for p in &plan {
            self.workers[w].pages.prefetch_seq(slot(p.seq));
        }
        for p in &plan {
            let n = p.tokens as u32;
            let pages = &mut self.workers[w].pages;
            let s = pages.seq_mut(slot(p.seq));
            let new_len = s.len + n;
            let prefill = prefill_share(s.prompt_len as usize, s.len as usize, p.tokens) as u32;
            let full = ((new_len / ps) as usize).min(s.hashes.len()) as u32;
            let filled = published.len();
            for page in s.published..full {
                published.push((s.hashes[page as usize], p.seq, page));
            }
            s.published = s.published.max(full);
            s.len = new_len;
            let mut generated = 0;
            if s.handoff.is_some() {
                // A remote prefill samples nothing; its prompt is done.
                if new_len >= s.prompt_len {
                    done.push(p.index);
                }
            } else if new_len == s.tokens() {
                s.generated += 1;
                generated = 1;
                if s.generated == 1 {
                    self.records[s.req as usize].first_token_us = Some(now);
                } else {
                    self.counters.itl.add(now - s.last_token_us);
                }
                s.last_token_us = now;
                if s.generated >= s.max_tokens {
                    done.push(p.index);
                }
                if w < self.cfg.prefill_workers {
                    self.counters.transfers.prefill_worker_output_tokens += 1;
                }
            }
            if in_window {
                s.window_tokens += u64::from(prefill + generated);
            }
            for &(h, _, _) in &published[filled..] {
                pages.cache.prefetch(h);
            }
            self.counters.prefill_tokens += u64::from(prefill);
            self.counters.decode_tokens += u64::from(n - prefill);
            let (scheduler, kv, _) = self.split(w);
            scheduler.charge(&kv, p.index, prefill as usize, generated as usize);
        }
        // Published after the loop, so that their cache misses overlap.
        let pages = &mut self.workers[w].pages;
        for &(h, seq, page) in &published {
            pages.publish(h, slot(seq), page);
        }
        published.clear();
        self.published = published;
        let mut plan = plan;
        plan.clear();
        self.workers[w].plan = plan;
        if !done.is_empty() {
            self.finish(w, &done, now, true);
        }
        self.sync_index(w);
        let pages = &self.workers[w].pages;
        if let Some(step) = self.log.as_mut().and_then(|log| log.steps.last_mut()) {
            step.free_pages = pages.free_pages();
            step.cached_pages = pages.cache.evictable();
        }
    }

    /// Remove the candidates at `indices`: their pages are retained for their
    /// session (if `may_retain`, else they expired) or released, their records
    /// closed, their next turns queued.
    pub(super) fn finish(&mut self, w: usize, indices: &[usize], now: u64, may_retain: bool) {
        let (scheduler, mut kv, _) = self.split(w);
        for seq in scheduler.finish(&mut kv, indices, may_retain) {
            let s = self.workers[w].pages.remove(slot(seq));
            match s.handoff {
                Some(d) if may_retain => self.hand_off(w, s, d as usize, now),
                _ => self.close(w, s, now, !may_retain),
            }
        }
    }

    /// A finished sequence's record, service and next turn.
    pub(super) fn close(&mut self, w: usize, s: Seq, now: u64, expired: bool) {
        let req = s.req as usize;
        let rec = &mut self.records[req];
        rec.finish_us = Some(now);
        rec.expired = expired;
        rec.generated_tokens = s.generated;
        let c = s.client as usize;
        let window = &mut self.counters.window_service;
        if window.len() <= c {
            window.resize(c + 1, 0);
        }
        window[c] += s.window_tokens;
        let next_turn = self.followers[req]
            .map(|n| n as usize)
            .filter(|&n| self.reqs[n].continues(&self.reqs[req]));
        if let Some(n) = next_turn {
            self.carried[n] = Some(s.hashes);
        }
        if self.migrations.remove(&s.req).is_some() {
            // Finished (or aborted) before it left its source.
            self.counters.migrations.abandoned += 1;
        }
        self.router.set_load(w, self.router.load(w) - 1);
        if let Some(d) = s.handoff.map(|d| d as usize) {
            // Expired while prefilling remotely: its decode worker drops it too.
            self.router.set_load(d, self.router.load(d) - 1);
        }
        self.follow_up(req, now);
    }
}
