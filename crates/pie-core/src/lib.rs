//! Shared vocabulary of Pie: identifiers, block hashes and props.
//!
//! Everything here is plain data so that every other crate (policies, KV cache,
//! model, binaries, simulator) can depend on it without pulling in I/O.

pub mod hash;
pub mod ids;
pub mod props;

pub use hash::{block_hash, block_hashes, BlockHash, ModelFingerprint};
pub use ids::SeqId;
pub use props::{PropError, PropValue, Props};
