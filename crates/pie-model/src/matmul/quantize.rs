//! The 8-bit block rule (`quantize_block`, for weights and activations alike),
//! and activations quantised block by block: `d = max|x| / 127`,
//! `q = round(x / d)` (halves away from zero), and `s = d * sum(q)` for the 4-bit
//! weights' minimum term. The AVX-512 version gives the same bits as the scalar
//! rule (tested on random blocks and on every tie), sixteen lanes at a time: at
//! 32 decode rows the scalar loop took about 5% of a step.

use super::layout::BLOCK;

/// Quantise 32 values to `d * q`; returns `d`. The same rule for weights and
/// activations: `d = max|x| / 127`, `q = round(x / d)`, so `|q| <= 127` (the
/// kernel's 16-bit sums rely on it).
pub(super) fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    d
}

/// Quantise `x` (whole blocks) into `q`, with each block's `d` and `s`.
pub(super) fn blocks(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F; `avx512::blocks` checks the sizes.
        return unsafe { avx512::blocks(x, q, d, s) };
    }
    scalar(x, q, d, s);
}

fn scalar(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    for (((x, q), d), s) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
        .zip(s.iter_mut())
    {
        *d = quantize_block(x, q);
        *s = *d * q.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::BLOCK;

    /// `round` as `f32::round` does it: to nearest, halves away from zero.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn round_half_away(y: __m512) -> __m512 {
        let even = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y);
        let tie = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(
            _mm512_abs_ps(_mm512_sub_ps(y, even)),
            _mm512_set1_ps(0.5),
        );
        // A tie is `n + 0.5` with `|n| < 2^22`, so `y ± 0.5` is exact.
        let sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(i32::MIN));
        let half = _mm512_castsi512_ps(_mm512_or_si512(
            sign,
            _mm512_castps_si512(_mm512_set1_ps(0.5)),
        ));
        _mm512_mask_add_ps(even, tie, y, half)
    }

    /// Sixteen values times `id`, rounded, as i32; their values `|q| <= 127`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn quanta(x: *const f32, id: __m512) -> __m512i {
        _mm512_cvttps_epi32(round_half_away(_mm512_mul_ps(_mm512_loadu_ps(x), id)))
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn blocks(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
        let n = x.len() / BLOCK;
        assert!(x.len() == n * BLOCK && q.len() == x.len() && d.len() >= n && s.len() >= n);
        for b in 0..n {
            let xp = x.as_ptr().add(b * BLOCK);
            let (lo, hi) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            // The scalar rule's arithmetic, operation for operation.
            let db = amax / 127.0;
            let id = _mm512_set1_ps(if db > 0.0 { 1.0 / db } else { 0.0 });
            let (qlo, qhi) = (quanta(xp, id), quanta(xp.add(16), id));
            let qp = q.as_mut_ptr().add(b * BLOCK);
            _mm_storeu_si128(qp.cast(), _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128(qp.add(16).cast(), _mm512_cvtepi32_epi8(qhi));
            d[b] = db;
            s[b] = db * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// A block quantiser: `x` (whole blocks) into `q`, each block's `d` and `s`.
    type Blocks = fn(&[f32], &mut [i8], &mut [f32], &mut [f32]);

    fn both(x: &[f32]) -> [(Vec<i8>, Vec<f32>, Vec<f32>); 2] {
        let n = x.len() / BLOCK;
        let run = |f: Blocks| {
            let (mut q, mut d, mut s) = (vec![0; x.len()], vec![0.0; n], vec![0.0; n]);
            f(x, &mut q, &mut d, &mut s);
            (q, d, s)
        };
        [run(scalar), run(blocks)]
    }

    /// Random blocks of every scale, zero blocks, and blocks whose every value
    /// is a tie (`n + 0.5` times the block's `d`) give the scalar rule's bits.
    #[test]
    fn blocks_match_the_scalar_rule() {
        #[cfg(target_arch = "x86_64")]
        if !is_x86_feature_detected!("avx512f") {
            eprintln!(
                "SKIPPED: AVX-512 activation quantisation not tested: this CPU lacks AVX-512F"
            );
            return;
        }
        let mut rng = StdRng::seed_from_u64(11);
        let mut x: Vec<f32> = (0..BLOCK * 4000)
            .map(|i| (rng.gen::<f32>() * 2.0 - 1.0) * 10f32.powi((i / BLOCK % 9) as i32 - 4))
            .collect();
        x[..BLOCK].fill(0.0);
        // Ties: with amax = 127 the scale is exactly 1, so `n + 0.5` stays one.
        for (b, block) in x.chunks_exact_mut(BLOCK).enumerate().skip(1).take(254) {
            block.fill(0.0);
            block[0] = 127.0;
            for (j, v) in block.iter_mut().enumerate().skip(1) {
                let n = ((b + j) % 254) as f32 - 127.0;
                *v = n + 0.5;
            }
        }
        let [want, got] = both(&x);
        assert_eq!(got, want);
        assert!(want.0.contains(&-127) && want.0.contains(&127));
    }
}
