//! The AMX kernel: Intel's tile unit (AMX-TILE, AMX-INT8) computes a
//! many-row call's integer block dot products, sixteen rows by sixteen
//! columns by one 32-value block per instruction, and AVX-512 scales and
//! adds them in exactly the f32 operations, in exactly the order, of the
//! AVX-512 kernel's tiles (`x86_tiles::x86_tile!`). Integer dot products are
//! exact whichever unit sums them, so a row's result is bit for bit the one
//! the AVX-512 kernel gives it, and stays independent of the batch: decode's
//! few rows, and every weight or column this kernel does not take, run on
//! the AVX-512 tiles.
//!
//! What it takes: weights whose rows are whole groups of eight blocks
//! (every K-quant's are), in calls of at least [`MIN_ROWS`] rows, sixteen
//! columns at a time; the last `n % 16` columns of a task go to the AVX-512
//! tiles. Q6_K weights, whose scales cover half a block, multiply half
//! blocks (16 values) instead.
//!
//! Why it is faster although it scales every block apart, as the AVX-512
//! kernel does: the tile unit's integer work costs next to nothing, and what
//! remains, the f32 step, runs sixteen rows to a vector with no unpacking of
//! weights per row tile (`kernel_throughput`: 1.6x the AVX-512 kernel on a
//! 1B model's Q4_K gate/up projections at 512 rows, 2.2x on Q6_K, 2.9x on
//! 8-bit weights).
//!
//! The layouts: a tile multiply sums 32 values of one block, but
//! `layout::kernel_order` interleaves a group's eight blocks four bytes at a
//! time (value `4 b + t` of vector `v` is value `4 v + t` of block `b`). The
//! activations are repacked once per call into the tile unit's B form
//! ([`TileActs`]); a column tile's weights are unpacked to bytes in its A
//! form as the task reaches it, and serve every row tile.

use std::arch::asm;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::layout::{unpack_q4_groups, unpack_q6_groups, BLOCK, GROUP};
use super::store::{Acts, Out, QWeight, Quants};
use super::x86_tiles::widen;

/// Rows (and columns) a tile multiply covers.
const TILE: usize = 16;

/// The fewest rows a call hands to the tile unit: about where it starts to
/// gain, as repacking the activations and unpacking every column tile's
/// weights cost the same whatever the rows. `kernel_throughput` on a 1B
/// model's Q4_K gate/up and Q6_K down projections, tile unit against
/// AVX-512: 0.35x at 8 rows, 0.55-0.65x at 16, 1.15x and 0.83x at 32, 1.5x
/// and 1.15x at 64.
pub(super) const MIN_ROWS: usize = 32;

/// Linux's `arch_prctl` request for permission to use an extended state
/// component, and AMX's tile data component.
const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
const XFEATURE_XTILEDATA: libc::c_ulong = 18;

/// Whether this CPU has AMX-TILE and AMX-INT8 and the OS lets this process
/// use them.
pub(super) fn available() -> bool {
    let (has, granted) = support();
    has && granted
}

/// Whether this CPU has AMX but the OS refused this process the tile state
/// (a VM or a kernel may), so many-row calls run on the AVX-512 kernel.
pub(super) fn refused() -> bool {
    let (has, granted) = support();
    has && !granted
}

/// Whether the CPU has AMX-TILE and AMX-INT8, and whether Linux granted this
/// process the tile state (it does only on request, once per process; a tile
/// instruction without it faults). Asked once: every kernel call checks it,
/// and in a VM `cpuid` traps to the hypervisor (1.7 us on the host of
/// the AMX figures in docs/benchmarks/models.md; at about 1,100 calls a token it cost Qwen3-0.6B's
/// single-sequence decode 12%).
fn support() -> (bool, bool) {
    static SUPPORT: OnceLock<(bool, bool)> = OnceLock::new();
    *SUPPORT.get_or_init(|| {
        let leaf7 = __cpuid_count(7, 0);
        let has = leaf7.edx >> 24 & 1 == 1 && leaf7.edx >> 25 & 1 == 1;
        // SAFETY: the syscall only changes this process's permissions.
        let granted = has
            && unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                ) == 0
            };
        (has, granted)
    })
}

/// Whether a call of `rows` rows runs `w` on the tile unit.
pub(super) fn takes(w: &QWeight, rows: usize) -> bool {
    rows >= MIN_ROWS && takes_weight(w)
}

/// Whether calls of enough rows run `w` on the tile unit: its rows are whole
/// groups of blocks.
pub(super) fn takes_weight(w: &QWeight) -> bool {
    w.blocks().is_multiple_of(GROUP)
}

