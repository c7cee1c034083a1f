//! The AVX-512 kernel (F, BW, VL and VNNI): the AVX2 kernel's tiles and scale
//! step, with the integer dot products in 512-bit `vpdpbusd`, which multiplies
//! 64 byte pairs and adds them in quads into i32 lanes in one instruction where
//! AVX2 needs maddubs, a 16-bit add and madd for 32. Each register holds two of
//! `layout`'s 32-byte vectors; adding its halves at the end leaves the same
//! eight block lanes the AVX2 kernel scales, so the scale step is unchanged.

use std::arch::x86_64::*;

use super::layout::{BLOCK, GROUP};
use super::store::{Acts, QWeight, Quants};
use super::x86_tiles::{ahead, load8, prefetch, q6_rows, x86_tile};

x86_tile!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    wide: (4, 4),
    wide_q6: (4, 2)
);

/// The eight block lanes of a register holding two 32-byte vectors' sums.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
unsafe fn fold<const R: usize, const C: usize>(sums: [[__m512i; C]; R]) -> [[__m256i; C]; R] {
    let mut out = [[_mm256_setzero_si256(); C]; R];
    for (o, s) in out.iter_mut().zip(&sums) {
        for (o, s) in o.iter_mut().zip(s) {
            *o = _mm256_add_epi32(
                _mm512_castsi512_si256(*s),
                _mm512_extracti64x4_epi64::<1>(*s),
            );
        }
    }
    out
}

/// Integer dot products of a run of `g` blocks of 4-bit weights (unsigned, the
/// first operand of `vpdpbusd`) with the signed activations, one i32 lane per
/// block quarter (see `layout::kernel_order`); sums are 32-bit throughout.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
#[inline]
unsafe fn dots_q4<const R: usize, const C: usize>(
    qs: &[u8],
    a: &Acts,
    k: usize,
    r0: usize,
    c0: usize,
    start: usize,
    g: usize,
) -> [[__m256i; C]; R] {
    // Closures would not inherit this function's target features, so rows
    // are addressed by plain offsets.
    let wrow = qs.as_ptr().add(c0 * k / 2 + start * BLOCK / 2);
    let arow = a.qs.as_ptr().add(r0 * k + start * BLOCK);
    if g == 1 {
        // 16 bytes, GGML's layout: element `j` low, `j + 16` high; one vector.
        let low4 = _mm256_set1_epi8(0x0f);
        let mut wv = [_mm256_setzero_si256(); C];
        for (j, wv) in wv.iter_mut().enumerate() {
            let raw = _mm_loadu_si128(wrow.add(j * k / 2).cast());
            *wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
        }
        let mut sums = [[_mm256_setzero_si256(); C]; R];
        for (i, sums) in sums.iter_mut().enumerate() {
            let av = _mm256_loadu_si256(arow.add(i * k).cast());
            for j in 0..C {
                sums[j] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv[j], av);
            }
        }
        return sums;
    }
    let low4 = _mm512_set1_epi8(0x0f);
    let mut sums = [[_mm512_setzero_si512(); C]; R];
    if g == 2 {
        // One 32-byte pair: vector 0 in the low nibbles, vector 1 in the high.
        let mut wv = [_mm512_setzero_si512(); C];
        for (j, wv) in wv.iter_mut().enumerate() {
            prefetch(wrow.wrapping_add(j * k / 2 + ahead(C, k / 2)));
            let raw = _mm256_loadu_si256(wrow.add(j * k / 2).cast());
            let both =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4));
            *wv = _mm512_and_si512(both, low4);
        }
        for (i, sums) in sums.iter_mut().enumerate() {
            let av = _mm512_loadu_si512(arow.add(i * k).cast());
            for j in 0..C {
                sums[j] = _mm512_dpbusd_epi32(sums[j], wv[j], av);
            }
        }
    } else {
        // 64 bytes hold vectors 4q..4q + 4: the low nibbles (4q, 4q + 1),
        // the high ones (4q + 2, 4q + 3), as the activations are stored.
        for quad in 0..g / 4 {
            let mut w0 = [_mm512_setzero_si512(); C];
            let mut w1 = [_mm512_setzero_si512(); C];
            for j in 0..C {
                let at = j * k / 2 + quad * 2 * BLOCK;
                prefetch(wrow.wrapping_add(at + ahead(C, k / 2)));
                let raw = _mm512_loadu_si512(wrow.add(at).cast());
                w0[j] = _mm512_and_si512(raw, low4);
                w1[j] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low4);
            }
            for (i, sums) in sums.iter_mut().enumerate() {
                let a0 = _mm512_loadu_si512(arow.add(i * k + quad * 4 * BLOCK).cast());
                let a1 = _mm512_loadu_si512(arow.add(i * k + quad * 4 * BLOCK + 2 * BLOCK).cast());
                for j in 0..C {
                    sums[j] =
                        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[j], w0[j], a0), w1[j], a1);
                }
            }
        }
    }
    fold(sums)
}

