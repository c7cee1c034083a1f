//! Next-token sampling: greedy, temperature, top-k, top-p and min-p,
//! reproducible by seed, after the penalties and biases that reshape the
//! logits: `logit_bias` (OpenAI: added, clamped to +-100), `frequency_penalty`
//! and `presence_penalty` (OpenAI: minus count x frequency + presence for
//! each token generated so far), `repetition_penalty` (vLLM, as in CTRL: a
//! token of the prompt or the output has a positive logit divided by it, a
//! negative one multiplied), all applied before greedy too.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::attention::sum_exp;
use crate::token_sets::TokenSets;

/// The largest `logit_bias` magnitude (OpenAI's).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// The most tokens one `logit_bias` may name (OpenAI allows 300), so what
/// a request or a guest's context keeps is bounded.
pub const MAX_LOGIT_BIASES: usize = 1024;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches top_p (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than min_p x the most likely one's (0 = off).
    pub min_p: f32,
    pub seed: Option<u64>,
    /// Subtracted per earlier occurrence of a token in the output.
    pub frequency_penalty: f32,
    /// Subtracted once from every token already in the output.
    pub presence_penalty: f32,
    /// Divides (or, when negative, multiplies) the logit of every token of
    /// the prompt and the output (1 = off).
    pub repetition_penalty: f32,
    /// Added to these tokens' logits (clamped to +-`MAX_LOGIT_BIAS`).
    pub logit_bias: Vec<(u32, f32)>,
    /// The tokens it may sample (checked by [`TokenSets::new`]).
    pub token_sets: TokenSets,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            token_sets: TokenSets::default(),
        }
    }
}

/// Sampling as a client or a guest asks for it, every field optional (None:
/// its default). [`SamplingRequest::check`] is the one place their ranges
/// are checked: the OpenAI routes, native args and inferlet host calls all
/// go through it.
#[derive(Clone, Debug, Default)]
pub struct SamplingRequest {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Vec<(u32, f32)>,
    pub token_sets: TokenSets,
}

/// A sampling field out of its range: the field (OpenAI's snake_case name)
/// and what is wrong.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct BadSampling {
    pub field: &'static str,
    pub message: String,
}

impl SamplingRequest {
    /// Checked parameters for a model of `vocab` tokens (OpenAI's ranges for
    /// temperature, top-p and the penalties; vLLM's meaning for
    /// `repetition_penalty` and `min_p`; every biased token in the vocabulary).
    pub fn check(self, vocab: usize) -> Result<SamplingParams, BadSampling> {
        let defaults = SamplingParams::default();
        let temperature = within(
            "temperature",
            self.temperature,
            defaults.temperature,
            |v| (0.0..=2.0).contains(&v),
            "between 0 and 2",
        )?;
        let top_p = within(
            "top_p",
            self.top_p,
            defaults.top_p,
            |v| v > 0.0 && v <= 1.0,
            "in (0, 1]",
        )?;
        let min_p = within(
            "min_p",
            self.min_p,
            defaults.min_p,
            |v| (0.0..=1.0).contains(&v),
            "in [0, 1]",
        )?;
        let penalty = |v: f32| (-2.0..=2.0).contains(&v);
        let frequency_penalty = within(
            "frequency_penalty",
            self.frequency_penalty,
            0.0,
            penalty,
            "in [-2, 2]",
        )?;
        let presence_penalty = within(
            "presence_penalty",
            self.presence_penalty,
            0.0,
            penalty,
            "in [-2, 2]",
        )?;
        let repetition_penalty = within(
            "repetition_penalty",
            self.repetition_penalty,
            1.0,
            |v| v > 0.0 && v.is_finite(),
            "positive",
        )?;
        if self.logit_bias.len() > MAX_LOGIT_BIASES {
            return Err(BadSampling {
                field: "logit_bias",
                message: format!(
                    "logit_bias names at most {MAX_LOGIT_BIASES} tokens, got {}",
                    self.logit_bias.len()
                ),
            });
        }
        for &(token, bias) in &self.logit_bias {
            if let Err(e) = check_token_ids(&[token], vocab) {
                return Err(BadSampling {
                    field: "logit_bias",
                    message: format!("logit_bias {e}"),
                });
            }
            if !bias.is_finite() {
                return Err(BadSampling {
                    field: "logit_bias",
                    message: format!(
                        "logit_bias of token {token} must be a finite number, got {bias}"
                    ),
                });
            }
        }
        if let Err(e) = check_token_ids(&self.token_sets.ids().collect::<Vec<_>>(), vocab) {
            return Err(BadSampling {
                field: "token_sets",
                message: format!("a token set's {e}"),
            });
        }
        Ok(SamplingParams {
            temperature,
            top_k: self.top_k.unwrap_or(0).min(vocab),
            top_p,
            min_p,
            seed: self.seed,
            frequency_penalty,
            presence_penalty,
            repetition_penalty,
            logit_bias: self.logit_bias,
            token_sets: self.token_sets,
        })
    }
}

