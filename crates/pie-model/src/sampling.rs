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
    logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &l)| {
            if l > best.1 {
                (i, l)
            } else {
                best
            }
        })
        .0 as u32
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
