//! The step-time cost model and its profiles:
//! `step_ms = a + b * batch_tokens + c * context_tokens + d * attention_pairs`
//! (context tokens: the batch's sequence lengths after the step, what decode
//! attention reads; attention pairs: query x key pairs, what attention computes,
//! `n * cached + n * (n + 1) / 2` for `n` new tokens after `cached` ones), with
//! the engine limits (page size, pages, batch tokens, running sequences) that
//! belong to the same hardware.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostProfile {
    pub name: String,
    /// Fixed cost of a step (ms): weight reads, launch overhead.
    pub a_ms: f64,
    /// Cost per token computed in the step (ms): the linear layers.
    pub b_ms_per_token: f64,
    /// Cost per token of KV attended over (ms): attention reads.
    pub c_ms_per_context_token: f64,
    /// Cost per query x key pair (ms): attention computed pair by pair (the CPU
    /// engine; prefill on a GPU). 0 in profiles written before it existed.
    #[serde(default)]
    pub d_ms_per_pair: f64,
    /// Repeated steps of one shape, measured by `pie bench --calibrate`
    /// (`pie-sim`'s `jitter.rs` draws each step's time from them): their mean
    /// over the fit's prediction (the fit keeps each grid shape's faster time
    /// of two, so a typical step is slower), for decode steps, and for every
    /// step where `prefill_mean_over_fit` is absent ...
    #[serde(default = "one")]
    pub step_mean_over_fit: f64,
    /// ... prefill steps' own mean over the fit (in 30 calibrations on one
    /// machine the two kinds were up to 0.3 apart, either way), absent in
    /// profiles written before it ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_mean_over_fit: Option<f64>,
    /// ... their coefficient of variation (a queue's tail grows with it), for
    /// decode steps, and for every step where `prefill_cv` is absent ...
    #[serde(default)]
    pub step_cv: f64,
    /// ... prefill steps' own (served prefills varied half as much as served
    /// decode steps in one run, 0.25 against 0.47), absent in profiles
    /// written before it ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_cv: Option<f64>,
    /// ... and how long a slow spell lasts: the correlation time of one step's
    /// deviation with the next's (ms; 0: independent). Profiles written before
    /// these existed load as 1, 0, 0: every step of a shape the fit's time.
    #[serde(default)]
    pub step_corr_ms: f64,
    /// A step that starts after its worker sat idle at least `AFTER_IDLE_MS`
    /// takes this many times a step that follows another at once, on top of
    /// its kind's mean (waking the thread pool; caches the idle spell let
    /// others cool). Measured on prefills, the steps that meet an idle worker;
    /// absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_idle_factor: Option<f64>,
    /// The share of its host one step keeps busy, in (0, 1]: workers sharing a
    /// host slow each other by what their overlapping steps demand together
    /// (`pie-sim`'s `machine.rs`). Measured on served steps that overlapped
    /// another worker's (`pie bench --calibrate --from-steps`); absent: 1,
    /// processor sharing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_share: Option<f64>,
    /// False for placeholder coefficients; results must say so.
    pub calibrated: bool,
    /// Where the coefficients come from.
    pub source: String,
    pub page_size: usize,
    pub kv_pages: usize,
    pub max_batch_tokens: usize,
    pub max_running: usize,
    /// Bandwidth of a KV transfer between workers (bytes/s): what migration,
    /// replication and the pool pay per page. Profiles written before it existed
    /// load with the CPU (loopback) figure, as `pie bench --calibrate` measures
    /// CPU workers.
    #[serde(default = "loopback_bytes_per_s")]
    pub transfer_bytes_per_s: f64,
    /// Fixed cost of one transfer (us): handshake and request round trip.
    #[serde(default = "loopback_latency_us")]
    pub transfer_latency_us: u64,
}

fn one() -> f64 {
    1.0
}

