//! `PageStore`: the pool's pages, addressed by page format (model
//! fingerprint, dtype, layout) and block hash, in memory with an optional
//! disk tier (`pie_kv::disk::DiskStore`, the code `persist-prefix` uses).
//!
//! - **Watermarks.** Past `high` x `capacity` bytes in memory, the least
//!   recently used pages go until `low` x `capacity` remain; soft-pinned
//!   pages go only when nothing else is left to evict. A pin may end
//!   (`Pin::Until`: a spilled session's `keep-ms`, `retain-all`); after it
//!   the page is an ordinary least recently used one.
//! - **Reader leases.** A reader takes its pages as shared references for its
//!   whole answer: eviction takes a page out of the index, never out from
//!   under a reader.
//! - **Disk tier.** Every page stored is written through to disk (atomically,
//!   under its own byte budget); a memory miss reads the disk (checked; a
//!   damaged file is deleted and counted) and brings the page back into
//!   memory. At start-up every format directory is opened again.
//! - Every page taken in is checked (checksum, format, the block hash it is
//!   stored under) before it is kept.
//! - **Changes.** What the pool holds (memory or disk) gains or loses a block:
//!   recorded as a [`Change`] for the KV event stream (`api`), taken with
//!   [`PageStore::take_changes`].

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use pie_core::BlockHash;
use pie_kv::disk::{format_dir, parse_format_dir, DiskError, DiskStore, Loaded};
use pie_kv::transfer::{verify_page_format, PageFormat};

/// A page as readers share it.
pub type Page = Arc<Vec<u8>>;

/// The store's limits (`[pool]`).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Bytes of pages kept in memory.
    pub capacity: u64,
    /// Eviction starts above `high * capacity` ...
    pub high: f64,
    /// ... and stops at `low * capacity`.
    pub low: f64,
    /// The disk tier's directory and byte budget.
    pub disk: Option<(PathBuf, u64)>,
}

/// What happened, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub stored: u64,
    pub hits_memory: u64,
    pub hits_disk: u64,
    pub misses: u64,
    pub evicted: u64,
    /// Pages refused on the way in, or read back damaged from disk.
    pub refused: u64,
    pub deleted: u64,
}

/// How a page is kept when the store must evict: unpinned pages go first,
/// then soft-pinned ones (least recently used first in both).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pin {
    #[default]
    None,
    /// Pinned until then (a spilled session's retention).
    Until(SystemTime),
    Always,
}

impl Pin {
    /// `pin` for good, else for `keep_ms` from `now` when given.
    pub fn of(pin: bool, keep_ms: Option<u64>, now: SystemTime) -> Self {
        match (pin, keep_ms) {
            (true, _) => Pin::Always,
            (false, Some(ms)) => Pin::Until(now + Duration::from_millis(ms)),
            (false, None) => Pin::None,
        }
    }

    fn holds(self, now: SystemTime) -> bool {
        match self {
            Pin::None => false,
            Pin::Until(until) => now < until,
            Pin::Always => true,
        }
    }
}

#[derive(Debug)]
struct Entry {
    page: Page,
    tick: u64,
    pin: Pin,
    used: SystemTime,
}

/// One format's pages.
struct Tier {
    format: PageFormat,
    pages: HashMap<BlockHash, Entry>,
    disk: Option<DiskStore>,
}

/// A block the pool started or stopped holding (in memory or on disk), for
/// pages of the model `fingerprint`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    pub fingerprint: u64,
    pub hash: BlockHash,
    pub stored: bool,
}

pub struct PageStore {
    limits: Limits,
    changes: Vec<Change>,
    tiers: HashMap<String, Tier>,
    bytes: u64,
    tick: u64,
    /// tick -> (tier, page): least recently used first.
    lru: BTreeMap<u64, (String, BlockHash)>,
    pub counts: Counts,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("page refused: {0}")]
    Page(String),
    #[error(transparent)]
    Disk(#[from] DiskError),
}

impl PageStore {
    /// A store over `limits`; with a disk tier, every format directory found
    /// there is opened (torn writes deleted) and returns the pages it held.
    pub fn open(limits: Limits) -> Result<(Self, usize), DiskError> {
        let mut store = Self {
            limits,
            changes: Vec::new(),
            tiers: HashMap::new(),
            bytes: 0,
            tick: 0,
            lru: BTreeMap::new(),
            counts: Counts::default(),
        };
        let mut on_disk = 0;
        if let Some((root, _)) = store.limits.disk.clone() {
            std::fs::create_dir_all(&root).map_err(|source| DiskError::Io {
                path: root.clone(),
                source,
            })?;
            let entries = std::fs::read_dir(&root).map_err(|source| DiskError::Io {
                path: root.clone(),
                source,
            })?;
            for entry in entries.flatten() {
                if let Some(format) = parse_format_dir(&entry.file_name().to_string_lossy()) {
                    on_disk += store.tier(format)?.disk.as_ref().map_or(0, DiskStore::len);
                }
            }
        }
        Ok((store, on_disk))
    }

