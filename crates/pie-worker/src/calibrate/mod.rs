//! `pie bench --calibrate`: time the real engine's steps over a grid of batch
//! shapes and fit the simulator's cost model
//! `step_ms = a + b * batch_tokens + c * context_tokens + d * attention_pairs`
//! (context tokens: the step's sequences' lengths after it, as `pie-sim` counts
//! them; attention pairs: the query x key pairs its attention computes,
//! `n * cached + n * (n + 1) / 2` for `n` new tokens after `cached` ones), then
//! write a `pie_workload::CostProfile` with the engine limits `pie serve` uses
//! by default.
//!
//! The grid: prefill steps of fresh prompts (1 to 8 sequences, 32 to 512
//! tokens), 32-token prompts after a cached 256-token prefix (what a
//! shared-prefix workload sends), and decode steps of 1 to 64 sequences at about
//! 128 and 512 tokens of context (their prompts share a cached prefix, so only
//! decode is expensive to set up). The grid runs twice and each shape keeps its
//! faster time, so a busy neighbour on a shared machine inflates fewer samples.
//! The fit is weighted by 1/time^2 (least relative error), so 15 ms decode steps
//! count as much as 2 s prefills; a coefficient that comes out negative (or a
//! pair term indistinguishable from the context term) is dropped and the rest
//! refitted. The fit without the pair term is printed beside it: the CPU
//! engine's attention costs per pair, so prefill after a long prefix is far
//! dearer than context tokens alone say.
//!
//! Then the spread: one prefill shape (32 tokens after a cached 256-token
//! prefix; half of them after 300 ms idle) and one decode shape (one sequence at about 256 tokens) are each
//! stepped many times in a row; the standard deviation of their times over
//! their shape's mean is the profile's `prefill_cv` and `step_cv` (decode),
//! which `pie-sim` draws each step's variance from (a queue's tail grows with
//! it). Printed beside it: p90 / p50 of the repeated times, their lag-1
//! autocorrelation (near 0: steps vary one by one, not in slow swings; pooled,
//! the profile's `step_corr_ms`), and their mean over the fit's prediction
//! (the fit keeps each grid shape's faster time of two), which goes into the
//! profile per kind (prefill and decode differ); the prefills after idle over
//! those back to back is the profile's `after_idle_factor`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use pie_model::Model;
use pie_policy::Fcfs;
use pie_workload::{CostProfile, StepKind, StepShape};

use crate::config::Config;
use crate::engine::{Engine, EngineConfig, Request};

pub mod served;

/// One timed step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub batch_tokens: usize,
    pub context_tokens: usize,
    /// Query x key pairs of the step's (causal) attention.
    pub pairs: usize,
    pub ms: f64,
}

impl Sample {
    pub fn of(shape: &StepShape, ms: f64) -> Self {
        Self {
            batch_tokens: shape.batch_tokens,
            context_tokens: shape.context_tokens,
            pairs: shape.attention_pairs as usize,
            ms,
        }
    }
}

/// Which terms a fit may use: 1, batch tokens, context tokens, attention pairs.
pub type Terms = [bool; 4];
pub const ALL_TERMS: Terms = [true; 4];
pub const WITHOUT_PAIRS: Terms = [true, true, true, false];

/// Fitted coefficients and how well they fit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fit {
    pub a: f64,
    pub b: f64,
    pub c: f64,
    pub d: f64,
    /// Coefficient of determination on the step times.
    pub r2: f64,
    /// max |predicted - measured| / measured.
    pub worst_rel_err: f64,
}

impl Fit {
    /// Every step predicted at `ms` (tests).
    #[cfg(test)]
    const fn flat(ms: f64) -> Self {
        Self {
            a: ms,
            b: 0.0,
            c: 0.0,
            d: 0.0,
            r2: 1.0,
            worst_rel_err: 0.0,
        }
    }

