//! Property-based fuzzing of the controller's inputs: its config file (a valid
//! one, mutated) and a worker's KV event stream (SSE bytes, any chunking, valid
//! and broken batches). No input panics; every config error names the file and
//! the line or key; a bad event names its event; the index always equals what
//! the accepted messages say. `PROPTEST_CASES` overrides the case count.

use std::collections::HashSet;
use std::path::Path;

use pie_client::sse::SseParser;
use pie_controller::config::Config;
use pie_controller::kv_sync::{parse_event, KvFollower, KvMessage};
use pie_policy::cluster::ClusterIndex;
use proptest::prelude::*;
use serde_json::json;

const CONFIG: &str = r#"[server]
host = "127.0.0.1"
port = 9090
api_keys = [{ name = "alice", key = "sk-a" }]

[model]
path = "model.gguf"

[cluster]
cluster_policies = ["cluster-priority", "pin", "session-affinity", "cache-aware", "scale-by-prop"]
poll_ms = 250
max_queued = 64
max_wait_ms = 30000
connect_timeout_ms = 2000
read_timeout_ms = 120000
kv_idle_timeout_ms = 45000
actor_tick_ms = 1000

[cluster.pin]
strict = true

[cluster.scale-by-prop]
prop = "tier"

[[cluster.workers]]
name = "w0"
url = "http://127.0.0.1:8080"
group = "gold"
"#;

#[path = "../../pie-core/tests/support/config_edits.rs"]
mod config_edits;

use config_edits::{apply, edit};

/// One message of a fuzzed KV stream, before it becomes SSE.
#[derive(Clone, Debug)]
enum Wire {
    Snapshot(u64, Vec<u64>),
    /// A batch numbered `next + skew` (skew 0: in sequence).
    Batch {
        skew: u64,
        stored: Vec<u64>,
        removed: Vec<u64>,
    },
    Lagged,
    Garbage(String, String),
}

fn wire() -> impl Strategy<Value = Wire> {
    let hashes = || proptest::collection::vec(0u64..12, 0..5);
    prop_oneof![
        1 => (0u64..20, hashes()).prop_map(|(s, h)| Wire::Snapshot(s, h)),
        4 => (prop_oneof![8 => Just(0u64), 1 => 1u64..3], hashes(), hashes())
            .prop_map(|(skew, stored, removed)| Wire::Batch { skew, stored, removed }),
        1 => Just(Wire::Lagged),
        1 => (prop_oneof![Just("kv"), Just("snapshot"), Just("other")], ".{0,12}")
            .prop_map(|(n, d)| Wire::Garbage(n.to_string(), d)),
    ]
}

/// The stream as a worker would send it (keep-alive comments between events).
fn sse(messages: &[Wire], mut next: impl FnMut(&Wire) -> u64) -> Vec<u8> {
    let mut out = String::new();
    for m in messages {
        let (name, data) = match m {
            Wire::Snapshot(seq, hashes) => (
                "snapshot".to_string(),
                json!({"seq": seq, "fingerprint": 1, "page_size": 16, "hashes": hashes})
                    .to_string(),
            ),
            Wire::Batch {
                stored, removed, ..
            } => (
                "kv".to_string(),
                json!({"seq": next(m), "stored": stored, "removed": removed}).to_string(),
            ),
            Wire::Lagged => ("lagged".to_string(), "reconnect".to_string()),
            Wire::Garbage(name, data) => (name.clone(), data.clone()),
        };
        out += &format!("event: {name}\ndata: {data}\n\n:\n\n");
    }
    out.into_bytes()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A mutated config loads, or its error names the file and a line or key.
    #[test]
    fn config_errors_name_file_and_line_or_key(edits in proptest::collection::vec(edit(), 1..4)) {
        let text = edits.iter().fold(CONFIG.to_string(), |t, e| apply(&t, e));
        if let Err(e) = Config::parse(&text, Path::new("controller.toml")) {
            let shown = format!("{e:#}");
            let located = shown.starts_with("controller.toml:")
                && (shown.contains("key `") || shown["controller.toml:".len()..].starts_with(|c: char| c.is_ascii_digit()));
            prop_assert!(located, "{}\n--- from:\n{}", shown, text);
        }
    }

    /// Followed as the controller does, any stream keeps the index equal to
    /// the snapshot plus the in-sequence batches since; a gap, a lag or a
    /// batch before a snapshot resubscribes; a bad event names itself.
    #[test]
    fn kv_streams_keep_the_index_exact_or_resubscribe(
        messages in proptest::collection::vec(wire(), 0..24),
        chunk in 1usize..40,
    ) {
        // Number the batches as the worker would: in sequence after the last
        // snapshot, or skewed to make a gap.
        let mut last = None;
        let bytes = sse(&messages, |m| match m {
            Wire::Batch { skew, .. } => {
                let seq = last.map_or(0, |s: u64| s + 1) + skew;
                last = Some(seq);
                seq
            }
            _ => 0,
        });
        let mut parser = SseParser::default();
        let (mut index, mut follower) = (ClusterIndex::new(), KvFollower::default());
        let mut model: Option<HashSet<u64>> = None;
        let mut seq = None;
        for piece in bytes.chunks(chunk) {
            for event in parser.push_events(piece).unwrap() {
                let msg = match parse_event(&event) {
                    None => continue,
                    Some(Err(why)) => {
                        prop_assert!(why.contains(&format!("`{}`", event.name)), "{}", why);
                        continue;
                    }
                    Some(Ok(msg)) => msg,
                };
                let expect_ok = match (&msg, seq) {
                    (KvMessage::Snapshot(_), _) => true,
                    (KvMessage::Batch(b), Some(s)) => b.seq == s + 1,
                    _ => false,
                };
                match (&msg, follower.apply(&mut index, &mut ClusterIndex::new(), 0, msg.clone())) {
                    (KvMessage::Snapshot(s), Ok(())) => {
                        model = Some(s.hashes.iter().copied().collect());
                        seq = Some(s.seq);
                    }
                    (KvMessage::Batch(b), Ok(())) => {
                        let m = model.get_or_insert_with(HashSet::new);
                        b.removed.iter().for_each(|h| { m.remove(h); });
                        m.extend(&b.stored);
                        seq = Some(b.seq);
                    }
                    (_, Err(_)) => {
                        prop_assert!(!expect_ok, "refused {:?}", msg);
                        follower = KvFollower::default();
                        seq = None;
                        continue;
                    }
                    (KvMessage::Lagged, Ok(())) => prop_assert!(false, "lagged accepted"),
                }
                prop_assert!(expect_ok, "accepted {:?}", msg);
                let held = model.clone().unwrap_or_default();
                prop_assert_eq!(index.blocks_of(0), held.len());
                for h in 0..12 {
                    let indexed = index.prefix_blocks(&[h], 1)[0] == 1;
                    prop_assert_eq!(indexed, held.contains(&h), "hash {}", h);
                }
            }
        }
    }
}
