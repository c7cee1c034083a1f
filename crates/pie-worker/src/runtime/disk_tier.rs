//! The worker's disk tier (`[runtime.persist] dir`, a [`DiskStore`] used on
//! blocking threads only) and what persist requests take and answer; the
//! persisting itself is `persist.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pie_core::worker_config::PersistConfig;
use pie_core::BlockHash;
use pie_kv::disk::{DiskError, DiskStore, Opened};
use serde::Serialize;

/// A worker's disk tier.
pub struct PersistStore {
    /// Locked on blocking threads only (disk I/O under it).
    pub(super) store: Arc<Mutex<DiskStore>>,
    pub(super) ttl: Option<Duration>,
    /// Temporary files of interrupted writes found at open (deleted).
    pub(super) torn_at_open: usize,
}

impl PersistStore {
    /// Open `[runtime.persist]` for pages of `format`; None without a `dir`.
    pub fn open(
        config: &PersistConfig,
        format: pie_kv::transfer::PageFormat,
    ) -> Result<Option<(Self, Opened)>, DiskError> {
        let Some(dir) = &config.dir else {
            return Ok(None);
        };
        let (store, opened) = DiskStore::open(dir, format, config.budget.0)?;
        let ttl = (config.ttl_ms > 0).then(|| Duration::from_millis(config.ttl_ms));
        Ok(Some((
            Self {
                store: Arc::new(Mutex::new(store)),
                ttl,
                torn_at_open: opened.torn,
            },
            opened,
        )))
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, DiskStore> {
        lock(&self.store)
    }

    /// `work` on the store, on a blocking thread.
    pub(super) async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut DiskStore) -> T + Send + 'static,
    ) -> Result<T, PersistError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || work(&mut lock(&store)))
            .await
            .map_err(|e| PersistError::Engine(format!("disk task failed: {e}")))
    }

    /// Every page on disk (the KV event snapshot's disk tier).
    pub fn hashes(&self) -> Vec<BlockHash> {
        self.lock().hashes().collect()
    }
}

/// What one persist request did.
#[derive(Debug, Default, Serialize)]
pub struct Persisted {
    /// Pages written now.
    pub written: usize,
    /// Pages of the prefix already on disk.
    pub present: usize,
    /// Leading pages of the prefix the pool held (the rest cannot be written).
    pub held: usize,
    /// Least recently used pages deleted to make room.
    pub evicted: usize,
    /// Pages the `[runtime] pool` took.
    pub pooled: usize,
}

/// Where a persist request keeps the pages: `any` (its disk tier and its
/// `pie-pool`, whichever it has), `disk` or `pool` (the controller's
/// `pool-replicate`).
pub use pie_policy::cluster::Tier as PersistTo;

/// Why a persist request did nothing.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error(
        "this worker cannot persist pages: neither [runtime.persist] dir nor [runtime] pool is set"
    )]
    NoStore,
    #[error("this worker has no [runtime.persist] dir")]
    NoDisk,
    #[error("this worker has no [runtime] pool")]
    NoPool,
    #[error("the pool at {url} did not take the pages: {why}")]
    Pool { url: String, why: String },
    #[error("{0}")]
    Disk(#[from] DiskError),
    #[error("{0}")]
    Engine(String),
}

/// Which persisted pages to delete.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Forget {
    /// The pages of this prefix (token ids; full pages only).
    #[serde(default)]
    pub tokens: Option<Vec<u32>>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Pages unused for at least this long (0: every page).
    #[serde(default)]
    pub older_than_ms: Option<u64>,
}

pub(super) fn lock(store: &Mutex<DiskStore>) -> std::sync::MutexGuard<'_, DiskStore> {
    store.lock().unwrap_or_else(|e| e.into_inner())
}