    pub fn predict(&self, s: &Sample) -> f64 {
        let x = features(s);
        self.a * x[0] + self.b * x[1] + self.c * x[2] + self.d * x[3]
    }
}

/// The engine limits of `pie serve` with no config file, for `model`.
pub fn serve_engine_config(model: &Model) -> EngineConfig {
    let config = Config::default();
    let rt = &config.runtime;
    let page_bytes = model.kv_layout(rt.page_size).page_bytes(rt.kv_dtype);
    EngineConfig {
        page_size: rt.page_size,
        kv_pages: config.kv_pages(page_bytes),
        kv_dtype: rt.kv_dtype,
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
    let without_pairs = fit(&samples, WITHOUT_PAIRS);
    let fit = fit(&samples, ALL_TERMS).context("fitting the step times")?;
    println!(
        "calibrated {} on {} steps in {:.1} s:\n  {}",
        path.display(),
        samples.len(),
        started.elapsed().as_secs_f64(),
        describe(&fit)
    );
    print_samples(&samples, &fit);
    if let Some(f) = without_pairs {
        println!("  without the pair term: {}", describe(&f));
    }
    let repeated = measure_spread(&model, &serve)?;
    // The profile's terms are the back-to-back steps'; the steps after idle
    // are printed beside them (whether waking costs anything).
    let back_to_back = || repeated.iter().filter(|r| r.idle_ms == 0);
    let of_kind = |kind: StepKind| spread(back_to_back().filter(|r| r.kind == kind), &fit);
    let (prefill, decode) = (of_kind(StepKind::Prefill), of_kind(StepKind::Decode));
    let after_idle = repeated.iter().filter(|r| r.idle_ms > 0);
    let measured = KindSpread {
        pooled: spread(back_to_back(), &fit),
        prefill,
        decode,
        after_idle_factor: Some(spread(after_idle, &fit).mean_over_fit / prefill.mean_over_fit),
        host_share: None,
    };
    println!("  {}", describe_spread(&measured.pooled, &repeated, &fit));
    write_profile(
        profile(path, "pie bench --calibrate", &serve, &fit, &measured),
        out,
    )
}

/// Write `profile` to `out` as JSON and say so.
fn write_profile(profile: CostProfile, out: &Path) -> Result<CostProfile> {
    let json = serde_json::to_string_pretty(&profile)?;
    std::fs::write(out, json + "\n").with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(profile)
}

fn describe(f: &Fit) -> String {
    format!(
        "step_ms = {:.3} + {:.5} * batch_tokens + {:.3e} * context_tokens + {:.3e} * pairs; R^2 = {:.4}, worst relative error {:.1}%",
        f.a, f.b, f.c, f.d, f.r2, 100.0 * f.worst_rel_err
    )
}

fn print_samples(samples: &[Sample], fit: &Fit) {
    println!(
        "  {:>6} {:>8} {:>8} {:>10} {:>10}",
        "batch", "context", "pairs", "ms", "fit ms"
    );
    for s in samples {
        let p = fit.predict(s);
        println!(
            "  {:>6} {:>8} {:>8} {:>10.2} {:>10.2}",
            s.batch_tokens, s.context_tokens, s.pairs, s.ms, p
        );
    }
}

/// The profile of `fit` and `spread`, measured on the model at `path` by
/// `how` (a command, with what it timed).
fn profile(
    path: &Path,
    how: &str,
    serve: &EngineConfig,
    fit: &Fit,
    spread: &KindSpread,
) -> CostProfile {
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
        d_ms_per_pair: fit.d,
        step_mean_over_fit: spread.decode.mean_over_fit,
        prefill_mean_over_fit: Some(spread.prefill.mean_over_fit),
        after_idle_factor: spread.after_idle_factor,
        step_cv: spread.decode.cv,
        prefill_cv: Some(spread.prefill.cv),
        host_share: spread.host_share,
        step_corr_ms: spread.pooled.corr_ms,
        calibrated: true,
        source: format!(
            "{how} on {file}, {}, {cores} cores; R^2 {:.4}, worst relative error {:.1}%",
            utc_date(),
            fit.r2,
            100.0 * fit.worst_rel_err
        ),
        page_size: serve.page_size,
        kv_pages: serve.kv_pages,
        max_batch_tokens: serve.max_batch_tokens,
        max_running: serve.max_running,
        // Not measured by the step grid: the loopback placeholder.
        transfer_bytes_per_s: CostProfile::cpu_placeholder().transfer_bytes_per_s,
        transfer_latency_us: CostProfile::cpu_placeholder().transfer_latency_us,
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

/// How long the engine sits idle before half the repeated prefills (past
/// `pie_workload::AFTER_IDLE_MS`: the simulator's waking from idle).
const AFTER_IDLE_IN_CALIBRATION_MS: u64 = 300;

/// Steps of one shape, timed again and again.
pub struct Repeated {
    pub name: &'static str,
    pub kind: StepKind,
    /// How long the engine sat idle before each step (0: back to back).
    pub idle_ms: u64,
    pub samples: Vec<Sample>,
    /// When each sample's step started (ms since the first).
    pub starts_ms: Vec<f64>,
}

/// Prefills of 32 tokens after a cached 256-token prefix (every other one
/// after the engine sat idle for 300 ms), and decode steps of one sequence
/// from 256 tokens of context on: the shapes a shared-prefix workload's first
/// tokens and gaps are made of.
pub fn measure_spread(model: &Arc<Model>, serve: &EngineConfig) -> Result<Vec<Repeated>> {
    const PREFILLS: usize = 48;
    const DECODES: usize = 120;
    let mut grid = Grid::new(model.clone(), serve);
    grid.prefill(1, 32)?; // warm-up, not kept
    let mut back_to_back = Repeated::new("prefill 32 after 256", StepKind::Prefill, 0);
    let mut after_idle = Repeated::new(
        "the same after 300 ms idle",
        StepKind::Prefill,
        AFTER_IDLE_IN_CALIBRATION_MS,
    );
    for i in 0..PREFILLS {
        // A served request often finds the engine idle: its step may pay
        // for waking the thread pool and cold caches. The idle spell ends
        // right before the timed step (setting it up runs steps too).
        let into = if i % 2 == 1 {
            &mut after_idle
        } else {
            &mut back_to_back
        };
        let idle = std::time::Duration::from_millis(into.idle_ms);
        let samples = grid.after_prefix(1, 256, 32, idle)?;
        into.add(samples, &grid.starts_ms);
    }
    let mut decode = Repeated::new("decode 1 at 256", StepKind::Decode, 0);
    let samples = grid.decode_steps(1, 256, DECODES)?;
    decode.add(samples, &grid.starts_ms);
    Ok(vec![back_to_back, after_idle, decode])
}

impl Repeated {
    fn new(name: &'static str, kind: StepKind, idle_ms: u64) -> Self {
        Self {
            name,
            kind,
            idle_ms,
            samples: Vec::new(),
            starts_ms: Vec::new(),
        }
    }

    /// `samples` just timed, with their starts: the last of `starts`.
    fn add(&mut self, samples: Vec<Sample>, starts: &[f64]) {
        let from = starts.len().saturating_sub(samples.len());
        self.starts_ms.extend(&starts[from..]);
        self.samples.extend(samples);
    }
}

/// The spread pooled over the repeated shapes, and each kind's own mean over
/// the fit (the two can be 0.3 apart, either way).
struct KindSpread {
    /// Its correlation time goes into the profile.
    pooled: Spread,
    /// Its mean over the fit is that of prefills that do not wake the
    /// engine (served steps: when measured apart from those that do).
    prefill: Spread,
    decode: Spread,
    /// Prefills after idle over prefills that follow a step at once.
    after_idle_factor: Option<f64>,
    /// Measured on served steps of workers sharing a host only.
    host_share: Option<f64>,
}

/// How repeated steps of one shape spread (of several: pooled).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// Standard deviation over the mean (pooled: the root mean square).
    pub cv: f64,
    /// p90 / p50 of the times (pooled: the mean).
    pub p90_over_p50: f64,
    /// Lag-1 autocorrelation of consecutive times (pooled: weighted by samples).
    pub lag1: f64,
    /// The correlation time (ms) that lag-1 autocorrelation gives at the mean
    /// time between the steps' starts, `-dt / ln(lag1)`; 0 when it is not
    /// positive (pooled: weighted by samples).
    pub corr_ms: f64,
    /// Mean time over the fit's prediction (pooled: the mean).
    pub mean_over_fit: f64,
}

/// Each shape's spread, then pooled with every shape counting alike (its
/// spread does not depend on how long it takes or how often it was timed);
/// the autocorrelation by samples, as short runs estimate it poorly.
pub fn spread<'a>(repeated: impl IntoIterator<Item = &'a Repeated>, fit: &Fit) -> Spread {
    pool(
        repeated
            .into_iter()
            .filter(|r| r.samples.len() > 2)
            .map(|r| (r.samples.len() as f64, shape_spread(r, fit)))
            .collect(),
    )
}

