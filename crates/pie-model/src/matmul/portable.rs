//! The reference kernel: plain per-(row, column) dot products over the same data,
//! block by block, in the order the SIMD kernels accumulate.

use super::layout::{runs, unpack_q4, unpack_q6};
use super::layout::{BLOCK, GROUP};
use super::store::{Acts, Out, QWeight, Quants, Scales};

/// Output columns `c0..c0 + nc` for every row of `a`, into `out`.
///
/// # Safety
/// As `Kernel::run`'s.
pub(super) unsafe fn run(w: &QWeight, a: &Acts, c0: usize, nc: usize, out: Out) {
    if let Quants::Q6 { lo, hi, d_hi } = &w.quants {
        return run_q6(w, (lo, hi, d_hi), a, c0, nc, out);
    }
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
                    Quants::Q6 { .. } => unreachable!("Q6_K weights take `run_q6`"),
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

/// [`run`] for Q6_K weights: each block's two halves dotted apart, as their
/// scales differ, each from the activations' `-32` offset.
///
/// # Safety
/// As `Kernel::run`'s.
unsafe fn run_q6(
    w: &QWeight,
    (lo, hi, d_hi): (&[u8], &[u8], &Scales),
    a: &Acts,
    c0: usize,
    nc: usize,
    out: Out,
) {
    let (nb, nbp, k) = (w.blocks(), w.padded_blocks(), w.k);
    for r in 0..a.rows() {
        let aq = &a.qs[r * k..][..k];
        for j in 0..nc {
            let c = c0 + j;
            let (lo, hi) = (&lo[c * k / 2..][..k / 2], &hi[c * k / 4..][..k / 4]);
            let offsets = &a.q6_offsets[r * 2 * nbp..][..2 * nbp];
            let mut dots: Vec<[i32; 2]> = (0..nb).map(|b| [offsets[b], offsets[nbp + b]]).collect();
            for (pos, &e) in w.order.iter().enumerate() {
                let e = e as usize;
                let q = unpack_q6(lo, hi, pos) as i32;
                dots[e / BLOCK][e % BLOCK / (BLOCK / 2)] += q * aq[pos] as i32;
            }
            let mut acc = 0f32;
            for (b, dots) in dots.iter().enumerate() {
                for (h, scales) in [&w.d, d_hi].into_iter().enumerate() {
                    acc += scales.get(c * nbp + b) * a.d[r * nbp + b] * dots[h] as f32;
                }
            }
            out.set(r, j, acc);
        }
    }
}