/// Uncalibrated: one HTTP stream over loopback with per-page checksums, of the
/// order of 1 GB/s on a small CPU host.
fn loopback_bytes_per_s() -> f64 {
    1e9
}

/// Uncalibrated: an HTTP request round trip on localhost, handshake included.
fn loopback_latency_us() -> u64 {
    200
}

pub const PROFILES: &[&str] = &["gpu", "cpu"];

/// A step that starts at least this long after its worker's previous step
/// ended wakes from idle (`CostProfile::after_idle_factor`).
pub const AFTER_IDLE_MS: u64 = 100;

impl CostProfile {
    pub fn named(name: &str) -> Result<Self, String> {
        match name {
            "gpu" => Ok(Self::gpu_a100_llama3_8b()),
            "cpu" => Ok(Self::cpu_placeholder()),
            other => Err(format!(
                "unknown profile `{other}` (available: {})",
                PROFILES.join(", ")
            )),
        }
    }

    /// Llama-3-8B (bf16) on one A100-80GB SXM, a roofline estimate from published
    /// figures, NOT fitted to measured step times:
    /// - NVIDIA A100 datasheet: 2,039 GB/s HBM2e, 312 TFLOPS dense BF16.
    /// - Llama-3-8B config (Meta, Hugging Face `config.json`): 8.03 B parameters,
    ///   32 layers, 8 KV heads of dimension 128, so 16.06 GB of weights and
    ///   2 * 32 * 8 * 128 * 2 B = 128 KiB of KV per token.
    ///
    /// a = 16.06 GB / 2,039 GB/s = 7.9 ms (weights read once per step);
    /// b = 2 * 8.03 GFLOP / (312 TFLOPS * 0.5 assumed utilisation) = 0.103 ms;
    /// c = 131,072 B / 2,039 GB/s = 6.4e-5 ms;
    /// d = 4 FLOP * 32 layers * 32 query heads * 128 (QK^T and PV per pair)
    ///   / 156 TFLOPS = 3.4e-6 ms.
    /// Limits: 28,000 pages of 16 tokens (about 58 GB of KV after the weights and
    /// activations), `max_batch_tokens` 2048 and `max_running` 256 (vLLM's defaults
    /// for chunked prefill and `max_num_seqs`).
    /// Transfers between workers: one 200 Gb/s HDR InfiniBand port per GPU, as in
    /// the NVIDIA DGX A100 datasheet (8 ConnectX-6 single-port adapters for 8
    /// GPUs), so 25 GB/s by RDMA (workers are on different nodes; NVLink within a
    /// node would be 300 GB/s each way); 50 us per transfer for the handshake and
    /// RDMA setup is an assumption, not a published figure.
    pub fn gpu_a100_llama3_8b() -> Self {
        Self {
            name: "gpu-a100-llama3-8b".into(),
            a_ms: 7.9,
            b_ms_per_token: 0.103,
            c_ms_per_context_token: 6.4e-5,
            d_ms_per_pair: 3.4e-6,
            step_mean_over_fit: 1.0,
            step_cv: 0.0,
            step_corr_ms: 0.0,
            prefill_mean_over_fit: None,
            prefill_cv: None,
            after_idle_factor: None,
            host_share: None,
            calibrated: false,
            source: "roofline from the A100 datasheet and the Llama-3-8B config; not measured"
                .into(),
            page_size: 16,
            kv_pages: 28_000,
            max_batch_tokens: 2048,
            max_running: 256,
            transfer_bytes_per_s: 25e9,
            transfer_latency_us: 50,
        }
    }

