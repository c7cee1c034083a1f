//! The KV event stream a worker publishes and the controller subscribes to
//! (`GET /v1/internal/kv-events`, server-sent events): first a `snapshot` of the
//! prefix index, then `kv` batches of block hashes stored and removed. Batches
//! are numbered; a subscriber that sees a gap has lost an event and reconnects,
//! and the new snapshot repairs its view.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Every block hash in a worker's prefix index, as of batch `seq`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvSnapshot {
    /// The last batch whose changes this snapshot includes.
    pub seq: u64,
    pub fingerprint: u64,
    pub page_size: usize,
    /// Every block the worker serves without recompute: in its pool or on
    /// its disk.
    pub hashes: Vec<u64>,
    /// The disk tier (`persist-prefix`): the blocks of `hashes` on disk.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub persisted: Vec<u64>,
}

/// The prefix-index changes of one engine iteration. `stored` and `removed` are
/// disjoint (only a hash's last change in the batch is kept), so they can be
/// applied in either order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub seq: u64,
    pub stored: Vec<u64>,
    pub removed: Vec<u64>,
    /// Blocks written to the disk tier (also in `stored` unless the pool
    /// already held them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub persisted: Vec<u64>,
    /// Blocks gone from the disk tier (in `removed` unless the pool holds them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unpersisted: Vec<u64>,
}

impl KvEventBatch {
    /// A batch from changes in the order they happened: `(hash, stored?)`.
    pub fn from_changes(seq: u64, changes: impl IntoIterator<Item = (u64, bool)>) -> Self {
        let mut last: HashMap<u64, bool> = HashMap::new();
        let mut order = Vec::new();
        for (hash, stored) in changes {
            if last.insert(hash, stored).is_none() {
                order.push(hash);
            }
        }
        let mut batch = Self {
            seq,
            ..Self::default()
        };
        for hash in order {
            match last[&hash] {
                true => batch.stored.push(hash),
                false => batch.removed.push(hash),
            }
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_change_of_a_hash_wins() {
        let b = KvEventBatch::from_changes(
            3,
            [(1, true), (2, true), (1, false), (3, false), (3, true)],
        );
        assert_eq!(b.seq, 3);
        assert_eq!(b.stored, vec![2, 3]);
        assert_eq!(b.removed, vec![1]);
    }
}
