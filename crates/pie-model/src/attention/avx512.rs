//! The AVX-512F kernel: sixteen lanes per register for the dot products, the
//! widening and the accumulation (the exponentials are AVX2's).

use std::arch::x86_64::*;

use super::avx2::{exponentials, hsum, hsum8};
use super::softmax::Stat;
use crate::ops::softcap;

#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn half_sum(a: __m512) -> __m256 {
    _mm256_add_ps(
        _mm512_castps512_ps256(a),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
    )
}

/// `Kernel::widen` sixteen lanes at a time (`hd` a multiple of 16).
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn widen(src: &[u16], stride: usize, hd: usize, slots: usize, dst: &mut [f32]) {
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    for j in 0..slots {
        for d in (0..hd).step_by(16) {
            let h = _mm256_loadu_si256(sp.add(j * stride + d) as *const __m256i);
            _mm512_storeu_ps(dp.add(j * hd + d), _mm512_cvtph_ps(h));
        }
    }
}

/// `acc[..16N] = acc * alpha + sum_j p[j] * v_j`, N registers wide, even and
/// odd keys in separate registers (twice the independent chains).
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn accumulate<const N: usize>(
    acc: *mut f32,
    v: *const f32,
    stride: usize,
    p: &[f32],
    alpha: f32,
) {
    let mut a = [_mm512_setzero_ps(); N];
    let mut b = [_mm512_setzero_ps(); N];
    let mut pairs = p.chunks_exact(2);
    let mut vj = v;
    for pp in &mut pairs {
        let (p0, p1) = (_mm512_set1_ps(pp[0]), _mm512_set1_ps(pp[1]));
        let v1 = vj.add(stride);
        for r in 0..N {
            a[r] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vj.add(16 * r)), a[r]);
            b[r] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1.add(16 * r)), b[r]);
        }
        vj = vj.add(2 * stride);
    }
    if let [p0] = pairs.remainder() {
        let p0 = _mm512_set1_ps(*p0);
        for (r, a) in a.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vj.add(16 * r)), *a);
        }
    }
    let al = _mm512_set1_ps(alpha);
    for r in 0..N {
        let old = _mm512_loadu_ps(acc.add(16 * r));
        let old = if alpha != 1.0 {
            _mm512_mul_ps(old, al)
        } else {
            old
        };
        _mm512_storeu_ps(
            acc.add(16 * r),
            _mm512_add_ps(old, _mm512_add_ps(a[r], b[r])),
        );
    }
}

/// `kernel.rs`'s `portable` with 16-lane registers: eight keys' dot products at a
/// time, the exponentials eight lanes at a time.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn span_step(
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
    let (qp, kp, sp) = (q.as_ptr(), k.as_ptr(), s.as_mut_ptr());
    let mut j = 0;
    while j + 8 <= n {
        let mut a = [_mm512_setzero_ps(); 8];
        for d in (0..hd).step_by(16) {
            let qv = _mm512_loadu_ps(qp.add(d));
            for (t, a) in a.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kp.add((j + t) * stride + d)), *a);
            }
        }
        let h = [
            half_sum(a[0]),
            half_sum(a[1]),
            half_sum(a[2]),
            half_sum(a[3]),
            half_sum(a[4]),
            half_sum(a[5]),
            half_sum(a[6]),
            half_sum(a[7]),
        ];
        _mm256_storeu_ps(sp.add(j), _mm256_mul_ps(hsum8(h), _mm256_set1_ps(scale)));
        j += 8;
    }
    while j < n {
        let mut a = _mm512_setzero_ps();
        for d in (0..hd).step_by(16) {
            a = _mm512_fmadd_ps(
                _mm512_loadu_ps(qp.add(d)),
                _mm512_loadu_ps(kp.add(j * stride + d)),
                a,
            );
        }
        *sp.add(j) = hsum(half_sum(a)) * scale;
        j += 1;
    }
    if let Some(cap) = cap {
        // SAFETY: `sp` is `s`'s start, and `s` holds at least `n` scores.
        softcap(std::slice::from_raw_parts_mut(sp, n), cap);
    }
    // Eight lanes here: the scores were stored eight at a time.
    let alpha = exponentials(sp, n, st);
    let (ap, vp, p) = (acc.as_mut_ptr(), v.as_ptr(), &s[..n]);
    let mut d = 0;
    while d + 64 <= hd {
        accumulate::<4>(ap.add(d), vp.add(d), stride, p, alpha);
        d += 64;
    }
    while d < hd {
        accumulate::<1>(ap.add(d), vp.add(d), stride, p, alpha);
        d += 16;
    }
}
