//! Following each worker's KV event stream (`GET /v1/internal/kv-events`) into
//! the cluster prefix index, and the shared pool's (`[cluster] pool`) into the
//! pool's index.
//!
//! A stream starts with a snapshot, which replaces everything the index held for
//! that worker; numbered batches follow. A batch whose number is not the next
//! one means an event was lost: the follower drops the connection and
//! resubscribes, and the new snapshot repairs the index. A dropped connection
//! (worker restart, network) is repaired the same way, and so is a half-open
//! one: a stream that sends nothing, not even the worker's keep-alive comment
//! (every 15 s), for `kv_idle_timeout_ms` is dropped and resubscribed.

use std::time::Duration;

use futures_util::StreamExt;
use pie_client::sse::{SseEvent, SseParser};
use pie_core::{KvEventBatch, KvSnapshot};
use pie_policy::cluster::ClusterIndex;

use crate::metrics::ControllerMetrics;
use crate::registry::Registry;
use crate::worker_client::with_worker_key;

/// One message of the stream.
#[derive(Clone, Debug, PartialEq)]
pub enum KvMessage {
    Snapshot(KvSnapshot),
    Batch(KvEventBatch),
    /// The worker dropped us for being slow; resubscribe.
    Lagged,
}

/// Why a subscription must be restarted.
#[derive(Debug, PartialEq, Eq)]
pub enum Resync {
    Gap { expected: u64, got: u64 },
    BatchBeforeSnapshot,
    Lagged,
}