/// Integer dot products of a run of `g` blocks of 8-bit weights, one i32 lane
/// per block quarter. `vpdpbusd` needs one unsigned operand: `|w|` times `a`
/// with `w`'s sign (`|w|, |a| <= 127`, so negating never overflows).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
#[inline]
unsafe fn dots_q8<const R: usize, const C: usize>(
    qs: &[i8],
    a: &Acts,
    k: usize,
    r0: usize,
    c0: usize,
    start: usize,
    g: usize,
) -> [[__m256i; C]; R] {
    let at = start * BLOCK;
    if g == 1 {
        let mut wv = [_mm256_setzero_si256(); C];
        for (j, wv) in wv.iter_mut().enumerate() {
            *wv = _mm256_loadu_si256(qs.as_ptr().add((c0 + j) * k + at).cast());
        }
        let mut sums = [[_mm256_setzero_si256(); C]; R];
        for (i, sums) in sums.iter_mut().enumerate() {
            let av = _mm256_loadu_si256(a.qs.as_ptr().add((r0 + i) * k + at).cast());
            for j in 0..C {
                let signed = _mm256_sign_epi8(av, wv[j]);
                sums[j] =
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(wv[j]), signed);
            }
        }
        return sums;
    }
    let zero = _mm512_setzero_si512();
    let mut sums = [[zero; C]; R];
    for v in (0..g).step_by(2) {
        let at = at + v * BLOCK;
        let mut wabs = [zero; C];
        let mut neg = [0 as __mmask64; C];
        for j in 0..C {
            let wp = qs.as_ptr().add((c0 + j) * k + at);
            prefetch(wp.wrapping_add(ahead(C, k)));
            let wv = _mm512_loadu_si512(wp.cast());
            wabs[j] = _mm512_abs_epi8(wv);
            neg[j] = _mm512_movepi8_mask(wv);
        }
        for (i, sums) in sums.iter_mut().enumerate() {
            let av = _mm512_loadu_si512(a.qs.as_ptr().add((r0 + i) * k + at).cast());
            for j in 0..C {
                let signed = _mm512_mask_sub_epi8(av, neg[j], zero, av);
                sums[j] = _mm512_dpbusd_epi32(sums[j], wabs[j], signed);
            }
        }
    }
    fold(sums)
}

/// Integer dot products of a group of eight blocks of 6-bit weights (values
/// `0..64`, unsigned for `vpdpbusd`), per half of the blocks: the first
/// quad of vectors holds each block's first 16 values, the second quad its
/// last 16 (see `layout::pack_q6`). Each starts from the activations'
/// `-32` offset, so the sums are the weights' signed ones.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
#[inline]
unsafe fn dots_q6<const R: usize, const C: usize>(
    lo: &[u8],
    hi: &[u8],
    a: &Acts,
    k: usize,
    r0: usize,
    c0: usize,
    group: usize,
) -> [[[__m256i; C]; R]; 2] {
    let (lrow, hrow, arow) = q6_rows((lo, hi), a, (k, r0, c0, group));
    let low4 = _mm512_set1_epi8(0x0f);
    let pair = _mm512_set1_epi8(0x30);
    // Shifts (per 16-bit lane; the mask drops what crosses bytes) that bring
    // the pairs of vectors (v0, v1) and (v2, v3) to bits 4 and 5: the low
    // 256 bits by the first count, the high by the second.
    let by_two = _mm256_set1_epi16(2);
    let up = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_set1_epi16(4)), by_two);
    let down = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), by_two);
    // `a | (b & c)`.
    const OR_MASKED: i32 = 0xF8;
    let mut sums = [[[_mm512_setzero_si512(); C]; R]; 2];
    for (quad, sums) in sums.iter_mut().enumerate() {
        for (i, sums) in sums.iter_mut().enumerate() {
            let offsets = a
                .q6_offsets
                .as_ptr()
                .add((2 * (r0 + i) + quad) * a.nbp + group);
            *sums = [_mm512_zextsi256_si512(load8(offsets)); C];
        }
        let mut w0 = [_mm512_setzero_si512(); C];
        let mut w1 = [_mm512_setzero_si512(); C];
        for j in 0..C {
            let (lp, hp) = (
                lrow.add(j * k / 2 + quad * 2 * BLOCK),
                hrow.add(j * k / 4 + quad * BLOCK),
            );
            prefetch(lp.wrapping_add(ahead(C, k / 2)));
            prefetch(hp.wrapping_add(ahead(C, k / 4)));
            let nibbles = _mm512_loadu_si512(lp.cast());
            let pairs = _mm512_broadcast_i64x4(_mm256_loadu_si256(hp.cast()));
            w0[j] = _mm512_ternarylogic_epi32::<OR_MASKED>(
                _mm512_and_si512(nibbles, low4),
                _mm512_sllv_epi16(pairs, up),
                pair,
            );
            w1[j] = _mm512_ternarylogic_epi32::<OR_MASKED>(
                _mm512_and_si512(_mm512_srli_epi16::<4>(nibbles), low4),
                _mm512_srlv_epi16(pairs, down),
                pair,
            );
        }
        for (i, sums) in sums.iter_mut().enumerate() {
            let at = arow.add(i * k + quad * 4 * BLOCK);
            let (a0, a1) = (
                _mm512_loadu_si512(at.cast()),
                _mm512_loadu_si512(at.add(2 * BLOCK).cast()),
            );
            for j in 0..C {
                sums[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[j], w0[j], a0), w1[j], a1);
            }
        }
    }
    let [first, second] = sums;
    [fold(first), fold(second)]
}