/// How the tile unit multiplies a weight's values: unsigned 4-bit values
/// whole blocks at a time, signed 8-bit ones, or Q6_K's as signed `q - 32`
/// half a block at a time (each half has its own scale).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    Q4,
    Q8,
    Q6,
}

impl Form {
    fn of(w: &QWeight) -> Self {
        match w.quants {
            Quants::Q4 { .. } => Form::Q4,
            Quants::Q8 { .. } => Form::Q8,
            Quants::Q6 { .. } => Form::Q6,
        }
    }
}

/// A call's activations in the tile unit's B form: per tile of sixteen rows
/// (the last padded with zero rows) and per block, eight rows of 64 bytes,
/// row `v` holding the block's values `4 v..4 v + 4` of each of the sixteen
/// rows in turn; and each block's scale `d` and sum term `s` for the
/// sixteen rows side by side.
pub(super) struct TileActs {
    nb: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

/// Bytes of one block's tile, in either form.
const TILE_BYTES: usize = TILE * BLOCK;

impl TileActs {
    /// `a` repacked (its rows whole groups).
    pub(super) fn pack(a: &Acts) -> Self {
        let (k, nbp) = (a.k, a.nbp);
        let nb = k / BLOCK;
        debug_assert!(nb.is_multiple_of(GROUP) && nb == nbp);
        let tiles = a.rows().div_ceil(TILE);
        let mut p = Self {
            nb,
            qs: vec![0; tiles * nb * TILE_BYTES],
            d: vec![0.0; tiles * nb * TILE],
            s: vec![0.0; tiles * nb * TILE],
        };
        p.qs.par_chunks_mut(nb * TILE_BYTES)
            .zip(p.d.par_chunks_mut(nb * TILE))
            .zip(p.s.par_chunks_mut(nb * TILE))
            .enumerate()
            .for_each(|(tile, ((qs, d), s))| {
                let first = tile * TILE;
                for n in 0..TILE.min(a.rows() - first) {
                    let r = first + n;
                    let row = &a.qs[r * k..][..k];
                    for kb in 0..nb {
                        let block = &mut qs[kb * TILE_BYTES..][..TILE_BYTES];
                        for (v, quad) in block_quads(row, kb).enumerate() {
                            block[v * 4 * TILE + 4 * n..][..4].copy_from_slice(quad);
                        }
                        d[kb * TILE + n] = a.d[r * nbp + kb];
                        s[kb * TILE + n] = a.s[r * nbp + kb];
                    }
                }
            });
        p
    }
}

/// Block `kb`'s eight four-value quads in a kernel-order row of bytes (see
/// the module's doc).
fn block_quads<T>(row: &[T], kb: usize) -> impl Iterator<Item = &[T]> {
    let (group, b) = (kb / GROUP, kb % GROUP);
    let at = group * GROUP * BLOCK + 4 * b;
    (0..GROUP).map(move |v| &row[at + v * BLOCK..][..4])
}

/// A tile configuration (`ldtilecfg`'s 64 bytes).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// `tmm0..tmm3` 16 by 16 i32 results; `tmm4` and `tmm5` sixteen rows
/// (columns of the weight) of `values` weight bytes (A); `tmm6` and `tmm7`
/// `values / 4` rows of sixteen activation rows' quads (B).
const fn config(values: usize) -> TileConfig {
    let mut bytes_per_row = [0; 16];
    let mut rows = [0; 16];
    let mut t = 0;
    while t < 8 {
        (bytes_per_row[t], rows[t]) = match t {
            0..4 => (4 * TILE as u16, TILE as u8),
            4 | 5 => (values as u16, TILE as u8),
            _ => (4 * TILE as u16, (values / 4) as u8),
        };
        t += 1;
    }
    TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        bytes_per_row,
        rows,
    }
}

/// Whole blocks, and Q6_K's half blocks.
const WHOLE: TileConfig = config(BLOCK);
const HALVES: TileConfig = config(BLOCK / 2);

