//! Identifiers shared across crates.

use serde::{Deserialize, Serialize};

/// A sequence in the engine: one context being generated (a process has one or more).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SeqId(pub u64);
