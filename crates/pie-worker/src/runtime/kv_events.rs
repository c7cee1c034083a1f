//! The KV event publisher, owned by the engine thread: numbers and
//! broadcasts the prefix-index changes (memory and disk tier) a controller
//! routes by, and builds the snapshot a new subscriber starts from.
//!
//! Invariant: a snapshot's `seq` covers exactly what it contains (pending
//! changes are published first), so a subscriber that applies every batch
//! after it is never missing a change.

use std::collections::HashSet;
use std::sync::Arc;

use pie_core::{BlockHash, KvEventBatch, KvSnapshot};
use pie_kv::IndexChange;
use tokio::sync::broadcast;

use crate::engine::Engine;

/// Numbers and broadcasts the blocks this worker serves without recompute:
/// the engine's prefix-index changes and the disk tier's. A block leaves the
/// published set only when it is in neither.
pub(super) struct KvPublisher {
    tx: broadcast::Sender<Arc<KvEventBatch>>,
    seq: u64,
    /// The disk tier as the events have told it.
    on_disk: HashSet<u64>,
    /// Disk changes since the last batch: (block, stored?).
    disk_changes: Vec<(u64, bool)>,
}

impl KvPublisher {
    /// A publisher on `tx` whose disk tier holds `on_disk` at start.
    pub(super) fn new(tx: broadcast::Sender<Arc<KvEventBatch>>, on_disk: HashSet<u64>) -> Self {
        Self {
            tx,
            seq: 0,
            on_disk,
            disk_changes: Vec::new(),
        }
    }

    pub(super) fn disk_changed(&mut self, stored: Vec<BlockHash>, removed: Vec<BlockHash>) {
        for h in stored {
            self.on_disk.insert(h.0);
            self.disk_changes.push((h.0, true));
        }
        for h in removed {
            self.on_disk.remove(&h.0);
            self.disk_changes.push((h.0, false));
        }
    }

    pub(super) fn publish(&mut self, engine: &mut Engine) {
        let changes = engine.pool_mut().take_index_events();
        if changes.is_empty() && self.disk_changes.is_empty() {
            return;
        }
        let on_disk = &self.on_disk;
        let pool = engine.pool();
        let memory = changes.into_iter().filter_map(|c| match c {
            IndexChange::Stored(h) => Some((h.0, true)),
            IndexChange::Removed(h) => (!on_disk.contains(&h.0)).then_some((h.0, false)),
        });
        let disk = self.disk_changes.iter().filter_map(|&(h, stored)| {
            (stored || pool.lookup(BlockHash(h)).is_none()).then_some((h, stored))
        });
        self.seq += 1;
        let mut batch = KvEventBatch::from_changes(self.seq, memory.chain(disk));
        let tier = KvEventBatch::from_changes(self.seq, self.disk_changes.drain(..));
        (batch.persisted, batch.unpersisted) = (tier.stored, tier.removed);
        // No subscriber is fine: a later one starts from a snapshot.
        let _ = self.tx.send(Arc::new(batch));
    }

    /// Everything indexed now; publishes pending changes first so the snapshot's
    /// `seq` covers exactly what it contains.
    pub(super) fn snapshot(&mut self, engine: &mut Engine) -> KvSnapshot {
        self.publish(engine);
        KvSnapshot {
            seq: self.seq,
            fingerprint: engine.pool().fingerprint().0,
            page_size: engine.config().page_size,
            hashes: engine
                .pool()
                .indexed_hashes()
                .map(|h| h.0)
                .filter(|h| !self.on_disk.contains(h))
                .chain(self.on_disk.iter().copied())
                .collect(),
            persisted: self.on_disk.iter().copied().collect(),
        }
    }
}