/// One column tile's weights in the tile unit's A form: per block, sixteen
/// rows (the columns) of its 32 values, the order of [`block_quads`], as
/// unsigned bytes (4-bit values) or signed ones (8-bit values, and Q6_K's
/// `q - 32`).
fn unpack_columns(w: &QWeight, c: usize, dst: &mut [u8], row: &mut [u8]) {
    let (k, nb) = (w.k, w.blocks());
    for m in 0..TILE {
        let col = c + m;
        match &w.quants {
            Quants::Q4 { qs, .. } => unpack_q4_groups(&qs[col * k / 2..][..k / 2], row),
            Quants::Q8 { qs } => {
                for (d, &q) in row.iter_mut().zip(&qs[col * k..][..k]) {
                    *d = q as u8;
                }
            }
            Quants::Q6 { lo, hi, .. } => unpack_q6_groups(
                &lo[col * k / 2..][..k / 2],
                &hi[col * k / 4..][..k / 4],
                row,
            ),
        }
        for kb in 0..nb {
            let dst = &mut dst[kb * TILE_BYTES + m * BLOCK..][..BLOCK];
            for (d, quad) in dst.chunks_exact_mut(4).zip(block_quads(row, kb)) {
                d.copy_from_slice(quad);
            }
        }
    }
}

/// Output columns `c0..c0 + nc` for every row of `a`: whole column tiles on
/// the tile unit, the rest on `rest` (the AVX-512 walk).
///
/// # Safety
/// [`available`] and the AVX-512 kernel's features hold, `w` is one
/// [`takes`] accepts for `a`'s rows, `t` is `a` packed, and `out` is as
/// `Kernel::run` requires.
pub(super) unsafe fn walk(
    w: &QWeight,
    a: &Acts,
    t: &TileActs,
    (c0, nc): (usize, usize),
    out: Out,
    rest: impl FnOnce(usize, usize, Out),
) {
    let whole = nc / TILE * TILE;
    if whole > 0 {
        let config = if Form::of(w) == Form::Q6 {
            &HALVES
        } else {
            &WHOLE
        };
        asm!("ldtilecfg [{0}]", in(reg) config, options(nostack, readonly));
        let step = chunk_columns(t);
        SCRATCH.with_borrow_mut(|scratch| {
            for first in (c0..c0 + whole).step_by(step) {
                let cols = step.min(c0 + whole - first);
                chunk(w, a, t, (first, cols), out.at(0, first - c0), scratch);
            }
        });
        asm!("tilerelease", options(nostack, nomem));
    }
    if whole < nc {
        rest(c0 + whole, nc - whole, out.at(0, whole));
    }
}

/// Columns `first..first + cols` (whole tiles) for every row of `a`: the
/// chunk's weights unpacked and its scales widened once, then row tile by
/// row tile.
///
/// # Safety
/// As [`walk`]'s, with the tile configuration loaded for `w`.
unsafe fn chunk(
    w: &QWeight,
    a: &Acts,
    t: &TileActs,
    (first, cols): (usize, usize),
    out: Out,
    scratch: &mut Scratch,
) {
    let form = Form::of(w);
    let per_tile = t.nb * TILE_BYTES;
    let Scratch {
        weights,
        row,
        dw,
        sw,
        dots,
    } = scratch;
    let weights = grown(weights, cols / TILE * per_tile);
    let row = grown(row, w.k);
    for (tile, weights) in weights.chunks_exact_mut(per_tile).enumerate() {
        unpack_columns(w, first + tile * TILE, weights, row);
    }
    let (d, second) = w.scales();
    let nbp = w.padded_blocks();
    let blocks = first * nbp..(first + cols) * nbp;
    widen(d, blocks.clone(), dw);
    sw.clear();
    if form != Form::Q8 {
        widen(second, blocks, sw);
    }
    for row_tile_at in (0..a.rows()).step_by(TILE) {
        let rows = TILE.min(a.rows() - row_tile_at);
        for c in (0..cols).step_by(TILE) {
            let columns = Columns {
                form,
                weights: &weights[c / TILE * per_tile..][..per_tile],
                d: &dw[c * nbp..][..TILE * nbp],
                second: sw.get(c * nbp..(c + TILE) * nbp).unwrap_or_default(),
            };
            let out = out.at(row_tile_at, c);
            row_tile(&columns, t, row_tile_at / TILE, dots, out, rows);
        }
    }
}

/// The first `len` bytes of `buf`, grown if it is shorter. Every byte read is
/// written first, and chunks' sizes vary from weight to weight: shrinking and
/// growing again would zero the difference each time (3.6% of a Qwen3-0.6B
/// prefill).
fn grown(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buf.len() < len {
        buf.resize(len, 0);
    }
    &mut buf[..len]
}

/// The columns of a chunk: whole tiles whose unpacked weights make about
/// [`CHUNK_BYTES`].
fn chunk_columns(t: &TileActs) -> usize {
    (CHUNK_BYTES / (t.nb * TILE_BYTES)).max(1) * TILE
}