/// `value` (or `default`) when `ok`, else the error naming `field`.
fn within(
    field: &'static str,
    value: Option<f32>,
    default: f32,
    ok: impl Fn(f32) -> bool,
    range: &str,
) -> Result<f32, BadSampling> {
    match value {
        Some(v) if !ok(v) => Err(BadSampling {
            field,
            message: format!("{field} must be {range}, got {v}"),
        }),
        Some(v) => Ok(v),
        None => Ok(default),
    }
}

/// A token id at or past the vocabulary's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("token id {token} is outside the vocabulary ({vocab} tokens)")]
pub struct OutOfVocab {
    pub token: u32,
    pub vocab: usize,
}

/// The one check that token ids from outside (a prompt, a guest's context,
/// a bias, a peer's transfer) are ids of a vocabulary of `vocab` tokens.
pub fn check_token_ids(ids: &[u32], vocab: usize) -> Result<(), OutOfVocab> {
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(&token) => Err(OutOfVocab { token, vocab }),
        None => Ok(()),
    }
}

impl SamplingParams {
    /// Whether anything reshapes the logits before sampling.
    fn reshapes(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || !self.token_sets.is_empty()
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Each token's count in the output so far (kept only when a penalty
    /// reads it).
    output_counts: HashMap<u32, u32>,
    /// The prompt's distinct tokens (for `repetition_penalty` only).
    prompt_tokens: Vec<u32>,
    /// Scratch for the reshaped logits.
    reshaped: Vec<f32>,
}

impl Sampler {
    /// A sampler for a sequence whose prompt is `prompt`.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        Self::resumed(params, prompt, &[])
    }

    /// A sampler that has already sampled `sampled` (the tokens it generated
    /// elsewhere, after `prompt`): a seeded one is where the same seed would
    /// be after them (each non-greedy sample draws once) and its penalties
    /// count them, so a process resumed on another worker goes on as it
    /// would have.
    pub fn resumed(params: SamplingParams, prompt: &[u32], sampled: &[u32]) -> Self {
        let mut rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_entropy(),
        };
        if params.temperature > 0.0 {
            for _ in sampled {
                rng.gen::<f32>();
            }
        }
        let mut prompt_tokens = Vec::new();
        if params.repetition_penalty != 1.0 {
            prompt_tokens = prompt.to_vec();
            prompt_tokens.sort_unstable();
            prompt_tokens.dedup();
        }
        let mut sampler = Self {
            params,
            rng,
            output_counts: HashMap::new(),
            prompt_tokens,
            reshaped: Vec::new(),
        };
        for &t in sampled {
            sampler.count(t);
        }
        sampler
    }

    fn count(&mut self, token: u32) {
        if self.params.reshapes() {
            *self.output_counts.entry(token).or_default() += 1;
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = if self.params.reshapes() {
            let mut reshaped = std::mem::take(&mut self.reshaped);
            reshaped.clear();
            reshaped.extend_from_slice(logits);
            self.reshape(&mut reshaped);
            let token = self.draw(&reshaped);
            self.reshaped = reshaped;
            token
        } else {
            self.draw(logits)
        };
        self.count(token);
        token
    }

    /// Apply the penalties and biases to `logits`.
    fn reshape(&self, logits: &mut [f32]) {
        let p = &self.params;
        let repeat = |t: u32, logits: &mut [f32]| {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        };
        if p.repetition_penalty != 1.0 {
            for &t in &self.prompt_tokens {
                repeat(t, logits);
            }
            for &t in self.output_counts.keys() {
                if self.prompt_tokens.binary_search(&t).is_err() {
                    repeat(t, logits);
                }
            }
        }
        for (&t, &n) in &self.output_counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
        for &(t, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias.clamp(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS);
            }
        }
        p.token_sets.apply(logits);
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut cands: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / self.params.temperature))
            .collect();
        cands.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        if self.params.top_k > 0 {
            cands.truncate(self.params.top_k);
        }
        let max = cands[0].1;
        let mut total = 0.0;
        for c in cands.iter_mut() {
            c.1 = (c.1 - max).exp();
            total += c.1;
        }
        if self.params.min_p > 0.0 {
            // The first candidate's weight is exp(0) = 1: the most likely's.
            let keep = cands.partition_point(|c| c.1 >= self.params.min_p);
            cands.truncate(keep.max(1));
            total = cands.iter().map(|c| c.1).sum();
        }
        if self.params.top_p < 1.0 {
            let mut mass = 0.0;
            let keep = cands
                .iter()
                .position(|c| {
                    mass += c.1 / total;
                    mass >= self.params.top_p
                })
                .map_or(cands.len(), |i| i + 1);
            cands.truncate(keep);
            total = cands.iter().map(|c| c.1).sum();
        }
        let mut r = self.rng.gen::<f32>() * total;
        for &(id, p) in &cands {
            if r < p {
                return id;
            }
            r -= p;
        }
        cands.last().map_or(0, |c| c.0)
    }
}