    /// Pages and bytes in memory; pages on disk.
    pub fn sizes(&self) -> (usize, u64, usize) {
        let pages = self.tiers.values().map(|t| t.pages.len()).sum();
        let disk = self
            .tiers
            .values()
            .filter_map(|t| t.disk.as_ref())
            .map(DiskStore::len)
            .sum();
        (pages, self.bytes, disk)
    }

    fn tier(&mut self, format: PageFormat) -> Result<&mut Tier, DiskError> {
        let key = format_dir(&format);
        if !self.tiers.contains_key(&key) {
            let disk = match &self.limits.disk {
                Some((root, budget)) => Some(DiskStore::open(root, format, *budget)?.0),
                None => None,
            };
            self.tiers.insert(
                key.clone(),
                Tier {
                    format,
                    pages: HashMap::new(),
                    disk,
                },
            );
        }
        Ok(self.tiers.get_mut(&key).expect("inserted above"))
    }

    /// Check and keep `bytes` as the page of `hash` in `format` (written
    /// through to disk when there is a disk tier).
    pub fn put(
        &mut self,
        format: PageFormat,
        hash: BlockHash,
        bytes: Vec<u8>,
        pin: Pin,
    ) -> Result<(), StoreError> {
        match verify_page_format(&format, &bytes) {
            Ok(found) if found == hash => {}
            Ok(found) => {
                self.counts.refused += 1;
                return Err(StoreError::Page(format!(
                    "it holds block {:016x}, not {:016x}",
                    found.0, hash.0
                )));
            }
            Err(e) => {
                self.counts.refused += 1;
                return Err(StoreError::Page(e.to_string()));
            }
        }
        let tier = self.tier(format)?;
        let evicted = match &mut tier.disk {
            Some(disk) => disk.put(hash, &bytes)?,
            None => Vec::new(),
        };
        let gone: Vec<BlockHash> = (evicted.into_iter())
            .filter(|h| !tier.pages.contains_key(h))
            .collect();
        for hash in gone {
            self.changed(format, hash, false);
        }
        self.changed(format, hash, true);
        self.remember(format, hash, Arc::new(bytes), pin);
        self.counts.stored += 1;
        Ok(())
    }

    /// The leading pages of `chain` this store holds (memory, else disk),
    /// up to the first it lacks: the reader's lease on them.
    pub fn leading(&mut self, format: PageFormat, chain: &[BlockHash]) -> Vec<Page> {
        let mut out = Vec::new();
        for &hash in chain {
            match self.get(format, hash) {
                Some(page) => out.push(page),
                None => {
                    self.counts.misses += 1;
                    break;
                }
            }
        }
        out
    }

    fn get(&mut self, format: PageFormat, hash: BlockHash) -> Option<Page> {
        let key = format_dir(&format);
        let tier = self.tiers.get_mut(&key)?;
        if let Some(entry) = tier.pages.get_mut(&hash) {
            self.lru.remove(&entry.tick);
            self.tick += 1;
            entry.tick = self.tick;
            entry.used = SystemTime::now();
            self.lru.insert(self.tick, (key, hash));
            self.counts.hits_memory += 1;
            return Some(entry.page.clone());
        }
        match tier.disk.as_mut()?.get(hash) {
            Loaded::Page(bytes) => {
                let page = Arc::new(bytes);
                self.remember(format, hash, page.clone(), Pin::None);
                self.counts.hits_disk += 1;
                Some(page)
            }
            Loaded::Missing => None,
            Loaded::Refused(why) => {
                tracing::warn!(error = %why, "a pool page on disk was refused and deleted");
                self.counts.refused += 1;
                self.changed(format, hash, false);
                None
            }
        }
    }

    fn remember(&mut self, format: PageFormat, hash: BlockHash, page: Page, pin: Pin) {
        let key = format_dir(&format);
        self.tick += 1;
        let len = page.len() as u64;
        let tick = self.tick;
        let Some(tier) = self.tiers.get_mut(&key) else {
            return;
        };
        let old = tier.pages.insert(
            hash,
            Entry {
                page,
                tick,
                pin,
                used: SystemTime::now(),
            },
        );
        if let Some(old) = old {
            self.lru.remove(&old.tick);
            self.bytes -= old.page.len() as u64;
            let entry = tier.pages.get_mut(&hash).expect("inserted");
            entry.pin = entry.pin.max(old.pin);
        }
        self.lru.insert(tick, (key, hash));
        self.bytes += len;
        self.evict_past_watermark();
    }

