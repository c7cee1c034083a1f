use pie_core::{block_hash, BlockHash};

use crate::{KvPool, OutOfPages, PageId};

/// One context's pages: token `i` lives in `pages[i / page_size]` at slot
/// `i % page_size`. Only full pages are ever shared, so the partial last page is
/// always private and safe to write.
#[derive(Debug, Default)]
pub struct PageTable {
    pages: Vec<PageId>,
    /// Tokens whose K and V are stored.
    len: usize,
    /// Block hashes of the full pages, in order (the chain continues from the last).
    hashes: Vec<BlockHash>,
    /// Where the chain starts when not at the pool's model fingerprint: a
    /// tenant's cache salt (`ModelFingerprint::salted_root`).
    root: Option<BlockHash>,
}

impl PageTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// A table whose pages chain from `root`: they are shared only with
    /// tables of the same root.
    pub fn with_root(root: BlockHash) -> Self {
        Self {
            root: Some(root),
            ..Self::default()
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Page and slot of token position `pos`.
    pub fn slot(&self, pos: usize, page_size: usize) -> (PageId, usize) {
        (self.pages[pos / page_size], pos % page_size)
    }

    /// Pages to allocate so that `new_len` tokens fit.
    pub fn pages_needed(&self, new_len: usize, page_size: usize) -> usize {
        new_len.div_ceil(page_size).saturating_sub(self.pages.len())
    }

    /// Share the cached pages named by `hashes` (a prefix chain of this context's
    /// tokens) into an empty table. Returns the number of tokens now covered.
    pub fn attach_prefix(&mut self, pool: &mut KvPool, hashes: &[BlockHash]) -> usize {
        assert!(self.pages.is_empty(), "attach_prefix on a non-empty table");
        for page in pool.longest_prefix(hashes) {
            pool.retain(page);
            self.hashes
                .push(pool.hash_of(page).expect("indexed page has a hash"));
            self.pages.push(page);
        }
        self.len = self.pages.len() * pool.layout().page_size;
        self.len
    }

    /// After the shared whole pages, the next `slots` tokens' K and V copied
    /// from `src` (another table's page holding the same tokens at the same
    /// positions) into a private page: they need not be computed again.
    /// Returns the tokens now covered.
    pub fn attach_copy(
        &mut self,
        pool: &mut KvPool,
        src: PageId,
        slots: usize,
    ) -> Result<usize, OutOfPages> {
        let page_size = pool.layout().page_size;
        assert_eq!(
            self.len,
            self.pages.len() * page_size,
            "copied after whole pages"
        );
        assert!(
            (1..=page_size).contains(&slots),
            "a copy fills part of one page"
        );
        let page = pool.allocate()?;
        pool.copy_page(src, page, slots);
        self.pages.push(page);
        self.len += slots;
        Ok(self.len)
    }

    /// Allocate pages so `new_len` tokens fit; all or nothing.
    pub fn reserve(&mut self, pool: &mut KvPool, new_len: usize) -> Result<(), OutOfPages> {
        let needed = self.pages_needed(new_len, pool.layout().page_size);
        if needed > pool.available() {
            return Err(OutOfPages {
                needed,
                available: pool.available(),
            });
        }
        for _ in 0..needed {
            self.pages.push(pool.allocate()?);
        }
        Ok(())
    }

    /// Record that K and V of `tokens[..new_len]` are stored, and publish every page
    /// that became full under its block hash.
    pub fn commit(&mut self, pool: &mut KvPool, tokens: &[u32], new_len: usize) {
        let page_size = pool.layout().page_size;
        assert!(new_len <= self.pages.len() * page_size && new_len <= tokens.len());
        self.len = new_len;
        while self.hashes.len() < new_len / page_size {
            let i = self.hashes.len();
            let parent = self
                .hashes
                .last()
                .copied()
                .or(self.root)
                .unwrap_or(pool.fingerprint().root());
            let hash = block_hash(parent, &tokens[i * page_size..(i + 1) * page_size]);
            pool.publish(self.pages[i], hash);
            self.hashes.push(hash);
        }
    }

    /// Drop every page reference; the table is empty afterwards. Pages go back
    /// last first, so LRU eviction takes a prefix's tail before its head: a cached
    /// head stays reachable by the prefix index, a cached tail without its head
    /// would not be.
    pub fn release(&mut self, pool: &mut KvPool) {
        for page in self.pages.drain(..).rev() {
            pool.release(page);
        }
        self.hashes.clear();
        self.len = 0;
    }

    /// Keep only the first `len` tokens' K and V: the pages after them are
    /// released, last first. A shared full page that `len` cuts into goes
    /// too (a partial page is always private); the private partial page
    /// stays.
    pub fn truncate(&mut self, pool: &mut KvPool, len: usize) {
        if len >= self.len {
            return;
        }
        let page_size = pool.layout().page_size;
        let whole = len / page_size;
        let keeps_partial = !len.is_multiple_of(page_size) && whole >= self.hashes.len();
        let keep = whole + usize::from(keeps_partial);
        for page in self.pages.drain(keep..).rev() {
            pool.release(page);
        }
        self.hashes.truncate(whole);
        self.len = if keeps_partial {
            len
        } else {
            whole * page_size
        };
    }

    /// A new table with the same tokens: full pages shared, the partial last page copied.
    pub fn fork(&self, pool: &mut KvPool) -> Result<PageTable, OutOfPages> {
        let page_size = pool.layout().page_size;
        let full = self.len / page_size;
        let pages = self.pages[..full].to_vec();
        for &page in &pages {
            pool.retain(page);
        }
        let mut table = PageTable {
            pages,
            len: full * page_size,
            hashes: self.hashes[..full].to_vec(),
            root: self.root,
        };
        let partial = self.len % page_size;
        if partial > 0 {
            if let Err(e) = table.attach_copy(pool, self.pages[full], partial) {
                table.release(pool);
                return Err(e);
            }
        }
        Ok(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvLayout, PoolStats};
    use pie_core::{block_hashes, ModelFingerprint};
    use proptest::prelude::*;

    const FP: ModelFingerprint = ModelFingerprint(3);

    fn pool(pages: usize) -> KvPool {
        KvPool::new(
            KvLayout {
                layers: 1,
                page_size: 4,
                kv_dim: 2,
            },
            pages,
            FP,
        )
    }

    fn fill(pool: &mut KvPool, tokens: &[u32]) -> PageTable {
        let mut t = PageTable::new();
        t.reserve(pool, tokens.len()).unwrap();
        for (pos, &tok) in tokens.iter().enumerate() {
            let (page, slot) = t.slot(pos, 4);
            pool.write(0, page, slot, &[tok as f32; 2], &[-(tok as f32); 2]);
        }
        t.commit(pool, tokens, tokens.len());
        t
    }

    #[test]
    fn prefix_is_found_and_shared() {
        let mut p = pool(8);
        let tokens: Vec<u32> = (0..10).collect();
        let mut a = fill(&mut p, &tokens);
        let mut b = PageTable::new();
        let covered = b.attach_prefix(&mut p, &block_hashes(FP, &tokens, 4));
        assert_eq!(covered, 8);
        assert_eq!(b.pages(), &a.pages()[..2]);
        assert_eq!(p.refcount(a.pages()[0]), 2);
        a.release(&mut p);
        b.release(&mut p);
        assert_eq!(
            p.stats(),
            PoolStats {
                total: 8,
                used: 0,
                cached: 2,
                free: 6
            }
        );
    }

    #[test]
    fn eviction_takes_the_tail_of_a_prefix_first() {
        let mut p = pool(3);
        let tokens: Vec<u32> = (0..12).collect();
        let mut t = fill(&mut p, &tokens);
        let head = t.pages()[0];
        t.release(&mut p);
        let hashes = block_hashes(FP, &tokens, 4);
        p.allocate().unwrap();
        assert_eq!(
            p.longest_prefix(&hashes),
            vec![head, p.lookup(hashes[1]).unwrap()],
            "the first two pages are still a usable prefix"
        );
    }

    #[test]
    fn fork_copies_partial_page() {
        let mut p = pool(8);
        let tokens: Vec<u32> = (0..6).collect();
        let a = fill(&mut p, &tokens);
        let f = a.fork(&mut p).unwrap();
        assert_eq!(f.pages()[0], a.pages()[0]);
        assert_ne!(f.pages()[1], a.pages()[1]);
        assert_eq!(p.read(0, f.pages()[1], 1), p.read(0, a.pages()[1], 1));
        assert_eq!(p.read(0, f.pages()[1], 1).0, &[5.0, 5.0]);
    }

    /// A continuation of another table's tokens shares its whole pages and
    /// copies the slots of its partial page it has too, into a page of its own.
    #[test]
    fn a_copy_covers_the_slots_after_the_whole_pages() {
        let mut p = pool(8);
        let tokens: Vec<u32> = (10..17).collect();
        let a = fill(&mut p, &tokens);
        let mut b = PageTable::new();
        assert_eq!(b.attach_prefix(&mut p, &block_hashes(FP, &tokens, 4)), 4);
        assert_eq!(b.attach_copy(&mut p, a.pages()[1], 2), Ok(6));
        assert_ne!(b.pages()[1], a.pages()[1]);
        assert_eq!(p.read(0, b.pages()[1], 1), p.read(0, a.pages()[1], 1));
        assert_eq!(p.read(0, b.pages()[1], 1).0, &[15.0, 15.0]);
        // Its next slot is its own to write: the source keeps its value.
        p.write(0, b.pages()[1], 2, &[99.0; 2], &[0.0; 2]);
        assert_eq!(p.read(0, a.pages()[1], 2).0, &[16.0, 16.0]);
    }

    /// Truncating keeps the private partial page, drops a shared full page
    /// it cuts into, and releases every page after.
    #[test]
    fn truncate_releases_the_pages_past_the_new_length() {
        let mut p = pool(8);
        let tokens: Vec<u32> = (0..10).collect();
        let mut t = fill(&mut p, &tokens);
        let (head, second) = (t.pages()[0], t.pages()[1]);
        t.truncate(&mut p, 9);
        assert_eq!((t.len(), t.pages().len(), t.hashes().len()), (9, 3, 2));
        t.truncate(&mut p, 6);
        assert_eq!((t.len(), t.pages(), t.hashes().len()), (4, &[head][..], 1));
        assert_eq!(p.refcount(second), 0);
        assert_eq!(p.stats().used, 1);
        t.truncate(&mut p, 7);
        assert_eq!(t.len(), 4, "truncating never grows a table");
        t.truncate(&mut p, 0);
        assert_eq!((t.len(), p.stats().used), (0, 0));
    }

    #[test]
    fn reserve_is_all_or_nothing() {
        let mut p = pool(2);
        let mut t = PageTable::new();
        assert_eq!(
            t.reserve(&mut p, 12),
            Err(OutOfPages {
                needed: 3,
                available: 2
            })
        );
        assert_eq!(p.stats().free, 2);
    }

    proptest! {
        /// Random interleavings of contexts that create, share prefixes, fork and end:
        /// a referenced page is never handed out twice, and refcounts return to zero.
        #[test]
        fn no_page_leaks_or_double_use(ops in proptest::collection::vec((0u8..4, 0usize..3, 1usize..14), 1..60)) {
            let mut p = pool(12);
            let mut live: Vec<PageTable> = Vec::new();
            for (op, prefix, len) in ops {
                match op {
                    0 | 1 => {
                        // Token streams share a prefix chosen by `prefix`.
                        let tokens: Vec<u32> = (0..len as u32).map(|i| if i < 8 { prefix as u32 * 100 + i } else { 1000 + i }).collect();
                        let mut t = PageTable::new();
                        let covered = t.attach_prefix(&mut p, &block_hashes(FP, &tokens[..tokens.len() - 1], 4));
                        if t.reserve(&mut p, tokens.len()).is_ok() {
                            prop_assert!(covered < tokens.len());
                            t.commit(&mut p, &tokens, tokens.len());
                            live.push(t);
                        } else {
                            t.release(&mut p);
                        }
                    }
                    2 if !live.is_empty() => {
                        let i = len % live.len();
                        if let Ok(f) = live[i].fork(&mut p) { live.push(f); }
                    }
                    _ if !live.is_empty() => {
                        let i = len % live.len();
                        live.swap_remove(i).release(&mut p);
                    }
                    _ => {}
                }
                // Every page a live table references has a refcount equal to the
                // number of references, so it cannot be free or cached.
                let mut refs = std::collections::HashMap::new();
                for t in &live { for pg in t.pages() { *refs.entry(*pg).or_insert(0u32) += 1; } }
                for (pg, n) in &refs { prop_assert_eq!(p.refcount(*pg), *n); }
                prop_assert_eq!(p.stats().used, refs.len());
            }
            for mut t in live { t.release(&mut p); }
            prop_assert_eq!(p.stats().used, 0);
            prop_assert_eq!(p.stats().cached + p.stats().free, 12);
        }
    }
}
