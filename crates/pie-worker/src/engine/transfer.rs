//! The engine's side of moving pages: leasing published pages for export,
//! serializing them, and importing pages a peer sent. Only the engine thread
//! calls these (it owns the pool); the HTTP side streams and verifies.

use pie_core::BlockHash;
use pie_kv::transfer::{export_page, import_page, PageFormat};
use pie_kv::{KvPool, PageId};

use super::state::Engine;

impl Engine {
    /// The format a page must have to be used here (the transfer handshake).
    pub fn page_format(&self) -> PageFormat {
        PageFormat::of(&self.kv.pool)
    }

    /// How many leading pages of `chain` this pool holds.
    pub fn cached_pages(&self, chain: &[BlockHash]) -> usize {
        self.kv.pool.longest_prefix(chain).len()
    }

    /// Pin the pool's leading pages of `chain` so they cannot be evicted while
    /// they are exported; the caller must `unpin` them.
    pub fn pin_prefix(&mut self, chain: &[BlockHash]) -> Vec<PageId> {
        let pages = self.kv.pool.longest_prefix(chain);
        for &page in &pages {
            self.kv.pool.retain(page);
        }
        pages
    }

    pub fn unpin(&mut self, pages: &[PageId]) {
        for &page in pages {
            self.kv.pool.release(page);
        }
    }

    /// Pinned, published pages in the transfer format.
    pub fn export_pages(&self, pages: &[PageId]) -> Vec<Vec<u8>> {
        pages
            .iter()
            .filter_map(|&page| export_page(&self.kv.pool, page).ok())
            .collect()
    }

    /// Import verified pages as cached pages; returns how many the pool holds
    /// afterwards (already present ones count; a full pool stops the import).
    /// `pages` continue `chain`, whose leading part in the pool is kept
    /// (`import_keeping`).
    /// Retained sessions make room first, soonest expiry first (spilled
    /// under `retain-all`): pages pulled for an arriving prompt are worth
    /// more than a finished session's that may never be asked for again.
    pub fn import_pages(&mut self, chain: &[BlockHash], pages: &[Vec<u8>]) -> usize {
        while self.kv.pool.available() < pages.len()
            && self.scheduler.evict_soonest_retained(&mut self.kv)
        {}
        import_keeping(&mut self.kv.pool, chain, pages)
    }
}

/// Import `pages`, which continue `chain`, as cached pages, keeping the
/// chain's leading pages the pool holds and the pages already imported while
/// room is made
/// (a chain's head is often the least recently used page, and evicting it
/// for its own tail leaves a prompt nothing). Stops at a full pool or a
/// refused page; returns how many of `pages` the pool holds. Released tail
/// first, so the prefix's tail is evicted first, as a sequence's is.
fn import_keeping(pool: &mut KvPool, chain: &[BlockHash], pages: &[Vec<u8>]) -> usize {
    let mut kept = pool.longest_prefix(chain);
    for &page in &kept {
        pool.retain(page);
    }
    let before = kept.len();
    for bytes in pages {
        match import_page(pool, bytes) {
            Ok(page) => {
                pool.retain(page);
                kept.push(page);
            }
            Err(_) => break,
        }
    }
    let imported = kept.len() - before;
    for &page in kept.iter().rev() {
        pool.release(page);
    }
    imported
}
