//! The AVX2 kernel: a tile of rows times a tile of columns over rows in
//! `layout`'s order, so eight blocks' integer dot products sit side by side in
//! one register and their scales apply as one vector multiply.

use std::arch::x86_64::*;

use super::{Acts, QWeight, Quants, BLOCK, GROUP};

/// Tile shapes: four rows by two columns while four rows remain (each
/// unpacked weight vector serves four rows), then single rows by four columns.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run(w: &QWeight, a: &Acts, c0: usize, nc: usize, out: &mut [f32]) {
    let rows = out.len() / nc;
    let mut r = 0;
    while r < rows {
        let four = rows - r >= 4;
        let mut c = 0;
        while c < nc {
            let o = &mut out[r * nc + c..];
            c += match (four, nc - c) {
                (true, 2..) => tile::<4, 2>(w, a, r, c0 + c, o, nc),
                (true, _) => tile::<4, 1>(w, a, r, c0 + c, o, nc),
                (false, 4..) => tile::<1, 4>(w, a, r, c0 + c, o, nc),
                (false, _) => tile::<1, 1>(w, a, r, c0 + c, o, nc),
            };
        }
        r += if four { 4 } else { 1 };
    }
}

/// Rows `r0..r0 + R` times columns `c0..c0 + C`; `out[i * stride + j]` gets
/// (row `r0 + i`, column `c0 + j`). Returns `C`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile<const R: usize, const C: usize>(
    w: &QWeight,
    a: &Acts,
    r0: usize,
    c0: usize,
    out: &mut [f32],
    stride: usize,
) -> usize {
    let (nb, nbp) = (w.blocks(), w.padded_blocks());
    debug_assert_eq!((a.k, a.nbp), (w.k, nbp));
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for group in (0..nb).step_by(GROUP) {
        let mut dw = [_mm256_setzero_ps(); C];
        for (j, dw) in dw.iter_mut().enumerate() {
            *dw = _mm256_cvtph_ps(_mm_loadu_si128(
                w.d.as_ptr().add((c0 + j) * nbp + group).cast(),
            ));
        }
        if let Quants::Q4 { m, .. } = &w.quants {
            // The minimum term `m_w * s_a`, eight blocks at a time.
            for j in 0..C {
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(
                    m.as_ptr().add((c0 + j) * nbp + group).cast(),
                ));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let sa = _mm256_loadu_ps(a.s.as_ptr().add((r0 + i) * nbp + group));
                    acc[j] = _mm256_fmadd_ps(mw, sa, acc[j]);
                }
            }
        }
        let mut start = group;
        for g in [8, 4, 2, 1] {
            if nb - start < g {
                continue;
            }
            let dots = match &w.quants {
                Quants::Q4 { qs, .. } => dots_q4::<R, C>(qs, a, w.k, r0, c0, start, g),
                Quants::Q8 { qs } => dots_q8::<R, C>(qs, a, w.k, r0, c0, start, g),
            };
            // Lane `l` holds block `start + l * g / 8`: spread the scales to match.
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let spread = _mm256_add_epi32(
                _mm256_set1_epi32((start - group) as i32),
                _mm256_srli_epi32(_mm256_mullo_epi32(lanes, _mm256_set1_epi32(g as i32)), 3),
            );
            for (i, acc) in acc.iter_mut().enumerate() {
                let da = _mm256_loadu_ps(a.d.as_ptr().add((r0 + i) * nbp + group));
                for j in 0..C {
                    let mut scale = _mm256_mul_ps(dw[j], da);
                    if g != GROUP {
                        scale = _mm256_permutevar8x32_ps(scale, spread);
                    }
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i][j]), scale, acc[j]);
                }
            }
            start += g;
            if g == GROUP {
                break;
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (j, v) in acc.iter().enumerate() {
            out[i * stride + j] = hsum(*v);
        }
    }
    C
}

