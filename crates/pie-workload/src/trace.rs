//! The trace format: one JSON object per line, as in the public Mooncake traces
//! (`timestamp` in ms since the trace's start, `input_length`, `output_length`,
//! `hash_ids`: one id per 512-token block of the prompt, the last one possibly
//! partial), plus our own optional `props`. Equal ids mean equal blocks *and*
//! equal prefixes before them (ids are chained), which is all a replay needs to
//! reproduce prefix sharing. Token ids never appear in a trace.
//!
//! Owns the record, the block ids a recorder writes, the JSONL reader and the
//! conversion of records into the [`Request`]s both replayers run.

use std::io::BufRead;

use pie_core::hash::{block_hash, BlockHash};
use pie_core::Props;
use serde::{Deserialize, Serialize};

use crate::workload::{Request, Segment};

/// Tokens per `hash_ids` entry (Mooncake's block size).
pub const TRACE_BLOCK_TOKENS: usize = 512;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival in milliseconds: since the trace's start in published traces,
    /// Unix time in recorded ones (`read_trace` rebases both to the first).
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

/// Segment key spaces of replayed prompt blocks, prompt tails past the ids, and
/// outputs (apart from the generators' keys).
const TRACE_BLOCK: u64 = 11;
const TRACE_TAIL: u64 = 12;
const TRACE_OUTPUT: u64 = 13;

/// The records of a JSONL trace (blank lines skipped; an error names the line),
/// in arrival order with time counted from the first (recorded traces hold Unix
/// milliseconds and are written in finish order).
pub fn read_trace(reader: impl BufRead) -> Result<Vec<TraceRecord>, String> {
    let mut records = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| format!("line {}: {e}", i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(&line).map_err(|e| format!("line {}: {e}", i + 1))?;
        records.push(record);
    }
    records.sort_by_key(|r: &TraceRecord| r.timestamp);
    let start = records.first().map_or(0, |r| r.timestamp);
    for r in &mut records {
        r.timestamp -= start;
    }
    Ok(records)
}

/// Requests replaying `records`: the prompt is one segment per hash id, keyed by
/// the id and 512 tokens long, the last one the rest of `input_length` (ids past
/// the prompt's end are ignored; a prompt longer than its ids ends with a segment
/// of its own); the output is `output_length` tokens of its own. Arrival is the
/// timestamp, the props are the record's, the client (and class) the `client`
/// prop or "default".
pub fn trace_requests(records: &[TraceRecord]) -> Vec<Request> {
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let client = r.props.str("client").unwrap_or("default").to_string();
            Request {
                arrival_us: r.timestamp.saturating_mul(1000),
                follows: None,
                class: client.clone(),
                client,
                prompt: prompt_segments(i, r),
                output: Segment::named(&[TRACE_OUTPUT, i as u64], r.output_length),
                props: r.props.clone(),
            }
        })
        .collect()
}

fn prompt_segments(index: usize, r: &TraceRecord) -> Vec<Segment> {
    let mut left = r.input_length;
    let block = TRACE_BLOCK_TOKENS as u32;
    let mut prompt: Vec<Segment> = r
        .hash_ids
        .iter()
        .map_while(|&id| {
            let len = left.min(block);
            left -= len;
            (len > 0).then(|| Segment::named(&[TRACE_BLOCK, id], len))
        })
        .collect();
    if left > 0 {
        prompt.push(Segment::named(&[TRACE_TAIL, index as u64], left));
    }
    prompt
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

    const FIXTURE: &str = r#"{"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 3]}

{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, 9], "props": {"client": "acme", "priority": 1}}
{"timestamp": 9, "input_length": 700, "output_length": 3, "hash_ids": [1]}
"#;

    #[test]
    fn a_jsonl_trace_becomes_requests() {
        let records = read_trace(FIXTURE.as_bytes()).expect("valid trace");
        let reqs = trace_requests(&records);
        assert_eq!(reqs.len(), 3);
        let lens = |r: &Request| r.prompt.iter().map(|s| s.len).collect::<Vec<_>>();
        assert_eq!(lens(&reqs[0]), [512, 512, 76]);
        assert_eq!(lens(&reqs[1]), [512, 88]);
        // More prompt than ids: the rest is a segment of its own.
        assert_eq!(lens(&reqs[2]), [512, 188]);
        assert_eq!(reqs[0].prompt[0], reqs[1].prompt[0], "hash id 1 shared");
        assert_eq!(reqs[0].prompt[0], reqs[2].prompt[0]);
        assert_ne!(reqs[0].prompt[1].key, reqs[1].prompt[1].key);
        assert_eq!(reqs[1].arrival_us, 5_000);
        assert_eq!((reqs[1].output_len(), reqs[1].prompt_len()), (7, 600));
        assert_eq!(reqs[1].client, "acme");
        assert_eq!(reqs[1].props.int("priority"), Some(1));
        assert_eq!(reqs[0].client, "default");
    }

    #[test]
    fn a_bad_line_is_named() {
        let text = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": \"soon\"}\n";
        let err = read_trace(text.as_bytes()).unwrap_err();
        assert!(err.starts_with("line 2:"), "{err}");
    }
}
