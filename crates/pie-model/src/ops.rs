//! Small dense kernels on f32 slices. Written so LLVM vectorises them (fixed-width
//! partial sums), since they run once per token per layer.

use crate::architecture::RopeLayout;

const LANES: usize = 8;

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out += scale * x`
pub fn axpy(out: &mut [f32], scale: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += scale * v;
    }
}

/// Each row of `x` (width `weight.len()`) normalised by its RMS and scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let d = weight.len();
    let mut out = vec![0f32; x.len()];
    for (row, dst) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let scale = 1.0 / (dot(row, row) / d as f32 + eps).sqrt();
        for ((o, v), w) in dst.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
    out
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Gemma 2's soft cap, on attention scores and on final logits alike:
/// each `x` becomes `cap * tanh(x / cap)`.
pub fn softcap(xs: &mut [f32], cap: f32) {
    for x in xs {
        *x = cap * (*x / cap).tanh();
    }
}

/// GELU, tanh approximation (as Gemma and llama.cpp's `ggml_gelu` compute it).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

/// How a model's RoPE frequencies stretch past the context it was trained on
/// (`rope.scaling.type`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// YaRN, as llama.cpp computes it: a pair that turns fewer than
    /// `beta_slow` times over `original_context` positions is interpolated
    /// (its frequency divided by `factor`), one that turns more than
    /// `beta_fast` times keeps its frequency, with a linear ramp (by pair
    /// index) between, mixed in by `ext_factor`; the rotated elements are
    /// scaled by `1 + 0.1 ln(factor)`.
    Yarn {
        factor: f32,
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
        ext_factor: f32,
    },
}

impl RopeScaling {
    /// Pair `i`'s frequency multiplier, of a RoPE turning `dims` elements
    /// with base `theta`.
    fn multiplier(&self, i: usize, dims: usize, theta: f32) -> f64 {
        match *self {
            Self::None => 1.0,
            Self::Linear { factor } => 1.0 / factor as f64,
            Self::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                ext_factor,
            } => {
                let (low, high) =
                    yarn_ramp_ends(dims, original_context, theta, beta_fast, beta_slow);
                let ramp = 1.0 - ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
                let mix = ramp * ext_factor as f64;
                (1.0 - mix) / factor as f64 + mix
            }
        }
    }

    /// What the rotated elements are scaled by, apart from the file's own
    /// attention factor.
    fn mscale(&self) -> f32 {
        match *self {
            Self::Yarn {
                factor, ext_factor, ..
            } if ext_factor != 0.0 => 1.0 + 0.1 * factor.ln(),
            _ => 1.0,
        }
    }
}

/// The pair indices where YaRN's ramp starts and ends: those whose
/// frequency turns `beta_fast` and `beta_slow` times over `original`
/// positions, rounded outwards and kept within the pairs (llama.cpp's
/// `ggml_rope_yarn_corr_dims`).
fn yarn_ramp_ends(dims: usize, original: usize, theta: f32, fast: f32, slow: f32) -> (f64, f64) {
    let pair = |turns: f32| {
        let two_pi = 2.0 * std::f64::consts::PI;
        dims as f64 * (original as f64 / (turns as f64 * two_pi)).ln() / (2.0 * (theta as f64).ln())
    };
    (
        pair(fast).floor().max(0.0),
        pair(slow).ceil().min(dims as f64 - 1.0),
    )
}

/// What a model's RoPE is: which elements of a head turn, how fast, paired how.
pub struct RopeSpec<'a> {
    pub head_dim: usize,
    /// Elements rotated at the start of each head (the rest pass through).
    pub dims: usize,
    pub theta: f32,
    pub scaling: RopeScaling,
    /// Per pair, a divisor of its frequency (Llama 3's `rope_freqs`).
    pub freq_divisors: Option<&'a [f32]>,
    pub layout: RopeLayout,
    pub max_pos: usize,
    /// Rotated elements are scaled by it (`rope.scaling.attn_factor`, as
    /// LongRoPE's files carry it; 1: none), as llama.cpp scales its cos and
    /// sin; YaRN's own scale comes on top (`RopeScaling`).
    pub mscale: f32,
}

/// Rotary embedding tables: for position `p` and pair `i`, the angle is
/// `p * theta^(-2i / dims) / divisor_i * multiplier_i` (the scaling's);
/// which elements pair up is the architecture's [`RopeLayout`].
pub struct Rope {
    head_dim: usize,
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    layout: RopeLayout,
}

impl Rope {
    pub fn new(spec: &RopeSpec) -> Self {
        let half = spec.dims / 2;
        let freqs: Vec<f64> = (0..half)
            .map(|i| {
                let base = 1.0 / (spec.theta as f64).powf(2.0 * i as f64 / spec.dims as f64);
                let divisor = spec
                    .freq_divisors
                    .and_then(|d| d.get(i))
                    .copied()
                    .unwrap_or(1.0);
                base / divisor as f64 * spec.scaling.multiplier(i, spec.dims, spec.theta)
            })
            .collect();
        let mscale = spec.mscale * spec.scaling.mscale();
        let mut cos = Vec::with_capacity(spec.max_pos * half);
        let mut sin = Vec::with_capacity(spec.max_pos * half);
        for p in 0..spec.max_pos {
            for freq in &freqs {
                let angle = p as f64 * freq;
                cos.push(angle.cos() as f32 * mscale);
                sin.push(angle.sin() as f32 * mscale);
            }
        }
        Self {
            head_dim: spec.head_dim,
            half,
            cos,
            sin,
            layout: spec.layout,
        }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotate every head (of width `head_dim`) in `x` for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.half;
        let (cos, sin) = (
            &self.cos[pos * half..][..half],
            &self.sin[pos * half..][..half],
        );
        for head in x.chunks_exact_mut(self.head_dim) {
            match self.layout {
                RopeLayout::Adjacent => {
                    for i in 0..half {
                        rotate(head, 2 * i, 2 * i + 1, cos[i], sin[i]);
                    }
                }
                RopeLayout::Halves => {
                    for i in 0..half {
                        rotate(head, i, i + half, cos[i], sin[i]);
                    }
                }
            }
        }
    }
}

fn rotate(head: &mut [f32], a: usize, b: usize, cos: f32, sin: f32) {
    let (x, y) = (head[a], head[b]);
    head[a] = x * cos - y * sin;
    head[b] = x * sin + y * cos;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive() {
        let a: Vec<f32> = (0..19).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..19).map(|i| 1.0 - i as f32).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-3);
    }

    fn rope(layout: RopeLayout, dims: usize, divisors: Option<&[f32]>, linear: f32) -> Rope {
        Rope::new(&RopeSpec {
            head_dim: 4,
            dims,
            theta: 10_000.0,
            scaling: RopeScaling::Linear { factor: linear },
            freq_divisors: divisors,
            layout,
            max_pos: 8,
            mscale: 1.0,
        })
    }

    /// LongRoPE's attention factor scales the rotated pairs (at every
    /// position, 0 included) and leaves the unrotated tail alone.
    #[test]
    fn the_attention_factor_scales_only_the_rotated_elements() {
        let scaled = Rope::new(&RopeSpec {
            mscale: 1.5,
            ..RopeSpec {
                head_dim: 4,
                dims: 2,
                theta: 10_000.0,
                scaling: RopeScaling::None,
                freq_divisors: None,
                layout: RopeLayout::Halves,
                max_pos: 8,
                mscale: 1.0,
            }
        });
        let plain = rope(RopeLayout::Halves, 2, None, 1.0);
        for pos in [0, 3] {
            let (mut a, mut b) = (vec![1.0, 2.0, 3.0, 4.0], vec![1.0, 2.0, 3.0, 4.0]);
            scaled.apply(&mut a, pos);
            plain.apply(&mut b, pos);
            assert!((a[0] - 1.5 * b[0]).abs() < 1e-6 && (a[1] - 1.5 * b[1]).abs() < 1e-6);
            assert_eq!(a[2..], b[2..]);
        }
    }

    /// YaRN on 4 pairs (base 10,000) trained on 64 positions, stretched 4x:
    /// the ramp runs from pair 0 (it turns ~10 times in 64 positions, under
    /// `beta_fast` 32: llama.cpp's corr dims floor(-0.50) -> 0) to pair 2
    /// (ceil(1.01) for `beta_slow` 1), so pair 0 keeps its frequency, pair 1
    /// is half interpolated (0.5 / 4 + 0.5), pairs 2 and 3 are divided by 4;
    /// every rotated element scaled by 1 + 0.1 ln 4.
    #[test]
    fn yarn_interpolates_the_slow_pairs_and_keeps_the_fast_ones() {
        let yarn = Rope::new(&RopeSpec {
            head_dim: 8,
            dims: 8,
            theta: 10_000.0,
            scaling: RopeScaling::Yarn {
                factor: 4.0,
                original_context: 64,
                beta_fast: 32.0,
                beta_slow: 1.0,
                ext_factor: 1.0,
            },
            freq_divisors: None,
            layout: RopeLayout::Adjacent,
            max_pos: 200,
            mscale: 1.0,
        });
        let mscale = 1.0 + 0.1 * 4f64.ln();
        for (i, multiplier) in [1.0, 0.625, 0.25, 0.25].into_iter().enumerate() {
            let angle = 150.0 * 10_000f64.powf(-2.0 * i as f64 / 8.0) * multiplier;
            let (cos, sin) = (yarn.cos[150 * 4 + i], yarn.sin[150 * 4 + i]);
            assert!((cos as f64 - angle.cos() * mscale).abs() < 1e-5, "pair {i}");
            assert!((sin as f64 - angle.sin() * mscale).abs() < 1e-5, "pair {i}");
        }
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        // Pair 0 at angle 5 (frequency 1): (x[0], x[1]) adjacent, (x[0], x[2]) in halves.
        for (layout, partner) in [(RopeLayout::Adjacent, 2.0), (RopeLayout::Halves, 3.0)] {
            let rope = rope(layout, 4, None, 1.0);
            let mut x = vec![1.0, 2.0, 3.0, 4.0];
            rope.apply(&mut x, 0);
            assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
            rope.apply(&mut x, 5);
            assert!((dot(&x, &x) - 30.0).abs() < 1e-4);
            assert!(
                (x[0] - (5f32.cos() - partner * 5f32.sin())).abs() < 1e-5,
                "{layout:?}"
            );
        }
    }

    #[test]
    fn scaling_slows_the_turn_and_partial_rotary_leaves_the_tail() {
        let turned = |rope: &Rope, pos| {
            let mut x = vec![1.0, 0.0, 0.0, 0.0];
            rope.apply(&mut x, pos);
            x
        };
        // Pair 0 at position 6 divided by 2 (linear) or by its divisor: angle 3.
        let plain = turned(&rope(RopeLayout::Adjacent, 4, None, 1.0), 3);
        assert_eq!(turned(&rope(RopeLayout::Adjacent, 4, None, 2.0), 6), plain);
        assert_eq!(
            turned(&rope(RopeLayout::Adjacent, 4, Some(&[2.0, 1.0]), 1.0), 6),
            plain
        );
        // Two of four elements rotate: pair (0, 1); elements 2 and 3 pass through.
        let partial = rope(RopeLayout::Halves, 2, None, 1.0);
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        partial.apply(&mut x, 5);
        assert_eq!(&x[2..], &[3.0, 4.0]);
        assert!((x[0] - (5f32.cos() - 2.0 * 5f32.sin())).abs() < 1e-5);
    }
}