/// Integer dot products of a run of `g` blocks of 4-bit weights, one i32 lane
/// per block quarter (see `kernel_order`). The 16-bit partial sums hold at most
/// 16 products of `15 * 127`, so they cannot overflow.
#[target_feature(enable = "avx2")]
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
    let low4 = _mm256_set1_epi8(0x0f);
    // Closures would not inherit this function's target features, so rows
    // are addressed by plain offsets.
    let wrow = qs.as_ptr().add(c0 * k / 2 + start * BLOCK / 2);
    let arow = a.qs.as_ptr().add(r0 * k + start * BLOCK);
    let mut sums = [[_mm256_setzero_si256(); C]; R];
    if g == 1 {
        let mut wv = [_mm256_setzero_si256(); C];
        for (j, wv) in wv.iter_mut().enumerate() {
            let raw = _mm_loadu_si128(wrow.add(j * k / 2).cast());
            *wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
        }
        for (i, sums) in sums.iter_mut().enumerate() {
            let av = _mm256_loadu_si256(arow.add(i * k).cast());
            for j in 0..C {
                sums[j] = _mm256_maddubs_epi16(wv[j], av);
            }
        }
    } else {
        for pair in 0..g / 2 {
            let mut lo = [_mm256_setzero_si256(); C];
            let mut hi = [_mm256_setzero_si256(); C];
            for j in 0..C {
                let at = j * k / 2 + pair * BLOCK;
                prefetch(wrow.wrapping_add(at + AHEAD));
                let raw = _mm256_loadu_si256(wrow.add(at).cast());
                lo[j] = _mm256_and_si256(raw, low4);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            }
            for (i, sums) in sums.iter_mut().enumerate() {
                let a0 = _mm256_loadu_si256(arow.add(i * k + pair * 2 * BLOCK).cast());
                let a1 = _mm256_loadu_si256(arow.add(i * k + pair * 2 * BLOCK + BLOCK).cast());
                for j in 0..C {
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo[j], a0),
                        _mm256_maddubs_epi16(hi[j], a1),
                    );
                    sums[j] = _mm256_add_epi16(sums[j], p);
                }
            }
        }
    }
    let ones = _mm256_set1_epi16(1);
    for row in sums.iter_mut() {
        for s in row.iter_mut() {
            *s = _mm256_madd_epi16(*s, ones);
        }
    }
    sums
}

/// Integer dot products of a run of `g` blocks of 8-bit weights, one i32 lane
/// per block quarter. maddubs needs one unsigned operand: `|w|` times `a` with
/// `w`'s sign; a pair of products stays under `2 * 127 * 127`, so it cannot
/// saturate, but two pairs could overflow 16 bits, so sums are 32-bit.
#[target_feature(enable = "avx2")]
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
    let ones = _mm256_set1_epi16(1);
    let mut sums = [[_mm256_setzero_si256(); C]; R];
    for v in 0..g {
        let at = start * BLOCK + v * BLOCK;
        let mut wv = [_mm256_setzero_si256(); C];
        let mut wabs = [_mm256_setzero_si256(); C];
        for j in 0..C {
            let wp = qs.as_ptr().add((c0 + j) * k + at);
            prefetch(wp.wrapping_add(AHEAD));
            wv[j] = _mm256_loadu_si256(wp.cast());
            wabs[j] = _mm256_sign_epi8(wv[j], wv[j]);
        }
        for (i, sums) in sums.iter_mut().enumerate() {
            let av = _mm256_loadu_si256(a.qs.as_ptr().add((r0 + i) * k + at).cast());
            for j in 0..C {
                let p = _mm256_maddubs_epi16(wabs[j], _mm256_sign_epi8(av, wv[j]));
                sums[j] = _mm256_add_epi32(sums[j], _mm256_madd_epi16(p, ones));
            }
        }
    }
    sums
}

/// How far ahead (bytes) weights are prefetched. A tile's columns are only a
/// few hundred bytes each, too short for the hardware prefetcher to lock on
/// before they end, which starves single-row calls streaming weights from
/// memory; the distance was tuned on the default model (Zen 3).
const AHEAD: usize = 8192;

#[inline]
fn prefetch<T>(p: *const T) {
    // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
}

#[target_feature(enable = "avx2")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}
