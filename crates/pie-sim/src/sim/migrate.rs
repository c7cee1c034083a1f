//! `MigrateProcess` in the simulation (`rebalance`, `drain-migrate`; the
//! cost model is `crate::migrate`): copy stages while the process runs on,
//! then it leaves its source at a step boundary, pauses while its last pages
//! cross the link, and joins the target's queue.

use std::ops::Range;

use pie_core::SeqId;
use pie_policy::cluster::{MovePlan, MoveStep, Progress, Stage};

use crate::events::Event;
use crate::migrate::{Migration, PAUSE_US};
use crate::pages::{slot, Seq};

use super::Sim;

impl Sim<'_> {
    /// Carry out a `MigrateProcess` from an actor: request `process` on worker
    /// `from` starts moving to `to` (its first copy stage). What cannot be
    /// done is an error that stops the run.
    pub(super) fn migrate(
        &mut self,
        process: &str,
        from: &str,
        to: &str,
        now: u64,
    ) -> anyhow::Result<()> {
        let r: u32 = process
            .strip_prefix("request-")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("migrate: no process `{process}`"))?;
        let worker = |name: &str| {
            self.worker_named(name)
                .map_err(|e| anyhow::anyhow!("migrate: {e}"))
        };
        let (f, t) = (worker(from)?, worker(to)?);
        anyhow::ensure!(f != t, "migrate: `{process}` from `{from}` to itself");
        anyhow::ensure!(
            self.router.views()[t].stage != Stage::Prefill,
            "migrate: `{to}` is a prefill-stage worker"
        );
        anyhow::ensure!(
            !self.migrations.contains_key(&r),
            "migrate: `{process}` is already migrating"
        );
        let seq = self
            .find_seq(f, r)
            .ok_or_else(|| anyhow::anyhow!("migrate: `{process}` is not on `{from}`"))?;
        anyhow::ensure!(
            self.workers[f].pages.seq(slot(seq)).handoff.is_none(),
            "migrate: `{process}` is a remote prefill on `{from}`"
        );
        let mut plan = MovePlan::new(self.cfg.profile.page_size);
        let progress = self.progress(f, self.workers[f].pages.seq(slot(seq)));
        let first = plan.start(Some(progress));
        let migration = Migration {
            from: f,
            to: t,
            plan,
        };
        self.migrations.insert(r, migration);
        self.counters.migrations.started += 1;
        self.take_move_step(r, seq, first, now)
    }

    /// Request `r`'s sequence on worker `w`, if it is there.
    pub(super) fn find_seq(&self, w: usize, r: u32) -> Option<SeqId> {
        let worker = &self.workers[w];
        (worker.scheduler.candidates().iter())
            .map(|c| c.seq)
            .find(|&seq| worker.pages.seq(slot(seq)).req == r)
    }

    /// The leading pages of `s` whose KV worker `w` has for it: a running
    /// sequence's computed full pages, a queued one's prefix in `w`'s cache.
    pub(super) fn computed_pages(&self, w: usize, s: &Seq) -> usize {
        let ps = self.cfg.profile.page_size;
        if s.pages > 0 {
            return (s.len as usize / ps).min(s.hashes.len());
        }
        let usable = ((s.tokens() as usize - 1) / ps).min(s.hashes.len());
        let cache = &self.workers[w].pages.cache;
        s.hashes[..usable]
            .iter()
            .take_while(|h| cache.contains(h))
            .count()
    }

    /// Where `s` stands on worker `w`, as the move plan reads it: a
    /// sequence holding pages runs on (its computed tokens); a queued one
    /// has its cached prefix and leaves at once.
    fn progress(&self, w: usize, s: &Seq) -> Progress {
        match s.pages > 0 {
            true => Progress {
                kv_tokens: s.len as usize,
                running: true,
            },
            false => Progress {
                kv_tokens: self.computed_pages(w, s) * self.cfg.profile.page_size,
                running: false,
            },
        }
    }

    /// Carry out the plan's `step` for request `r`'s migration.
    fn take_move_step(
        &mut self,
        r: u32,
        seq: SeqId,
        step: MoveStep,
        now: u64,
    ) -> anyhow::Result<()> {
        let Some(m) = self.migrations.get(&r).copied() else {
            return Ok(());
        };
        match step {
            MoveStep::Copy(pages) => self.copy_stage(r, m, seq, pages, now),
            MoveStep::Await => self.awaiting[m.from].push(r),
            MoveStep::HandOff => self.leave_source(r, m, seq, now)?,
        }
        Ok(())
    }

    /// A copy stage of request `r`'s migration: the pages of `stage` that
    /// the target lacks go over its link while the process runs on; with
    /// none to copy, it is looked at at the next step boundary.
    fn copy_stage(&mut self, r: u32, m: Migration, seq: SeqId, stage: Range<usize>, now: u64) {
        let s = self.workers[m.from].pages.seq(slot(seq));
        let held = s.hashes.len();
        let target = &self.workers[m.to].pages.cache;
        let pages = s.hashes[stage.start.min(held)..stage.end.min(held)]
            .iter()
            .filter(|h| !target.contains(h))
            .count() as u64;
        if pages == 0 {
            self.awaiting[m.from].push(r);
            return;
        }
        let bytes = pages * self.cfg.profile.page_size as u64 * self.cfg.kv_bytes_per_token;
        let (_, end) = self.links.book(&self.cfg.profile, m.to, now, bytes);
        let c = &mut self.counters.migrations;
        c.stages += 1;
        c.pages += pages;
        c.bytes += bytes;
        self.events.push(end, Event::MigrationCopied(r));
    }

    /// A copy stage of request `r` reached its target: the source looks at it
    /// when its running step ends (at once if it is idle).
    pub(super) fn migration_copied(&mut self, r: u32, now: u64) -> anyhow::Result<()> {
        let Some(m) = self.migrations.get(&r).copied() else {
            return Ok(()); // it finished on its source meanwhile
        };
        self.awaiting[m.from].push(r);
        if self.workers[m.from].step_end.is_none() {
            self.migration_boundary(m.from, now)?;
        }
        Ok(())
    }

    /// At a step boundary of worker `w`, each migration awaiting one takes
    /// its plan's next step.
    pub(super) fn migration_boundary(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        for r in std::mem::take(&mut self.awaiting[w]) {
            let Some(seq) = self.find_seq(w, r) else {
                continue;
            };
            let progress = self.progress(w, self.workers[w].pages.seq(slot(seq)));
            let Some(m) = self.migrations.get_mut(&r) else {
                continue;
            };
            let step = m.plan.next(progress);
            self.take_move_step(r, seq, step, now)?;
        }
        Ok(())
    }

    /// Request `r` leaves worker `m.from` and pauses while the pages computed
    /// since its last stage cross the link.
    fn leave_source(&mut self, r: u32, m: Migration, seq: SeqId, now: u64) -> anyhow::Result<()> {
        let w = m.from;
        let s = self.workers[w].pages.seq(slot(seq));
        let upto = self.computed_pages(w, s);
        let pages = m.plan.pause_pages(self.progress(w, s)).len() as u64;
        let index = (self.workers[w].scheduler.position(seq))
            .ok_or_else(|| anyhow::anyhow!("request {r} is not among its worker's"))?;
        let (scheduler, mut kv, _) = self.split(w);
        scheduler.finish(&mut kv, &[index], false);
        let s = self.workers[w].pages.remove(slot(seq));
        self.sync_index(w);
        self.router.set_load(w, self.router.load(w) - 1);
        self.router.set_load(m.to, self.router.load(m.to) + 1);
        let bytes = pages * self.cfg.profile.page_size as u64 * self.cfg.kv_bytes_per_token;
        let copied = match bytes {
            0 => now,
            _ => self.links.book(&self.cfg.profile, m.to, now, bytes).1,
        };
        let resume = copied + PAUSE_US;
        let c = &mut self.counters.migrations;
        c.stages += u64::from(bytes > 0);
        c.pages += pages;
        c.bytes += bytes;
        c.pause_us += resume - now;
        c.max_pause_us = c.max_pause_us.max(resume - now);
        self.records[r as usize].worker = m.to as u32;
        self.paused.insert(r, (s, upto));
        self.events.push(resume, Event::Migrated(r));
        Ok(())
    }

    /// Request `r`'s pause ended: its pages into the target's prefix cache (as
    /// many as fit), its session routed there from now on, and it joins the
    /// target's queue.
    pub(super) fn migrated(&mut self, r: u32, now: u64) -> anyhow::Result<()> {
        let (s, pages) = self
            .paused
            .remove(&r)
            .ok_or_else(|| anyhow::anyhow!("request {r} resumed twice"))?;
        let m = self
            .migrations
            .remove(&r)
            .ok_or_else(|| anyhow::anyhow!("request {r} resumed without a migration"))?;
        self.workers[m.to].pages.receive(&s.hashes[..pages]);
        self.sync_index(m.to);
        let props = &self.reqs[r as usize].props;
        self.router
            .moved(now / 1000, props, s.prompt_len as usize, m.to);
        self.counters.migrations.completed += 1;
        self.admit(m.to, s, now)
    }
}
