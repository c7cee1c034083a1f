//! What the x86 kernels share: the walk over tiles and the tile itself (the
//! f32 scale step over eight blocks' integer dot products). The kernels differ
//! only in their integer dot products (`dots_q4`, `dots_q8`, `dots_q6`, one
//! i32 lane per block quarter in `layout::kernel_order`) and in their target
//! features, so each kernel module instantiates the tile with [`x86_tile!`]
//! over its own dot products.

use std::arch::x86_64::*;

use super::layout::{BLOCK, GROUP};
use super::store::{Acts, Out, QWeight, Scales};

/// One tile shape's function: rows `r0..r0 + R` times columns `c0..c0 + C` of
/// the output, written to `out`'s (`i`, `j`); returns `C`.
pub(super) type TileFn =
    unsafe fn(w: &QWeight, s: &ScaleView, a: &Acts, r0: usize, c0: usize, out: Out) -> usize;

/// Where a tile reads a weight's block scales.
#[derive(Clone, Copy)]
pub(super) enum ScaleSource<'a> {
    Stored(&'a Scales),
    /// Widened to f32 for a chunk of columns (see [`walk`]).
    Widened(&'a [f32]),
}

/// The block scales a tile reads: `d`, and `second` (a 4-bit weight's
/// minimums, a Q6_K weight's second halves' scales; an 8-bit weight's tile
/// reads none), for columns from `first_col` on, `nbp` a column.
#[derive(Clone, Copy)]
pub(super) struct ScaleView<'a> {
    pub d: ScaleSource<'a>,
    pub second: ScaleSource<'a>,
    first_col: usize,
    nbp: usize,
}

impl ScaleView<'_> {
    /// The index of column `c`'s block `b`.
    #[inline]
    pub fn at(&self, c: usize, b: usize) -> usize {
        (c - self.first_col) * self.nbp + b
    }
}

/// A kernel's four tile shapes: `rows` rows by `cols` columns (`wide`) and
/// by one (`narrow`) while `rows` rows remain (each unpacked weight vector
/// serves every row, each activation vector every column), then single rows
/// by four columns and by one. The widest tile whose sums and accumulators
/// stay in registers is the fastest: on AVX-512 (32 registers) four rows by
/// four columns ran a 1B model's projections 1.05-1.2x faster than four by
/// two (`kernel_throughput`, 512 rows, several runs), while four by six and eight by four
/// spilled and ran slower; eight by two gained on 2,048-wide inputs but
/// not on 8,192-wide ones, whose eight activation rows outgrow L1.
pub(super) struct Tiles {
    pub rows: usize,
    pub cols: usize,
    pub wide: TileFn,
    pub narrow: TileFn,
    pub one_by_four: TileFn,
    pub one_by_one: TileFn,
}

/// Output columns `c0..c0 + nc` for every row of `a`, into `out`, tile by
/// tile.
///
/// A call of many rows goes a chunk of columns at a time: each chunk's
/// weights, about [`CHUNK_BYTES`], stay in cache while every row passes, and
/// its scales are widened to f32 once for every row (for Q4_K's and Q6_K's
/// stepped scales, widening them in every tile cost a 4-row tile four more
/// operations per column and group: 5% of a Q4_K matrix's prefill). The
/// widened values are the ones a tile computes, so results do not depend on
/// the path.
///
/// # Safety
/// The CPU has the target features of every function in `tiles`, and `out` is
/// as `Kernel::run` requires.
pub(super) unsafe fn walk(tiles: &Tiles, w: &QWeight, a: &Acts, c0: usize, nc: usize, out: Out) {
    let (d, second) = w.scales();
    let nbp = w.padded_blocks();
    let stored = ScaleView {
        d: ScaleSource::Stored(d),
        second: ScaleSource::Stored(second),
        first_col: 0,
        nbp,
    };
    if a.rows() < CHUNKED_ROWS {
        return walk_columns(tiles, w, &stored, a, c0, nc, out);
    }
    let chunk = (CHUNK_BYTES / w.row_bytes())
        .next_multiple_of(tiles.cols)
        .max(tiles.cols);
    WIDENED.with_borrow_mut(|(wd, ws)| {
        for cs in (c0..c0 + nc).step_by(chunk) {
            let n = chunk.min(c0 + nc - cs);
            widen(d, cs * nbp..(cs + n) * nbp, wd);
            // An 8-bit weight's second set is its scales again.
            let same = std::ptr::eq(d, second);
            if !same {
                widen(second, cs * nbp..(cs + n) * nbp, ws);
            }
            let view = ScaleView {
                d: ScaleSource::Widened(wd),
                second: ScaleSource::Widened(if same { wd } else { ws }),
                first_col: cs,
                nbp,
            };
            walk_columns(tiles, w, &view, a, cs, n, out.at(0, cs - c0));
        }
    });
}

/// The weight bytes of a chunk of columns in a many-row call (see [`walk`]):
/// well inside L2 beside the rows' activations.
const CHUNK_BYTES: usize = 64 << 10;

