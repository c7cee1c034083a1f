//! Linear layers without activation quantisation: the weights dequantised to
//! f32 (once per matrix, kept) times f32 activations. Slow and four times the
//! weights' memory; it exists to measure what a change does by itself
//! (`Model::with_float_activations`): with 8-bit activations a last-bit change
//! anywhere flips some quanta, and the logits move by the quantisation's own
//! noise, whatever caused it (see `pie-worker/tests/kv_dtype.rs`).

use rayon::prelude::*;

use super::layout::BLOCK;
use super::layout::{unpack_q6, unpack_row_q4};
use super::store::{Out, QWeight, Quants};
use crate::ops::dot;

impl QWeight {
    /// `x (rows x k_in) @ self^T` in f32, row-major `rows x n`.
    pub(crate) fn forward_float(&self, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k_in, "activation size");
        let w = self.float.get_or_init(|| self.dequantize());
        let mut out = vec![0f32; rows * self.n];
        let dst = Out {
            ptr: out.as_mut_ptr(),
            stride: self.n,
        };
        w.par_chunks_exact(self.k_in)
            .enumerate()
            .for_each(|(c, wc)| {
                for (r, xr) in x.chunks_exact(self.k_in).enumerate() {
                    // SAFETY: `out` holds `rows x n`, outlives the loop, and
                    // each task writes only its own column `c`.
                    unsafe { dst.set(r, c, dot(wc, xr)) };
                }
            });
        out
    }

    /// Every weight as f32, row-major `n x k_in`, in the elements' own order.
    fn dequantize(&self) -> Vec<f32> {
        let (k, nbp) = (self.k, self.padded_blocks());
        let mut w = vec![0f32; self.n * self.k_in];
        let mut q = vec![0i32; k];
        for (c, row) in w.chunks_exact_mut(self.k_in).enumerate() {
            match &self.quants {
                Quants::Q8 { qs } => {
                    for (q, &v) in q.iter_mut().zip(&qs[c * k..][..k]) {
                        *q = v as i32;
                    }
                }
                Quants::Q4 { qs, .. } => unpack_row_q4(&qs[c * k / 2..][..k / 2], &mut q),
                Quants::Q6 { lo, hi, .. } => {
                    let (lo, hi) = (&lo[c * k / 2..][..k / 2], &hi[c * k / 4..][..k / 4]);
                    for (pos, q) in q.iter_mut().enumerate() {
                        *q = unpack_q6(lo, hi, pos) as i32 - 32;
                    }
                }
            }
            for (&e, &q) in self.order.iter().zip(&q) {
                let e = e as usize;
                if e >= self.k_in {
                    continue;
                }
                let b = c * nbp + e / BLOCK;
                let d = self.d.get(b);
                row[e] = match &self.quants {
                    Quants::Q8 { .. } => d * q as f32,
                    Quants::Q4 { m, .. } => d * q as f32 + m.get(b),
                    Quants::Q6 { d_hi, .. } if e % BLOCK >= BLOCK / 2 => d_hi.get(b) * q as f32,
                    Quants::Q6 { .. } => d * q as f32,
                };
            }
        }
        w
    }
}
