//! Full KV pages on disk: a worker's `persist-prefix` tier (and the disk tier
//! a page pool can reuse).
//!
//! A page rests in `DIR/<format>/<block hash>.kvpage`, in the transfer format
//! ([`crate::transfer`]: header and XXH3 checksum), where `<format>` names the
//! model fingerprint, dtype and layout, so pages of another model, dtype or
//! page size never share a directory. What a store guarantees:
//!
//! - **No torn page is ever read.** A page is written to a temporary name,
//!   fsynced, renamed into place and the directory fsynced; a crash leaves at
//!   most a temporary file, removed when the store opens.
//! - **No damaged or foreign page is ever used.** Every read is checked
//!   (magic, checksum, model, dtype, layout, length, and the block hash it was
//!   asked for); a page that fails is deleted and reported, so the caller
//!   counts it and recomputes.
//! - **The index survives restarts.** It is the directory itself, listed when
//!   the store opens (pages are read lazily, when asked for); its LRU order is
//!   the files' modification times, which reads refresh.
//! - **Bounded.** At most `budget` bytes: writing evicts the least recently
//!   used pages first; a budget smaller than one page stores nothing.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use pie_core::BlockHash;

use crate::transfer::{page_bytes_len, verify_page_format, PageFormat, TransferError};

const PAGE_SUFFIX: &str = ".kvpage";
const TMP_SUFFIX: &str = ".tmp";

/// Why a store could not open or write.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("a page of {page} bytes does not fit the disk budget of {budget} bytes")]
    OverBudget { page: u64, budget: u64 },
    #[error("refusing to write a bad page: {0}")]
    BadPage(TransferError),
    #[error("refusing to write the page of block {got:016x} as block {want:016x}")]
    WrongBlock { got: u64, want: u64 },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DiskError + '_ {
    move |source| DiskError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a read found.
#[derive(Debug)]
pub enum Loaded {
    Page(Vec<u8>),
    Missing,
    /// The file was unreadable, damaged, of another format or under another
    /// hash; it is deleted.
    Refused(String),
}

/// What opening a store found on disk.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Opened {
    pub pages: usize,
    pub bytes: u64,
    /// Temporary files of writes a crash interrupted, deleted.
    pub torn: usize,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    bytes: u64,
    tick: u64,
    used: SystemTime,
}

/// One format's pages under one directory. Not shared between processes:
/// give each worker its own directory.
pub struct DiskStore {
    dir: PathBuf,
    format: PageFormat,
    budget: u64,
    bytes: u64,
    entries: HashMap<BlockHash, Entry>,
    /// tick -> page: least recently used first.
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
}

/// The subdirectory of `format`'s pages.
pub fn format_dir(format: &PageFormat) -> String {
    let l = format.layout;
    format!(
        "{:016x}-dtype{}-{}x{}x{}",
        format.fingerprint.0, format.dtype, l.layers, l.page_size, l.kv_dim
    )
}

/// The format a subdirectory's name (from [`format_dir`]) stands for.
pub fn parse_format_dir(name: &str) -> Option<PageFormat> {
    let (fingerprint, rest) = name.split_once("-dtype")?;
    let (dtype, shape) = rest.split_once('-')?;
    let mut dims = shape.split('x').map(str::parse::<usize>);
    let (Some(Ok(layers)), Some(Ok(page_size)), Some(Ok(kv_dim)), None) =
        (dims.next(), dims.next(), dims.next(), dims.next())
    else {
        return None;
    };
    Some(PageFormat {
        fingerprint: pie_core::ModelFingerprint(u64::from_str_radix(fingerprint, 16).ok()?),
        dtype: dtype.parse().ok()?,
        layout: crate::KvLayout {
            layers,
            page_size,
            kv_dim,
        },
    })
}

