//! Each worker's disk tier (`--disk-pages`), as `pie-worker`'s
//! `[runtime.persist]` over a `pie-kv` `DiskStore`: pages by block hash that
//! only their worker reads, up to a capacity in pages, least recently used
//! first out (the store's LRU budget: `pool.rs`'s model with both watermarks
//! at 1.0, no pins). `persist-prefix` writes hot prefixes there, a worker
//! told to spill to disk (`retain-all`, `to = "disk"`, or `any` without a
//! pool) writes the retained sessions it evicts early there, and an arrival
//! first loads the leading pages of its prompt its worker's disk holds past
//! its cached prefix. A worker's reads and writes queue on its one disk,
//! each costing a fixed latency plus its bytes at the disk's bandwidth. A
//! worker's disk outlives the worker (a stopped slot started again finds
//! it, as a StatefulSet pod finds its volume).

use serde::Serialize;

use crate::pool::Pool;

/// A PCIe 4.0 x4 datacenter NVMe SSD: the Samsung PM9A3 datasheet gives
/// up to 6,900 MB/s sequential read and 4,100 MB/s sequential write (a
/// page file is 2 MiB at Llama-3-8B's KV, large enough to stream).
pub const DISK_READ_BYTES_PER_S: f64 = 6.9e9;
pub const DISK_WRITE_BYTES_PER_S: f64 = 4.1e9;
/// Per read or write of a prompt's pages: opening the files and, for a
/// write, fsync and rename. An assumption, not a published figure.
pub const DISK_LATENCY_US: u64 = 100;

pub fn read_us(bytes: u64) -> u64 {
    DISK_LATENCY_US + (bytes as f64 / DISK_READ_BYTES_PER_S * 1e6) as u64
}

pub fn write_us(bytes: u64) -> u64 {
    DISK_LATENCY_US + (bytes as f64 / DISK_WRITE_BYTES_PER_S * 1e6) as u64
}

/// The workers' disks and when each is next free.
pub struct Disks {
    capacity: usize,
    stores: Vec<Pool>,
    busy_until: Vec<u64>,
}

impl Disks {
    pub fn new(workers: usize, capacity: usize) -> Self {
        let mut d = Self {
            capacity,
            stores: Vec::new(),
            busy_until: Vec::new(),
        };
        d.grow(workers);
        d
    }

    /// Disks for `workers` workers (new ones empty).
    pub fn grow(&mut self, workers: usize) {
        while self.stores.len() < workers {
            self.stores
                .push(Pool::with_watermarks(self.capacity, 1.0, 1.0));
            self.busy_until.push(0);
        }
    }

    pub fn store(&self, w: usize) -> &Pool {
        &self.stores[w]
    }

    pub fn store_mut(&mut self, w: usize) -> &mut Pool {
        &mut self.stores[w]
    }

    /// An I/O of `us` on worker `w`'s disk, ready at `now`: when it ends.
    pub fn book(&mut self, w: usize, now: u64, us: u64) -> u64 {
        let end = now.max(self.busy_until[w]) + us;
        self.busy_until[w] = end;
        end
    }

    /// Pages evicted over every disk, and the most any held.
    pub fn finish(&self, c: &mut DiskCounters) {
        c.capacity_pages = self.capacity;
        c.evicted_pages = self.stores.iter().map(|s| s.evicted).sum();
        c.max_held_pages = self.stores.iter().map(|s| s.max_held).max().unwrap_or(0);
    }
}

/// What the run's disks did (present in the metrics with `--disk-pages`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DiskCounters {
    /// Each worker's disk, in pages.
    pub capacity_pages: usize,
    /// `PersistPrefix` actions carried out, the pages they wrote (those the
    /// disk lacked) and their bytes.
    pub persists: u64,
    pub persisted_pages: u64,
    pub persisted_bytes: u64,
    /// Retained sessions spilled to disk (`retain-all`), their pages and
    /// bytes; spills to disk dropped (4 of the worker's on their way).
    pub spills: u64,
    pub spilled_pages: u64,
    pub spilled_bytes: u64,
    pub dropped_spills: u64,
    /// Pages written that reached the disk new, or found there already.
    pub stored_pages: u64,
    pub already_held_pages: u64,
    /// Loads before a prefill (an arrival's leading pages from its worker's
    /// disk), their pages and bytes, and the seconds they took (queueing on
    /// the disk included), summed.
    pub loads: u64,
    pub loaded_pages: u64,
    pub loaded_bytes: u64,
    pub load_s: f64,
    /// Loaded pages that did not fit the worker's memory when they arrived.
    pub unfit_pages: u64,
    /// Pages evicted (LRU past the capacity), over every disk; the most one
    /// disk held.
    pub evicted_pages: u64,
    pub max_held_pages: usize,
}