/// Spreads of several series, each with its number of samples.
fn pool(shapes: Vec<(f64, Spread)>) -> Spread {
    let n = shapes.len().max(1) as f64;
    let samples = shapes.iter().map(|(w, _)| w).sum::<f64>().max(1.0);
    let mean = |f: fn(&Spread) -> f64| shapes.iter().map(|(_, s)| f(s)).sum::<f64>() / n;
    let weighted =
        |f: fn(&Spread) -> f64| shapes.iter().map(|(w, s)| w * f(s)).sum::<f64>() / samples;
    Spread {
        cv: mean(|s| s.cv * s.cv).sqrt(),
        p90_over_p50: mean(|s| s.p90_over_p50),
        lag1: weighted(|s| s.lag1),
        corr_ms: weighted(|s| s.corr_ms),
        mean_over_fit: mean(|s| s.mean_over_fit),
    }
}

/// One shape's spread (at least two samples).
fn shape_spread(r: &Repeated, fit: &Fit) -> Spread {
    let ratios: Vec<f64> = r.samples.iter().map(|s| s.ms / fit.predict(s)).collect();
    let span = r
        .starts_ms
        .last()
        .zip(r.starts_ms.first())
        .map_or(0.0, |(l, f)| l - f);
    let dt = span / (r.starts_ms.len().max(2) - 1) as f64;
    let consecutive: Vec<(usize, usize)> = (1..ratios.len()).map(|i| (i - 1, i)).collect();
    series_spread(&ratios, &consecutive, dt)
}

