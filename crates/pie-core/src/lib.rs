//! Shared vocabulary of Pie: identifiers, block hashes, props, API keys, the KV
//! page dtype, the config-file reader, the KV event stream's wire types and the
//! names the binaries exchange (`wire`).
//!
//! Everything here is plain data so that every other crate (policies, KV cache,
//! model, binaries, simulator) can depend on it without pulling in I/O.

pub mod api_error;
pub mod auth;
pub mod chat;
pub mod clock;
pub mod config_file;
pub mod hash;
pub mod ids;
pub mod inferlet_ref;
pub mod kv_dtype;
pub mod kv_events;
pub mod openai_fields;
pub mod pool;
pub mod props;
pub mod size;
pub mod tools;
pub mod wire;
pub mod worker_config;

pub use hash::{block_hash, block_hashes, BlockHash, ModelFingerprint};
pub use ids::SeqId;
pub use kv_dtype::KvDtype;
pub use kv_events::{KvEventBatch, KvSnapshot};
pub use props::{PropError, PropValue, Props};
pub use size::ByteSize;
