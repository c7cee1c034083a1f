//! `offload`: send a new process's prefill to a peer worker when local compute is
//! busy.
//!
//! Rule: offload when the prompt tokens waiting for local prefill exceed
//! `queue_tokens`, or the estimated wait (waiting tokens / measured prefill rate)
//! exceeds `wait_ms`. The peer computes the prompt's full KV pages and returns them
//! in the page export format; the local worker imports them and decodes. A failed
//! or slow peer means the prefill runs locally: offload never fails a request.
//! Props read: none. Config keys: `[runtime.offload] peers` (URLs), `queue_tokens`
//! (default 2048), `wait_ms` (default 2000), `timeout_ms` (default 10000). The
//! worker calls its peers with its one worker key (`[server] worker_key`).
//! Invariant (tested): offload exactly when over either threshold and a peer exists.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadConfig {
    pub peers: Vec<String>,
    pub queue_tokens: usize,
    pub wait_ms: u64,
    pub timeout_ms: u64,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            peers: Vec::new(),
            queue_tokens: 2048,
            wait_ms: 2000,
            timeout_ms: 10_000,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Offload {
    pub config: OffloadConfig,
}

impl Offload {
    pub fn new(config: OffloadConfig) -> Self {
        Self { config }
    }

    /// Whether to offload a prefill given the waiting prompt tokens and the local
    /// prefill rate (tokens per second; 0 when unknown).
    pub fn should_offload(&self, waiting_prefill_tokens: usize, prefill_tokens_per_s: f64) -> bool {
        if self.config.peers.is_empty() {
            return false;
        }
        let wait_ms = if prefill_tokens_per_s > 0.0 {
            waiting_prefill_tokens as f64 / prefill_tokens_per_s * 1000.0
        } else {
            0.0
        };
        waiting_prefill_tokens > self.config.queue_tokens || wait_ms > self.config.wait_ms as f64
    }

    /// The peer for the `n`-th offload (round robin).
    pub fn peer(&self, n: usize) -> Option<&str> {
        (!self.config.peers.is_empty())
            .then(|| self.config.peers[n % self.config.peers.len()].as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds() {
        let cfg = OffloadConfig {
            peers: vec!["http://p".into()],
            queue_tokens: 100,
            wait_ms: 1000,
            ..OffloadConfig::default()
        };
        let o = Offload::new(cfg.clone());
        assert!(!o.should_offload(100, 0.0));
        assert!(o.should_offload(101, 0.0));
        // 90 tokens at 50 tok/s is a 1.8 s wait.
        assert!(o.should_offload(90, 50.0));
        assert!(!o.should_offload(90, 100.0));
        assert!(!Offload::new(OffloadConfig {
            peers: vec![],
            ..cfg
        })
        .should_offload(10_000, 1.0));
        assert_eq!(o.peer(3), Some("http://p"));
    }
}