/// The rows from which a call goes by chunks (see [`walk`]): below it, as
/// in decode, each chunk's widening would be a large share of its work.
const CHUNKED_ROWS: usize = 16;

/// Blocks `range` of `scales` (whole groups) as f32 into `out`, the values
/// [`eight`] gives.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn widen(scales: &Scales, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
    out.clear();
    out.reserve(range.len());
    for at in range.step_by(GROUP) {
        let mut group = [0f32; GROUP];
        _mm256_storeu_ps(group.as_mut_ptr(), eight(ScaleSource::Stored(scales), at));
        out.extend_from_slice(&group);
    }
}

thread_local! {
    /// Widened scales of the chunk a pool thread is on: `d`, `second`.
    static WIDENED: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = Default::default();
}

/// [`walk`]'s loop: every row of `a`, row tile by row tile, over columns
/// `c0..c0 + nc`.
unsafe fn walk_columns(
    tiles: &Tiles,
    w: &QWeight,
    scales: &ScaleView,
    a: &Acts,
    c0: usize,
    nc: usize,
    out: Out,
) {
    let rows = a.rows();
    let mut r = 0;
    while r < rows {
        let full = rows - r >= tiles.rows;
        let mut c = 0;
        while c < nc {
            let tile = match (full, nc - c) {
                (true, left) if left >= tiles.cols => tiles.wide,
                (true, _) => tiles.narrow,
                (false, 4..) => tiles.one_by_four,
                (false, _) => tiles.one_by_one,
            };
            c += tile(w, scales, a, r, c0 + c, out.at(r, c));
        }
        r += if full { tiles.rows } else { 1 };
    }
}

/// How far ahead (bytes) a tile prefetches the weights of a column whose
/// rows are `row_bytes` long, when a tile spans `cols` columns: the same place
/// in the columns [`TILES_AHEAD`] tiles on, and at least [`MIN_AHEAD`]. A
/// tile's columns are only a few hundred bytes to a few KiB each, too short
/// for the hardware prefetcher to lock on before they end, which starves
/// single-row calls streaming weights from memory. A fixed distance landed
/// inside the same tile on long rows: with 4 KiB rows (a 1B model's FFN down
/// projection, 8,192 inputs) 8 KiB ahead was two columns on, which the tile
/// was already reading, and those calls streamed at 33 GB/s against 46 for
/// 2,048-input ones; three tiles ahead they stream at 42 (`layer_sequence` in
/// `bench.rs`, 2 threads).
pub(super) fn ahead(cols: usize, row_bytes: usize) -> usize {
    (TILES_AHEAD * cols * row_bytes).max(MIN_AHEAD)
}

const TILES_AHEAD: usize = 3;

/// The distance tuned on the default model (576-byte rows, Zen 3), kept as
/// the floor for short rows, where three tiles are less than one page.
const MIN_AHEAD: usize = 8192;

#[inline]
pub(super) fn prefetch<T>(p: *const T) {
    // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
}

/// Each accumulator's sum into `out`'s (row, column).
///
/// # Safety
/// `out` has room for `R` rows by `C` columns, and no other thread writes them.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn store<const R: usize, const C: usize>(acc: &[[__m256; C]; R], out: Out) {
    for (i, acc) in acc.iter().enumerate() {
        for (j, v) in acc.iter().enumerate() {
            out.set(i, j, hsum(*v));
        }
    }
}

/// Eight i32 starting at `p`: `p` has eight valid values.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn load8(p: *const i32) -> __m256i {
    _mm256_loadu_si256(p.cast())
}

/// Blocks `at..at + 8` of `scales` (`at` a multiple of [`GROUP`]) as f32.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn eight(scales: ScaleSource, at: usize) -> __m256 {
    debug_assert!(at.is_multiple_of(GROUP));
    match scales {
        ScaleSource::Widened(f) => _mm256_loadu_ps(f.as_ptr().add(at)),
        ScaleSource::Stored(Scales::Half(h)) => {
            _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().add(at).cast()))
        }
        ScaleSource::Stored(Scales::Stepped { unit, step }) => {
            let unit = _mm256_cvtph_ps(_mm_set1_epi16(unit[at / GROUP].to_bits() as i16));
            let steps = _mm256_cvtepi8_epi32(_mm_loadl_epi64(step.as_ptr().add(at).cast()));
            _mm256_mul_ps(unit, _mm256_cvtepi32_ps(steps))
        }
    }
}

