//! The reference kernel: plain per-(row, column) dot products over the same data,
//! block by block, in the order the SIMD kernels accumulate.

use super::layout::{runs, unpack_q4};
use super::layout::{BLOCK, GROUP};
use super::store::{Acts, Out, QWeight, Quants};

/// Output columns `c0..c0 + nc` for every row of `a`, into `out`.
///
/// # Safety
/// As `Kernel::run`'s.
pub(super) unsafe fn run(w: &QWeight, a: &Acts, c0: usize, nc: usize, out: Out) {
    let (nb, nbp, k) = (w.blocks(), w.padded_blocks(), w.k);
    let runs = runs(nb);
    for r in 0..a.rows() {
        let aq = &a.qs[r * k..][..k];
        for j in 0..nc {
            let c = c0 + j;
            let weight = |pos: usize| -> i32 {
                match &w.quants {
                    Quants::Q4 { qs, .. } => unpack_q4(&qs[c * k / 2..][..k / 2], pos) as i32,
                    Quants::Q8 { qs } => qs[c * k + pos] as i32,
                }
            };
            let mut acc = 0f32;
            for &(start, g) in &runs {
                let width = BLOCK / g;
                let mut dots = [0i32; GROUP];
                for pos in start * BLOCK..(start + g) * BLOCK {
                    dots[pos % BLOCK / width] += weight(pos) * aq[pos] as i32;
                }
                for (b, dot) in (start..).zip(&dots[..g]) {
                    acc += w.d.get(c * nbp + b) * a.d[r * nbp + b] * *dot as f32;
                    if let Quants::Q4 { m, .. } = &w.quants {
                        acc += m.get(c * nbp + b) * a.s[r * nbp + b];
                    }
                }
            }
            out.set(r, j, acc);
        }
    }
}
