//! The shared page pool in the simulation (`--pool-pages`; its store is
//! `crate::pool`): pushes (`retain-all` spills, `CopyPrefixToPool`) cross
//! the sender's link and are stored when they arrive; an arrival first pulls
//! (from its worker's disk, then the pool) the leading pages of its prompt
//! past its worker's cached prefix and joins the queue when they arrive.

use pie_core::BlockHash;
use pie_policy::cluster::Tier;

use crate::copies::leading_held;
use crate::disk::read_us;
use crate::events::Event;
use crate::pages::Seq;
use pie_policy::cluster::SPILLS_IN_FLIGHT;

use super::in_transit::{PoolPush, Pull};
use super::Sim;

impl Sim<'_> {
    /// Carry out a `CopyPrefixToPool` (`pool-replicate`): the blocks `from`
    /// holds (from the first) go to the pool, unpinned.
    pub(super) fn copy_to_pool(
        &mut self,
        blocks: Vec<BlockHash>,
        from: &str,
        now: u64,
    ) -> anyhow::Result<()> {
        let f = self
            .worker_named(from)
            .map_err(|e| anyhow::anyhow!("copy-prefix-to-pool: {e}"))?;
        let held = leading_held(&self.workers[f].pages.cache, &blocks);
        let mut blocks = blocks;
        blocks.truncate(held);
        let (pages, bytes) = self.push_to_pool(f, blocks, 0, false, now)?;
        let c = &mut self.counters.pool;
        c.replicated += 1;
        c.replicated_pages += pages;
        c.replicated_bytes += bytes;
        Ok(())
    }

    /// Worker `w` pushes `blocks` to the pool (a spill if `spill`),
    /// soft-pinned until `pinned_until_ms`: those the pool holds are pinned
    /// (and refreshed) at once, the rest cross `w`'s sending link and are
    /// stored when they arrive. Returns the pages and bytes sent.
    pub(super) fn push_to_pool(
        &mut self,
        w: usize,
        blocks: Vec<BlockHash>,
        pinned_until_ms: u64,
        spill: bool,
        now: u64,
    ) -> anyhow::Result<(u64, u64)> {
        let pool = (self.pool.as_mut()).ok_or_else(|| anyhow::anyhow!("no pool to push to"))?;
        pool.pin(&blocks, pinned_until_ms);
        let lacking: Vec<BlockHash> = blocks.into_iter().filter(|h| !pool.contains(h)).collect();
        if lacking.is_empty() {
            return Ok((0, 0));
        }
        let pages = lacking.len() as u64;
        let bytes = pages * self.cfg.profile.page_size as u64 * self.cfg.kv_bytes_per_token;
        let (_, end) = self.send_links.book(&self.cfg.profile, w, now, bytes);
        self.pushed += 1;
        let push = PoolPush {
            blocks: lacking,
            pinned_until_ms,
            spilled_by: spill.then_some(w),
        };
        if spill {
            self.spills_in_flight[w] += 1;
        }
        self.pushes.insert(self.pushed, push);
        self.events.push(end, Event::PoolPushed(self.pushed));
        Ok((pages, bytes))
    }

    /// Push `p` reached the pool: its pages are stored (evicting past the
    /// high watermark).
    pub(super) fn pool_pushed(&mut self, p: u32, now: u64) -> anyhow::Result<()> {
        let push = (self.pushes.remove(&p))
            .ok_or_else(|| anyhow::anyhow!("pool push {p} arrived twice"))?;
        if let Some(w) = push.spilled_by {
            self.spills_in_flight[w] -= 1;
        }
        let pool = (self.pool.as_mut()).ok_or_else(|| anyhow::anyhow!("no pool"))?;
        let new = pool.put(&push.blocks, push.pinned_until_ms, now / 1000) as u64;
        let c = &mut self.counters.pool;
        c.stored_pages += new;
        c.already_held_pages += push.blocks.len() as u64 - new;
        Ok(())
    }

    /// The retained sessions worker `w` spilled in its last plan go to the
    /// pool, each pinned until its retention would have ended; with
    /// `SPILLS_IN_FLIGHT` of its spills on their way already, one more is
    /// dropped (as `pie-worker` bounds them).
    /// To its disk when it spills there (`to = "disk"`, or `any` without a
    /// pool), unpinned.
    pub(super) fn spill(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        let to_disk = match self.workers[w].pages.spill {
            Some(Tier::Disk) => true,
            Some(Tier::Any) => self.pool.is_none(),
            _ => false,
        };
        for s in std::mem::take(&mut self.workers[w].pages.spilled) {
            if self.spills_in_flight[w] >= SPILLS_IN_FLIGHT {
                if to_disk {
                    self.counters.disk.dropped_spills += 1;
                    continue;
                }
                let c = &mut self.counters.pool;
                c.dropped_spills += 1;
                c.dropped_spill_pages += s.blocks.len() as u64;
                continue;
            }
            if to_disk {
                let (pages, bytes) = self.write_to_disk(w, s.blocks, true, now)?;
                let c = &mut self.counters.disk;
                c.spills += 1;
                c.spilled_pages += pages;
                c.spilled_bytes += bytes;
                continue;
            }
            let (pages, bytes) = self.push_to_pool(w, s.blocks, s.expires_ms, true, now)?;
            let c = &mut self.counters.pool;
            c.spills += 1;
            c.spilled_pages += pages;
            c.spilled_bytes += bytes;
        }
        Ok(())
    }

    /// Queue `seq` on worker `w` (`admit`), first pulling from the pool the
    /// leading pages of its prompt the pool holds past `w`'s own cached
    /// prefix, if any: it is admitted when they arrive.
    pub(super) fn pull_then_admit(&mut self, w: usize, seq: Seq, now: u64) -> anyhow::Result<()> {
        if self.pool.is_none() && self.disks.is_none() {
            return self.admit(w, seq, now);
        }
        let ps = self.cfg.profile.page_size;
        let page_bytes = ps as u64 * self.cfg.kv_bytes_per_token;
        let usable = seq.prefix_pages(ps);
        let own = leading_held(&self.workers[w].pages.cache, &seq.hashes[..usable]);
        let mut end = now;
        let mut disk_to = own;
        if let Some(disks) = &mut self.disks {
            let loaded = disks.store(w).leading(&seq.hashes[own..usable]);
            if loaded > 0 {
                disk_to = own + loaded;
                disks.store_mut(w).read(&seq.hashes[own..disk_to]);
                let bytes = loaded as u64 * page_bytes;
                end = disks.book(w, now, read_us(bytes));
                let c = &mut self.counters.disk;
                c.loads += 1;
                c.loaded_pages += loaded as u64;
                c.loaded_bytes += bytes;
                c.load_s += (end - now) as f64 / 1e6;
            }
        }
        let mut to = disk_to;
        if let Some(pool) = &mut self.pool {
            let pulled = pool.leading(&seq.hashes[disk_to..usable]);
            if pulled > 0 {
                to = disk_to + pulled;
                pool.read(&seq.hashes[disk_to..to]);
                let bytes = pulled as u64 * page_bytes;
                let (_, pool_end) = self.links.book(&self.cfg.profile, w, now, bytes);
                end = end.max(pool_end);
                let c = &mut self.counters.pool;
                c.pulls += 1;
                if c.pulls_by_worker.len() <= w {
                    c.pulls_by_worker.resize(w + 1, 0);
                }
                c.pulls_by_worker[w] += 1;
                c.pulled_pages += pulled as u64;
                c.pulled_bytes += bytes;
                c.pull_s += (pool_end - now) as f64 / 1e6;
            }
        }
        if to == own {
            return self.admit(w, seq, now);
        }
        let r = seq.req;
        self.pulling.insert(
            r,
            Pull {
                w,
                seq,
                from: own,
                disk_to,
                to,
            },
        );
        self.events.push(end, Event::Pulled(r));
        Ok(())
    }

    /// Request `r`'s pages from its worker's disk and the pool reached its
    /// worker: into its prefix cache (as many as fit: as the engine imports
    /// pages, retained sessions make room first, soonest expiry first and
    /// spilled when the worker spills; then unreferenced cached pages are
    /// evicted; never a running sequence's), then the request joins its queue.
    pub(super) fn pulled(&mut self, r: u32, now: u64) -> anyhow::Result<()> {
        let p =
            (self.pulling.remove(&r)).ok_or_else(|| anyhow::anyhow!("request {r} pulled twice"))?;
        self.make_room(p.w, p.to - p.from);
        self.spill(p.w, now)?;
        let kept = self.workers[p.w].pages.receive(&p.seq.hashes[p.from..p.to]);
        // The disk's pages come first: they are the last to be dropped.
        let disk_unfit = (p.disk_to - p.from).saturating_sub(kept) as u64;
        let unfit = (p.to - p.from - kept) as u64 - disk_unfit;
        self.counters.disk.unfit_pages += disk_unfit;
        self.counters.pool.unfit_pages += unfit;
        self.counters.pool.short_pulls += u64::from(unfit > 0);
        self.sync_index(p.w);
        self.admit(p.w, p.seq, now)
    }

    /// Retained sessions on worker `w` evicted (soonest expiry first) until
    /// `pages` are free or evictable, as the engine's import does.
    pub(super) fn make_room(&mut self, w: usize, pages: usize) {
        let (scheduler, mut kv, _) = self.split(w);
        while kv.pages.free_pages() + kv.pages.cache.evictable() < pages
            && scheduler.evict_soonest_retained(&mut kv)
        {}
    }
}
