//! The AVX2 kernel: a tile of rows times a tile of columns over rows in
//! `layout`'s order, so eight blocks' integer dot products sit side by side in
//! one register and their scales apply as one vector multiply.

use std::arch::x86_64::*;

use super::layout::{BLOCK, GROUP};
use super::store::{Acts, QWeight, Quants};
use super::x86_tiles::{ahead, load8, prefetch, q6_rows, x86_tile};

x86_tile!("avx2,fma,f16c", wide: (4, 2), wide_q6: (4, 2));

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
                prefetch(wrow.wrapping_add(at + ahead(C, k / 2)));
                let raw = _mm256_loadu_si256(wrow.add(at).cast());
                lo[j] = _mm256_and_si256(raw, low4);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            }
            // The pair's vectors (see `layout::nibble`): (0, 1) in a run of
            // two; in a quad, (4q, 4q + 2) then (4q + 1, 4q + 3).
            let (first, second) = match g {
                2 => (0, 1),
                _ => (pair / 2 * 4 + pair % 2, pair / 2 * 4 + pair % 2 + 2),
            };
            for (i, sums) in sums.iter_mut().enumerate() {
                let a0 = _mm256_loadu_si256(arow.add(i * k + first * BLOCK).cast());
                let a1 = _mm256_loadu_si256(arow.add(i * k + second * BLOCK).cast());
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
            prefetch(wp.wrapping_add(ahead(C, k)));
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

/// Integer dot products of a group of eight blocks of 6-bit weights (values
/// `0..64`), per half of the blocks (see `layout::pack_q6`). Two maddubs
/// products stay under `2 * 2 * 63 * 127`, inside 16 bits, so each pair of
/// vectors is summed in 16 bits and widened. Each starts from the
/// activations' `-32` offset, so the sums are the weights' signed ones.
#[target_feature(enable = "avx2")]
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
    let (low4, pair, ones) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(0x30),
        _mm256_set1_epi16(1),
    );
    let mut sums = [[[_mm256_setzero_si256(); C]; R]; 2];
    for (quad, sums) in sums.iter_mut().enumerate() {
        for (i, sums) in sums.iter_mut().enumerate() {
            let offsets = a
                .q6_offsets
                .as_ptr()
                .add((2 * (r0 + i) + quad) * a.nbp + group);
            *sums = [load8(offsets); C];
        }
        // Vectors v0..v3 of the quad, per column.
        let mut w = [[_mm256_setzero_si256(); 4]; C];
        for (j, w) in w.iter_mut().enumerate() {
            let (lp, hp) = (
                lrow.add(j * k / 2 + quad * 2 * BLOCK),
                hrow.add(j * k / 4 + quad * BLOCK),
            );
            prefetch(lp.wrapping_add(ahead(C, k / 2)));
            prefetch(hp.wrapping_add(ahead(C, k / 4)));
            // Low nibbles v0 and v1, high nibbles v2 and v3.
            let v0v2 = _mm256_loadu_si256(lp.cast());
            let v1v3 = _mm256_loadu_si256(lp.add(BLOCK).cast());
            let pairs = _mm256_loadu_si256(hp.cast());
            let high = [
                _mm256_slli_epi16::<4>(pairs),
                _mm256_slli_epi16::<2>(pairs),
                pairs,
                _mm256_srli_epi16::<2>(pairs),
            ];
            let nibbles = [
                v0v2,
                v1v3,
                _mm256_srli_epi16::<4>(v0v2),
                _mm256_srli_epi16::<4>(v1v3),
            ];
            for u in 0..4 {
                w[u] = _mm256_or_si256(
                    _mm256_and_si256(nibbles[u], low4),
                    _mm256_and_si256(high[u], pair),
                );
            }
        }
        for (i, sums) in sums.iter_mut().enumerate() {
            let at = arow.add(i * k + quad * 4 * BLOCK);
            // Not `array::from_fn`: a closure would not inherit this
            // function's target features.
            let mut av = [_mm256_setzero_si256(); 4];
            for (u, av) in av.iter_mut().enumerate() {
                *av = _mm256_loadu_si256(at.add(u * BLOCK).cast());
            }
            for j in 0..C {
                for u in [0, 2] {
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[j][u], av[u]),
                        _mm256_maddubs_epi16(w[j][u + 1], av[u + 1]),
                    );
                    sums[j] = _mm256_add_epi32(sums[j], _mm256_madd_epi16(p, ones));
                }
            }
        }
    }
    sums
}
