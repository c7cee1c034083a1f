//! Disaggregated prefill in the simulator: what a KV transfer costs and what
//! the run counts of them. The routing decision is `pie_policy`'s
//! `disaggregate` (through `router.rs`); `sim/disaggregate.rs` runs the prefill on the
//! prefill-stage worker's scheduler like any sequence, then hands the prompt's
//! full pages to the decode worker through a [`Links`] transfer.

use pie_core::KvDtype;
use pie_workload::Percentiles;
use serde::Serialize;

use crate::cost::CostProfile;

/// KV bytes per token of the model a built-in profile models, from the model's
/// config: 2 (K and V) x layers x KV heads x head dimension x bytes per value.
/// A profile read from a file (`pie bench --calibrate`, which measures CPU
/// workers) is taken to model the CPU engine's SmolLM2-135M, its pages in
/// `dtype` (the workers' `[runtime] kv_dtype`), unless `--kv-bytes-per-token`
/// says otherwise.
pub fn kv_bytes_per_token(profile: &CostProfile, dtype: KvDtype) -> u64 {
    match profile.name.as_str() {
        // Llama-3-8B bf16: 2 x 32 layers x 8 KV heads x 128 x 2 B = 128 KiB
        // (the figure `cost.rs` derives the profile's `c` from).
        "gpu-a100-llama3-8b" => LLAMA3_8B_BF16,
        _ => SMOLLM2_135M_VALUES * dtype.bytes() as u64,
    }
}

const LLAMA3_8B_BF16: u64 = 2 * 32 * 8 * 128 * 2;
/// SmolLM2-135M (Hugging Face `config.json`: 30 layers, 3 KV heads of dimension
/// 64): 2 x 30 x 3 x 64 values per token, 46,080 B in f32.
const SMOLLM2_135M_VALUES: u64 = 2 * 30 * 3 * 64;

/// Each decode worker's receiving link (one port per GPU, as the GPU profile's
/// transfer bandwidth assumes): transfers into the same worker queue behind
/// each other, transfers into different workers overlap.
#[derive(Debug, Default)]
pub struct Links {
    busy_until: Vec<u64>,
}

impl Links {
    pub fn new(workers: usize) -> Self {
        Self {
            busy_until: vec![0; workers],
        }
    }

    /// Links for `workers` workers (new ones idle).
    pub fn grow(&mut self, workers: usize) {
        if self.busy_until.len() < workers {
            self.busy_until.resize(workers, 0);
        }
    }

    /// Book a transfer of `bytes` into `worker` ready at `now`; returns when it
    /// starts and when it ends.
    pub fn book(
        &mut self,
        profile: &CostProfile,
        worker: usize,
        now: u64,
        bytes: u64,
    ) -> (u64, u64) {
        let start = now.max(self.busy_until[worker]);
        let end = start + profile.transfer_us(bytes);
        self.busy_until[worker] = end;
        (start, end)
    }
}

/// What a run's disaggregated prefills did (simulator-wide counts).
#[derive(Clone, Debug, Default)]
pub struct TransferCounters {
    pub remote_prefills: u64,
    /// The fewest uncached prompt tokens a remote prefill had (while
    /// `remote_prefills` is 0: nothing).
    pub min_remote_uncached_tokens: u64,
    pub pages: u64,
    pub bytes: u64,
    /// Time on the links, summed over transfers.
    pub transfer_us: u64,
    /// Time transfers waited for a busy link, summed.
    pub wait_us: u64,
    /// Output tokens sampled on prefill-stage workers: none may be.
    pub prefill_worker_output_tokens: u64,
}

/// The disaggregation figures of [`crate::RunMetrics`] (runs with
/// `--prefill-workers`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Disaggregation {
    /// Workers `w0..` of this many are prefill-stage, the rest decode-stage.
    pub prefill_workers: usize,
    pub kv_bytes_per_token: u64,
    /// Requests whose prefill ran on a prefill-stage worker.
    pub remote_prefills: u64,
    /// The fewest uncached prompt tokens of a remote prefill (0 when none):
    /// never below `disaggregate`'s `min_remote_prefill_tokens`.
    pub min_remote_uncached_tokens: u64,
    pub transferred_pages: u64,
    pub transferred_bytes: u64,
    /// Seconds of transfer, summed over transfers (they overlap in time).
    pub transfer_s: f64,
    /// Seconds transfers queued behind others into the same worker, summed.
    pub transfer_wait_s: f64,
    /// TTFT of the remotely prefilled requests (from their arrival).
    pub remote_ttft_ms: Percentiles,
    /// Output tokens sampled on prefill-stage workers (0: they only prefill).
    pub prefill_worker_output_tokens: u64,
}

impl Disaggregation {
    pub fn new(
        prefill_workers: usize,
        kv_bytes_per_token: u64,
        c: &TransferCounters,
        remote_ttft_ms: Percentiles,
    ) -> Self {
        Self {
            prefill_workers,
            kv_bytes_per_token,
            remote_prefills: c.remote_prefills,
            min_remote_uncached_tokens: if c.remote_prefills > 0 {
                c.min_remote_uncached_tokens
            } else {
                0
            },
            transferred_pages: c.pages,
            transferred_bytes: c.bytes,
            transfer_s: c.transfer_us as f64 / 1e6,
            transfer_wait_s: c.wait_us as f64 / 1e6,
            remote_ttft_ms,
            prefill_worker_output_tokens: c.prefill_worker_output_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_into_one_worker_queue_and_others_overlap() {
        let p = CostProfile::gpu_a100_llama3_8b();
        let mut links = Links::new(2);
        // 100 pages of 16 Llama-3-8B tokens: 209,715,200 B at 25 GB/s = 8,389 us + 50.
        let bytes = 100 * 16 * kv_bytes_per_token(&p, KvDtype::F32);
        assert_eq!(links.book(&p, 0, 1000, bytes), (1000, 1000 + 8439));
        assert_eq!(links.book(&p, 0, 1000, bytes), (9439, 9439 + 8439));
        assert_eq!(links.book(&p, 1, 1000, bytes), (1000, 1000 + 8439));
        let cpu = CostProfile::cpu_placeholder();
        assert_eq!(kv_bytes_per_token(&cpu, KvDtype::F32), 46_080);
        assert_eq!(kv_bytes_per_token(&cpu, KvDtype::F16), 23_040);
    }
}
