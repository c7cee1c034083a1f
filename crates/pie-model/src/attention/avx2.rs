//! The AVX2+FMA kernel (F16C for widening): eight keys' dot products and
//! eight exponentials at a time.

use std::arch::x86_64::*;

use super::expf;
use super::softmax::Stat;
use crate::ops::softcap;

/// Eight accumulators summed lane-wise: lane `t` of the result is the sum of
/// `a[t]`'s lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn hsum8(a: [__m256; 8]) -> __m256 {
    let h01 = _mm256_hadd_ps(a[0], a[1]);
    let h23 = _mm256_hadd_ps(a[2], a[3]);
    let h45 = _mm256_hadd_ps(a[4], a[5]);
    let h67 = _mm256_hadd_ps(a[6], a[7]);
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(h0123, h4567),
        _mm256_permute2f128_ps::<0x31>(h0123, h4567),
    )
}

#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(expf::LO)),
        _mm256_set1_ps(expf::HI),
    );
    let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(expf::LOG2E),
    ));
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(expf::LN2_HI), x);
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(expf::LN2_LO), r);
    let mut y = _mm256_set1_ps(expf::P[0]);
    for &p in &expf::P[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(p));
    }
    let y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    let y = _mm256_add_ps(y, _mm256_set1_ps(1.0));
    let pow = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(fx),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow))
}

/// `Kernel::widen` eight lanes at a time (`hd` a multiple of 8).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn widen(src: &[u16], stride: usize, hd: usize, slots: usize, dst: &mut [f32]) {
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    for j in 0..slots {
        for d in (0..hd).step_by(8) {
            let h = _mm_loadu_si128(sp.add(j * stride + d) as *const __m128i);
            _mm256_storeu_ps(dp.add(j * hd + d), _mm256_cvtph_ps(h));
        }
    }
}

/// All ones in the lanes below `n` (`n < 8`).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn lanes_below(n: usize) -> __m256 {
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx))
}

/// `acc[d..d + 8N] = acc * alpha + sum_j p[j] * v_j`, N registers wide.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn accumulate<const N: usize>(
    acc: *mut f32,
    v: *const f32,
    stride: usize,
    p: &[f32],
    alpha: f32,
) {
    let mut a = [_mm256_setzero_ps(); N];
    for (r, a) in a.iter_mut().enumerate() {
        *a = _mm256_loadu_ps(acc.add(8 * r));
    }
    if alpha != 1.0 {
        let al = _mm256_set1_ps(alpha);
        for a in &mut a {
            *a = _mm256_mul_ps(*a, al);
        }
    }
    for (j, &p) in p.iter().enumerate() {
        let pj = _mm256_set1_ps(p);
        let vj = v.add(j * stride);
        for (r, a) in a.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj.add(8 * r)), *a);
        }
    }
    for (r, a) in a.iter().enumerate() {
        _mm256_storeu_ps(acc.add(8 * r), *a);
    }
}

/// The sum of `exp(x - max)` over `xs`, eight lanes at a time.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn sum_exp(xs: &[f32], max: f32) -> f32 {
    let mv = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let (chunks, rest) = xs.as_chunks::<8>();
    for c in chunks {
        acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv)));
    }
    hsum(acc) + rest.iter().map(|x| (x - max).exp()).sum::<f32>()
}

/// The scores `s[..n]` to `exp(s - m)` in place, `m` the new running maximum;
/// updates `st` and returns the factor the accumulator is rescaled by.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn exponentials(sp: *mut f32, n: usize, st: &mut Stat) -> f32 {
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    for j in (0..n).step_by(8) {
        let x = _mm256_loadu_ps(sp.add(j));
        let x = if n - j < 8 {
            _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), x, lanes_below(n - j))
        } else {
            x
        };
        mx = _mm256_max_ps(mx, x);
    }
    let m = st.m.max(hmax(mx));
    let alpha = if m == st.m { 1.0 } else { (st.m - m).exp() };
    let mv = _mm256_set1_ps(m);
    let mut sum = _mm256_setzero_ps();
    for j in (0..n).step_by(8) {
        let mut e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp.add(j)), mv));
        if n - j < 8 {
            e = _mm256_and_ps(e, lanes_below(n - j));
        }
        _mm256_storeu_ps(sp.add(j), e);
        sum = _mm256_add_ps(sum, e);
    }
    st.l = st.l * alpha + hsum(sum);
    st.m = m;
    alpha
}

/// `kernel.rs`'s `portable` with eight keys' dot products at a time and the
/// exponentials eight lanes at a time.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
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
        let mut a = [_mm256_setzero_ps(); 8];
        for d in (0..hd).step_by(8) {
            let qv = _mm256_loadu_ps(qp.add(d));
            for (t, a) in a.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add((j + t) * stride + d)), *a);
            }
        }
        _mm256_storeu_ps(sp.add(j), _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
        j += 8;
    }
    while j < n {
        let mut a = _mm256_setzero_ps();
        for d in (0..hd).step_by(8) {
            a = _mm256_fmadd_ps(
                _mm256_loadu_ps(qp.add(d)),
                _mm256_loadu_ps(kp.add(j * stride + d)),
                a,
            );
        }
        *sp.add(j) = hsum(a) * scale;
        j += 1;
    }
    if let Some(cap) = cap {
        // SAFETY: `sp` is `s`'s start, and `s` holds at least `n` scores.
        softcap(std::slice::from_raw_parts_mut(sp, n), cap);
    }
    let alpha = exponentials(sp, n, st);
    let (ap, vp, p) = (acc.as_mut_ptr(), v.as_ptr(), &s[..n]);
    let mut d = 0;
    while d + 64 <= hd {
        accumulate::<8>(ap.add(d), vp.add(d), stride, p, alpha);
        d += 64;
    }
    while d < hd {
        accumulate::<1>(ap.add(d), vp.add(d), stride, p, alpha);
        d += 8;
    }
}
