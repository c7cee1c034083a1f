//! Paged KV cache.
//!
//! - [`KvPool`]: the page storage (K and V for every layer, f32 or f16) and the page
//!   bookkeeping: reference counts, block hashes, the prefix index and LRU
//!   eviction of unreferenced cached pages.
//! - [`PageTable`]: one context's pages and how many of its tokens have KV.
//! - [`transfer`]: a page to bytes and back, with a header and a checksum, so
//!   pages can move between workers, a pool and disk.
//! - [`stream`]: pages as a framed stream with a handshake, checked by the
//!   receiver against the prompt's own block-hash chain.
//! - [`disk`]: pages at rest, written atomically, checked when read, under a
//!   byte budget (`persist-prefix`).
//!
//! Invariant (tested): a page referenced by a live page table is never evicted or
//! handed out again; once every table is released, every refcount is zero.

pub mod disk;
mod pool;
pub mod stream;
mod table;
pub mod transfer;

pub use pie_core::KvDtype;
pub use pool::{IndexChange, KvLayout, KvPool, OutOfPages, PageId, PageKv, PoolStats};
pub use table::PageTable;