/// The sequence state of one worker's subscription.
impl KvMessage {
    /// The blocks this message says the worker holds (a snapshot: all).
    pub fn stored(&self) -> Vec<u64> {
        match self {
            KvMessage::Snapshot(s) => s.hashes.clone(),
            KvMessage::Batch(b) => b.stored.clone(),
            KvMessage::Lagged => Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
pub struct KvFollower {
    seq: Option<u64>,
}

impl KvFollower {
    /// Apply one message to `slot`'s entries in the index and in the disk
    /// tier's index.
    pub fn apply(
        &mut self,
        index: &mut ClusterIndex,
        disk: &mut ClusterIndex,
        slot: usize,
        msg: KvMessage,
    ) -> Result<(), Resync> {
        match msg {
            KvMessage::Snapshot(s) => {
                index.replace(slot, s.hashes);
                disk.replace(slot, s.persisted);
                self.seq = Some(s.seq);
                Ok(())
            }
            KvMessage::Batch(b) => {
                let last = self.seq.ok_or(Resync::BatchBeforeSnapshot)?;
                if b.seq != last + 1 {
                    return Err(Resync::Gap {
                        expected: last + 1,
                        got: b.seq,
                    });
                }
                for h in b.removed {
                    index.remove(slot, h);
                }
                for h in b.stored {
                    index.store(slot, h);
                }
                for h in b.unpersisted {
                    disk.remove(slot, h);
                }
                for h in b.persisted {
                    disk.store(slot, h);
                }
                self.seq = Some(b.seq);
                Ok(())
            }
            KvMessage::Lagged => Err(Resync::Lagged),
        }
    }
}

/// The message an event of the stream carries; None for unknown event names.
pub fn parse_event(event: &SseEvent) -> Option<Result<KvMessage, String>> {
    let parsed = match event.name.as_str() {
        "snapshot" => serde_json::from_str(&event.data).map(KvMessage::Snapshot),
        "kv" => serde_json::from_str(&event.data).map(KvMessage::Batch),
        "lagged" => return Some(Ok(KvMessage::Lagged)),
        _ => return None,
    };
    Some(parsed.map_err(|e| format!("bad `{}` event: {e}", event.name)))
}

/// How a follower reaches the workers' streams.
pub struct Stream<'a> {
    pub http: &'a reqwest::Client,
    /// The controller's worker key.
    pub key: Option<&'a str>,
    /// No byte for this long: the stream is half-open.
    pub idle_timeout: Duration,
}

/// Follow worker `slot` for as long as the controller runs.
pub async fn follow(
    registry: &Registry,
    stream: &Stream<'_>,
    slot: usize,
    metrics: &ControllerMetrics,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        if let Some(url) = registry.url_of_slot(slot) {
            let events = format!("{url}/v1/internal/kv-events");
            let applied = subscribe(stream, &events, metrics, |follower, msg| {
                let stored = msg.stored();
                registry.with_index(|index, disk| follower.apply(index, disk, slot, msg))?;
                registry.confirm_pending(slot, &stored);
                Ok(())
            })
            .await;
            backoff = next_backoff(backoff, applied, &url);
            metrics.kv_resyncs.inc();
        }
        tokio::time::sleep(backoff).await;
    }
}

/// Follow the shared pool at `pool` (its KV events for the admitted workers'
/// model, once one is admitted) into the registry's pool index; while the
/// pool cannot be reached, the index is empty.
pub async fn follow_pool(
    registry: &Registry,
    stream: &Stream<'_>,
    pool: &str,
    metrics: &ControllerMetrics,
) {
    let mut backoff = Duration::from_millis(50);
    // The pool publishes no disk tier of its own: its pages on disk are held.
    let mut no_disk = ClusterIndex::new();
    loop {
        if let Some(fingerprint) = registry.fingerprint() {
            let events = format!("{pool}/v1/internal/kv-events?fingerprint={fingerprint}");
            let applied = subscribe(stream, &events, metrics, |follower, msg| {
                registry.with_pool_index(|index| follower.apply(index, &mut no_disk, 0, msg))
            })
            .await;
            if applied.is_err() {
                // A pool out of reach serves nothing: until it answers again
                // its blocks must not draw requests.
                registry.with_pool_index(|index| index.clear(0));
            }
            backoff = next_backoff(backoff, applied, pool);
            metrics.kv_resyncs.inc();
        }
        tokio::time::sleep(backoff).await;
    }
}

/// Short after a subscription that ran, doubling (to 2 s) after one that failed.
fn next_backoff(backoff: Duration, applied: Result<(), String>, url: &str) -> Duration {
    match applied {
        Ok(()) => Duration::from_millis(50),
        Err(e) => {
            tracing::debug!(url, error = e, "kv event stream ended; resubscribing");
            (backoff * 2).min(Duration::from_secs(2))
        }
    }
}

/// One subscription to the event stream at `events`, each message handed to
/// `apply` with the subscription's follower: Ok when it ran and ended for a
/// resync, Err when it failed.
async fn subscribe(
    stream: &Stream<'_>,
    events: &str,
    metrics: &ControllerMetrics,
    mut apply: impl FnMut(&mut KvFollower, KvMessage) -> Result<(), Resync>,
) -> Result<(), String> {
    let idle = stream.idle_timeout;
    let silent = || {
        format!(
            "half-open: nothing for kv_idle_timeout_ms = {}",
            idle.as_millis()
        )
    };
    let req = with_worker_key(stream.http.get(events), stream.key);
    let resp = tokio::time::timeout(idle, req.send())
        .await
        .map_err(|_| silent())?
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let mut body = resp.bytes_stream();
    let mut parser = SseParser::default();
    let mut follower = KvFollower::default();
    while let Some(chunk) = tokio::time::timeout(idle, body.next())
        .await
        .map_err(|_| silent())?
    {
        let chunk = chunk.map_err(|e| e.to_string())?;
        for event in parser.push_events(&chunk).map_err(|e| e.to_string())? {
            let Some(msg) = parse_event(&event) else {
                continue;
            };
            let msg = msg?;
            if matches!(msg, KvMessage::Snapshot(_)) {
                metrics.kv_snapshots.inc();
            }
            if let Err(why) = apply(&mut follower, msg) {
                tracing::info!(
                    events,
                    ?why,
                    "kv events out of sequence; resubscribing for a snapshot"
                );
                return Ok(());
            }
        }
    }
    Err("stream closed".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(seq: u64, stored: &[u64], removed: &[u64]) -> KvMessage {
        KvMessage::Batch(KvEventBatch {
            seq,
            stored: stored.to_vec(),
            removed: removed.to_vec(),
            ..KvEventBatch::default()
        })
    }

    fn snapshot(seq: u64, hashes: &[u64]) -> KvMessage {
        KvMessage::Snapshot(KvSnapshot {
            seq,
            fingerprint: 1,
            page_size: 16,
            hashes: hashes.to_vec(),
            persisted: Vec::new(),
        })
    }

    #[test]
    fn the_disk_tier_follows_its_own_lists() {
        let (mut index, mut disk) = (ClusterIndex::new(), ClusterIndex::new());
        let mut f = KvFollower::default();
        let KvMessage::Snapshot(mut s) = snapshot(1, &[1, 2, 3]) else {
            unreachable!()
        };
        s.persisted = vec![1, 2];
        f.apply(&mut index, &mut disk, 0, KvMessage::Snapshot(s))
            .expect("snapshot");
        assert_eq!(disk.prefix_blocks(&[1, 2, 3], 1), vec![2]);
        let b = KvEventBatch {
            seq: 2,
            persisted: vec![3],
            unpersisted: vec![1],
            ..KvEventBatch::default()
        };
        f.apply(&mut index, &mut disk, 0, KvMessage::Batch(b))
            .expect("batch");
        assert_eq!(disk.prefix_blocks(&[1, 2, 3], 1), vec![0]);
        assert_eq!(disk.prefix_blocks(&[2, 3], 1), vec![2]);
        assert_eq!(
            index.prefix_blocks(&[1, 2, 3], 1),
            vec![3],
            "memory unchanged"
        );
    }

    #[test]
    fn a_lost_batch_is_detected_and_the_next_snapshot_repairs_it() {
        let mut index = ClusterIndex::new();
        let mut disk = ClusterIndex::new();
        let mut f = KvFollower::default();
        assert_eq!(
            f.apply(&mut index, &mut disk, 0, batch(1, &[9], &[])),
            Err(Resync::BatchBeforeSnapshot)
        );
        f.apply(&mut index, &mut disk, 0, snapshot(4, &[1, 2]))
            .expect("snapshot");
        f.apply(&mut index, &mut disk, 0, batch(5, &[3], &[1]))
            .expect("next batch");
        assert_eq!(index.prefix_blocks(&[2, 3], 1), vec![2]);
        // Batch 6 (which stored 4) is lost.
        assert_eq!(
            f.apply(&mut index, &mut disk, 0, batch(7, &[5], &[])),
            Err(Resync::Gap {
                expected: 6,
                got: 7
            })
        );
        assert_eq!(
            index.prefix_blocks(&[2, 3, 4], 1),
            vec![2],
            "block 4 is missing"
        );
        // Resubscribing gives a snapshot with everything up to batch 7.
        let mut f = KvFollower::default();
        f.apply(&mut index, &mut disk, 0, snapshot(7, &[2, 3, 4, 5]))
            .expect("snapshot");
        assert_eq!(index.prefix_blocks(&[2, 3, 4, 5], 1), vec![4]);
        assert_eq!(
            index.blocks_of(0),
            4,
            "block 1, removed in batch 5, stays gone"
        );
    }

    #[test]
    fn events_parse_into_messages() {
        let mut p = SseParser::default();
        let events = p
            .push_events(
                b"event: kv\ndata: {\"seq\":3,\"stored\":[1],\"removed\":[]}\n\n:\n\nevent: lagged\ndata: reconnect\n\nevent: snapshot\ndata: {\"seq\": \"x\"}\n\n",
            )
            .unwrap();
        assert_eq!(events.len(), 3, "the keep-alive comment is no event");
        assert_eq!(parse_event(&events[0]), Some(Ok(batch(3, &[1], &[]))));
        assert_eq!(parse_event(&events[1]), Some(Ok(KvMessage::Lagged)));
        assert!(matches!(parse_event(&events[2]), Some(Err(e)) if e.contains("snapshot")));
    }
}
