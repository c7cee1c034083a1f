use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use pie_core::{BlockHash, KvDtype, ModelFingerprint};

use serde::{Deserialize, Serialize};

/// Not enough free or evictable pages for a request.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("out of KV pages: need {needed}, {available} available")]
pub struct OutOfPages {
    pub needed: usize,
    pub available: usize,
}

/// Shape of one page: `page_size` tokens of K and V for each of `layers` layers,
/// each token `kv_dim` (= kv heads x head dim) floats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub layers: usize,
    pub page_size: usize,
    pub kv_dim: usize,
}

impl KvLayout {
    /// Floats of K (or of V) for one page in one layer.
    pub fn page_floats(&self) -> usize {
        self.page_size * self.kv_dim
    }

    /// Bytes one page takes in memory (K and V, all layers) as `dtype`.
    pub fn page_bytes(&self, dtype: KvDtype) -> usize {
        2 * self.layers * self.page_floats() * dtype.bytes()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub u32);

#[derive(Clone, Debug, Default)]
struct PageMeta {
    refcount: u32,
    /// Set once the page is full and its block hash is in the prefix index.
    hash: Option<BlockHash>,
    /// Key in `lru` while the page is cached (hashed, unreferenced).
    lru_tick: Option<u64>,
}

/// Counts of pages by state; `used + cached + free == total` always.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub total: usize,
    /// Referenced by at least one page table.
    pub used: usize,
    /// Unreferenced but hashed: reusable by a prefix match, evictable.
    pub cached: usize,
    pub free: usize,
}

/// K and V of every layer for every page, one `Vec` per layer each.
struct Planes<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
}

impl<T: bytemuck::Pod> Planes<T> {
    fn new(layers: usize, len: usize) -> Self {
        Self {
            k: (0..layers).map(|_| vec![T::zeroed(); len]).collect(),
            v: (0..layers).map(|_| vec![T::zeroed(); len]).collect(),
        }
    }

    fn slices(&self, layer: usize, r: Range<usize>) -> (&[T], &[T]) {
        (&self.k[layer][r.clone()], &self.v[layer][r])
    }

    fn slices_mut(&mut self, layer: usize, r: Range<usize>) -> (&mut [T], &mut [T]) {
        (&mut self.k[layer][r.clone()], &mut self.v[layer][r])
    }

    fn bytes(&self, layer: usize, r: Range<usize>) -> (&[u8], &[u8]) {
        let (k, v) = self.slices(layer, r);
        (bytemuck::cast_slice(k), bytemuck::cast_slice(v))
    }

    fn bytes_mut(&mut self, layer: usize, r: Range<usize>) -> (&mut [u8], &mut [u8]) {
        let (k, v) = self.slices_mut(layer, r);
        (bytemuck::cast_slice_mut(k), bytemuck::cast_slice_mut(v))
    }

    fn copy_within(&mut self, src: Range<usize>, dst: usize) {
        for plane in self.k.iter_mut().chain(&mut self.v) {
            plane.copy_within(src.clone(), dst);
        }
    }
}

/// The pool's values in its dtype. f16 is kept as its bits (`u16`): plain old
/// data for the page format's byte copies, and what the attention kernels'
/// conversion instructions load.
enum Storage {
    F32(Planes<f32>),
    F16(Planes<u16>),
}

/// One layer's K and V of a page as stored (`page_size * kv_dim` values each).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PageKv<'a> {
    F32(&'a [f32], &'a [f32]),
    /// f16 bits.
    F16(&'a [u16], &'a [u16]),
}

/// The page pool of one worker.
pub struct KvPool {
    layout: KvLayout,
    dtype: KvDtype,
    fingerprint: ModelFingerprint,
    values: Storage,
    meta: Vec<PageMeta>,
    free: Vec<PageId>,
    index: HashMap<BlockHash, PageId>,
    lru: BTreeMap<u64, PageId>,
    tick: u64,
    /// Changes to the prefix index since the last `take_index_events`, when
    /// recording (a controller subscribes to them); None when nobody listens.
    index_events: Option<Vec<IndexChange>>,
}

