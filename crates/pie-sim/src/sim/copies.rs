//! `CopyPrefix` (`replicate`) in the simulation: the pages go over the
//! target's link and into its prefix cache when they arrive (the cost model
//! and hot-prefix reading are `crate::copies`).

use pie_core::BlockHash;
use pie_policy::cluster::{Action, ClusterEvent};

use crate::copies::{leading_held, PrefixCopy};
use crate::events::Event;

use super::Sim;

impl Sim<'_> {
    /// Carry out a `CopyPrefix` from an actor: the blocks `from` holds (from
    /// the first) that `to` lacks go over `to`'s link (see `copies`). A
    /// worker that does not exist is an error that stops the run.
    pub(super) fn copy_prefix(
        &mut self,
        blocks: Vec<BlockHash>,
        from: &str,
        to: &str,
        now: u64,
    ) -> anyhow::Result<()> {
        let (f, t) = (self.worker_named(from)?, self.worker_named(to)?);
        anyhow::ensure!(f != t, "copy-prefix: from `{from}` to itself");
        let action = Action::CopyPrefix {
            blocks: blocks.clone(),
            from: from.to_string(),
            to: to.to_string(),
        };
        let held = leading_held(&self.workers[f].pages.cache, &blocks);
        let mut blocks = blocks;
        blocks.truncate(held);
        let target = &self.workers[t].pages.cache;
        let pages = blocks.iter().filter(|h| !target.contains(h)).count() as u64;
        let ps = self.cfg.profile.page_size as u64;
        let bytes = pages * ps * self.cfg.kv_bytes_per_token;
        let arrive = match bytes {
            0 => now,
            _ => self.links.book(&self.cfg.profile, t, now, bytes).1,
        };
        let c = &mut self.counters.copies;
        c.copies += 1;
        c.pages += pages;
        c.bytes += bytes;
        let id = u32::try_from(c.copies)?;
        let copy = PrefixCopy {
            to: t,
            incarnation: self.fleet.stops(t),
            blocks,
            action,
        };
        self.copies.insert(id, copy);
        self.events.push(arrive, Event::PrefixCopied(id));
        Ok(())
    }

    /// Copy `c` reached its target at `now`: the blocks into its prefix
    /// cache (as many as fit) and the router's index; if the worker it was
    /// sent to has stopped meanwhile, the copy failed (`ActionFailed`).
    pub(super) fn prefix_copied(&mut self, c: u32, now: u64) -> anyhow::Result<()> {
        let copy = (self.copies.remove(&c))
            .ok_or_else(|| anyhow::anyhow!("prefix copy {c} arrived twice"))?;
        if self.fleet.stops(copy.to) != copy.incarnation {
            self.counters.copies.failed += 1;
            let error = format!("w{} stopped before the copy arrived", copy.to);
            return self.deliver(
                ClusterEvent::ActionFailed {
                    action: copy.action,
                    error,
                },
                now,
            );
        }
        let received = self.workers[copy.to].pages.receive(&copy.blocks);
        self.counters.copies.received += received as u64;
        self.sync_index(copy.to);
        Ok(())
    }
}
