//! The trace format: one JSON object per line, as in the public Mooncake traces
//! (`timestamp` in ms since the trace's start, `input_length`, `output_length`,
//! `hash_ids`: one id per 512-token block of the prompt, the last one possibly
//! partial), plus our own optional `props`. Equal ids mean equal blocks *and*
//! equal prefixes before them (ids are chained), which is all a replay needs to
//! reproduce prefix sharing. Token ids never appear in a trace.

use pie_core::hash::{block_hash, BlockHash};
use pie_core::Props;
use serde::{Deserialize, Serialize};

/// Tokens per `hash_ids` entry (Mooncake's block size).
pub const TRACE_BLOCK_TOKENS: usize = 512;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival, in milliseconds since the start of the trace.
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
    #[serde(default, skip_serializing_if = "Props::is_empty")]
    pub props: Props,
}

/// The chained ids of `tokens`' 512-token blocks, the trailing partial block
/// included, so that two prompts share a leading id exactly when they share
/// that whole block and everything before it. The chain is rooted at 0, not at a
/// model fingerprint: a trace names prefixes, not model pages.
pub fn trace_block_ids(tokens: &[u32]) -> Vec<u64> {
    let mut parent = BlockHash(0);
    tokens
        .chunks(TRACE_BLOCK_TOKENS)
        .map(|block| {
            parent = block_hash(parent, block);
            parent.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_chained_and_cover_the_partial_block() {
        let a: Vec<u32> = (0..1100).collect();
        let mut b = a.clone();
        b[600] = 7;
        let (ia, ib) = (trace_block_ids(&a), trace_block_ids(&b));
        assert_eq!(ia.len(), 3, "1100 tokens = 2 full blocks + 1 partial");
        assert_eq!(ia[0], ib[0], "same first block");
        assert_ne!(ia[1], ib[1], "second block differs");
        assert_ne!(ia[2], ib[2], "a later block inherits the difference");
    }

    #[test]
    fn a_mooncake_line_parses() {
        let line = r#"{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 2353, 2354]}"#;
        let r: TraceRecord = serde_json::from_str(line).expect("Mooncake record");
        assert_eq!(r.input_length, 6955);
        assert_eq!(r.hash_ids.len(), 15);
        assert!(r.props.is_empty());
    }
}