/// A block hash entered or left the prefix index. Order matters (a hash can be
/// stored, evicted and stored again), so consumers apply changes in sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexChange {
    Stored(BlockHash),
    Removed(BlockHash),
}

impl KvPool {
    /// A pool of f32 pages.
    pub fn new(layout: KvLayout, num_pages: usize, fingerprint: ModelFingerprint) -> Self {
        Self::with_dtype(layout, KvDtype::F32, num_pages, fingerprint)
    }

    /// A pool whose pages hold `dtype` (values are rounded to it when written).
    pub fn with_dtype(
        layout: KvLayout,
        dtype: KvDtype,
        num_pages: usize,
        fingerprint: ModelFingerprint,
    ) -> Self {
        let floats = num_pages * layout.page_floats();
        Self {
            layout,
            dtype,
            fingerprint,
            values: match dtype {
                KvDtype::F32 => Storage::F32(Planes::new(layout.layers, floats)),
                KvDtype::F16 => Storage::F16(Planes::new(layout.layers, floats)),
            },
            meta: vec![PageMeta::default(); num_pages],
            free: (0..num_pages as u32).rev().map(PageId).collect(),
            index: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            index_events: None,
        }
    }

    /// Start recording prefix-index changes for `take_index_events` (off by
    /// default: an engine nobody drains would keep them all).
    pub fn record_index_events(&mut self) {
        self.index_events.get_or_insert_with(Vec::new);
    }

