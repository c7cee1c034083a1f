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

    /// The heads of one row that share a KV head (`st.len()` of them,
    /// `q` and `acc` a row of `hd` floats each) against `n` consecutive keys
    /// of a span: `k` and `v` start at the first key, keys `stride` floats
    /// apart. Updates each head's running state and accumulator; `scratch`
    /// holds a row of `n` rounded up to 16 floats per head. Each head's
    /// result is the same bits however many there are: the AVX-512 kernel
    /// steps them in pairs only to share their K and V loads (three
    /// at once measured slower: the accumulators no longer fit the registers).
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
        st: &mut [Stat],
        acc: &mut [f32],
        scratch: &mut [f32],
    ) {
        let heads = st.len();
        let hd = acc.len() / heads.max(1);
        let pad = n.next_multiple_of(16);
        let (scale, cap) = (scoring.scale, scoring.softcap);
        assert!(heads >= 1 && acc.len() == heads * hd && q.len() == heads * hd);
        assert!(scratch.len() >= heads * pad);
        assert!(n >= 1 && k.len() >= (n - 1) * stride + hd && v.len() >= (n - 1) * stride + hd);
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                assert!(hd.is_multiple_of(16), "AVX-512 heads are whole registers");
                for h0 in (0..heads).step_by(2) {
                    let m = 2.min(heads - h0);
                    let (q, st) = (q[h0 * hd..].as_ptr(), &mut st[h0..h0 + m]);
                    let (acc, s) = (
                        acc[h0 * hd..].as_mut_ptr(),
                        scratch[h0 * pad..].as_mut_ptr(),
                    );
                    let (kp, vp) = (k.as_ptr(), v.as_ptr());
                    macro_rules! step {
                        ($q:literal) => {
                            avx512::span_step::<$q>(
                                q,
                                hd,
                                kp,
                                vp,
                                stride,
                                n,
                                scale,
                                cap,
                                st.try_into().expect("a state per head"),
                                acc,
                                s,
                                pad,
                            )
                        };
                    }
                    // SAFETY: `detect`/`available` checked the features, `hd` is a
                    // multiple of 16, the slices were checked above, and `st`
                    // holds `m` states.
                    unsafe {
                        match m {
                            1 => step!(1),
                            _ => step!(2),
                        }
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                for (h, st) in st.iter_mut().enumerate() {
                    let (q, acc) = (&q[h * hd..][..hd], &mut acc[h * hd..][..hd]);
                    let s = &mut scratch[h * pad..][..pad];
                    // SAFETY: as above, for AVX2 and FMA and a multiple of 8.
                    unsafe { avx2::span_step(q, k, v, stride, n, scale, cap, st, acc, s) }
                }
            }
            Kernel::Portable => {
                for (h, st) in st.iter_mut().enumerate() {
                    let (q, acc) = (&q[h * hd..][..hd], &mut acc[h * hd..][..hd]);
                    let s = &mut scratch[h * pad..][..pad];
                    portable(q, k, v, stride, n, scale, cap, st, acc, s)
                }
            }
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

    /// Heads stepped together (one to six: alone, in pairs, and a pair
    /// with one more) give each the bits a step of its own gives, from a running
    /// state, with and without a soft cap, for key counts around the
    /// eight-key blocks.
    #[test]
    fn heads_stepped_together_step_as_each_alone() {
        let mut x = 1u32;
        let mut rand = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (x >> 8) as f32 / (1 << 23) as f32 - 1.0
                })
                .collect()
        };
        let kernels = [
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2,
            Kernel::Portable,
        ];
        for (kernel, hd) in kernels
            .into_iter()
            .flat_map(|k| [16, 64, 80, 128].map(|h| (k, h)))
        {
            if !kernel.available(hd) {
                eprintln!("SKIPPED: {kernel:?} attention kernel not tested for head dim {hd}");
                continue;
            }
            let cases = [
                (1, None),
                (7, Some(1.5)),
                (8, None),
                (13, None),
                (32, Some(2.0)),
            ];
            for (heads, (n, cap)) in (1..=6).flat_map(|h| cases.map(|c| (h, c))) {
                let scoring = Scoring {
                    scale: 0.7,
                    softcap: cap,
                    window: None,
                };
                let (q, k, v) = (rand(heads * hd), rand(n * hd), rand(n * hd));
                let start = rand(heads * hd);
                let st0: Vec<Stat> = (0..heads)
                    .map(|h| Stat {
                        m: 0.4 - 0.3 * h as f32,
                        l: 1.5,
                    })
                    .collect();
                let pad = n.next_multiple_of(16);
                let (mut sts, mut acc, mut scratch) =
                    (st0.clone(), start.clone(), vec![0.0; heads * pad]);
                kernel.span_step(&q, &k, &v, hd, n, scoring, &mut sts, &mut acc, &mut scratch);
                for h in 0..heads {
                    let (mut st, mut alone) = ([st0[h]], start[h * hd..][..hd].to_vec());
                    let qh = &q[h * hd..][..hd];
                    kernel.span_step(
                        qh,
                        &k,
                        &v,
                        hd,
                        n,
                        scoring,
                        &mut st,
                        &mut alone,
                        &mut scratch,
                    );
                    let what = format!("{kernel:?}, {heads} heads of {hd}, {n} keys, head {h}");
                    assert_eq!(alone, acc[h * hd..][..hd], "{what}");
                    assert_eq!((st[0].m, st[0].l), (sts[h].m, sts[h].l), "{what}");
                    assert_ne!(
                        alone,
                        start[h * hd..][..hd],
                        "{what}: the step changed nothing"
                    );
                }
            }
        }
    }
}
