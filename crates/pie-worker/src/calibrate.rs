//! `pie bench --calibrate`: time the real engine's steps over a grid of batch
//! shapes and fit the simulator's cost model
//! `step_ms = a + b * batch_tokens + c * context_tokens`
//! (`context_tokens`: the sum over the step's sequences of their length after
//! the step, as `pie-sim` counts it), then write a `pie_workload::CostProfile`
//! with the engine limits `pie serve` uses by default.
//!
//! The grid: prefill steps of fresh prompts (1 to 8 sequences, 32 to 512
//! tokens), 32-token prompts after a cached 256-token prefix (what a
//! shared-prefix workload sends), and decode steps of 1 to 64 sequences at about
//! 128 and 512 tokens of context (their prompts share a cached prefix, so only
//! decode is expensive to set up). The grid runs twice and each shape keeps its
//! faster time, so a busy neighbour on a shared machine inflates fewer samples.
//! The fit is weighted by 1/time^2 (least relative error), so 15 ms decode steps
//! count as much as 2 s prefills; a coefficient that comes out negative is
//! dropped and the rest refitted.
//!
//! A second fit, printed but not written, replaces `context_tokens` with the
//! query x key pairs the step's attention computes (a decode step: its context;
//! `n` prompt tokens after `p` cached ones: `n * p + n * (n + 1) / 2`). The
//! engine's attention costs per pair, so prefill over a long context is far
//! dearer than `c * context_tokens` says; the two fits' R^2 show by how much.

use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use pie_model::{Model, SamplingParams};
use pie_policy::Fcfs;
use pie_workload::CostProfile;

use crate::config::Config;
use crate::engine::{Engine, EngineConfig, Request};

/// One timed step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub batch_tokens: usize,
    pub context_tokens: usize,
    /// Query x key pairs of the step's (causal) attention.
    pub pairs: usize,
    pub ms: f64,
}

/// What the third term of the model counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// `pie-sim`'s: the sequences' lengths after the step.
    Context,
    /// Query x key pairs.
    Pairs,
}

/// The shape of a step on sequences with `cached` tokens computing `new` each.
fn shape(seqs: &[(usize, usize)]) -> (usize, usize) {
    seqs.iter().fold((0, 0), |(ctx, pairs), &(cached, new)| {
        (
            ctx + cached + new,
            pairs + new * cached + new * (new + 1) / 2,
        )
    })
}

/// Fitted coefficients and how well they fit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fit {
    pub a: f64,
    pub b: f64,
    pub c: f64,
    /// Coefficient of determination on the step times.
    pub r2: f64,
    /// max |predicted - measured| / measured.
    pub worst_rel_err: f64,
}

impl Fit {
    pub fn predict(&self, batch_tokens: usize, context_tokens: usize) -> f64 {
        self.a + self.b * batch_tokens as f64 + self.c * context_tokens as f64
    }
}

/// The engine limits of `pie serve` with no config file, for `model`.
pub fn serve_engine_config(model: &Model) -> EngineConfig {
    let config = Config::default();
    let rt = &config.runtime;
    let page_bytes = model.kv_layout(rt.page_size).page_bytes();
    EngineConfig {
        page_size: rt.page_size,
        kv_pages: config.kv_pages(page_bytes),
        max_batch_tokens: rt.max_batch_tokens,
        max_running: rt.max_running,
    }
}

/// Calibrate on the GGUF at `path`, print the fit, write the profile to `out`.
pub fn run(path: &Path, out: &Path) -> Result<CostProfile> {
    let model = Arc::new(Model::load(path).with_context(|| format!("loading {}", path.display()))?);
    let serve = serve_engine_config(&model);
    let started = Instant::now();
    let samples = measure(&model, &serve)?;
    let by_pairs = fit(&samples, Attention::Pairs);
    let fit = fit(&samples, Attention::Context).context("fitting the step times")?;
    println!(
        "calibrated {} on {} steps in {:.1} s:\n  step_ms = {:.3} + {:.5} * batch_tokens + {:.3e} * context_tokens\n  R^2 = {:.4}, worst relative error {:.1}%",
        path.display(),
        samples.len(),
        started.elapsed().as_secs_f64(),
        fit.a,
        fit.b,
        fit.c,
        fit.r2,
        100.0 * fit.worst_rel_err
    );
    print_samples(&samples, &fit);
    if let Some(by_pairs) = by_pairs {
        println!(
            "  with attention as query x key pairs (not written; pie-sim counts context tokens):\n  step_ms = {:.3} + {:.5} * batch_tokens + {:.3e} * pairs, R^2 = {:.4}, worst relative error {:.1}%",
            by_pairs.a, by_pairs.b, by_pairs.c, by_pairs.r2, 100.0 * by_pairs.worst_rel_err
        );
    }
    let profile = profile(path, &serve, &fit);
    let json = serde_json::to_string_pretty(&profile)?;
    std::fs::write(out, json + "\n").with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(profile)
}