/// The most alternatives [`logprobs`] reports per token.
pub const MAX_TOP_LOGPROBS: usize = 64;

/// A sampled token's log-probability under the model (the logits before any
/// penalty, bias or temperature), and the `top` most likely tokens with theirs.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// Most likely first; ties by lower id.
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability and the `top` most likely tokens' (at most
/// [`MAX_TOP_LOGPROBS`]), by a log-softmax over `logits`.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let log_sum = log_sum_exp(logits);
    let of = |t: u32| {
        logits
            .get(t as usize)
            .map_or(f32::NEG_INFINITY, |l| l - log_sum)
    };
    TokenLogprobs {
        logprob: of(token),
        top: most_likely(logits, top.min(MAX_TOP_LOGPROBS))
            .into_iter()
            .map(|t| (t, of(t)))
            .collect(),
    }
}

/// log(sum(exp(logits))): a log-softmax subtracts it.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = max_logit(logits);
    max + sum_exp(logits, max).ln()
}

/// The largest logit, in 16 lanes: a reduction in one accumulator cannot
/// be reordered, so it would not vectorize.
fn max_logit(logits: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [f32::NEG_INFINITY; LANES];
    let (chunks, rest) = logits.as_chunks::<LANES>();
    for chunk in chunks {
        for j in 0..LANES {
            acc[j] = if chunk[j] > acc[j] { chunk[j] } else { acc[j] };
        }
    }
    acc.iter()
        .chain(rest)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// The `k` largest logits' ids, largest first (ties: lower id first).
fn most_likely(logits: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, by_logit);
        ids.truncate(k);
    }
    ids.sort_unstable_by(by_logit);
    ids
}

pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes in lanes the compiler vectorises (the largest value, then the
    // first chunk holding it) instead of one loop carrying an index: at 32
    // sequences a step's argmaxes over a 49,152-token vocabulary took 2% of it.
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &l) in lanes.iter_mut().zip(c) {
            *m = if l > *m { l } else { *m };
        }
    }
    let max = lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    if max == f32::NEG_INFINITY {
        // Nothing above -inf (or only NaN): no value is greater than the first.
        return 0;
    }
    let mut start = 0;
    for c in logits.chunks(LANES) {
        if c.iter().fold(false, |found, &l| found | (l == max)) {
            let at = c
                .iter()
                .position(|&l| l == max)
                .expect("found in this chunk");
            return (start + at) as u32;
        }
        start += c.len();
    }
    unreachable!("the maximum is one of the logits")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each field out of its range is refused naming it; in range, the
    /// fields pass through, top-k capped at the vocabulary.
    #[test]
    fn sampling_request_checks_every_range_and_names_the_field() {
        let bad = [
            (
                "temperature",
                SamplingRequest {
                    temperature: Some(2.5),
                    ..Default::default()
                },
            ),
            (
                "top_p",
                SamplingRequest {
                    top_p: Some(0.0),
                    ..Default::default()
                },
            ),
            (
                "min_p",
                SamplingRequest {
                    min_p: Some(1.5),
                    ..Default::default()
                },
            ),
            (
                "frequency_penalty",
                SamplingRequest {
                    frequency_penalty: Some(-3.0),
                    ..Default::default()
                },
            ),
            (
                "presence_penalty",
                SamplingRequest {
                    presence_penalty: Some(2.1),
                    ..Default::default()
                },
            ),
            (
                "repetition_penalty",
                SamplingRequest {
                    repetition_penalty: Some(0.0),
                    ..Default::default()
                },
            ),
            (
                "logit_bias",
                SamplingRequest {
                    logit_bias: vec![(10, 1.0)],
                    ..Default::default()
                },
            ),
            (
                "logit_bias",
                SamplingRequest {
                    logit_bias: vec![(1, f32::NAN)],
                    ..Default::default()
                },
            ),
        ];
        for (field, request) in bad {
            let err = request.check(10).expect_err(field);
            assert_eq!(err.field, field, "{err}");
            assert!(err.message.contains(field), "{err}");
        }
        let ok = SamplingRequest {
            temperature: Some(0.7),
            top_k: Some(50),
            frequency_penalty: Some(1.0),
            repetition_penalty: Some(1.2),
            logit_bias: vec![(9, -100.0)],
            ..Default::default()
        }
        .check(10)
        .unwrap();
        assert_eq!((ok.temperature, ok.top_k, ok.top_p), (0.7, 10, 1.0));
        assert_eq!(
            (
                ok.frequency_penalty,
                ok.presence_penalty,
                ok.repetition_penalty
            ),
            (1.0, 0.0, 1.2)
        );
        assert_eq!(ok.logit_bias, vec![(9, -100.0)]);
        assert_eq!(
            SamplingRequest::default().check(10).unwrap(),
            SamplingParams::default()
        );
    }

    #[test]
    fn token_ids_past_the_vocabulary_are_named() {
        assert_eq!(check_token_ids(&[0, 9], 10), Ok(()));
        let err = check_token_ids(&[3, 10, 11], 10).unwrap_err();
        assert_eq!(
            err.to_string(),
            "token id 10 is outside the vocabulary (10 tokens)"
        );
    }

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(
            SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: Some(seed),
                ..SamplingParams::default()
            },
            &[],
        )
    }

    #[test]
    fn greedy_takes_argmax() {
        assert_eq!(sampler(0.0, 0, 1.0, 1).sample(&[0.1, 2.0, 1.0]), 1);
    }

    /// The first of equal maxima, NaN never, and 0 when nothing exceeds -inf, at
    /// every length and place (inside a chunk of lanes, across them, in the
    /// remainder), as a plain scan gives.
    #[test]
    fn argmax_is_the_first_largest() {
        let scan = |l: &[f32]| {
            l.iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                )
                .0 as u32
        };
        let mut rng = StdRng::seed_from_u64(5);
        for len in [1, 2, 15, 16, 17, 33, 100, 49_152] {
            for case in 0..40 {
                let mut l: Vec<f32> = (0..len).map(|_| (rng.gen::<f32>() * 8.0).round()).collect();
                match case % 4 {
                    1 => l[rng.gen_range(0..len)] = f32::NAN,
                    2 => l.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                    3 => l[0] = f32::NAN,
                    _ => {}
                }
                assert_eq!(argmax(&l), scan(&l), "len {len}, case {case}: {l:?}");
            }
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let a: Vec<u32> = {
            let mut s = sampler(1.0, 0, 1.0, 9);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = sampler(1.0, 0, 1.0, 9);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "temperature 1 should vary");
    }

    #[test]
    fn a_resumed_sampler_goes_on_as_the_original() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: Some(5),
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        };
        let mut whole = Sampler::new(params.clone(), &[]);
        let all: Vec<u32> = (0..30).map(|_| whole.sample(&logits)).collect();
        let mut resumed = Sampler::resumed(params, &[], &all[..12]);
        let rest: Vec<u32> = (0..18).map(|_| resumed.sample(&logits)).collect();
        assert_eq!(rest, all[12..]);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0, 4.9, 0.0, -1.0, -2.0];
        let mut s = sampler(1.0, 2, 1.0, 3);
        assert!((0..200).all(|_| s.sample(&logits) < 2));
        // The first two tokens hold ~99% of the mass.
        let mut s = sampler(1.0, 0, 0.9, 4);
        assert!((0..200).all(|_| s.sample(&logits) < 2));
    }

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            seed: Some(11),
            ..SamplingParams::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn a_token_biased_to_minus_100_never_comes() {
        let logits = [3.0, 2.9, 0.5, 0.1];
        for temperature in [0.0, 1.0] {
            let mut s = Sampler::new(
                params(|p| {
                    p.temperature = temperature;
                    p.logit_bias = vec![(0, -1e6), (1, -100.0)];
                }),
                &[],
            );
            assert!(
                (0..300).all(|_| s.sample(&logits) >= 2),
                "temperature {temperature}"
            );
        }
        // Clamped: +1e6 counts as +100, still enough to win here.
        let mut s = Sampler::new(params(|p| p.logit_bias = vec![(3, 1e6)]), &[]);
        assert_eq!(s.sample(&logits), 3);
    }

    /// Greedy on logits that always favour token 0 repeats it; a frequency
    /// penalty of 2 takes away 2 per earlier 0, so the runner-up comes in
    /// turn; a presence penalty takes a fixed amount once.
    #[test]
    fn frequency_and_presence_penalties_lower_repeats() {
        let logits = [5.0, 4.0, 0.0];
        let repeats = |p: SamplingParams| {
            let mut s = Sampler::new(p, &[]);
            let out: Vec<u32> = (0..12).map(|_| s.sample(&logits)).collect();
            out.iter().filter(|&&t| t == 0).count()
        };
        assert_eq!(repeats(params(|_| {})), 12);
        let with_frequency = repeats(params(|p| p.frequency_penalty = 2.0));
        assert!(with_frequency <= 6, "{with_frequency} of 12");
        // Presence: 0 once, then 1 (5 - 1.5 < 4), then both penalised alike.
        let mut s = Sampler::new(params(|p| p.presence_penalty = 1.5), &[]);
        let out: Vec<u32> = (0..4).map(|_| s.sample(&logits)).collect();
        assert_eq!(out, [0, 1, 0, 0]);
    }

    /// A prompt token's positive logit is divided by the penalty, a
    /// negative one multiplied: greedy moves off the prompt's token.
    #[test]
    fn repetition_penalty_divides_the_prompts_tokens() {
        let logits = [4.0, 3.0, -1.0];
        let p = params(|p| p.repetition_penalty = 2.0);
        let mut s = Sampler::new(p.clone(), &[0, 2]);
        assert_eq!(s.sample(&logits), 1, "4 / 2 = 2 < 3");
        let mut reshaped = logits.to_vec();
        Sampler::new(p, &[0, 2]).reshape(&mut reshaped);
        assert_eq!(reshaped, [2.0, 3.0, -2.0]);
    }

    /// min_p drops every token less likely than min_p x the most likely one.
    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lp = logprobs(&logits, 2, 3);
        let total: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((lp.logprob - (2.0f32.exp() / total).ln()).abs() < 1e-5);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        let probs: f32 = logprobs(&logits, 0, 99).top.iter().map(|t| t.1.exp()).sum();
        assert!(
            (probs - 1.0).abs() < 1e-5,
            "every token's probability sums to 1"
        );
        assert!(logprobs(&vec![0.0; 1000], 0, 1000).top.len() == MAX_TOP_LOGPROBS);
    }

    #[test]
    fn min_p_keeps_only_tokens_near_the_top() {
        // Probabilities about 0.47, 0.47, 0.06: min_p 0.5 drops the last.
        let logits = [2.0, 2.0, 0.0];
        let mut s = Sampler::new(
            params(|p| {
                p.temperature = 1.0;
                p.min_p = 0.5
            }),
            &[],
        );
        assert!((0..500).all(|_| s.sample(&logits) < 2));
        let mut s = Sampler::new(params(|p| p.temperature = 1.0), &[]);
        assert!(
            (0..500).any(|_| s.sample(&logits) == 2),
            "without it the third comes"
        );
    }
}