    fn evict_past_watermark(&mut self) {
        let capacity = self.limits.capacity as f64;
        if (self.bytes as f64) <= self.limits.high * capacity {
            return;
        }
        let target = (self.limits.low * capacity) as u64;
        let now = SystemTime::now();
        for pinned_too in [false, true] {
            let victims: Vec<(u64, String, BlockHash)> = self
                .lru
                .iter()
                .map(|(&tick, (key, hash))| (tick, key.clone(), *hash))
                .collect();
            for (tick, key, hash) in victims {
                if self.bytes <= target {
                    return;
                }
                let Some(tier) = self.tiers.get_mut(&key) else {
                    continue;
                };
                if tier
                    .pages
                    .get(&hash)
                    .is_some_and(|e| e.pin.holds(now) && !pinned_too)
                {
                    continue;
                }
                if let Some(entry) = tier.pages.remove(&hash) {
                    self.bytes -= entry.page.len() as u64;
                    self.lru.remove(&tick);
                    self.counts.evicted += 1;
                    if !tier.disk.as_ref().is_some_and(|d| d.contains(hash)) {
                        let format = tier.format;
                        self.changed(format, hash, false);
                    }
                }
            }
        }
    }

    /// Delete the pages of `chain` in `format`, from memory and disk.
    pub fn remove_chain(&mut self, format: PageFormat, chain: &[BlockHash]) -> usize {
        let Some(tier) = self.tiers.get_mut(&format_dir(&format)) else {
            return 0;
        };
        let mut removed = 0;
        for hash in chain {
            let in_memory = tier.pages.remove(hash);
            if let Some(entry) = &in_memory {
                self.lru.remove(&entry.tick);
                self.bytes -= entry.page.len() as u64;
            }
            let on_disk = tier.disk.as_mut().is_some_and(|d| d.remove(*hash));
            if in_memory.is_some() || on_disk {
                removed += 1;
                self.changes.push(Change {
                    fingerprint: format.fingerprint.0,
                    hash: *hash,
                    stored: false,
                });
            }
        }
        self.counts.deleted += removed as u64;
        removed
    }

    /// Delete every page unused for `age`, from memory and disk.
    pub fn remove_older_than(&mut self, age: Duration, now: SystemTime) -> usize {
        let cutoff = now.checked_sub(age).unwrap_or(SystemTime::UNIX_EPOCH);
        let mut removed = 0;
        for tier in self.tiers.values_mut() {
            let old: Vec<BlockHash> = tier
                .pages
                .iter()
                .filter(|(_, e)| e.used < cutoff)
                .map(|(&h, _)| h)
                .collect();
            for hash in &old {
                if let Some(entry) = tier.pages.remove(hash) {
                    self.lru.remove(&entry.tick);
                    self.bytes -= entry.page.len() as u64;
                }
            }
            let disk_old = tier
                .disk
                .as_mut()
                .map_or(Vec::new(), |d| d.remove_older_than(age, now));
            let fingerprint = tier.format.fingerprint.0;
            let gone: Vec<BlockHash> = old
                .iter()
                .copied()
                .filter(|h| !tier.disk.as_ref().is_some_and(|d| d.contains(*h)))
                .chain(
                    disk_old
                        .iter()
                        .copied()
                        .filter(|h| !tier.pages.contains_key(h) && !old.contains(h)),
                )
                .collect();
            self.changes.extend(gone.into_iter().map(|hash| Change {
                fingerprint,
                hash,
                stored: false,
            }));
            removed += old.len() + disk_old.iter().filter(|h| !old.contains(h)).count();
        }
        self.counts.deleted += removed as u64;
        removed
    }

    fn changed(&mut self, format: PageFormat, hash: BlockHash, stored: bool) {
        self.changes.push(Change {
            fingerprint: format.fingerprint.0,
            hash,
            stored,
        });
    }