    /// UNCALIBRATED placeholder for `pie serve` with SmolLM2-135M on two CPU cores:
    /// the coefficients are of the order `pie bench --calibrate` measured on this
    /// 2-core machine (docs/benchmarks/simulator.md), rounded; calibrate your own. The limits are
    /// `pie-worker`'s `EngineConfig` defaults. Transfers: the loopback placeholder.
    pub fn cpu_placeholder() -> Self {
        Self {
            name: "cpu-smollm2-135m".into(),
            a_ms: 25.0,
            b_ms_per_token: 2.0,
            c_ms_per_context_token: 0.0,
            d_ms_per_pair: 0.02,
            step_mean_over_fit: 1.0,
            step_cv: 0.0,
            step_corr_ms: 0.0,
            prefill_mean_over_fit: None,
            prefill_cv: None,
            after_idle_factor: None,
            host_share: None,
            calibrated: false,
            source: "uncalibrated placeholder".into(),
            page_size: 16,
            kv_pages: 2048,
            max_batch_tokens: 512,
            max_running: 64,
            transfer_bytes_per_s: loopback_bytes_per_s(),
            transfer_latency_us: loopback_latency_us(),
        }
    }

    /// A profile from its JSON (as `pie bench --calibrate` writes it). Errors name
    /// the field: a missing or mistyped one, or a limit that is not positive or a
    /// coefficient that is negative or not finite.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let p: Self = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            if field == "." {
                e.inner().to_string()
            } else {
                format!("field `{field}`: {}", e.inner())
            }
        })?;
        p.validate()?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), String> {
        let coefficients = [
            ("a_ms", self.a_ms),
            ("b_ms_per_token", self.b_ms_per_token),
            ("c_ms_per_context_token", self.c_ms_per_context_token),
            ("d_ms_per_pair", self.d_ms_per_pair),
            ("step_mean_over_fit", self.step_mean_over_fit),
            ("step_cv", self.step_cv),
            ("prefill_cv", self.prefill_cv.unwrap_or(0.0)),
            ("step_corr_ms", self.step_corr_ms),
            ("after_idle_factor", self.after_idle_factor.unwrap_or(1.0)),
            ("transfer_bytes_per_s", self.transfer_bytes_per_s),
        ];
        if let Some((field, v)) = coefficients
            .iter()
            .find(|(_, v)| !v.is_finite() || *v < 0.0)
        {
            return Err(format!("field `{field}`: {v} is not a finite number >= 0"));
        }
        let limits = [
            ("page_size", self.page_size),
            ("kv_pages", self.kv_pages),
            ("max_batch_tokens", self.max_batch_tokens),
            ("max_running", self.max_running),
        ];
        if let Some(share) = self.host_share.filter(|s| !(*s > 0.0 && *s <= 1.0)) {
            return Err(format!("field `host_share`: {share} is not in (0, 1]"));
        }
        match limits.iter().find(|(_, v)| *v == 0) {
            Some((field, _)) => Err(format!("field `{field}`: must be positive")),
            None if self.transfer_bytes_per_s == 0.0 => {
                Err("field `transfer_bytes_per_s`: must be positive".into())
            }
            None if self.step_mean_over_fit == 0.0 => {
                Err("field `step_mean_over_fit`: must be positive".into())
            }
            None => Ok(()),
        }
    }

    /// Duration of moving `bytes` of KV between workers in microseconds: the
    /// fixed latency plus the bytes at the transfer bandwidth (rounded up).
    pub fn transfer_us(&self, bytes: u64) -> u64 {
        let streaming = (bytes as f64 / self.transfer_bytes_per_s * 1e6).ceil() as u64;
        self.transfer_latency_us + streaming
    }

    /// Duration of one step in milliseconds.
    pub fn step_ms(&self, shape: &StepShape) -> f64 {
        self.a_ms
            + self.b_ms_per_token * shape.batch_tokens as f64
            + self.c_ms_per_context_token * shape.context_tokens as f64
            + self.d_ms_per_pair * shape.attention_pairs as f64
    }

    /// Duration of one step in microseconds (at least 1).
    pub fn step_us(&self, shape: &StepShape) -> u64 {
        ((self.step_ms(shape) * 1000.0).round() as u64).max(1)
    }

    /// A step's mean time over the fit's prediction, by its kind.
    pub fn mean_over_fit(&self, kind: StepKind) -> f64 {
        match kind {
            StepKind::Prefill => self
                .prefill_mean_over_fit
                .unwrap_or(self.step_mean_over_fit),
            StepKind::Decode => self.step_mean_over_fit,
        }
    }

    /// The coefficient of variation of a step's time, by its kind.
    pub fn cv_of(&self, kind: StepKind) -> f64 {
        match kind {
            StepKind::Prefill => self.prefill_cv.unwrap_or(self.step_cv),
            StepKind::Decode => self.step_cv,
        }
    }

    /// What a step's time over the fit's prediction is drawn with: its
    /// kind's mean (times `after_idle_factor` when its worker `woke` from
    /// idle for it) and its kind's cv.
    pub fn step_draw(&self, kind: StepKind, woke: bool) -> StepDraw {
        let wake = if woke {
            self.after_idle_factor.unwrap_or(1.0)
        } else {
            1.0
        };
        StepDraw {
            mean: self.mean_over_fit(kind) * wake,
            cv: self.cv_of(kind),
        }
    }
}

