//! The per-(query, span) step of the online softmax and the widening of f16
//! pages: `Kernel` chosen once per call from the CPU's features and the head
//! size, dispatching to AVX-512F, AVX2+FMA(+F16C) or the portable code here.

use crate::ops::{axpy, dot, softcap};

use super::softmax::{Scoring, Stat};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};

/// Which implementation of the per-page step runs, chosen once per call from the
/// CPU's features and the head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

/// The sum of `exp(x - max)` over `xs` (a log-softmax's denominator), with
/// the vector `exp` where the CPU has AVX2.
pub(crate) fn sum_exp(xs: &[f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if Kernel::Avx2.available(8) {
        // SAFETY: `available` checked AVX2 and FMA.
        return unsafe { avx2::sum_exp(xs, max) };
    }
    xs.iter().map(|x| (x - max).exp()).sum()
}

impl Kernel {
    pub(crate) fn detect(head_dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        for k in [Kernel::Avx512, Kernel::Avx2] {
            if k.available(head_dim) {
                return k;
            }
        }
        Kernel::Portable
    }

    /// Whether this CPU can run the kernel for heads of `head_dim`.
    pub(crate) fn available(self, head_dim: usize) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                head_dim.is_multiple_of(16)
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                head_dim.is_multiple_of(8)
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            Kernel::Portable => true,
        }
    }

    /// The first `hd` values of `slots` rows of f16 bits, `stride` apart in
    /// `src`, widened to f32 into `dst`, rows `hd` apart.
    pub(super) fn widen(
        self,
        src: &[u16],
        stride: usize,
        hd: usize,
        slots: usize,
        dst: &mut [f32],
    ) {
        assert!(slots >= 1 && src.len() >= (slots - 1) * stride + hd && dst.len() >= slots * hd);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available` checked AVX-512F and that `hd` is a multiple of
            // 16; the slices were checked above.
            Kernel::Avx512 => unsafe { avx512::widen(src, stride, hd, slots, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for F16C and a multiple of 8.
            Kernel::Avx2 => unsafe { avx2::widen(src, stride, hd, slots, dst) },
            Kernel::Portable => {
                for (j, row) in dst.chunks_exact_mut(hd).take(slots).enumerate() {
                    for (d, x) in row.iter_mut().zip(&src[j * stride..][..hd]) {
                        *d = half::f16::from_bits(*x).to_f32();
                    }
                }
            }
        }
    }

    /// One query against `n` consecutive keys of a span: `k` and `v` start at
    /// the first key, keys `stride` floats apart. Updates the running
    /// state `st` and accumulator `acc` (the query's length); `scratch` holds at
    /// least `n` rounded up to 16 floats.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn span_step(
        self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        stride: usize,
        n: usize,
        scoring: Scoring,
        st: &mut Stat,
        acc: &mut [f32],
        scratch: &mut [f32],
    ) {
        let hd = q.len();
        let (scale, cap) = (scoring.scale, scoring.softcap);
        assert!(n >= 1 && acc.len() == hd && scratch.len() >= n.next_multiple_of(16));
        assert!(k.len() >= (n - 1) * stride + hd && v.len() >= (n - 1) * stride + hd);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect`/`available` checked the features and that `hd` is a
            // multiple of 16; the slices were checked above.
            Kernel::Avx512 => unsafe {
                avx512::span_step(q, k, v, stride, n, scale, cap, st, acc, scratch)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2 and FMA and a multiple of 8.
            Kernel::Avx2 => unsafe {
                avx2::span_step(q, k, v, stride, n, scale, cap, st, acc, scratch)
            },
            Kernel::Portable => portable(q, k, v, stride, n, scale, cap, st, acc, scratch),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn portable(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    stride: usize,
    n: usize,
    scale: f32,
    cap: Option<f32>,
    st: &mut Stat,
    acc: &mut [f32],
    s: &mut [f32],
) {
    let hd = q.len();
    for (j, s) in s[..n].iter_mut().enumerate() {
        *s = dot(q, &k[j * stride..][..hd]) * scale;
    }
    if let Some(cap) = cap {
        softcap(&mut s[..n], cap);
    }
    let m = s[..n].iter().fold(st.m, |a, &b| a.max(b));
    let alpha = if m == st.m { 1.0 } else { (st.m - m).exp() };
    let mut sum = 0.0;
    for s in &mut s[..n] {
        *s = (*s - m).exp();
        sum += *s;
    }
    st.l = st.l * alpha + sum;
    st.m = m;
    if alpha != 1.0 {
        acc.iter_mut().for_each(|a| *a *= alpha);
    }
    for (j, &p) in s[..n].iter().enumerate() {
        axpy(acc, p, &v[j * stride..][..hd]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detect_picks_the_widest_available() {
        let k = Kernel::detect(64);
        eprintln!("attention kernel on this CPU for head dim 64: {k:?}");
        assert!(k.available(64));
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512.available(64) {
            assert_eq!(k, Kernel::Avx512);
        } else if Kernel::Avx2.available(64) {
            assert_eq!(k, Kernel::Avx2);
        }
        // A head dim no vector kernel fits falls back.
        assert_eq!(Kernel::detect(12), Kernel::Portable);
    }
}
