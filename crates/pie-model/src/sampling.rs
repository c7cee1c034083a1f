//! Next-token sampling: greedy, temperature, top-k and top-p, reproducible by seed.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches top_p (1 = off).
    pub top_p: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self::resumed(params, 0)
    }

    /// A sampler that has already sampled `sampled` tokens: a seeded one is
    /// where the same seed would be after them (each non-greedy sample draws
    /// once), so a process resumed on another worker goes on as it would have.
    pub fn resumed(params: SamplingParams, sampled: usize) -> Self {
        let mut rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_entropy(),
        };
        if params.temperature > 0.0 {
            for _ in 0..sampled {
                rng.gen::<f32>();
            }
        }
        Self { params, rng }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
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

    fn sampler(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
        })
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
        let mut whole = sampler(1.0, 0, 0.9, 5);
        let all: Vec<u32> = (0..30).map(|_| whole.sample(&logits)).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: Some(5),
        };
        let mut resumed = Sampler::resumed(params, 12);
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
}