/// A pool thread's buffers for [`chunk`], kept from call to call: a chunk's
/// unpacked weights are half a MiB, which a fresh allocation maps and
/// faults in (and zeroes) every time.
#[derive(Default)]
struct Scratch {
    weights: Vec<u8>,
    row: Vec<u8>,
    dw: Vec<f32>,
    sw: Vec<f32>,
    dots: Box<Dots>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = Default::default();
}

/// The unpacked weights of the column tiles that every row tile passes in
/// turn: with one row tile's activations beside them, well inside L2, so
/// each activation tile comes from memory once for all of them.
const CHUNK_BYTES: usize = 512 << 10;

/// A column tile as [`row_tile`] reads it: its weights in A form, and its
/// scales widened, [`TILE`] columns of `nb` blocks: `d`, and `second` (a
/// 4-bit weight's minimums, a Q6_K weight's second halves' scales; empty for
/// an 8-bit weight).
struct Columns<'a> {
    form: Form,
    weights: &'a [u8],
    d: &'a [f32],
    second: &'a [f32],
}

/// Sixteen columns by row tile `tile` (its first `rows` rows written).
#[target_feature(enable = "avx512f")]
unsafe fn row_tile(
    cols: &Columns,
    t: &TileActs,
    tile: usize,
    dots: &mut Dots,
    out: Out,
    rows: usize,
) {
    let nb = t.nb;
    // One accumulator per column and block lane, sixteen rows wide: lane `b`
    // sums blocks `b, b + 8, ...`, as an AVX-512 tile's lane `b` does. The
    // first group starts each from zero rather than the array being zeroed
    // first (a call to `memset`, 5% of this function's time).
    let mut acc = MaybeUninit::<[[__m512; GROUP]; TILE]>::uninit();
    let lanes = acc.as_mut_ptr().cast::<__m512>();
    let acts = t.qs.as_ptr().add(tile * nb * TILE_BYTES);
    let scales = tile * nb * TILE;
    let dot = |dots: &[i32; TILE * TILE], m: usize| {
        _mm512_cvtepi32_ps(_mm512_loadu_si512(dots.as_ptr().add(m * TILE).cast()))
    };
    for group in (0..nb).step_by(GROUP) {
        let at = group * TILE_BYTES;
        multiply(cols.form, cols.weights.as_ptr().add(at), acts.add(at), dots);
        for b in 0..GROUP {
            let kb = group + b;
            let da = _mm512_loadu_ps(t.d.as_ptr().add(scales + kb * TILE));
            let sa = _mm512_loadu_ps(t.s.as_ptr().add(scales + kb * TILE));
            for m in 0..TILE {
                let at = lanes.add(m * GROUP + b);
                let lane = &mut if group == 0 {
                    _mm512_setzero_ps()
                } else {
                    at.read()
                };
                let scaled = |s: &[f32]| _mm512_mul_ps(_mm512_set1_ps(s[m * nb + kb]), da);
                // The operations of `x86_tile!`'s tiles, in their order.
                match cols.form {
                    Form::Q4 => {
                        let mw = _mm512_set1_ps(cols.second[m * nb + kb]);
                        *lane = _mm512_fmadd_ps(mw, sa, *lane);
                        *lane = _mm512_fmadd_ps(dot(&dots.0[b], m), scaled(cols.d), *lane);
                    }
                    Form::Q8 => {
                        *lane = _mm512_fmadd_ps(dot(&dots.0[b], m), scaled(cols.d), *lane);
                    }
                    Form::Q6 => {
                        *lane = _mm512_fmadd_ps(dot(&dots.0[2 * b], m), scaled(cols.d), *lane);
                        let hi = dot(&dots.0[2 * b + 1], m);
                        *lane = _mm512_fmadd_ps(hi, scaled(cols.second), *lane);
                    }
                }
                at.write(*lane);
            }
        }
    }
    // SAFETY: the first group wrote every lane of every column.
    let acc = acc.assume_init();
    // Column `m`'s sixteen rows, then turned so each row's sixteen columns
    // go to the output in one store (column by column, each row was a
    // separate line, a page apart in a wide matrix).
    let mut sums = [[0f32; TILE]; TILE];
    for (sums, a) in sums.iter_mut().zip(&acc) {
        // `x86_tiles::hsum`'s order over the eight lanes.
        let add = |x, y| _mm512_add_ps(x, y);
        let total = add(
            add(add(a[0], a[4]), add(a[2], a[6])),
            add(add(a[1], a[5]), add(a[3], a[7])),
        );
        _mm512_storeu_ps(sums.as_mut_ptr(), total);
    }
    let mut by_row = [[0f32; TILE]; TILE];
    for (m, column) in sums.iter().enumerate() {
        for (row, &v) in by_row.iter_mut().zip(column) {
            row[m] = v;
        }
    }
    for (n, row) in by_row[..rows].iter().enumerate() {
        out.row(n, row);
    }
}