    /// The changes since the last call, oldest first.
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// Every block held (in memory or on disk) for pages of the model
    /// `fingerprint`, each once.
    pub fn held(&self, fingerprint: u64) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .tiers
            .values()
            .filter(|t| t.format.fingerprint.0 == fingerprint)
            .flat_map(|t| {
                let disk = t.disk.iter().flat_map(|d| d.hashes());
                t.pages.keys().copied().chain(disk)
            })
            .map(|h| h.0)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The format of a tier this store holds, by its directory name.
    pub fn formats(&self) -> Vec<PageFormat> {
        self.tiers.values().map(|t| t.format).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::ModelFingerprint;
    use pie_kv::transfer::export_page;
    use pie_kv::{KvDtype, KvLayout, KvPool};

    const LAYOUT: KvLayout = KvLayout {
        layers: 1,
        page_size: 2,
        kv_dim: 2,
    };

    fn format() -> PageFormat {
        PageFormat {
            fingerprint: ModelFingerprint(7),
            dtype: 0,
            layout: LAYOUT,
        }
    }

    fn page(hash: u64) -> Vec<u8> {
        page_of(KvDtype::F32, hash)
    }

    fn page_of(dtype: KvDtype, hash: u64) -> Vec<u8> {
        let mut pool = KvPool::with_dtype(LAYOUT, dtype, 1, ModelFingerprint(7));
        let p = pool.allocate().unwrap();
        pool.write(0, p, 0, &[hash as f32, 1.0], &[2.0, 3.0]);
        pool.publish(p, BlockHash(hash));
        export_page(&pool, p).unwrap()
    }

    fn page_len() -> u64 {
        page(0).len() as u64
    }

    fn store(pages: u64, disk: Option<PathBuf>) -> PageStore {
        PageStore::open(Limits {
            capacity: pages * page_len(),
            high: 0.95,
            low: 0.5,
            disk: disk.map(|d| (d, 1 << 20)),
        })
        .unwrap()
        .0
    }

    fn chain(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().copied().map(BlockHash).collect()
    }

    #[test]
    fn past_the_high_watermark_least_recent_go_down_to_the_low_one() {
        let mut s = store(10, None);
        for h in 1..=9 {
            s.put(format(), BlockHash(h), page(h), Pin::None).unwrap();
        }
        assert_eq!(s.sizes().0, 9, "below 95%: nothing evicted");
        assert_eq!(s.leading(format(), &chain(&[1])).len(), 1);
        s.put(format(), BlockHash(10), page(10), Pin::None).unwrap();
        assert_eq!(s.sizes().0, 5, "down to 50%");
        assert_eq!(s.counts.evicted, 5);
        assert_eq!(
            s.leading(format(), &chain(&[1])).len(),
            1,
            "1 was used recently"
        );
        assert!(s.leading(format(), &chain(&[2])).is_empty());
    }

    /// One model's f16 and f32 pages of one block are two pages, each served
    /// only in its own format, in memory and on disk after a reopen; a page
    /// offered under the other dtype's format is refused.
    #[test]
    fn pages_of_each_kv_dtype_are_kept_apart() {
        let dir = std::env::temp_dir().join(format!("pool-dtypes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let f16 = PageFormat {
            dtype: KvDtype::F16.code(),
            ..format()
        };
        let (full, half) = (page(1), page_of(KvDtype::F16, 1));
        for disk in [None, Some(dir.clone()), Some(dir.clone())] {
            let mut s = store(4, disk.clone());
            if s.leading(format(), &chain(&[1])).is_empty() {
                s.put(format(), BlockHash(1), full.clone(), Pin::None)
                    .unwrap();
                assert!(s.leading(f16, &chain(&[1])).is_empty(), "no f16 page yet");
                assert!(s.put(f16, BlockHash(1), full.clone(), Pin::None).is_err());
                s.put(f16, BlockHash(1), half.clone(), Pin::None).unwrap();
            }
            assert_eq!(*s.leading(format(), &chain(&[1]))[0], full);
            assert_eq!(*s.leading(f16, &chain(&[1]))[0], half, "{disk:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The held set replayed from the changes, as a KV event follower does.
    fn replay(changes: &[Change], held: &mut std::collections::BTreeSet<u64>) {
        for c in changes {
            assert_eq!(c.fingerprint, 7);
            match c.stored {
                true => held.insert(c.hash.0),
                false => held.remove(&c.hash.0),
            };
        }
    }

    #[test]
    fn the_changes_replay_to_what_the_pool_holds_with_and_without_disk() {
        let dir = std::env::temp_dir().join(format!("pool-changes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for disk in [None, Some(dir.clone())] {
            let mut s = store(4, disk.clone());
            let mut held = std::collections::BTreeSet::new();
            for h in 1..=6 {
                s.put(format(), BlockHash(h), page(h), Pin::None).unwrap();
            }
            s.remove_chain(format(), &chain(&[5]));
            s.remove_older_than(Duration::ZERO, SystemTime::now() + Duration::from_secs(1));
            s.put(format(), BlockHash(9), page(9), Pin::None).unwrap();
            replay(&s.take_changes(), &mut held);
            assert_eq!(
                held.iter().copied().collect::<Vec<_>>(),
                s.held(7),
                "{disk:?}"
            );
            assert_eq!(s.held(7), vec![9], "{disk:?}");
            assert!(s.held(8).is_empty(), "another model's pages are apart");
            assert!(s.take_changes().is_empty(), "taken once");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn soft_pins_go_last() {
        let mut s = store(4, None);
        s.put(format(), BlockHash(1), page(1), Pin::Always).unwrap();
        for h in 2..=4 {
            s.put(format(), BlockHash(h), page(h), Pin::None).unwrap();
        }
        assert_eq!(
            s.leading(format(), &chain(&[1])).len(),
            1,
            "pinned page kept"
        );
        let mut all_pinned = store(2, None);
        for h in 1..=2 {
            all_pinned
                .put(format(), BlockHash(h), page(h), Pin::Always)
                .unwrap();
        }
        assert_eq!(
            all_pinned.sizes().0,
            1,
            "soft: pinned pages go when nothing else can"
        );
    }

    #[test]
    fn a_pin_until_a_time_holds_until_then_and_then_goes_as_least_recently_used() {
        let now = SystemTime::now();
        let mut s = store(4, None);
        let until = |secs| Pin::Until(now + Duration::from_secs(secs));
        s.put(format(), BlockHash(1), page(1), until(3600)).unwrap();
        s.put(format(), BlockHash(2), page(2), until(0)).unwrap();
        for h in 3..=4 {
            s.put(format(), BlockHash(h), page(h), Pin::None).unwrap();
        }
        assert_eq!(
            s.leading(format(), &chain(&[1])).len(),
            1,
            "pinned for an hour: kept"
        );
        assert!(
            s.leading(format(), &chain(&[2])).is_empty(),
            "its pin ended: the least recently used page went"
        );
        assert_eq!(
            Pin::of(false, Some(1000), now),
            Pin::Until(now + Duration::from_secs(1))
        );
        assert_eq!(Pin::of(true, Some(1000), now), Pin::Always);
        assert!(
            Pin::Always > until(1) && until(1) > Pin::None,
            "a merge keeps the stronger pin"
        );
    }

    #[test]
    fn a_reader_keeps_its_pages_when_they_are_evicted() {
        let mut s = store(2, None);
        s.put(format(), BlockHash(1), page(1), Pin::None).unwrap();
        let lease = s.leading(format(), &chain(&[1, 2]));
        assert_eq!(lease.len(), 1, "up to the first missing page");
        for h in 2..=3 {
            s.put(format(), BlockHash(h), page(h), Pin::None).unwrap();
        }
        assert!(s.leading(format(), &chain(&[1])).is_empty(), "evicted");
        assert_eq!(*lease[0], page(1));
    }

    #[test]
    fn bad_pages_are_refused() {
        let mut s = store(4, None);
        assert!(s.put(format(), BlockHash(2), page(1), Pin::None).is_err());
        let mut other = format();
        other.fingerprint = ModelFingerprint(8);
        assert!(s.put(other, BlockHash(1), page(1), Pin::None).is_err());
        assert_eq!((s.counts.refused, s.sizes().0), (2, 0));
    }

    #[test]
    fn the_disk_tier_serves_after_a_restart_and_deletes_by_chain_and_age() {
        let dir = std::env::temp_dir().join(format!("pie-pool-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = store(8, Some(dir.clone()));
        for h in 1..=3 {
            s.put(format(), BlockHash(h), page(h), Pin::None).unwrap();
        }
        drop(s);
        let (mut s, on_disk) = PageStore::open(Limits {
            capacity: 8 * page_len(),
            high: 0.9,
            low: 0.5,
            disk: Some((dir.clone(), 1 << 20)),
        })
        .unwrap();
        assert_eq!(on_disk, 3);
        assert_eq!(s.leading(format(), &chain(&[1, 2, 3])).len(), 3);
        assert_eq!(s.counts.hits_disk, 3);
        assert_eq!(s.leading(format(), &chain(&[1])).len(), 1);
        assert_eq!(s.counts.hits_memory, 1, "brought back into memory");
        assert_eq!(s.remove_chain(format(), &chain(&[1, 9])), 1);
        assert!(s.leading(format(), &chain(&[1])).is_empty());
        let later = SystemTime::now() + Duration::from_secs(10);
        assert_eq!(s.remove_older_than(Duration::from_secs(5), later), 2);
        assert_eq!(s.sizes(), (0, 0, 0));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
