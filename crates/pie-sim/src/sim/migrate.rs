//! `MigrateProcess` in the simulation (`rebalance`, `drain-migrate`; the
//! cost model is `crate::migrate`): copy stages while the process runs on,
//! then it leaves its source at a step boundary, pauses while its last pages
//! cross the link, and joins the target's queue.

use pie_core::SeqId;
use pie_policy::cluster::Stage;

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
        self.migrations.insert(
            r,
            Migration {
                from: f,
                to: t,
                copied_pages: 0,
            },
        );
        self.counters.migrations.started += 1;
        self.copy_stage(r, seq, now);
        Ok(())
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

    /// A copy stage of request `r`'s migration: the pages computed since the
    /// last stage that the target lacks go over its link while the process
    /// runs on; with none to copy, it is looked at at the next step boundary.
    pub(super) fn copy_stage(&mut self, r: u32, seq: SeqId, now: u64) {
        let Some(m) = self.migrations.get(&r).copied() else {
            return;
        };
        let s = self.workers[m.from].pages.seq(slot(seq));
        let upto = self.computed_pages(m.from, s);
        let target = &self.workers[m.to].pages.cache;
        let pages = s.hashes[m.copied_pages.min(upto)..upto]
            .iter()
            .filter(|h| !target.contains(h))
            .count() as u64;
        if let Some(m) = self.migrations.get_mut(&r) {
            m.copied_pages = upto;
        }
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

    /// At a step boundary of worker `w`, each migration whose copy stage ended:
    /// another stage if more than one full page was computed meanwhile, else
    /// the process leaves `w` and pauses while its last pages cross the link.
    pub(super) fn migration_boundary(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        if self.awaiting[w].is_empty() {
            return Ok(());
        }
        let ps = self.cfg.profile.page_size;
        for r in std::mem::take(&mut self.awaiting[w]) {
            let Some(m) = self.migrations.get(&r).copied() else {
                continue;
            };
            let Some(seq) = self.find_seq(w, r) else {
                continue;
            };
            let s = self.workers[w].pages.seq(slot(seq));
            let upto = self.computed_pages(w, s);
            let uncopied = upto.saturating_sub(m.copied_pages);
            if uncopied > 1 {
                self.copy_stage(r, seq, now);
                continue;
            }
            let partial = usize::from(s.pages > 0 && !(s.len as usize).is_multiple_of(ps));
            let index = (self.workers[w].scheduler.position(seq))
                .ok_or_else(|| anyhow::anyhow!("request {r} is not among its worker's"))?;
            let (scheduler, mut kv, _) = self.split(w);
            scheduler.finish(&mut kv, &[index], false);
            let s = self.workers[w].pages.remove(slot(seq));
            self.sync_index(w);
            self.router.set_load(w, self.router.load(w) - 1);
            self.router.set_load(m.to, self.router.load(m.to) + 1);
            let pages = (uncopied + partial) as u64;
            let bytes = pages * ps as u64 * self.cfg.kv_bytes_per_token;
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
        }
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