/// The spread of step times over the fit's prediction (`ratios`; for one
/// shape the same as of the times themselves), with the lag-1
/// autocorrelation over the `consecutive` pairs of indices, `dt_ms` apart.
fn series_spread(ratios: &[f64], consecutive: &[(usize, usize)], dt_ms: f64) -> Spread {
    let n = ratios.len() as f64;
    let mean = ratios.iter().sum::<f64>() / n;
    let x: Vec<f64> = ratios.iter().map(|t| t / mean - 1.0).collect();
    let var = x.iter().map(|x| x * x).sum::<f64>() / n;
    // Over the pairs' own values: a subset of the steps (served steps back to
    // back) can vary more or less than all of them.
    let pairs = consecutive.len().max(1) as f64;
    let cov = consecutive.iter().map(|&(i, j)| x[i] * x[j]).sum::<f64>() / pairs;
    let paired_var = consecutive
        .iter()
        .map(|&(i, j)| (x[i] * x[i] + x[j] * x[j]) / 2.0)
        .sum::<f64>()
        / pairs;
    let lag1 = if paired_var > 0.0 {
        cov / paired_var
    } else {
        0.0
    };
    let mut sorted = ratios.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q) as usize];
    Spread {
        cv: var.sqrt(),
        p90_over_p50: at(0.9) / at(0.5),
        lag1,
        corr_ms: if lag1 > 0.0 && lag1 < 1.0 {
            -dt_ms / lag1.ln()
        } else {
            0.0
        },
        mean_over_fit: mean,
    }
}

