//! Linear layers without activation quantisation: the weights dequantised to
//! f32 (once per matrix, kept) times f32 activations. Slow and four times the
//! weights' memory; it exists to measure what a change does by itself
//! (`Model::with_float_activations`): with 8-bit activations a last-bit change
//! anywhere flips some quanta, and the logits move by the quantisation's own
//! noise, whatever caused it (see `pie-worker/tests/kv_dtype.rs`).

use rayon::prelude::*;

use super::layout::runs;
use super::{QWeight, Quants, BLOCK};
use crate::ops::dot;

impl QWeight {
    /// `x (rows x k_in) @ self^T` in f32, row-major `rows x n`.
    pub(crate) fn forward_float(&self, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k_in, "activation size");
        let w = self.float.get_or_init(|| self.dequantize());
        let cols: Vec<Vec<f32>> = w
            .par_chunks_exact(self.k_in)
            .map(|wc| x.chunks_exact(self.k_in).map(|xr| dot(wc, xr)).collect())
            .collect();
        let mut out = vec![0f32; rows * self.n];
        for (c, col) in cols.iter().enumerate() {
            for (r, v) in col.iter().enumerate() {
                out[r * self.n + c] = *v;
            }
        }
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
            }
            for (&e, &q) in self.order.iter().zip(&q) {
                let e = e as usize;
                if e >= self.k_in {
                    continue;
                }
                let b = c * nbp + e / BLOCK;
                let d = self.d[b].to_f32();
                row[e] = match &self.quants {
                    Quants::Q8 { .. } => d * q as f32,
                    Quants::Q4 { m, .. } => d * q as f32 + m[b].to_f32(),
                };
            }
        }
        w
    }
}

/// A row packed by `layout::pack_q4`, back to one value per position (kernel
/// order).
fn unpack_row_q4(row: &[u8], q: &mut [i32]) {
    let mut at = 0;
    for (start, g) in runs(q.len() / BLOCK) {
        let run = &mut q[start * BLOCK..(start + g) * BLOCK];
        if g == 1 {
            for (j, &byte) in row[at..at + 16].iter().enumerate() {
                run[j] = (byte & 0xf) as i32;
                run[j + 16] = (byte >> 4) as i32;
            }
            at += 16;
        } else {
            for pair in run.chunks_exact_mut(2 * BLOCK) {
                for (j, &byte) in row[at..at + BLOCK].iter().enumerate() {
                    pair[j] = (byte & 0xf) as i32;
                    pair[j + BLOCK] = (byte >> 4) as i32;
                }
                at += BLOCK;
            }
        }
    }
}
