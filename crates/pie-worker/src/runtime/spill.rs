//! `retain-all` on the worker: a retained session (keep-session) that the
//! scheduler must evict before its `keep-ms` passes is spilled instead of
//! dropped. The engine copies its full pages out in the step that evicts
//! them (`engine::Spill`); here they are kept where the controller's
//! `retain-all` asked (`POST /v1/internal/retain`): pushed to the
//! `[runtime] pool`, soft-pinned there until the session's retention would
//! have ended (the pool evicts least recently used first across every
//! worker's spills), or written to the `[runtime.persist] dir` (its LRU
//! budget and `ttl_ms` apply). The next turn finds them as any prefix:
//! pulled from the pool or loaded from disk before its prefill.
//!
//! Guarantees: spilling is off until asked, and asking for a tier this
//! worker lacks is refused (409 naming the missing setting); at most
//! `SPILLS_IN_FLIGHT` spills are kept at once, and one beyond is dropped
//! and counted (`pie_persist_pages_total{event="spill_dropped"}`), so a slow
//! pool costs recomputes, never memory without bound; a spill that fails
//! is counted (`spill_failed`) and logged; either way the session's next
//! turn is only slower, never wrong (pages are checked on the way back).

use std::sync::{Arc, Mutex};

use pie_core::BlockHash;
use pie_kv::stream::PushHeader;

use super::command::Command;
use super::disk_tier::{PersistError, PersistTo};
use super::Runtime;
use crate::engine::Spill;
use pie_core::clock::now_ms;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Runtime {
    /// Where retained sessions evicted early go; None: they are dropped.
    pub fn retain_spill(&self) -> Option<PersistTo> {
        *lock(&self.spill.to)
    }

    /// Spill retained sessions evicted early to `to` (None: drop them); a
    /// tier this worker lacks is refused.
    pub fn set_retain_spill(&self, to: Option<PersistTo>) -> Result<(), PersistError> {
        if let Some(to) = to {
            self.can_keep(to)?;
        }
        *lock(&self.spill.to) = to;
        self.send(Command::SetSpill(to.is_some()));
        Ok(())
    }

    /// Whether keep-session is among the active worker policies (without it
    /// nothing is retained, so nothing spills).
    pub fn keeps_sessions(&self) -> bool {
        lock(&self.policy_names).iter().any(|n| n == "keep-session")
    }

    /// Keep the engine's spills for the runtime's life.
    pub fn start_spills(self: &Arc<Self>) {
        let Some(mut spilled) = lock(&self.spill.spilled).take() else {
            return;
        };
        let rt = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(spill) = spilled.recv().await {
                let Some(rt) = rt.upgrade() else { return };
                rt.start_keeping(spill);
            }
        });
    }

    fn start_keeping(self: &Arc<Self>, spill: Spill) {
        let pages = spill.pages.len();
        let (Some(to), Ok(permit)) = (
            self.retain_spill(),
            self.spill.in_flight.clone().try_acquire_owned(),
        ) else {
            self.metrics.count_persist("spill_dropped", pages);
            return;
        };
        let rt = self.clone();
        tokio::spawn(async move {
            let session = spill.session.clone();
            match rt.keep(spill, to).await {
                Ok(kept) => rt.metrics.count_persist("spilled", kept),
                Err(e) => {
                    rt.metrics.count_persist("spill_failed", pages);
                    tracing::warn!(session, error = %e, "a retained session's spill was not kept");
                }
            }
            drop(permit);
        });
    }

    /// Keep `spill` in the pool (pinned until it expires) or on disk; the
    /// pages kept.
    async fn keep(&self, spill: Spill, to: PersistTo) -> Result<usize, PersistError> {
        let keep_ms = spill.expires_ms.saturating_sub(now_ms());
        if keep_ms == 0 {
            return Ok(0);
        }
        match (&self.settings.pool, &self.settings.persist, to) {
            (Some(url), _, PersistTo::Pool | PersistTo::Any) => {
                let header = PushHeader {
                    blocks: Some(spill.chain.iter().map(|h| h.0).collect()),
                    keep_ms: Some(keep_ms),
                    ..Default::default()
                };
                self.push_to_pool(url, &header, |tx| self.stream_pages(spill.pages, tx))
                    .await
            }
            (_, Some(store), PersistTo::Disk | PersistTo::Any) => {
                let pages: Vec<(BlockHash, Vec<u8>)> =
                    spill.chain.into_iter().zip(spill.pages).collect();
                let (stored, evicted, failed) = store
                    .blocking(move |disk| {
                        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
                        for (hash, page) in pages {
                            match disk.put(hash, &page) {
                                Ok(gone) => {
                                    stored.push(hash);
                                    evicted.extend(gone);
                                }
                                Err(e) => return (stored, evicted, Some(e)),
                            }
                        }
                        (stored, evicted, None)
                    })
                    .await?;
                let kept = stored.len();
                self.record_written(stored, evicted, failed.is_some());
                failed.map_or(Ok(kept), |e| Err(e.into()))
            }
            _ => Err(self.can_keep(to).err().unwrap_or(PersistError::NoStore)),
        }
    }
}