impl DiskStore {
    /// Open (creating it if needed) the store of `format`'s pages under
    /// `root`, list what it holds, delete torn writes, and evict down to
    /// `budget`.
    pub fn open(root: &Path, format: PageFormat, budget: u64) -> Result<(Self, Opened), DiskError> {
        let dir = root.join(format_dir(&format));
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let mut store = Self {
            dir,
            format,
            budget,
            bytes: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        };
        let mut opened = Opened::default();
        let mut found = Vec::new();
        for item in fs::read_dir(&store.dir).map_err(io(&store.dir))? {
            let item = item.map_err(io(&store.dir))?;
            let name = item.file_name().to_string_lossy().into_owned();
            if name.ends_with(TMP_SUFFIX) {
                fs::remove_file(item.path()).map_err(io(&item.path()))?;
                opened.torn += 1;
            } else if let Some(hash) = hash_of_name(&name) {
                let meta = item.metadata().map_err(io(&item.path()))?;
                found.push((
                    meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    hash,
                    meta.len(),
                ));
            }
        }
        found.sort();
        for (used, hash, bytes) in found {
            store.insert(hash, bytes, used);
        }
        store.evict_to(store.budget);
        opened.pages = store.entries.len();
        opened.bytes = store.bytes;
        Ok((store, opened))
    }

    pub fn format(&self) -> PageFormat {
        self.format
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.entries.keys().copied()
    }

    /// Read and check the page of `hash`; a page that fails any check is
    /// deleted and reported as `Refused`.
    pub fn get(&mut self, hash: BlockHash) -> Loaded {
        if !self.contains(hash) {
            return Loaded::Missing;
        }
        let path = self.path_of(hash);
        let checked = fs::read(&path)
            .map_err(|e| format!("unreadable: {e}"))
            .and_then(|bytes| match verify_page_format(&self.format, &bytes) {
                Ok(found) if found == hash => Ok(bytes),
                Ok(found) => Err(format!("holds block {:016x}", found.0)),
                Err(e) => Err(e.to_string()),
            });
        match checked {
            Ok(bytes) => {
                self.touch(hash, &path);
                Loaded::Page(bytes)
            }
            Err(why) => {
                self.remove(hash);
                Loaded::Refused(format!("{}: {why}", path.display()))
            }
        }
    }

    /// Write `bytes` (a page in the transfer format, checked) as the page of
    /// `hash`, evicting least recently used pages to stay within the budget.
    /// Returns the pages evicted; a page already stored is left as it is.
    pub fn put(&mut self, hash: BlockHash, bytes: &[u8]) -> Result<Vec<BlockHash>, DiskError> {
        match verify_page_format(&self.format, bytes) {
            Ok(found) if found == hash => {}
            Ok(found) => {
                return Err(DiskError::WrongBlock {
                    got: found.0,
                    want: hash.0,
                })
            }
            Err(e) => return Err(DiskError::BadPage(e)),
        }
        if self.contains(hash) {
            return Ok(Vec::new());
        }
        let len = bytes.len() as u64;
        if len > self.budget {
            return Err(DiskError::OverBudget {
                page: len,
                budget: self.budget,
            });
        }
        let evicted = self.evict_to(self.budget - len);
        self.write_atomically(hash, bytes)?;
        self.insert(hash, len, SystemTime::now());
        Ok(evicted)
    }

    fn write_atomically(&self, hash: BlockHash, bytes: &[u8]) -> Result<(), DiskError> {
        let path = self.path_of(hash);
        let tmp = self.dir.join(format!(
            ".{:016x}.{}{TMP_SUFFIX}",
            hash.0,
            std::process::id()
        ));
        let written = File::create(&tmp)
            .and_then(|mut f| {
                f.write_all(bytes)?;
                f.sync_all()
            })
            .and_then(|()| fs::rename(&tmp, &path))
            .and_then(|()| File::open(&self.dir)?.sync_all());
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written.map_err(io(&path))
    }

    /// Delete the page of `hash`; false when it was not stored.
    pub fn remove(&mut self, hash: BlockHash) -> bool {
        let Some(entry) = self.entries.remove(&hash) else {
            return false;
        };
        self.lru.remove(&entry.tick);
        self.bytes -= entry.bytes;
        let _ = fs::remove_file(self.path_of(hash));
        true
    }

    /// Delete every page last used before `now - age`; returns them.
    pub fn remove_older_than(&mut self, age: Duration, now: SystemTime) -> Vec<BlockHash> {
        let cutoff = now.checked_sub(age).unwrap_or(SystemTime::UNIX_EPOCH);
        let old: Vec<BlockHash> = self
            .entries
            .iter()
            .filter(|(_, e)| e.used < cutoff)
            .map(|(&h, _)| h)
            .collect();
        for &hash in &old {
            self.remove(hash);
        }
        old
    }