fn print_samples(samples: &[Sample], fit: &Fit) {
    println!(
        "  {:>6} {:>8} {:>8} {:>10} {:>10}",
        "batch", "context", "pairs", "ms", "fit ms"
    );
    for s in samples {
        let p = fit.predict(s.batch_tokens, s.context_tokens);
        println!(
            "  {:>6} {:>8} {:>8} {:>10.2} {:>10.2}",
            s.batch_tokens, s.context_tokens, s.pairs, s.ms, p
        );
    }
}

fn profile(path: &Path, serve: &EngineConfig, fit: &Fit) -> CostProfile {
    let file = path.file_name().map_or_else(
        || path.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    let stem = file.split('.').next().unwrap_or("model").to_lowercase();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    CostProfile {
        name: format!("cpu-calibrated-{stem}"),
        a_ms: fit.a,
        b_ms_per_token: fit.b,
        c_ms_per_context_token: fit.c,
        d_ms_per_pair: 0.0,
        calibrated: true,
        source: format!(
            "pie bench --calibrate on {file}, {}, {cores} cores; R^2 {:.4}, worst relative error {:.1}%",
            utc_date(),
            fit.r2,
            100.0 * fit.worst_rel_err
        ),
        page_size: serve.page_size,
        kv_pages: serve.kv_pages,
        max_batch_tokens: serve.max_batch_tokens,
        max_running: serve.max_running,
    }
}

/// Run the grid twice; keep each shape's faster time.
pub fn measure(model: &Arc<Model>, serve: &EngineConfig) -> Result<Vec<Sample>> {
    let mut grid = Grid::new(model.clone(), serve);
    grid.prefill(1, 32)?; // warm-up, not kept
    let first = grid.all()?;
    let second = grid.all()?;
    Ok(first
        .into_iter()
        .zip(second)
        .map(|(x, y)| if y.ms < x.ms { y } else { x })
        .collect())
}

/// An engine and a source of distinct prompts.
struct Grid {
    engine: Engine,
    vocab: u32,
    next: u32,
}

impl Grid {
    fn new(model: Arc<Model>, serve: &EngineConfig) -> Self {
        let vocab = model.config.vocab.max(2) as u32;
        let config = EngineConfig {
            // Room for 64 sequences of 512+ tokens even with a small default pool.
            kv_pages: serve.kv_pages.max(64 * 40),
            max_running: serve.max_running.max(64),
            ..serve.clone()
        };
        Self {
            engine: Engine::new(model, config, Box::new(Fcfs)),
            vocab,
            next: 0,
        }
    }

    fn all(&mut self) -> Result<Vec<Sample>> {
        let mut samples = Vec::new();
        for (seqs, len) in [(1, 32), (1, 128), (1, 256), (1, 512), (8, 64)] {
            samples.extend(self.prefill(seqs, len)?);
        }
        for seqs in [1, 4] {
            samples.extend(self.after_prefix(seqs, 256, 32)?);
        }
        for context in [128, 512] {
            for seqs in [1, 8, 32, 64] {
                samples.extend(self.decode(seqs, context)?);
            }
        }
        Ok(samples)
    }

    /// A prompt no earlier one shares a page with.
    fn fresh(&mut self, len: usize) -> Vec<u32> {
        self.next += 1;
        let salt = self.next.wrapping_mul(2_654_435_761);
        (0..len as u32)
            .map(|i| (salt ^ i.wrapping_mul(40_503)).wrapping_add(i) % self.vocab)
            .collect()
    }

    fn add(&mut self, prompt: Vec<u32>, max_tokens: usize) -> Result<pie_core::SeqId> {
        Ok(self.engine.add(Request {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
            ignore_eos: true,
            arrival_ms: 0,
            client: String::new(),
            props: Default::default(),
        })?)
    }

    /// One step, timed, on sequences of (cached, computed) tokens.
    fn step(&mut self, seqs: &[(usize, usize)]) -> Result<Sample> {
        let t = Instant::now();
        let out = self.engine.step(0)?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        let (context_tokens, pairs) = shape(seqs);
        let planned: usize = seqs.iter().map(|s| s.1).sum();
        anyhow::ensure!(
            out.batch_tokens == planned,
            "calibration step computed {} tokens, expected {planned}",
            out.batch_tokens
        );
        Ok(Sample {
            batch_tokens: out.batch_tokens,
            context_tokens,
            pairs,
            ms,
        })
    }

    /// A prompt shared by every run at this length: computed once, then its
    /// full pages come from the prefix cache.
    fn cached_base(&mut self, len: usize) -> Result<Vec<u32>> {
        let base: Vec<u32> = (0..len as u32).map(|i| (i * 7 + 3) % self.vocab).collect();
        self.add(base.clone(), 1)?;
        self.drain()?;
        Ok(base)
    }

    fn drain(&mut self) -> Result<()> {
        while self.engine.has_work() {
            self.engine.step(0)?;
        }
        Ok(())
    }

    /// `seqs` fresh prompts of `len` tokens prefilled in one step.
    fn prefill(&mut self, seqs: usize, len: usize) -> Result<Vec<Sample>> {
        for _ in 0..seqs {
            let prompt = self.fresh(len);
            self.add(prompt, 1)?;
        }
        let sample = self.step(&vec![(0, len); seqs])?;
        self.drain()?;
        Ok(vec![sample])
    }

    /// `seqs` prompts of `new` fresh tokens after a cached `cached`-token prefix
    /// (a multiple of the page size), prefilled in one step.
    fn after_prefix(&mut self, seqs: usize, cached: usize, new: usize) -> Result<Vec<Sample>> {
        let base = self.cached_base(cached)?;
        for _ in 0..seqs {
            let mut prompt = base.clone();
            prompt.extend(self.fresh(new));
            self.add(prompt, 1)?;
        }
        let sample = self.step(&vec![(cached, new); seqs])?;
        self.drain()?;
        Ok(vec![sample])
    }

    /// `seqs` sequences decoding at about `context` tokens each.
    fn decode(&mut self, seqs: usize, context: usize) -> Result<Vec<Sample>> {
        const STEPS: usize = 4;
        let base = self.cached_base(context)?;
        let mut ids = Vec::new();
        for i in 0..seqs {
            let mut prompt = base.clone();
            prompt.push(i as u32 % self.vocab);
            ids.push(self.add(prompt, STEPS + 1)?);
        }
        while ids.iter().any(|&id| self.waiting_first_token(id)) {
            self.engine.step(0)?;
        }
        let mut samples = Vec::new();
        for _ in 0..STEPS {
            // Before a decode step a sequence holds prompt + generated tokens,
            // all but the last in its KV.
            let seqs: Vec<(usize, usize)> = ids
                .iter()
                .filter_map(|&id| self.engine.info(id))
                .map(|s| (s.prompt_tokens + s.generated_tokens - 1, 1))
                .collect();
            samples.push(self.step(&seqs)?);
        }
        self.drain()?;
        Ok(samples)
    }

    fn waiting_first_token(&self, id: pie_core::SeqId) -> bool {
        self.engine
            .info(id)
            .is_some_and(|s| s.generated_tokens == 0)
    }
}

/// Weighted least squares (weights 1/ms^2) of `ms ~ a + b*batch + c*context`;
/// a negative coefficient is dropped (fixed at 0) and the rest refitted.
pub fn fit(samples: &[Sample], attention: Attention) -> Option<Fit> {
    let mut free = [true; 3];
    loop {
        let coef = solve_weighted(samples, attention, free)?;
        match coef.iter().position(|&x| x < 0.0) {
            Some(i) => free[i] = false,
            None => return Some(quality(samples, attention, coef)),
        }
    }
}

fn features(s: &Sample, attention: Attention) -> [f64; 3] {
    let third = match attention {
        Attention::Context => s.context_tokens,
        Attention::Pairs => s.pairs,
    };
    [1.0, s.batch_tokens as f64, third as f64]
}

/// Normal equations over the free terms; `None` if they are singular.
fn solve_weighted(samples: &[Sample], attention: Attention, free: [bool; 3]) -> Option<[f64; 3]> {
    let idx: Vec<usize> = (0..3).filter(|&i| free[i]).collect();
    let n = idx.len();
    let mut m = vec![vec![0.0; n + 1]; n];
    for s in samples.iter().filter(|s| s.ms > 0.0) {
        let x = features(s, attention);
        let w = 1.0 / (s.ms * s.ms);
        for (r, &i) in idx.iter().enumerate() {
            for (k, &j) in idx.iter().enumerate() {
                m[r][k] += w * x[i] * x[j];
            }
            m[r][n] += w * x[i] * s.ms;
        }
    }
    let sol = gauss(m)?;
    let mut coef = [0.0; 3];
    for (r, &i) in idx.iter().enumerate() {
        coef[i] = sol[r];
    }
    Some(coef)
}

/// Solve an augmented n x (n+1) system by Gaussian elimination with pivoting.
fn gauss(mut m: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let n = m.len();
    for col in 0..n {
        let pivot = (col..n).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[pivot][col].abs() < 1e-12 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col].clone();
        for (_, row) in m.iter_mut().enumerate().filter(|(r, _)| *r != col) {
            let f = row[col] / pivot_row[col];
            for (x, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                *x -= f * p;
            }
        }
    }
    Some((0..n).map(|i| m[i][n] / m[i][i]).collect())
}