/// The mean and coefficient of variation of one step's time over the fit's
/// prediction (`pie-sim`'s `jitter.rs` draws it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepDraw {
    pub mean: f64,
    pub cv: f64,
}

/// Prefill (some sequence computes more than one token) or decode (one token
/// per sequence): the calibrated terms that differ between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    Prefill,
    Decode,
}

/// What one engine step computes: the terms of the cost model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    pub batch_tokens: usize,
    /// The batch's sequence lengths after the step.
    pub context_tokens: usize,
    /// Query x key pairs of the step's causal attention.
    pub attention_pairs: u64,
    pub sequences: usize,
}

impl StepShape {
    /// Add a sequence computing `new` tokens after `cached` computed ones.
    pub fn add(&mut self, cached: usize, new: usize) {
        self.sequences += 1;
        self.batch_tokens += new;
        self.context_tokens += cached + new;
        self.attention_pairs += (new * cached + new * (new + 1) / 2) as u64;
    }

    pub fn kind(&self) -> StepKind {
        if self.batch_tokens > self.sequences {
            StepKind::Prefill
        } else {
            StepKind::Decode
        }
    }

    /// The shape of a step over `(cached, new)` sequences.
    pub fn of(seqs: &[(usize, usize)]) -> Self {
        let mut shape = Self::default();
        for &(cached, new) in seqs {
            shape.add(cached, new);
        }
        shape
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_time_is_the_linear_model() {
        let p = CostProfile::gpu_a100_llama3_8b();
        // 100 decode sequences of 99 cached tokens: 100 batch tokens, 10,000
        // context tokens, 100 * (99 + 1) = 10,000 pairs.
        let decode = StepShape::of(&[(99, 1); 100]);
        assert_eq!(
            decode,
            StepShape {
                batch_tokens: 100,
                context_tokens: 10_000,
                attention_pairs: 10_000,
                sequences: 100
            }
        );
        // 7.9 + 0.103 * 100 + 6.4e-5 * 10_000 + 3.4e-6 * 10_000 = 18.874 ms.
        assert_eq!(p.step_us(&decode), 18_874);
        assert_eq!(p.step_us(&StepShape::default()), 7_900);
        assert!(CostProfile::named("tpu").is_err());
    }

    #[test]
    fn shapes_count_context_and_causal_pairs() {
        // Decode at 100 tokens: 101 of context, 101 pairs; 4 tokens after 16 cached:
        // 20 of context, 4 * 16 + (1 + 2 + 3 + 4) pairs.
        let pairs = |seqs: &[(usize, usize)]| {
            let s = StepShape::of(seqs);
            (s.context_tokens, s.attention_pairs, s.sequences, s.kind())
        };
        assert_eq!(pairs(&[(100, 1)]), (101, 101, 1, StepKind::Decode));
        assert_eq!(pairs(&[(16, 4)]), (20, 74, 1, StepKind::Prefill));
        assert_eq!(
            pairs(&[(100, 1), (16, 4)]),
            (121, 175, 2, StepKind::Prefill)
        );
    }

    #[test]
    fn prefill_pairs_grow_with_the_square_of_the_chunk() {
        // 512 new tokens after 1,024 cached: 512 * 1024 + 512 * 513 / 2.
        let chunk = StepShape::of(&[(1024, 512)]);
        assert_eq!(chunk.attention_pairs, 655_616);
        assert_eq!(chunk.context_tokens, 1536);
        let p = CostProfile::cpu_placeholder();
        assert!(p.step_ms(&chunk) > 10.0 * p.step_ms(&StepShape::of(&[(1535, 1)])));
    }

    #[test]
    fn profiles_without_the_pair_term_or_transfer_costs_still_load() {
        let mut v = serde_json::to_value(CostProfile::cpu_placeholder()).expect("serialisable");
        let fields = v.as_object_mut().expect("object");
        for f in [
            "d_ms_per_pair",
            "step_mean_over_fit",
            "step_cv",
            "step_corr_ms",
            "transfer_bytes_per_s",
            "transfer_latency_us",
        ] {
            fields.remove(f);
        }
        let p = CostProfile::from_json(&v.to_string()).expect("older profile");
        assert_eq!(
            (p.d_ms_per_pair, p.step_cv, p.step_corr_ms),
            (0.0, 0.0, 0.0)
        );
        assert_eq!(p.step_mean_over_fit, 1.0);
        assert_eq!(
            (p.transfer_bytes_per_s, p.transfer_latency_us),
            (loopback_bytes_per_s(), loopback_latency_us())
        );
    }

    #[test]
    fn transfer_time_is_latency_plus_bytes_over_bandwidth() {
        let p = CostProfile::gpu_a100_llama3_8b();
        assert_eq!(p.transfer_us(0), 50);
        // One 16-token page of Llama-3-8B KV (16 * 128 KiB = 2 MiB) at 25 GB/s:
        // 2,097,152 / 25e9 s = 83.9 us, rounded up, + 50 us.
        assert_eq!(p.transfer_us(2_097_152), 50 + 84);
        let cpu = CostProfile::cpu_placeholder();
        assert!(cpu.transfer_us(2_097_152) > p.transfer_us(2_097_152));
        let mut v = serde_json::to_value(&p).expect("serialisable");
        v["transfer_bytes_per_s"] = serde_json::json!(0.0);
        let err = CostProfile::from_json(&v.to_string()).unwrap_err();
        assert_eq!(err, "field `transfer_bytes_per_s`: must be positive");
    }

    #[test]
    fn json_round_trips_and_errors_name_the_field() {
        let p = CostProfile::cpu_placeholder();
        let text = serde_json::to_string(&p).expect("serialisable");
        assert_eq!(CostProfile::from_json(&text), Ok(p.clone()));
        let mut v = serde_json::to_value(&p).expect("serialisable");
        v["a_ms"] = serde_json::json!("fast");
        let err = CostProfile::from_json(&v.to_string()).unwrap_err();
        assert!(err.starts_with("field `a_ms`:"), "{err}");
        v["a_ms"] = serde_json::json!(1.0);
        v.as_object_mut().expect("object").remove("kv_pages");
        let err = CostProfile::from_json(&v.to_string()).unwrap_err();
        assert!(err.contains("kv_pages"), "{err}");
        v["kv_pages"] = serde_json::json!(0);
        let err = CostProfile::from_json(&v.to_string()).unwrap_err();
        assert_eq!(err, "field `kv_pages`: must be positive");
        v["kv_pages"] = serde_json::json!(10);
        v["c_ms_per_context_token"] = serde_json::json!(-1.0);
        let err = CostProfile::from_json(&v.to_string()).unwrap_err();
        assert!(err.starts_with("field `c_ms_per_context_token`"), "{err}");
    }
}
