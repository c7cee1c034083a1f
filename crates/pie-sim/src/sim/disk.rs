//! The disk tier in the simulation (`--disk-pages`; the store and NVMe cost
//! model are `crate::disk`): `PersistPrefix` and spills to disk are queued
//! writes on the worker's disk, stored when they end.

use pie_core::BlockHash;

use crate::copies::leading_held;
use crate::disk::write_us;
use crate::events::Event;

use super::in_transit::DiskWrite;
use super::Sim;

impl Sim<'_> {
    /// Carry out a `PersistPrefix` (`persist-prefix`): the blocks worker
    /// `name` holds (from the first) and its disk lacks are written to it.
    pub(super) fn persist_prefix(
        &mut self,
        blocks: Vec<BlockHash>,
        name: &str,
        now: u64,
    ) -> anyhow::Result<()> {
        let w = self
            .worker_named(name)
            .map_err(|e| anyhow::anyhow!("persist-prefix: {e}"))?;
        let held = leading_held(&self.workers[w].pages.cache, &blocks);
        let mut blocks = blocks;
        blocks.truncate(held);
        let (pages, bytes) = self.write_to_disk(w, blocks, false, now)?;
        let c = &mut self.counters.disk;
        c.persists += 1;
        c.persisted_pages += pages;
        c.persisted_bytes += bytes;
        Ok(())
    }

    /// Worker `w` writes the pages of `blocks` its disk lacks (a spill if
    /// `spill`), queued on its disk; they are stored when the write ends.
    /// Returns the pages and bytes written.
    pub(super) fn write_to_disk(
        &mut self,
        w: usize,
        blocks: Vec<BlockHash>,
        spill: bool,
        now: u64,
    ) -> anyhow::Result<(u64, u64)> {
        let disks = (self.disks.as_mut()).ok_or_else(|| anyhow::anyhow!("no disk tier"))?;
        let store = disks.store_mut(w);
        store.read(&blocks);
        let lacking: Vec<BlockHash> = blocks.into_iter().filter(|h| !store.contains(h)).collect();
        if lacking.is_empty() {
            return Ok((0, 0));
        }
        let pages = lacking.len() as u64;
        let bytes = pages * self.cfg.profile.page_size as u64 * self.cfg.kv_bytes_per_token;
        let end = disks.book(w, now, write_us(bytes));
        self.disk_written += 1;
        if spill {
            self.spills_in_flight[w] += 1;
        }
        let write = DiskWrite {
            w,
            blocks: lacking,
            spill,
        };
        self.disk_writes.insert(self.disk_written, write);
        self.events.push(end, Event::DiskWritten(self.disk_written));
        Ok((pages, bytes))
    }

    /// Write `d` ended: its pages are on the disk (the least recently used
    /// going past its capacity).
    pub(super) fn disk_written(&mut self, d: u32, now: u64) -> anyhow::Result<()> {
        let write = (self.disk_writes.remove(&d))
            .ok_or_else(|| anyhow::anyhow!("disk write {d} ended twice"))?;
        if write.spill {
            self.spills_in_flight[write.w] -= 1;
        }
        let disks = (self.disks.as_mut()).ok_or_else(|| anyhow::anyhow!("no disk tier"))?;
        let new = disks.store_mut(write.w).put(&write.blocks, 0, now / 1000) as u64;
        let c = &mut self.counters.disk;
        c.stored_pages += new;
        c.already_held_pages += write.blocks.len() as u64 - new;
        Ok(())
    }
}
