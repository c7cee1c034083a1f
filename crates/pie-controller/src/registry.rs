//! The worker registry and the cluster prefix index.
//!
//! Every `poll_ms` the controller reads each worker's `/v1/internal/state`: health,
//! load (queued + running processes) and a snapshot of the block hashes in its
//! prefix cache. A snapshot per poll repairs anything missed, so no event can be
//! lost; the cost is one full snapshot per poll. Memory: one u64 per indexed
//! block per worker in a HashSet (about 16-24 bytes with the table's overhead).

use std::collections::HashSet;
use std::sync::RwLock;
use std::time::Duration;

use pie_core::{block_hashes, BlockHash, ModelFingerprint};
use pie_policy::cluster::WorkerView;
use serde::Serialize;
use serde_json::Value;

#[derive(Clone, Debug, Serialize)]
pub struct Worker {
    pub name: String,
    pub url: String,
    pub healthy: bool,
    pub load: usize,
    #[serde(skip)]
    pub hashes: HashSet<u64>,
    pub indexed_blocks: usize,
    pub page_size: usize,
    pub fingerprint: u64,
    /// Routed here since start.
    pub routed: u64,
}

impl Worker {
    pub fn new(name: &str, url: &str) -> Self {
        Self {
            name: name.into(),
            url: url.trim_end_matches('/').into(),
            healthy: false,
            load: 0,
            hashes: HashSet::new(),
            indexed_blocks: 0,
            page_size: 0,
            fingerprint: 0,
            routed: 0,
        }
    }

    /// Tokens of `prompt` this worker holds as a cached prefix.
    fn cached_prefix(&self, prompt: &[u32]) -> usize {
        if self.page_size == 0 || prompt.is_empty() {
            return 0;
        }
        let hashes = block_hashes(
            ModelFingerprint(self.fingerprint),
            &prompt[..prompt.len() - 1],
            self.page_size,
        );
        hashes
            .iter()
            .take_while(|BlockHash(h)| self.hashes.contains(h))
            .count()
            * self.page_size
    }
}

#[derive(Default)]
pub struct Registry {
    workers: RwLock<Vec<Worker>>,
}

impl Registry {
    pub fn new(workers: impl IntoIterator<Item = Worker>) -> Self {
        Self {
            workers: RwLock::new(workers.into_iter().collect()),
        }
    }

    pub fn snapshot(&self) -> Vec<Worker> {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Add or update a worker (dynamic registration and heartbeats).
    pub fn register(&self, name: &str, url: &str) {
        let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
        match ws.iter_mut().find(|w| w.name == name) {
            Some(w) => w.url = url.trim_end_matches('/').into(),
            None => ws.push(Worker::new(name, url)),
        }
    }

    pub fn url_of(&self, name: &str) -> Option<String> {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|w| w.name == name)
            .map(|w| w.url.clone())
    }

    fn update(&self, name: &str, f: impl FnOnce(&mut Worker)) {
        if let Some(w) = self
            .workers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
            .find(|w| w.name == name)
        {
            f(w);
        }
    }

    /// A worker refused connections: out of the candidates until a poll finds it.
    pub fn mark_down(&self, name: &str) {
        self.update(name, |w| w.healthy = false);
    }

    pub fn count_routed(&self, name: &str) {
        self.update(name, |w| {
            w.routed += 1;
            // Count it as load until the next poll reports the worker's own figure.
            w.load += 1;
        });
    }

    /// Healthy workers as the policies see them for `prompt`.
    pub fn views(&self, prompt: &[u32]) -> Vec<(WorkerView, String)> {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|w| w.healthy)
            .map(|w| {
                (
                    WorkerView {
                        name: w.name.clone(),
                        load: w.load,
                        cached_prefix_tokens: w.cached_prefix(prompt),
                    },
                    w.url.clone(),
                )
            })
            .collect()
    }

    /// Poll every worker once.
    pub async fn poll(&self, http: &reqwest::Client, key: Option<&str>) {
        for w in self.snapshot() {
            let mut req = http
                .get(format!("{}/v1/internal/state", w.url))
                .timeout(Duration::from_secs(2));
            if let Some(k) = key {
                req = req.bearer_auth(k);
            }
            let state: Option<Value> = match req.send().await {
                Ok(r) if r.status().is_success() => r.json().await.ok(),
                _ => None,
            };
            let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
            let Some(entry) = ws.iter_mut().find(|x| x.name == w.name) else {
                continue;
            };
            match state {
                Some(s) => {
                    entry.healthy = true;
                    entry.load = s["load"].as_u64().unwrap_or(0) as usize;
                    entry.page_size = s["page_size"].as_u64().unwrap_or(0) as usize;
                    entry.fingerprint = s["fingerprint"].as_u64().unwrap_or(0);
                    entry.hashes = s["hashes"]
                        .as_array()
                        .map(|a| a.iter().filter_map(Value::as_u64).collect())
                        .unwrap_or_default();
                    entry.indexed_blocks = entry.hashes.len();
                }
                None => entry.healthy = false,
            }
        }
    }
}
