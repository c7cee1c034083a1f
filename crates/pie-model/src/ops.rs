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

/// Rotary embedding tables: for position `p` and pair `i`, the angle is
/// `p * theta^(-2i / head_dim)`; which elements pair up is the
/// architecture's [`RopeLayout`].
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    layout: RopeLayout,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f32, max_pos: usize, layout: RopeLayout) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for i in 0..half {
                let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64);
                let angle = p as f64 * freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self {
            half,
            cos,
            sin,
            layout,
        }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.len() / self.half
    }

    /// Rotate every head (of width `2 * half`) in `x` for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let (cos, sin) = (
            &self.cos[pos * self.half..][..self.half],
            &self.sin[pos * self.half..][..self.half],
        );
        let half = self.half;
        for head in x.chunks_exact_mut(2 * half) {
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

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        // Pair 0 at angle 5 (frequency 1): (x[0], x[1]) adjacent, (x[0], x[2]) in halves.
        for (layout, partner) in [(RopeLayout::Adjacent, 2.0), (RopeLayout::Halves, 3.0)] {
            let rope = Rope::new(4, 10_000.0, 8, layout);
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
}