    /// Evict least recently used pages until at most `limit` bytes remain.
    fn evict_to(&mut self, limit: u64) -> Vec<BlockHash> {
        let mut evicted = Vec::new();
        while self.bytes > limit {
            let Some((_, &hash)) = self.lru.iter().next() else {
                break;
            };
            self.remove(hash);
            evicted.push(hash);
        }
        evicted
    }

    fn insert(&mut self, hash: BlockHash, bytes: u64, used: SystemTime) {
        self.tick += 1;
        self.entries.insert(
            hash,
            Entry {
                bytes,
                tick: self.tick,
                used,
            },
        );
        self.lru.insert(self.tick, hash);
        self.bytes += bytes;
    }

    /// Mark `hash` as just used, in memory and in the file's modification
    /// time (the LRU order a restart reads back).
    fn touch(&mut self, hash: BlockHash, path: &Path) {
        let Some(entry) = self.entries.get_mut(&hash) else {
            return;
        };
        self.lru.remove(&entry.tick);
        self.tick += 1;
        entry.tick = self.tick;
        entry.used = SystemTime::now();
        self.lru.insert(self.tick, hash);
        let _ = File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_modified(entry.used));
    }

    fn path_of(&self, hash: BlockHash) -> PathBuf {
        self.dir.join(format!("{:016x}{PAGE_SUFFIX}", hash.0))
    }

    /// Bytes one page of this store's format takes on disk.
    pub fn page_bytes(&self) -> u64 {
        page_bytes_len(&self.format) as u64
    }
}

