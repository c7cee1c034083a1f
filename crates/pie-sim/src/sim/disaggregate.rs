//! Disaggregated prefill in the simulation (`--prefill-workers`; links and
//! KV sizes are `crate::disaggregate`): a finished remote prefill's pages go
//! over the decode worker's link, and the request joins its queue when they
//! arrive.

use crate::events::Event;
use crate::pages::Seq;

use super::Sim;

impl Sim<'_> {
    /// A prefill ended on prefill worker `p`: the prompt's full pages that the
    /// decode worker does not hold go to it over its link.
    pub(super) fn hand_off(&mut self, p: usize, mut s: Seq, d: usize, now: u64) {
        s.handoff = None;
        self.router.set_load(p, self.router.load(p) - 1);
        let ps = self.cfg.profile.page_size;
        let cache = &self.workers[d].pages.cache;
        let pages = s.hashes[..s.prefix_pages(ps)]
            .iter()
            .filter(|h| !cache.contains(h))
            .count() as u64;
        let bytes = pages * ps as u64 * self.cfg.kv_bytes_per_token;
        let (start, end) = self.links.book(&self.cfg.profile, d, now, bytes);
        let t = &mut self.counters.transfers;
        t.pages += pages;
        t.bytes += bytes;
        t.transfer_us += end - start;
        t.wait_us += start - now;
        let r = s.req;
        self.in_transfer.insert(r, s);
        self.events.push(end, Event::Transferred(r));
    }

    /// Request `r`'s prefilled pages reached its decode worker: into its prefix
    /// cache (as many as fit), then the request joins its queue.
    pub(super) fn transferred(&mut self, r: u32, now: u64) -> anyhow::Result<()> {
        let s = self
            .in_transfer
            .remove(&r)
            .ok_or_else(|| anyhow::anyhow!("request {r} transferred twice"))?;
        let d = self.records[r as usize].worker as usize;
        let pages = s.prefix_pages(self.cfg.profile.page_size);
        self.workers[d].pages.receive(&s.hashes[..pages]);
        self.sync_index(d);
        self.admit(d, s, now)
    }
}
