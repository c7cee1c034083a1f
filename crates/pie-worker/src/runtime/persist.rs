//! `persist-prefix` on the worker: full pages of hot prefixes written to
//! `[runtime.persist] dir` (a [`DiskStore`]) and loaded back into the pool
//! when a prompt needs them and memory lacks them. Pages are written when
//! the controller's `persist-prefix` actor asks (`POST
//! /v1/internal/kv/persist` with the prefix's block hashes) or when a
//! process carries the `persist = true` prop (its prompt, after its
//! prefill).
//!
//! Guarantees (beyond the store's: atomic writes, every read checked):
//! - a page is exported from the pool under a lease, so it is not evicted
//!   while it is written;
//! - disk I/O runs on blocking threads, never on the engine thread;
//! - a page refused on reading is deleted, counted (`refused`) and the rest
//!   of the prompt prefilled: a damaged file costs a recompute, never a
//!   wrong token;
//! - the KV events count pages on disk as held (a prefix on disk is served
//!   without recompute) and list the disk tier apart (`persisted`).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use pie_core::BlockHash;
use pie_kv::disk::{DiskStore, Loaded};

use super::command::Command;
use super::disk_tier::{Forget, PersistError, PersistStore, PersistTo, Persisted};
use super::Runtime;

impl Runtime {
    fn persist_store(&self) -> Result<&PersistStore, PersistError> {
        self.settings.persist.as_ref().ok_or(PersistError::NoStore)
    }

    /// Before a prefill: the prompt's pages this pool lacks, pulled from the
    /// `[runtime] pool` (what it lacks too is prefilled here).
    pub(crate) async fn pull_from_pool(&self, req: &crate::engine::Request) {
        let Some(pool) = &self.settings.pool else {
            return;
        };
        let pull = super::transfer::Pull {
            peer: pool,
            tokens: &req.prompt,
            cache_salt: req.cache_salt.as_deref(),
            blocks: None,
            prefill: false,
            timeout_ms: self.settings.transfer.timeout_ms,
        };
        let _ = self.pull_pages(pull).await;
    }

    /// Whether the disk tier holds the first page of `chain`.
    pub(crate) fn on_disk(&self, chain: &[BlockHash]) -> bool {
        let (Some(store), Some(&first)) = (&self.settings.persist, chain.first()) else {
            return false;
        };
        store.lock().contains(first)
    }