fn describe_spread(s: &Spread, repeated: &[Repeated], fit: &Fit) -> String {
    let line = |name: String, s: &Spread| {
        format!(
            "{name}: cv {:.3}, p90/p50 {:.3}, lag-1 autocorrelation {:.2} (correlation time {:.1} ms), mean / fit {:.3}",
            s.cv, s.p90_over_p50, s.lag1, s.corr_ms, s.mean_over_fit
        )
    };
    let mut lines = vec![line("step spread, back-to-back shapes pooled".into(), s)];
    for r in repeated.iter().filter(|r| r.samples.len() > 2) {
        let one = shape_spread(r, fit);
        lines.push(line(
            format!("  {} ({} steps)", r.name, r.samples.len()),
            &one,
        ));
    }
    lines.join("\n  ")
}

/// An engine and a source of distinct prompts.
struct Grid {
    engine: Engine,
    vocab: u32,
    next: u32,
    origin: Instant,
    /// When each timed step started (ms since `origin`).
    starts_ms: Vec<f64>,
}

impl Grid {
    fn new(model: Arc<Model>, serve: &EngineConfig) -> Self {
        let config = EngineConfig {
            // Room for 64 sequences of 512+ tokens even with a small default pool.
            kv_pages: serve.kv_pages.max(64 * 40),
            max_running: serve.max_running.max(64),
            ..serve.clone()
        };
        let vocab = model.config.vocab.max(2) as u32;
        Self {
            engine: Engine::new(model, config, Box::new(Fcfs)),
            vocab,
            next: 0,
            origin: Instant::now(),
            starts_ms: Vec::new(),
        }
    }