#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Defines `tile::<R, C>` and `tile_q6::<R, C>` and the kernel's [`Tiles`]
/// (`TILES`, `TILES_Q6`) in the calling module, compiled with `$features`,
/// over that module's `dots_q4`, `dots_q8` (which return `[[__m256i; C]; R]`,
/// eight block lanes per pair) and `dots_q6` (the same for each half of the
/// blocks). Every kernel thus scales and accumulates in the same f32
/// operations in the same order.
macro_rules! x86_tile {
    ($features:literal, wide: ($r:literal, $c:literal), wide_q6: ($r6:literal, $c6:literal)) => {
        const TILES: super::x86_tiles::Tiles = super::x86_tiles::tiles!(tile, $r, $c);
        const TILES_Q6: super::x86_tiles::Tiles = super::x86_tiles::tiles!(tile_q6, $r6, $c6);

        /// The tiles for `w`'s storage.
        pub(super) fn tiles(w: &QWeight) -> &'static super::x86_tiles::Tiles {
            if w.is_q6() {
                &TILES_Q6
            } else {
                &TILES
            }
        }

        /// As `tile`, over Q6_K weights (whole groups only): each half of a
        /// block has its own scale.
        #[target_feature(enable = $features)]
        unsafe fn tile_q6<const R: usize, const C: usize>(
            w: &QWeight,
            s: &super::x86_tiles::ScaleView,
            a: &Acts,
            r0: usize,
            c0: usize,
            out: super::store::Out,
        ) -> usize {
            let Quants::Q6 { lo, hi, .. } = &w.quants else {
                unreachable!("Q6_K tiles run over Q6_K weights");
            };
            let (nb, nbp) = (w.blocks(), w.padded_blocks());
            debug_assert_eq!((a.k, a.nbp, nb % GROUP), (w.k, nbp, 0));
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            for group in (0..nb).step_by(GROUP) {
                let dots = dots_q6::<R, C>(lo, hi, a, w.k, r0, c0, group);
                for (h, scales) in [s.d, s.second].into_iter().enumerate() {
                    for j in 0..C {
                        let dw = super::x86_tiles::eight(scales, s.at(c0 + j, group));
                        for (i, acc) in acc.iter_mut().enumerate() {
                            let da = _mm256_loadu_ps(a.d.as_ptr().add((r0 + i) * nbp + group));
                            let dot = _mm256_cvtepi32_ps(dots[h][i][j]);
                            acc[j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, da), acc[j]);
                        }
                    }
                }
            }
            super::x86_tiles::store(&acc, out);
            C
        }

        /// Rows `r0..r0 + R` times columns `c0..c0 + C`; `out`'s (`i`, `j`) gets
        /// (row `r0 + i`, column `c0 + j`). Returns `C`.
        #[target_feature(enable = $features)]
        unsafe fn tile<const R: usize, const C: usize>(
            w: &QWeight,
            s: &super::x86_tiles::ScaleView,
            a: &Acts,
            r0: usize,
            c0: usize,
            out: super::store::Out,
        ) -> usize {
            let (nb, nbp) = (w.blocks(), w.padded_blocks());
            debug_assert_eq!((a.k, a.nbp), (w.k, nbp));
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            for group in (0..nb).step_by(GROUP) {
                let mut dw = [_mm256_setzero_ps(); C];
                for (j, dw) in dw.iter_mut().enumerate() {
                    *dw = super::x86_tiles::eight(s.d, s.at(c0 + j, group));
                }
                if let Quants::Q4 { .. } = &w.quants {
                    // The minimum term `m_w * s_a`, eight blocks at a time.
                    for j in 0..C {
                        let mw = super::x86_tiles::eight(s.second, s.at(c0 + j, group));
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
                        Quants::Q6 { .. } => unreachable!("Q6_K weights take `tile_q6`"),
                    };
                    // Lane `l` holds block `start + l * g / 8`: spread the scales to match.
                    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    let spread = _mm256_add_epi32(
                        _mm256_set1_epi32((start - group) as i32),
                        _mm256_srli_epi32(
                            _mm256_mullo_epi32(lanes, _mm256_set1_epi32(g as i32)),
                            3,
                        ),
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
            super::x86_tiles::store(&acc, out);
            C
        }
    };
}
pub(super) use x86_tile;

/// The [`Tiles`] of a tile function generic over rows and columns, its wide
/// shape `$r` by `$c`.
macro_rules! tiles {
    ($tile:ident, $r:literal, $c:literal) => {
        super::x86_tiles::Tiles {
            rows: $r,
            cols: $c,
            wide: $tile::<$r, $c>,
            narrow: $tile::<$r, 1>,
            one_by_four: $tile::<1, 4>,
            one_by_one: $tile::<1, 1>,
        }
    };
}
pub(super) use tiles;

/// Where a tile's Q6_K dot products start: the low nibbles and bit pairs of
/// column `c0`'s group `group`, and row `r0`'s activations there.
#[inline]
pub(super) fn q6_rows(
    (lo, hi): (&[u8], &[u8]),
    a: &Acts,
    (k, r0, c0, group): (usize, usize, usize, usize),
) -> (*const u8, *const u8, *const i8) {
    (
        lo[c0 * k / 2 + group * BLOCK / 2..].as_ptr(),
        hi[c0 * k / 4 + group * BLOCK / 4..].as_ptr(),
        a.qs[r0 * k + group * BLOCK..].as_ptr(),
    )
}