    /// The changes recorded since the last call (empty when not recording).
    pub fn take_index_events(&mut self) -> Vec<IndexChange> {
        self.index_events
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn log(&mut self, change: IndexChange) {
        if let Some(events) = &mut self.index_events {
            events.push(change);
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn fingerprint(&self) -> ModelFingerprint {
        self.fingerprint
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    pub fn stats(&self) -> PoolStats {
        let total = self.meta.len();
        let cached = self.lru.len();
        let free = self.free.len();
        PoolStats {
            total,
            used: total - cached - free,
            cached,
            free,
        }
    }

    /// Pages that an allocation could obtain now (free, or cached and evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn refcount(&self, page: PageId) -> u32 {
        self.meta[page.0 as usize].refcount
    }

    /// A fresh page with refcount 1: from the free list, else by evicting the least
    /// recently used cached page.
    pub fn allocate(&mut self) -> Result<PageId, OutOfPages> {
        let page = match self.free.pop() {
            Some(p) => p,
            None => self.evict_lru().ok_or(OutOfPages {
                needed: 1,
                available: 0,
            })?,
        };
        self.meta[page.0 as usize].refcount = 1;
        Ok(page)
    }

    fn evict_lru(&mut self) -> Option<PageId> {
        let (_, page) = self.lru.pop_first()?;
        let meta = &mut self.meta[page.0 as usize];
        meta.lru_tick = None;
        if let Some(hash) = meta.hash.take() {
            self.index.remove(&hash);
            self.log(IndexChange::Removed(hash));
        }
        Some(page)
    }

    /// Add a reference to a page (shared prefix, fork). A cached page leaves the LRU.
    pub fn retain(&mut self, page: PageId) {
        let meta = &mut self.meta[page.0 as usize];
        if let Some(tick) = meta.lru_tick.take() {
            self.lru.remove(&tick);
        }
        meta.refcount += 1;
    }

    /// Drop a reference. At zero a hashed page becomes cached (most recently used),
    /// an unhashed one returns to the free list.
    pub fn release(&mut self, page: PageId) {
        let meta = &mut self.meta[page.0 as usize];
        assert!(meta.refcount > 0, "release of unreferenced page {page:?}");
        meta.refcount -= 1;
        if meta.refcount > 0 {
            return;
        }
        if meta.hash.is_some() {
            self.tick += 1;
            meta.lru_tick = Some(self.tick);
            self.lru.insert(self.tick, page);
        } else {
            self.free.push(page);
        }
    }

    /// Name a full page by its block hash so later prompts can reuse it. If another
    /// page already holds that hash the index keeps the older one and this page stays
    /// private (freed when released).
    pub fn publish(&mut self, page: PageId, hash: BlockHash) {
        let meta = &mut self.meta[page.0 as usize];
        if meta.hash.is_some() || self.index.contains_key(&hash) {
            return;
        }
        meta.hash = Some(hash);
        self.index.insert(hash, page);
        self.log(IndexChange::Stored(hash));
    }

    pub fn lookup(&self, hash: BlockHash) -> Option<PageId> {
        self.index.get(&hash).copied()
    }

    pub fn hash_of(&self, page: PageId) -> Option<BlockHash> {
        self.meta[page.0 as usize].hash
    }

    /// The pages holding the longest cached prefix of the chain `hashes`.
    pub fn longest_prefix(&self, hashes: &[BlockHash]) -> Vec<PageId> {
        hashes.iter().map_while(|h| self.lookup(*h)).collect()
    }

    /// Every block hash in the prefix index (for the controller's snapshot).
    pub fn indexed_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.index.keys().copied()
    }

    fn slot_range(&self, page: PageId, slot: usize) -> Range<usize> {
        let start = page.0 as usize * self.layout.page_floats() + slot * self.layout.kv_dim;
        start..start + self.layout.kv_dim
    }

    /// Write one token's K and V for one layer (rounded to the pool's dtype).
    pub fn write(&mut self, layer: usize, page: PageId, slot: usize, k: &[f32], v: &[f32]) {
        let r = self.slot_range(page, slot);
        match &mut self.values {
            Storage::F32(p) => {
                let (dk, dv) = p.slices_mut(layer, r);
                dk.copy_from_slice(k);
                dv.copy_from_slice(v);
            }
            Storage::F16(p) => {
                let (dk, dv) = p.slices_mut(layer, r);
                dk.reinterpret_cast_mut::<f16>().convert_from_f32_slice(k);
                dv.reinterpret_cast_mut::<f16>().convert_from_f32_slice(v);
            }
        }
    }

    /// One token's K and V for one layer, as f32 (a copy: f16 widens).
    pub fn read(&self, layer: usize, page: PageId, slot: usize) -> (Vec<f32>, Vec<f32>) {
        let r = self.slot_range(page, slot);
        match &self.values {
            Storage::F32(p) => {
                let (k, v) = p.slices(layer, r);
                (k.to_vec(), v.to_vec())
            }
            Storage::F16(p) => {
                let (k, v) = p.slices(layer, r);
                (
                    k.reinterpret_cast::<f16>().to_f32_vec(),
                    v.reinterpret_cast::<f16>().to_f32_vec(),
                )
            }
        }
    }

    fn page_range(&self, page: PageId) -> Range<usize> {
        let n = self.layout.page_floats();
        let start = page.0 as usize * n;
        start..start + n
    }

    /// One layer's K and V of a whole page as stored.
    pub fn page_kv(&self, layer: usize, page: PageId) -> PageKv<'_> {
        let r = self.page_range(page);
        match &self.values {
            Storage::F32(p) => {
                let (k, v) = p.slices(layer, r);
                PageKv::F32(k, v)
            }
            Storage::F16(p) => {
                let (k, v) = p.slices(layer, r);
                PageKv::F16(k, v)
            }
        }
    }

    /// One layer's K and V of a whole page as little-endian bytes (the page
    /// format's values).
    pub(crate) fn page_bytes(&self, layer: usize, page: PageId) -> (&[u8], &[u8]) {
        let r = self.page_range(page);
        match &self.values {
            Storage::F32(p) => p.bytes(layer, r),
            Storage::F16(p) => p.bytes(layer, r),
        }
    }

    pub(crate) fn page_bytes_mut(&mut self, layer: usize, page: PageId) -> (&mut [u8], &mut [u8]) {
        let r = self.page_range(page);
        match &mut self.values {
            Storage::F32(p) => p.bytes_mut(layer, r),
            Storage::F16(p) => p.bytes_mut(layer, r),
        }
    }

    /// Copy the first `tokens` slots of `src` into `dst` in every layer.
    pub fn copy_page(&mut self, src: PageId, dst: PageId, tokens: usize) {
        let n = tokens * self.layout.kv_dim;
        let (s, d) = (
            src.0 as usize * self.layout.page_floats(),
            dst.0 as usize * self.layout.page_floats(),
        );
        match &mut self.values {
            Storage::F32(p) => p.copy_within(s..s + n, d),
            Storage::F16(p) => p.copy_within(s..s + n, d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(pages: usize) -> KvPool {
        KvPool::new(
            KvLayout {
                layers: 2,
                page_size: 4,
                kv_dim: 8,
            },
            pages,
            ModelFingerprint(1),
        )
    }

    #[test]
    fn allocate_release_and_lru_eviction() {
        let mut p = pool(2);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.allocate().is_err());
        p.publish(a, BlockHash(10));
        p.publish(b, BlockHash(11));
        p.release(b);
        p.release(a);
        assert_eq!(
            p.stats(),
            PoolStats {
                total: 2,
                used: 0,
                cached: 2,
                free: 0
            }
        );
        // b was released first, so it is least recently used and goes first.
        assert_eq!(p.allocate().unwrap(), b);
        assert_eq!(p.lookup(BlockHash(11)), None);
        assert_eq!(p.lookup(BlockHash(10)), Some(a));
        p.retain(a);
        assert!(
            p.allocate().is_err(),
            "a referenced page must not be evicted"
        );
    }

    #[test]
    fn index_changes_are_recorded_in_order_when_asked() {
        let mut p = pool(1);
        let a = p.allocate().unwrap();
        p.publish(a, BlockHash(1));
        assert!(p.take_index_events().is_empty(), "not recording yet");
        p.record_index_events();
        p.release(a);
        let b = p.allocate().unwrap();
        p.publish(b, BlockHash(2));
        assert_eq!(
            p.take_index_events(),
            vec![
                IndexChange::Removed(BlockHash(1)),
                IndexChange::Stored(BlockHash(2))
            ]
        );
        assert!(p.take_index_events().is_empty(), "taken");
    }

    #[test]
    fn f16_pages_round_to_nearest_and_take_half_the_bytes() {
        let layout = pool(1).layout();
        let mut p = KvPool::with_dtype(layout, KvDtype::F16, 2, ModelFingerprint(1));
        assert_eq!(
            layout.page_bytes(KvDtype::F16) * 2,
            layout.page_bytes(KvDtype::F32)
        );
        let a = p.allocate().unwrap();
        let k: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 / 3000.0).collect();
        p.write(1, a, 2, &k, &[65504.0, -1e-3, 0.0, 1.0, 2.0, 3.0, 4.0, 1e5]);
        let (got_k, got_v) = p.read(1, a, 2);
        for (g, w) in got_k.iter().zip(&k) {
            assert_eq!(*g, half::f16::from_f32(*w).to_f32());
            assert!((g - w).abs() <= w * 2f32.powi(-11), "{g} vs {w}");
        }
        assert_eq!(got_v[0], 65504.0);
        assert_eq!(got_v[7], f32::INFINITY, "beyond f16's range");
        let b = p.allocate().unwrap();
        p.copy_page(a, b, 3);
        assert_eq!(p.page_kv(1, a), p.page_kv(1, b));
    }

    #[test]
    fn duplicate_hash_keeps_first_page() {
        let mut p = pool(2);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.publish(a, BlockHash(5));
        p.publish(b, BlockHash(5));
        assert_eq!(p.lookup(BlockHash(5)), Some(a));
        p.release(b);
        assert_eq!(p.stats().free, 1);
    }
}
