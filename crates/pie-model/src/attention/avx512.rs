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

/// Per query `i`: `acc_i[..16N] = acc_i * alpha_i + sum_j p_i[j] * v_j`, N
/// registers wide, even and odd keys in separate registers (twice the
/// independent chains); each V load serves all `Q` queries.
// Indexed loops: the same register of every query, or of every key, in turn.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn accumulate<const N: usize, const Q: usize>(
    acc: [*mut f32; Q],
    v: *const f32,
    stride: usize,
    p: [*const f32; Q],
    n: usize,
    alpha: [f32; Q],
) {
    let mut a = [[_mm512_setzero_ps(); N]; Q];
    let mut b = [[_mm512_setzero_ps(); N]; Q];
    let mut vj = v;
    for j in (0..n & !1).step_by(2) {
        let mut p0 = [_mm512_setzero_ps(); Q];
        let mut p1 = [_mm512_setzero_ps(); Q];
        for i in 0..Q {
            p0[i] = _mm512_set1_ps(*p[i].add(j));
            p1[i] = _mm512_set1_ps(*p[i].add(j + 1));
        }
        let v1 = vj.add(stride);
        for r in 0..N {
            let (x0, x1) = (
                _mm512_loadu_ps(vj.add(16 * r)),
                _mm512_loadu_ps(v1.add(16 * r)),
            );
            for i in 0..Q {
                a[i][r] = _mm512_fmadd_ps(p0[i], x0, a[i][r]);
                b[i][r] = _mm512_fmadd_ps(p1[i], x1, b[i][r]);
            }
        }
        vj = vj.add(2 * stride);
    }
    if n % 2 == 1 {
        let mut p0 = [_mm512_setzero_ps(); Q];
        for i in 0..Q {
            p0[i] = _mm512_set1_ps(*p[i].add(n - 1));
        }
        for r in 0..N {
            let x0 = _mm512_loadu_ps(vj.add(16 * r));
            for i in 0..Q {
                a[i][r] = _mm512_fmadd_ps(p0[i], x0, a[i][r]);
            }
        }
    }
    for i in 0..Q {
        let al = _mm512_set1_ps(alpha[i]);
        for r in 0..N {
            let old = _mm512_loadu_ps(acc[i].add(16 * r));
            let old = if alpha[i] != 1.0 {
                _mm512_mul_ps(old, al)
            } else {
                old
            };
            _mm512_storeu_ps(
                acc[i].add(16 * r),
                _mm512_add_ps(old, _mm512_add_ps(a[i][r], b[i][r])),
            );
        }
    }
}

/// `kernel.rs`'s `portable` with 16-lane registers, for `Q` queries against
/// the same keys: eight keys' dot products at a time, each K and V load
/// shared by the queries, the exponentials eight lanes at a time. Each
/// query's arithmetic is the same, in the same order, whatever `Q` is.
///
/// Safety: the CPU has AVX-512F, AVX2 and FMA; `hd` is a multiple of 16;
/// `q` and `acc` hold `Q` rows of `hd` floats, `s` holds `Q` rows of `pad`
/// (at least `n` rounded up to 16), and `k` and `v` hold `n` rows `stride`
/// apart.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn span_step<const Q: usize>(
    q: *const f32,
    hd: usize,
    k: *const f32,
    v: *const f32,
    stride: usize,
    n: usize,
    scale: f32,
    cap: Option<f32>,
    st: &mut [Stat; Q],
    acc: *mut f32,
    s: *mut f32,
    pad: usize,
) {
    let mut qp = [q; Q];
    let mut ap = [acc; Q];
    let mut sp = [s; Q];
    for i in 0..Q {
        qp[i] = q.add(i * hd);
        ap[i] = acc.add(i * hd);
        sp[i] = s.add(i * pad);
    }
    let mut j = 0;
    while j + 8 <= n {
        let mut a = [[_mm512_setzero_ps(); 8]; Q];
        for d in (0..hd).step_by(16) {
            let mut qv = [_mm512_setzero_ps(); Q];
            for i in 0..Q {
                qv[i] = _mm512_loadu_ps(qp[i].add(d));
            }
            for t in 0..8 {
                let kv = _mm512_loadu_ps(k.add((j + t) * stride + d));
                for i in 0..Q {
                    a[i][t] = _mm512_fmadd_ps(qv[i], kv, a[i][t]);
                }
            }
        }
        for i in 0..Q {
            let mut h = [_mm256_setzero_ps(); 8];
            for t in 0..8 {
                h[t] = half_sum(a[i][t]);
            }
            _mm256_storeu_ps(sp[i].add(j), _mm256_mul_ps(hsum8(h), _mm256_set1_ps(scale)));
        }
        j += 8;
    }
    while j < n {
        let mut a = [_mm512_setzero_ps(); Q];
        for d in (0..hd).step_by(16) {
            let kv = _mm512_loadu_ps(k.add(j * stride + d));
            for i in 0..Q {
                a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qp[i].add(d)), kv, a[i]);
            }
        }
        for i in 0..Q {
            *sp[i].add(j) = hsum(half_sum(a[i])) * scale;
        }
        j += 1;
    }
    let mut alpha = [1.0; Q];
    for i in 0..Q {
        if let Some(cap) = cap {
            // SAFETY: `sp[i]` holds at least `n` scores.
            softcap(std::slice::from_raw_parts_mut(sp[i], n), cap);
        }
        // Eight lanes here: the scores were stored eight at a time.
        alpha[i] = exponentials(sp[i], n, &mut st[i]);
    }
    let p = sp.map(|s| s as *const f32);
    let mut d = 0;
    while d + 64 <= hd {
        accumulate::<4, Q>(ap.map(|a| a.add(d)), v.add(d), stride, p, n, alpha);
        d += 64;
    }
    while d < hd {
        accumulate::<1, Q>(ap.map(|a| a.add(d)), v.add(d), stride, p, n, alpha);
        d += 16;
    }
}
