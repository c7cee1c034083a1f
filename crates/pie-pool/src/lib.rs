//! `pie-pool`: a page store shared by workers. Workers pull the missing part
//! of a prompt's prefix from it before prefilling (`[runtime] pool = URL`)
//! and push hot prefixes to it (`persist`), over the same page streams they
//! use between themselves (`pie_kv::stream`). Pages are addressed by page
//! format and block hash, so pages of different models never mix.

pub mod api;
pub mod config;
pub mod metrics;
pub mod store;
