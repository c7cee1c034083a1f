//! Cephes' single-precision `exp` polynomial, eight lanes at a time with
//! AVX2 and FMA: attention's softmax and the SiLU gate share it.

use std::arch::x86_64::*;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// Inputs are clamped here first (the result of `exp(-87.3)` is ~1e-38).
const LO: f32 = -87.3;
const HI: f32 = 88.0;

/// `exp` of each lane (inputs clamped to `LO..HI`).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
    let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(LN2_LO), r);
    let mut y = _mm256_set1_ps(P[0]);
    for &p in &P[1..] {
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