/// A group's 16 by 16 dot products (column-major: column `m`'s sixteen rows
/// together): a block's in each of the first eight, or for Q6_K a half
/// block's in each of the sixteen (block `b`'s halves at `2 b`, `2 b + 1`);
/// aligned for the tile unit's stores.
#[repr(align(64))]
struct Dots([[i32; TILE * TILE]; 2 * GROUP]);

impl Default for Dots {
    fn default() -> Self {
        Self([[0; TILE * TILE]; 2 * GROUP])
    }
}

/// A group's dot products of sixteen columns (`weights`, A form) with
/// sixteen rows (`acts`, B form) into `dots`, four tiles in flight at a time
/// (results in `tmm0..tmm3`, operands alternating between `tmm4, tmm6` and
/// `tmm5, tmm7`), so one multiply overlaps the next one's loads and the last
/// one's store.
///
/// # Safety
/// The tile configuration is [`WHOLE`] (for Q6_K [`HALVES`]), and each
/// pointer has a group's tiles.
#[inline]
unsafe fn multiply(form: Form, weights: *const u8, acts: *const i8, dots: &mut Dots) {
    // Four tiles from `$w` and `$a`, their operands at the byte offsets
    // given, into `$d`'s four results.
    macro_rules! four {
        ($op:literal, $w:expr, $a:expr, $d:expr, [$w0:expr, $w1:expr, $w2:expr, $w3:expr], [$a0:expr, $a1:expr, $a2:expr, $a3:expr]) => {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm4, [{w} + {w_stride} * 1 + {w0}]",
                "tileloadd tmm6, [{a} + {a_stride} * 1 + {a0}]",
                concat!($op, " tmm0, tmm4, tmm6"),
                "tileloadd tmm5, [{w} + {w_stride} * 1 + {w1}]",
                "tileloadd tmm7, [{a} + {a_stride} * 1 + {a1}]",
                concat!($op, " tmm1, tmm5, tmm7"),
                "tileloadd tmm4, [{w} + {w_stride} * 1 + {w2}]",
                "tileloadd tmm6, [{a} + {a_stride} * 1 + {a2}]",
                concat!($op, " tmm2, tmm4, tmm6"),
                "tileloadd tmm5, [{w} + {w_stride} * 1 + {w3}]",
                "tileloadd tmm7, [{a} + {a_stride} * 1 + {a3}]",
                concat!($op, " tmm3, tmm5, tmm7"),
                "tilestored [{d} + {d_stride} * 1], tmm0",
                "tilestored [{d} + {d_stride} * 1 + 1024], tmm1",
                "tilestored [{d} + {d_stride} * 1 + 2048], tmm2",
                "tilestored [{d} + {d_stride} * 1 + 3072], tmm3",
                w = in(reg) $w,
                w_stride = in(reg) BLOCK,
                a = in(reg) $a,
                a_stride = in(reg) 4 * TILE,
                d = in(reg) $d,
                d_stride = in(reg) 4 * TILE,
                w0 = const $w0, w1 = const $w1, w2 = const $w2, w3 = const $w3,
                a0 = const $a0, a1 = const $a1, a2 = const $a2, a3 = const $a3,
                options(nostack),
            )
        };
    }
    const B: usize = TILE_BYTES;
    // Whole blocks `4 q..4 q + 4` with `$op`.
    macro_rules! whole {
        ($op:literal, $q:expr, $d:expr) => {{
            let (w, a) = (weights.add($q * 4 * B), acts.add($q * 4 * B));
            four!($op, w, a, $d, [0, B, 2 * B, 3 * B], [0, B, 2 * B, 3 * B])
        }};
    }
    for q in 0..if form == Form::Q6 { 4 } else { 2 } {
        let d = dots.0[4 * q..].as_mut_ptr();
        match form {
            Form::Q4 => whole!("tdpbusd", q, d),
            Form::Q8 => whole!("tdpbssd", q, d),
            Form::Q6 => {
                // The halves of blocks `2 q, 2 q + 1`: a half is the A tile's
                // second 16 bytes of each row, the B tile's last four rows.
                let (w, a) = (weights.add(q * 2 * B), acts.add(q * 2 * B));
                const H: usize = BLOCK / 2;
                four!(
                    "tdpbssd",
                    w,
                    a,
                    d,
                    [0, H, B, B + H],
                    [0, B / 2, B, B + B / 2]
                );
            }
        }
    }
}