fn quality(samples: &[Sample], attention: Attention, [a, b, c]: [f64; 3]) -> Fit {
    let mut f = Fit {
        a,
        b,
        c,
        r2: 0.0,
        worst_rel_err: 0.0,
    };
    let mean = samples.iter().map(|s| s.ms).sum::<f64>() / samples.len().max(1) as f64;
    let (mut res, mut tot) = (0.0, 0.0);
    for s in samples {
        let x = features(s, attention);
        let p = f.a + f.b * x[1] + f.c * x[2];
        res += (s.ms - p).powi(2);
        tot += (s.ms - mean).powi(2);
        if s.ms > 0.0 {
            f.worst_rel_err = f.worst_rel_err.max((p - s.ms).abs() / s.ms);
        }
    }
    f.r2 = if tot > 0.0 { 1.0 - res / tot } else { 1.0 };
    f
}

/// Today's date (UTC) as YYYY-MM-DD.
fn utc_date() -> String {
    let days = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(batch: usize, context: usize, ms: f64) -> Sample {
        Sample {
            batch_tokens: batch,
            context_tokens: context,
            pairs: context,
            ms,
        }
    }

    #[test]
    fn exact_linear_data_is_recovered() {
        let truth = |b: usize, c: usize| 5.0 + 0.5 * b as f64 + 0.01 * c as f64;
        let samples: Vec<Sample> = [(1, 100), (8, 800), (64, 4000), (256, 256), (512, 512)]
            .iter()
            .map(|&(b, c)| sample(b, c, truth(b, c)))
            .collect();
        let f = fit(&samples, Attention::Context).expect("well-posed");
        assert!(
            (f.a - 5.0).abs() < 1e-6 && (f.b - 0.5).abs() < 1e-8,
            "{f:?}"
        );
        assert!((f.c - 0.01).abs() < 1e-9, "{f:?}");
        assert!(f.r2 > 0.999_999 && f.worst_rel_err < 1e-9, "{f:?}");
    }

    #[test]
    fn a_negative_coefficient_is_dropped() {
        // Time falls with context: c would be negative, so it is fixed at 0.
        let samples = vec![
            sample(1, 100, 10.0),
            sample(1, 1000, 9.0),
            sample(100, 100, 110.0),
        ];
        let f = fit(&samples, Attention::Context).expect("fits");
        assert_eq!(f.c, 0.0);
        assert!(f.a > 0.0 && f.b > 0.0, "{f:?}");
    }

    #[test]
    fn shapes_count_context_and_causal_pairs() {
        // Decode at 100 tokens: 101 of context, 101 pairs; 4 tokens after 16 cached:
        // 20 of context, 4 * 16 + (1 + 2 + 3 + 4) pairs.
        assert_eq!(shape(&[(100, 1)]), (101, 101));
        assert_eq!(shape(&[(16, 4)]), (20, 74));
        assert_eq!(shape(&[(100, 1), (16, 4)]), (121, 175));
    }

    #[test]
    fn dates_are_civil() {
        let d = utc_date();
        assert_eq!(d.len(), 10);
        assert!(d.starts_with("20"), "{d}");
    }
}