fn hash_of_name(name: &str) -> Option<BlockHash> {
    let hex = name.strip_suffix(PAGE_SUFFIX)?;
    (hex.len() == 16)
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
        .map(BlockHash)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::export_page;
    use crate::{KvLayout, KvPool};
    use pie_core::ModelFingerprint;

    const LAYOUT: KvLayout = KvLayout {
        layers: 2,
        page_size: 2,
        kv_dim: 3,
    };

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pie-disk-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// The exported bytes of a page of model `fp` with block hash `hash`.
    fn page(fp: u64, hash: u64) -> Vec<u8> {
        let mut pool = KvPool::new(LAYOUT, 1, ModelFingerprint(fp));
        let p = pool.allocate().unwrap();
        for layer in 0..2 {
            for slot in 0..2 {
                let x = (hash as f32) + (layer * 2 + slot) as f32;
                pool.write(layer, p, slot, &[x, -x, 0.5], &[x * 3.0; 3]);
            }
        }
        pool.publish(p, BlockHash(hash));
        export_page(&pool, p).unwrap()
    }

    fn format(fp: u64) -> PageFormat {
        PageFormat {
            fingerprint: ModelFingerprint(fp),
            dtype: 0,
            layout: LAYOUT,
        }
    }

    fn page_len() -> u64 {
        page_bytes_len(&format(1)) as u64
    }

    #[test]
    fn pages_survive_a_reopen_and_read_back_identical() {
        let root = scratch("reopen");
        let (mut store, opened) = DiskStore::open(&root, format(1), 1 << 20).unwrap();
        assert_eq!(opened, Opened::default());
        for h in 1..=3 {
            assert!(store.put(BlockHash(h), &page(1, h)).unwrap().is_empty());
        }
        drop(store);
        let (mut store, opened) = DiskStore::open(&root, format(1), 1 << 20).unwrap();
        assert_eq!(opened.pages, 3);
        assert_eq!(opened.bytes, 3 * page_len());
        match store.get(BlockHash(2)) {
            Loaded::Page(bytes) => assert_eq!(bytes, page(1, 2)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(store.get(BlockHash(9)), Loaded::Missing));
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_format_directory_names_its_format() {
        let name = format_dir(&format(0xabc));
        assert_eq!(parse_format_dir(&name), Some(format(0xabc)));
        for bad in ["x", "00-dtype0-1x2", "zz-dtype0-1x2x3", "01-dtype0-1x2x3x4"] {
            assert_eq!(parse_format_dir(bad), None, "{bad}");
        }
    }

    #[test]
    fn torn_writes_are_deleted_on_open() {
        let root = scratch("torn");
        let (mut store, _) = DiskStore::open(&root, format(1), 1 << 20).unwrap();
        store.put(BlockHash(1), &page(1, 1)).unwrap();
        let dir = root.join(format_dir(&format(1)));
        let half = &page(1, 2)[..40];
        fs::write(dir.join(format!(".{:016x}.77{TMP_SUFFIX}", 2)), half).unwrap();
        drop(store);
        let (store, opened) = DiskStore::open(&root, format(1), 1 << 20).unwrap();
        assert_eq!((opened.pages, opened.torn), (1, 1));
        assert!(!store.contains(BlockHash(2)));
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        fs::remove_dir_all(root).unwrap();
    }

    /// A flipped byte, a truncated file, another model's page and a page under
    /// another hash's name are each refused and deleted, never returned.
    #[test]
    fn damaged_or_foreign_files_are_refused_and_deleted() {
        let root = scratch("damaged");
        let (mut store, _) = DiskStore::open(&root, format(1), 1 << 20).unwrap();
        for h in 1..=4 {
            store.put(BlockHash(h), &page(1, h)).unwrap();
        }
        let dir = root.join(format_dir(&format(1)));
        let path = |h: u64| dir.join(format!("{h:016x}{PAGE_SUFFIX}"));
        let mut flipped = page(1, 1);
        flipped[100] ^= 4;
        fs::write(path(1), flipped).unwrap();
        fs::write(path(2), &page(1, 2)[..60]).unwrap();
        fs::write(path(3), page(2, 3)).unwrap();
        fs::write(path(4), page(1, 5)).unwrap();
        drop(store);
        let (mut store, opened) = DiskStore::open(&root, format(1), 1 << 20).unwrap();
        assert_eq!(opened.pages, 4, "reads are lazy: damage is found on use");
        for (h, cause) in [
            (1, "checksum"),
            (2, "truncated"),
            (3, "model"),
            (4, "block"),
        ] {
            match store.get(BlockHash(h)) {
                Loaded::Refused(why) => assert!(why.contains(cause), "{h}: {why}"),
                other => panic!("page {h}: {other:?}"),
            }
            assert!(!path(h).exists(), "page {h} deleted");
        }
        assert!(store.is_empty());
        assert_eq!(store.bytes(), 0);
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn the_budget_evicts_least_recently_used_first() {
        let root = scratch("budget");
        let (mut store, _) = DiskStore::open(&root, format(1), 3 * page_len()).unwrap();
        for h in 1..=3 {
            store.put(BlockHash(h), &page(1, h)).unwrap();
        }
        assert!(matches!(store.get(BlockHash(1)), Loaded::Page(_)));
        assert_eq!(
            store.put(BlockHash(4), &page(1, 4)).unwrap(),
            vec![BlockHash(2)]
        );
        assert_eq!(store.bytes(), 3 * page_len());
        drop(store);
        let (store, opened) = DiskStore::open(&root, format(1), 2 * page_len()).unwrap();
        assert_eq!(opened.pages, 2, "a smaller budget evicts at open");
        assert!(store.contains(BlockHash(4)) && store.contains(BlockHash(1)));
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_budget_below_one_page_stores_nothing() {
        let root = scratch("zero");
        let (mut store, _) = DiskStore::open(&root, format(1), 0).unwrap();
        assert!(matches!(
            store.put(BlockHash(1), &page(1, 1)),
            Err(DiskError::OverBudget { budget: 0, .. })
        ));
        assert!(store.is_empty());
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn bad_pages_are_not_written() {
        let root = scratch("bad");
        let (mut store, _) = DiskStore::open(&root, format(1), 1 << 20).unwrap();
        assert!(matches!(
            store.put(BlockHash(1), &page(2, 1)),
            Err(DiskError::BadPage(TransferError::Model { .. }))
        ));
        assert!(matches!(
            store.put(BlockHash(2), &page(1, 1)),
            Err(DiskError::WrongBlock { got: 1, want: 2 })
        ));
        assert!(store.is_empty());
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn old_pages_are_removed_by_age() {
        let root = scratch("age");
        let (mut store, _) = DiskStore::open(&root, format(1), 1 << 20).unwrap();
        store.put(BlockHash(1), &page(1, 1)).unwrap();
        store.put(BlockHash(2), &page(1, 2)).unwrap();
        let later = SystemTime::now() + Duration::from_secs(60);
        assert!(store
            .remove_older_than(Duration::from_secs(120), later)
            .is_empty());
        let mut gone = store.remove_older_than(Duration::from_secs(30), later);
        gone.sort();
        assert_eq!(gone, vec![BlockHash(1), BlockHash(2)]);
        assert!(store.is_empty());
        fs::remove_dir_all(root).unwrap();
    }
}