    fn all(&mut self) -> Result<Vec<Sample>> {
        let mut samples = Vec::new();
        for (seqs, len) in [(1, 32), (1, 128), (1, 256), (1, 512), (8, 64)] {
            samples.extend(self.prefill(seqs, len)?);
        }
        for seqs in [1, 4] {
            samples.extend(self.after_prefix(seqs, 256, 32, std::time::Duration::ZERO)?);
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
        Ok(self.engine.add(Request::fixed_length(prompt, max_tokens))?)
    }

    /// One step, timed, on sequences of (cached, computed) tokens.
    fn step(&mut self, seqs: &[(usize, usize)]) -> Result<Sample> {
        let t = Instant::now();
        self.starts_ms
            .push(t.duration_since(self.origin).as_secs_f64() * 1000.0);
        let out = self.engine.step(0)?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        let planned = StepShape::of(seqs);
        anyhow::ensure!(
            out.shape == planned,
            "calibration step computed {:?}, expected {planned:?}",
            out.shape
        );
        Ok(Sample::of(&out.shape, ms))
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
    /// (a multiple of the page size), prefilled in one step after the engine
    /// sat `idle`.
    fn after_prefix(
        &mut self,
        seqs: usize,
        cached: usize,
        new: usize,
        idle: std::time::Duration,
    ) -> Result<Vec<Sample>> {
        let base = self.cached_base(cached)?;
        for _ in 0..seqs {
            let mut prompt = base.clone();
            prompt.extend(self.fresh(new));
            self.add(prompt, 1)?;
        }
        std::thread::sleep(idle);
        let sample = self.step(&vec![(cached, new); seqs])?;
        self.drain()?;
        Ok(vec![sample])
    }

    /// `seqs` sequences decoding at about `context` tokens each.
    fn decode(&mut self, seqs: usize, context: usize) -> Result<Vec<Sample>> {
        self.decode_steps(seqs, context, 4)
    }

    /// `steps` decode steps of `seqs` sequences from about `context` tokens on.
    fn decode_steps(&mut self, seqs: usize, context: usize, steps: usize) -> Result<Vec<Sample>> {
        let base = self.cached_base(context)?;
        let mut ids = Vec::new();
        for i in 0..seqs {
            let mut prompt = base.clone();
            prompt.push(i as u32 % self.vocab);
            ids.push(self.add(prompt, steps + 1)?);
        }
        while ids.iter().any(|&id| self.waiting_first_token(id)) {
            self.engine.step(0)?;
        }
        let mut samples = Vec::new();
        for _ in 0..steps {
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

/// Weighted least squares (weights 1/ms^2) of
/// `ms ~ a + b*batch + c*context + d*pairs` over the allowed `terms`; a
/// negative coefficient is dropped (fixed at 0) and the rest refitted, and so
/// is the pair term when it cannot be told from the context term.
pub fn fit(samples: &[Sample], terms: Terms) -> Option<Fit> {
    let mut free = terms;
    loop {
        let Some(coef) = solve_weighted(samples, free) else {
            if !free[3] {
                return None;
            }
            free[3] = false;
            continue;
        };
        match coef.iter().position(|&x| x < 0.0) {
            Some(i) => free[i] = false,
            None => return Some(quality(samples, coef)),
        }
    }
}

fn features(s: &Sample) -> [f64; 4] {
    [
        1.0,
        s.batch_tokens as f64,
        s.context_tokens as f64,
        s.pairs as f64,
    ]
}

/// Normal equations over the free terms; `None` if they are singular.
fn solve_weighted(samples: &[Sample], free: Terms) -> Option<[f64; 4]> {
    let idx: Vec<usize> = (0..4).filter(|&i| free[i]).collect();
    let n = idx.len();
    let mut m = vec![vec![0.0; n + 1]; n];
    for s in samples.iter().filter(|s| s.ms > 0.0) {
        let x = features(s);
        let w = 1.0 / (s.ms * s.ms);
        for (r, &i) in idx.iter().enumerate() {
            for (k, &j) in idx.iter().enumerate() {
                m[r][k] += w * x[i] * x[j];
            }
            m[r][n] += w * x[i] * s.ms;
        }
    }
    let sol = gauss(m)?;
    let mut coef = [0.0; 4];
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

fn quality(samples: &[Sample], [a, b, c, d]: [f64; 4]) -> Fit {
    let mut f = Fit {
        a,
        b,
        c,
        d,
        r2: 0.0,
        worst_rel_err: 0.0,
    };
    let mean = samples.iter().map(|s| s.ms).sum::<f64>() / samples.len().max(1) as f64;
    let (mut res, mut tot) = (0.0, 0.0);
    for s in samples {
        let p = f.predict(s);
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

    fn sample(batch: usize, context: usize, pairs: usize, ms: f64) -> Sample {
        Sample {
            batch_tokens: batch,
            context_tokens: context,
            pairs,
            ms,
        }
    }

    #[test]
    fn exact_linear_data_is_recovered() {
        let truth = |b: usize, c: usize, p: usize| {
            5.0 + 0.5 * b as f64 + 0.01 * c as f64 + 0.002 * p as f64
        };
        // Decode steps (pairs = context) and prefills (pairs grow as n^2).
        let shapes = [
            (1, 100, 100),
            (8, 800, 800),
            (64, 4000, 4000),
            (256, 256, 32_896),
            (512, 512, 131_328),
            (32, 288, 8_720),
        ];
        let samples: Vec<Sample> = shapes
            .iter()
            .map(|&(b, c, p)| sample(b, c, p, truth(b, c, p)))
            .collect();
        let f = fit(&samples, ALL_TERMS).expect("well-posed");
        assert!(
            (f.a - 5.0).abs() < 1e-6 && (f.b - 0.5).abs() < 1e-8,
            "{f:?}"
        );
        assert!(
            (f.c - 0.01).abs() < 1e-9 && (f.d - 0.002).abs() < 1e-10,
            "{f:?}"
        );
        assert!(f.r2 > 0.999_999 && f.worst_rel_err < 1e-9, "{f:?}");
        let without = fit(&samples, WITHOUT_PAIRS).expect("fits");
        assert_eq!(without.d, 0.0);
        assert!(without.r2 < f.r2);
    }

    #[test]
    fn negative_and_indistinguishable_terms_are_dropped() {
        // Pairs equal context everywhere (decode only): the pair term goes; time
        // falls with context, so c would be negative and is fixed at 0 too.
        let samples = vec![
            sample(1, 100, 100, 10.0),
            sample(1, 1000, 1000, 9.0),
            sample(100, 100, 100, 110.0),
        ];
        let f = fit(&samples, ALL_TERMS).expect("fits");
        assert_eq!((f.c, f.d), (0.0, 0.0));
        assert!(f.a > 0.0 && f.b > 0.0, "{f:?}");
    }

    #[test]
    fn spread_is_relative_to_each_shapes_mean() {
        // Two shapes, 10 ms and 100 ms, each alternating 10% either side of its
        // mean: cv 0.1 whatever the scale, consecutive steps anti-correlated
        // (no correlation time).
        let shape = |name, base: f64| Repeated {
            name,
            kind: StepKind::Decode,
            idle_ms: 0,
            samples: (0..20)
                .map(|i| sample(1, 1, 1, base * if i % 2 == 0 { 0.9 } else { 1.1 }))
                .collect(),
            starts_ms: (0..20).map(|i| i as f64 * base).collect(),
        };
        let repeated = [shape("fast", 10.0), shape("slow", 100.0)];
        // A fit of 50 ms for both: the means are 0.2 and 2 of it.
        let fit = Fit::flat(50.0);
        let s = spread(&repeated, &fit);
        assert!((s.cv - 0.1).abs() < 1e-9, "{s:?}");
        assert!((s.lag1 + 1.0).abs() < 1e-9 && s.corr_ms == 0.0, "{s:?}");
        assert!((s.p90_over_p50 - 1.1 / 0.9).abs() < 1e-9, "{s:?}");
        assert!((s.mean_over_fit - 1.1).abs() < 1e-9, "{s:?}");
        // Every step the same: no spread.
        let still = Repeated {
            samples: vec![sample(1, 1, 1, 5.0); 10],
            ..shape("still", 5.0)
        };
        assert!(
            spread([&still], &fit).cv < 1e-12,
            "ratios to the fit are equal to rounding"
        );
    }

    #[test]
    fn slow_swings_give_a_correlation_time() {
        // Times that swing (a sine over 12 steps 10 ms apart): lag-1
        // autocorrelation cos(2 pi / 12) = 0.866, so -10 / ln(0.866) = 70 ms.
        let swing = Repeated {
            name: "swing",
            kind: StepKind::Decode,
            idle_ms: 0,
            samples: (0..396)
                .map(|i| {
                    let phase = std::f64::consts::TAU * i as f64 / 12.0;
                    sample(1, 1, 1, 10.0 * (1.0 + 0.1 * phase.sin()))
                })
                .collect(),
            starts_ms: (0..396).map(|i| i as f64 * 10.0).collect(),
        };
        let fit = Fit::flat(10.0);
        let s = spread([&swing], &fit);
        let expected = -10.0 / (std::f64::consts::TAU / 12.0).cos().ln();
        assert!(
            (s.corr_ms - expected).abs() < 0.05 * expected,
            "{s:?} vs {expected}"
        );
        assert!((s.cv - 0.1 / 2f64.sqrt()).abs() < 1e-3, "{s:?}");
        assert!((s.mean_over_fit - 1.0).abs() < 1e-9, "{s:?}");
    }

    #[test]
    fn dates_are_civil() {
        let d = utc_date();
        assert_eq!(d.len(), 10);
        assert!(d.starts_with("20"), "{d}");
    }
}