    /// Before a prefill: load from disk the pages of `chain` after the ones
    /// the pool holds, up to the first one missing or refused. Returns the
    /// leading pages the pool holds afterwards.
    pub(crate) async fn load_persisted(&self, chain: &[BlockHash]) -> usize {
        let Some(store) = &self.settings.persist else {
            return 0;
        };
        let Ok(have) = self.cached_pages(chain).await else {
            return 0;
        };
        if have >= chain.len() || !store.lock().contains(chain[have]) {
            return have;
        }
        let wanted = chain[have..].to_vec();
        let Ok((pages, refused)) = store.blocking(move |disk| read_pages(disk, &wanted)).await
        else {
            return have;
        };
        if let Some(why) = &refused {
            self.metrics.count_persist("refused", 1);
            tracing::warn!(error = %why, "a persisted KV page was refused and deleted; prefilling from there");
            self.disk_changed(Vec::new(), vec![chain[have + pages.len()]]);
        }
        let read = pages.len();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::ImportPages {
            chain: chain.into(),
            pages,
            reply: tx,
        });
        let imported = rx.await.unwrap_or(0);
        self.metrics.count_persist("loaded", imported.min(read));
        have + imported
    }

    /// A process with the `persist` prop, after its prefill: its prompt's
    /// pages written while it decodes. A worker without a disk tier says so.
    pub(crate) fn persist_in_background(self: &Arc<Self>, chain: Vec<BlockHash>) {
        let rt = self.clone();
        tokio::spawn(async move {
            if let Err(e) = rt.persist(chain, PersistTo::Any).await {
                tracing::warn!(error = %e, "the `persist` prop's prefix was not persisted");
            }
        });
    }

    /// Whether this worker has the tier `to` names.
    pub(super) fn can_keep(&self, to: PersistTo) -> Result<(), PersistError> {
        let (disk, pool) = (
            self.settings.persist.is_some(),
            self.settings.pool.is_some(),
        );
        match to {
            PersistTo::Any if !disk && !pool => Err(PersistError::NoStore),
            PersistTo::Disk if !disk => Err(PersistError::NoDisk),
            PersistTo::Pool if !pool => Err(PersistError::NoPool),
            _ => Ok(()),
        }
    }

    /// Make the pool's leading pages of `chain` outlive this worker: written
    /// to its disk (those not there yet) and pushed to its `pie-pool`, those
    /// of the two it has that `to` names.
    pub async fn persist(
        &self,
        chain: Vec<BlockHash>,
        to: PersistTo,
    ) -> Result<Persisted, PersistError> {
        self.can_keep(to)?;
        let ttl = Duration::from_millis(self.settings.transfer.lease_ms);
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::PinPrefix {
            chain: chain.clone(),
            ttl,
            reply: tx,
        });
        let (lease, held) = rx
            .await
            .map_err(|_| PersistError::Engine(self.engine_stopped()))?;
        let done = self.persist_leased(lease, &chain[..held], to).await;
        self.send(Command::ReleaseLease(lease));
        done.map(|report| Persisted { held, ..report })
    }

    async fn persist_leased(
        &self,
        lease: u64,
        chain: &[BlockHash],
        to: PersistTo,
    ) -> Result<Persisted, PersistError> {
        let mut report = match &self.settings.persist {
            Some(store) if to != PersistTo::Pool => self.write_leased(store, lease, chain).await?,
            _ => Persisted::default(),
        };
        if let Some(pool) = self
            .settings
            .pool
            .as_ref()
            .filter(|_| to != PersistTo::Disk)
        {
            report.pooled = self.push_leased(pool, lease, chain).await?;
            self.metrics.count_persist("pooled", report.pooled);
        }
        Ok(report)
    }

    /// Push the leased pages of `chain` to the pool at `url` (named by their
    /// block hashes); the pages it took.
    async fn push_leased(
        &self,
        url: &str,
        lease: u64,
        chain: &[BlockHash],
    ) -> Result<usize, PersistError> {
        let header = pie_kv::stream::PushHeader {
            blocks: Some(chain.iter().map(|h| h.0).collect()),
            ..Default::default()
        };
        self.push_to_pool(url, &header, |tx| {
            self.stream_out(lease, 0..chain.len(), u64::MAX, tx)
        })
        .await
    }

    /// Push to the pool at `url`: `header`, then the page stream `fill`
    /// writes; the pages it took.
    pub(super) async fn push_to_pool<Fill, Filled>(
        &self,
        url: &str,
        header: &pie_kv::stream::PushHeader,
        fill: Fill,
    ) -> Result<usize, PersistError>
    where
        Fill: FnOnce(super::transfer::FrameSender) -> Filled,
        Filled: std::future::Future<Output = ()>,
    {
        let failed = |why: String| PersistError::Pool {
            url: url.to_string(),
            why,
        };
        let header = serde_json::to_vec(header).map_err(|e| failed(e.to_string()))?;
        let (tx, rx) = tokio::sync::mpsc::channel(super::transfer::SEND_QUEUE);
        let _ = tx.send(Ok(pie_kv::stream::frame(&header))).await;
        let mut req = self
            .http
            .post(format!("{}/v1/internal/kv/push", url.trim_end_matches('/')))
            .body(reqwest::Body::wrap_stream(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ));
        if let Some(key) = &self.settings.worker_key {
            req = req.bearer_auth(key);
        }
        let (_, answer) = tokio::join!(fill(tx), req.send());
        let resp = answer.map_err(|e| failed(e.to_string()))?;
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        match body["pages"].as_u64() {
            Some(pages) if status.is_success() => Ok(pages as usize),
            _ => Err(failed(format!("answered {status}: {body}"))),
        }
    }

    async fn write_leased(
        &self,
        store: &PersistStore,
        lease: u64,
        chain: &[BlockHash],
    ) -> Result<Persisted, PersistError> {
        let mut report = Persisted::default();
        let (mut stored, mut evicted) = (Vec::new(), Vec::new());
        let mut result = Ok(());
        for (i, &hash) in chain.iter().enumerate() {
            if store.lock().contains(hash) {
                report.present += 1;
                continue;
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            self.send(Command::ExportLeased {
                lease,
                from: i,
                count: 1,
                reply: tx,
            });
            let Some(Some(page)) = rx.await.ok().map(|p| p.and_then(|mut p| p.pop())) else {
                result = Err(PersistError::Engine("the pages' lease ended".into()));
                break;
            };
            match store.blocking(move |disk| disk.put(hash, &page)).await {
                Ok(Ok(gone)) => {
                    stored.push(hash);
                    evicted.extend(gone);
                }
                Ok(Err(e)) => {
                    result = Err(e.into());
                    break;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        report.written = stored.len();
        report.evicted = evicted.len();
        self.record_written(stored, evicted, result.is_err());
        result.map(|()| report)
    }

    /// Count pages written to disk and evicted there, and publish them.
    pub(super) fn record_written(
        &self,
        stored: Vec<BlockHash>,
        evicted: Vec<BlockHash>,
        failed: bool,
    ) {
        self.metrics.count_persist("written", stored.len());
        self.metrics.count_persist("evicted", evicted.len());
        if failed {
            self.metrics.count_persist("failed", 1);
        }
        self.disk_changed(stored, evicted);
    }

    /// Delete persisted pages: a prefix's, those unused for a while, or all.
    pub fn forget_persisted(&self, forget: &Forget) -> Result<usize, PersistError> {
        let store = self.persist_store()?;
        let mut gone = Vec::new();
        {
            let mut disk = store.lock();
            if let Some(tokens) = &forget.tokens {
                let chain = self.chain(tokens, forget.cache_salt.as_deref());
                gone.extend(chain.into_iter().filter(|&h| disk.remove(h)));
            }
            if let Some(ms) = forget.older_than_ms {
                gone.extend(disk.remove_older_than(Duration::from_millis(ms), SystemTime::now()));
            }
        }
        self.metrics.count_persist("deleted", gone.len());
        let n = gone.len();
        self.disk_changed(Vec::new(), gone);
        Ok(n)
    }

    /// Publish the disk tier's gauges and the torn writes found at open,
    /// then delete pages unused for `[runtime.persist] ttl_ms`, every quarter
    /// of it (at most every minute), for the runtime's life.
    pub fn start_persist(self: &std::sync::Arc<Self>) {
        self.disk_changed(Vec::new(), Vec::new());
        if let Some(store) = &self.settings.persist {
            self.metrics.count_persist("torn", store.torn_at_open);
        }
        let Some(ttl) = self.settings.persist.as_ref().and_then(|s| s.ttl) else {
            return;
        };
        let rt = std::sync::Arc::downgrade(self);
        let every = (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(60));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(rt) = rt.upgrade() else { return };
                let Some(store) = &rt.settings.persist else {
                    return;
                };
                let gone = store.lock().remove_older_than(ttl, SystemTime::now());
                rt.metrics.count_persist("expired", gone.len());
                rt.disk_changed(Vec::new(), gone);
            }
        });
    }

    /// Tell the KV event publisher (engine thread) what the disk tier gained
    /// and lost, and refresh the gauges.
    fn disk_changed(&self, stored: Vec<BlockHash>, removed: Vec<BlockHash>) {
        if let Some(store) = &self.settings.persist {
            let disk = store.lock();
            self.metrics.persisted_pages.set(disk.len() as i64);
            self.metrics.persisted_bytes.set(disk.bytes() as i64);
        }
        if !stored.is_empty() || !removed.is_empty() {
            self.send(Command::DiskChanged { stored, removed });
        }
    }
}

/// Read `wanted` in order up to the first page missing or refused (returned
/// with why).
fn read_pages(store: &mut DiskStore, wanted: &[BlockHash]) -> (Vec<Vec<u8>>, Option<String>) {
    let mut pages = Vec::new();
    for &hash in wanted {
        match store.get(hash) {
            Loaded::Page(bytes) => pages.push(bytes),
            Loaded::Missing => return (pages, None),
            Loaded::Refused(why) => return (pages, Some(why)),
        }
    }
    (pages, None)
}
