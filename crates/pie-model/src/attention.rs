//! Causal attention over paged KV: a cache-blocked kernel with an online softmax
//! (flash-attention style), SIMD where the CPU has it.
//!
//! Owns the attention of one layer for every row of a step, given the rotated
//! queries and the pages (the step's own K and V already written to them).
//!
//! - **Work units.** One unit is (sequence, KV head, block of up to
//!   `QUERY_BLOCK` consecutive rows of that sequence): the unit walks the
//!   sequence's pages once, and every query of the block (rows x the query heads
//!   sharing the KV head) is scored against a page while it sits in L1. Units run
//!   in parallel on the rayon pool (sequences, KV heads and query blocks alike).
//! - **Online softmax.** Per query and per page: scores, the running maximum and
//!   sum, the accumulator rescaled when the maximum grows, then `p * V` added.
//!   Pages group into fixed chunks of about `CHUNK_TOKENS` keys; each chunk has its
//!   own running state, merged into the query's state in chunk order. When a
//!   step has too few units to keep the threads busy (decode of a few sequences at
//!   depth), chunks become units of their own and are merged afterwards, in the
//!   same order with the same arithmetic.
//! - **Causal masking** is exact: a query at position `p` sees the keys `0..=p`
//!   and nothing else (keys beyond it are never read).
//! - **Kernels.** The per-(query, page) step (dot products, exponentials, the V
//!   accumulation) has an AVX-512F and an AVX2+FMA version chosen at run time
//!   (`Kernel::detect`, as `matmul.rs` chooses), and a portable one.
//! - **f16 pages.** A unit widens the K and V of its KV head in a page to f32
//!   once (F16C / AVX-512F conversions, or `half`), into a block that stays in
//!   L1 for every query of the unit, and runs the f32 step on it: the widening
//!   is exact, so everything above holds for f16 pages as for f32 pages holding
//!   the same values, and all arithmetic is f32.
//!
//! Invariant (tested): the output equals plain attention (a score vector over all
//! keys, softmax, weighted sum of V) to within float rounding, for every kernel,
//! page size, GQA group, cached prefix, chunked prefill and decode; and a row's
//! output is bit-identical whatever else is in the step (its block, the other
//! rows and sequences, whether its chunks were split into units), so a prompt
//! gives the same tokens with or without a prefix hit, chunked or whole.

use pie_kv::{KvDtype, KvPool, PageKv, PageTable};
use rayon::prelude::*;

use crate::ops::{axpy, dot};

/// Rows of one sequence per unit: a page of K/V is read once per block.
const QUERY_BLOCK: usize = 16;
/// Keys per chunk (rounded down to whole pages, at least one page).
const CHUNK_TOKENS: usize = 256;

/// The attention heads' shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// One sequence's rows in the step: batch rows `row0..row0 + len` hold positions
/// `start..start + len`, and `table`'s pages hold keys `0..start + len`.
pub(crate) struct SeqRows<'a> {
    pub table: &'a PageTable,
    pub row0: usize,
    pub start: usize,
    pub len: usize,
}

/// Running softmax state of one query: maximum score and sum of exponentials.
#[derive(Clone, Copy, Debug)]
struct Stat {
    m: f32,
    l: f32,
}

const EMPTY: Stat = Stat {
    m: f32::NEG_INFINITY,
    l: 0.0,
};

/// Attention of every row: `q` holds each row's query heads at the start of a
/// row of `q_stride` floats; `out` gets `rows x heads * head_dim`.
pub(crate) fn attention(
    pool: &KvPool,
    layer: usize,
    seqs: &[SeqRows],
    heads: Heads,
    q: &[f32],
    q_stride: usize,
    out: &mut [f32],
) {
    let kernel = Kernel::detect(heads.head_dim);
    attention_with(kernel, pool, layer, seqs, heads, q, q_stride, out);
}

#[derive(Clone, Debug)]
struct Unit {
    seq: usize,
    kvh: usize,
    /// First row, relative to the sequence's `row0`.
    first: usize,
    rows: usize,
    /// `Some(c)`: only chunk `c` (a split unit); `None`: every chunk.
    chunk: Option<usize>,
}

/// A unit's result: per query (row-major, then query head of the group) its
/// state and un-normalised accumulator.
struct Part {
    stats: Vec<Stat>,
    acc: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn attention_with(
    kernel: Kernel,
    pool: &KvPool,
    layer: usize,
    seqs: &[SeqRows],
    h: Heads,
    q: &[f32],
    q_stride: usize,
    out: &mut [f32],
) {
    let layout = pool.layout();
    let (ps, kv_dim, hd) = (layout.page_size, layout.kv_dim, h.head_dim);
    assert_eq!(kv_dim, h.kv_heads * hd, "KV layout and heads agree");
    assert_eq!(h.heads % h.kv_heads, 0, "query heads group over KV heads");
    let group = h.heads / h.kv_heads;
    let width = h.heads * hd;
    let rows: usize = seqs.iter().map(|s| s.len).sum();
    assert!(q_stride >= width && q.len() >= rows * q_stride);
    assert_eq!(out.len(), rows * width, "output size");
    let chunk_len = (CHUNK_TOKENS / ps).max(1) * ps;
    for s in seqs {
        assert!(
            s.table.pages().len() * ps >= s.start + s.len,
            "the page table covers every key"
        );
    }

    let mut units = Vec::new();
    for (seq, s) in seqs.iter().enumerate() {
        for kvh in 0..h.kv_heads {
            for first in (0..s.len).step_by(QUERY_BLOCK) {
                units.push(Unit {
                    seq,
                    kvh,
                    first,
                    rows: QUERY_BLOCK.min(s.len - first),
                    chunk: None,
                });
            }
        }
    }
    // Too few units for the threads (decode of a few sequences): one unit per
    // chunk of keys instead. The results are the same bits either way.
    if units.len() < 4 * rayon::current_num_threads() {
        units = units
            .into_iter()
            .flat_map(|u| {
                let last = seqs[u.seq].start + u.first + u.rows - 1;
                (0..last / chunk_len + 1).map(move |c| Unit {
                    chunk: Some(c),
                    ..u.clone()
                })
            })
            .collect();
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let parts: Vec<Part> = units
        .par_iter()
        .map(|u| {
            let s = &seqs[u.seq];
            run_unit(kernel, pool, layer, s, h, q, q_stride, u, chunk_len, scale)
        })
        .collect();

    // Merge split units in chunk order, normalise, write each query's head.
    let mut parts = units.iter().zip(parts).peekable();
    while let Some((u, mut part)) = parts.next() {
        while let Some((next, _)) = parts.peek() {
            if (next.seq, next.kvh, next.first) != (u.seq, u.kvh, u.first) {
                break;
            }
            let (_, more) = parts.next().expect("peeked");
            for (qi, c) in more.stats.iter().enumerate() {
                merge(
                    &mut part.stats[qi],
                    &mut part.acc[qi * hd..][..hd],
                    *c,
                    &more.acc[qi * hd..][..hd],
                );
            }
        }
        let row0 = seqs[u.seq].row0 + u.first;
        for i in 0..u.rows {
            for g in 0..group {
                let qi = i * group + g;
                let inv = 1.0 / part.stats[qi].l;
                let dst = &mut out[(row0 + i) * width + (u.kvh * group + g) * hd..][..hd];
                for (o, a) in dst.iter_mut().zip(&part.acc[qi * hd..][..hd]) {
                    *o = a * inv;
                }
            }
        }
    }
}

/// Merge a chunk's state `c` (accumulator `cacc`) into a query's state.
fn merge(st: &mut Stat, acc: &mut [f32], c: Stat, cacc: &[f32]) {
    if c.m == f32::NEG_INFINITY {
        return;
    }
    if st.m == f32::NEG_INFINITY {
        *st = c;
        acc.copy_from_slice(cacc);
        return;
    }
    let m = st.m.max(c.m);
    let (a, b) = ((st.m - m).exp(), (c.m - m).exp());
    st.l = st.l * a + c.l * b;
    st.m = m;
    for (x, y) in acc.iter_mut().zip(cacc) {
        *x = *x * a + *y * b;
    }
}

#[allow(clippy::too_many_arguments)]
fn run_unit(
    kernel: Kernel,
    pool: &KvPool,
    layer: usize,
    s: &SeqRows,
    h: Heads,
    q: &[f32],
    q_stride: usize,
    u: &Unit,
    chunk_len: usize,
    scale: f32,
) -> Part {
    let layout = pool.layout();
    let (ps, kv_dim, hd) = (layout.page_size, layout.kv_dim, h.head_dim);
    let group = h.heads / h.kv_heads;
    let nq = u.rows * group;
    let mut part = Part {
        stats: vec![EMPTY; nq],
        acc: vec![0.0; nq * hd],
    };
    let mut cst = vec![EMPTY; nq];
    let mut cacc = vec![0f32; nq * hd];
    let mut scratch = vec![0f32; ps.next_multiple_of(16)];
    // K then V of one page's slots for this unit's KV head, widened from f16.
    let mut wide = match pool.dtype() {
        KvDtype::F16 => vec![0f32; 2 * ps * hd],
        KvDtype::F32 => Vec::new(),
    };
    let pos0 = s.start + u.first;
    let last = pos0 + u.rows - 1;
    let chunks = match u.chunk {
        Some(c) => c..c + 1,
        None => 0..last / chunk_len + 1,
    };
    let pages = s.table.pages();
    for c in chunks {
        let c0 = c * chunk_len;
        if c0 > last {
            break;
        }
        // Rows before the chunk's first key see none of it.
        let from = c0.saturating_sub(pos0);
        cst[from * group..].fill(EMPTY);
        cacc[from * group * hd..].fill(0.0);
        let page_end = ((c0 + chunk_len).min(last + 1)).div_ceil(ps);
        for (p, &page) in pages.iter().enumerate().take(page_end).skip(c0 / ps) {
            let page_start = p * ps;
            let (k, v, stride) = match pool.page_kv(layer, page) {
                PageKv::F32(k, v) => (&k[u.kvh * hd..], &v[u.kvh * hd..], kv_dim),
                PageKv::F16(k, v) => {
                    let slots = (last + 1 - page_start).min(ps);
                    let (wk, wv) = wide.split_at_mut(ps * hd);
                    kernel.widen(&k[u.kvh * hd..], kv_dim, hd, slots, wk);
                    kernel.widen(&v[u.kvh * hd..], kv_dim, hd, slots, wv);
                    (&*wk, &*wv, hd)
                }
            };
            for i in page_start.saturating_sub(pos0)..u.rows {
                let n = (pos0 + i + 1 - page_start).min(ps);
                let row = s.row0 + u.first + i;
                for g in 0..group {
                    let qi = i * group + g;
                    let qv = &q[row * q_stride + (u.kvh * group + g) * hd..][..hd];
                    kernel.page_step(
                        qv,
                        k,
                        v,
                        stride,
                        n,
                        scale,
                        &mut cst[qi],
                        &mut cacc[qi * hd..][..hd],
                        &mut scratch,
                    );
                }
            }
        }
        if u.chunk.is_some() {
            // A split unit returns the chunk's own state (what `merge` into an
            // empty state would give, bit for bit).
            return Part {
                stats: cst,
                acc: cacc,
            };
        }
        for qi in from * group..nq {
            merge(
                &mut part.stats[qi],
                &mut part.acc[qi * hd..][..hd],
                cst[qi],
                &cacc[qi * hd..][..hd],
            );
        }
    }
    if u.chunk.is_some() {
        // Every row of the block precedes this chunk.
        return Part {
            stats: vec![EMPTY; nq],
            acc: vec![0.0; nq * hd],
        };
    }
    part
}

/// Which implementation of the per-page step runs, chosen once per call from the
/// CPU's features and the head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Kernel {
    pub(crate) fn detect(head_dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        for k in [Kernel::Avx512, Kernel::Avx2] {
            if k.available(head_dim) {
                return k;
            }
        }
        Kernel::Portable
    }

    /// Whether this CPU can run the kernel for heads of `head_dim`.
    pub(crate) fn available(self, head_dim: usize) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                head_dim.is_multiple_of(16)
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                head_dim.is_multiple_of(8)
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            Kernel::Portable => true,
        }
    }

    /// The first `hd` values of `slots` rows of f16 bits, `stride` apart in
    /// `src`, widened to f32 into `dst`, rows `hd` apart.
    fn widen(self, src: &[u16], stride: usize, hd: usize, slots: usize, dst: &mut [f32]) {
        assert!(slots >= 1 && src.len() >= (slots - 1) * stride + hd && dst.len() >= slots * hd);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available` checked AVX-512F and that `hd` is a multiple of
            // 16; the slices were checked above.
            Kernel::Avx512 => unsafe { avx512::widen(src, stride, hd, slots, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for F16C and a multiple of 8.
            Kernel::Avx2 => unsafe { avx2::widen(src, stride, hd, slots, dst) },
            Kernel::Portable => {
                for (j, row) in dst.chunks_exact_mut(hd).take(slots).enumerate() {
                    for (d, x) in row.iter_mut().zip(&src[j * stride..][..hd]) {
                        *d = half::f16::from_bits(*x).to_f32();
                    }
                }
            }
        }
    }

    /// One query against the first `n` keys of one page: `k` and `v` start at the
    /// query's KV head in slot 0, slots `stride` floats apart. Updates the running
    /// state `st` and accumulator `acc` (the query's length); `scratch` holds at
    /// least `n` rounded up to 16 floats.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn page_step(
        self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        stride: usize,
        n: usize,
        scale: f32,
        st: &mut Stat,
        acc: &mut [f32],
        scratch: &mut [f32],
    ) {
        let hd = q.len();
        assert!(n >= 1 && acc.len() == hd && scratch.len() >= n.next_multiple_of(16));
        assert!(k.len() >= (n - 1) * stride + hd && v.len() >= (n - 1) * stride + hd);
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect`/`available` checked the features and that `hd` is a
            // multiple of 16; the slices were checked above.
            Kernel::Avx512 => unsafe {
                avx512::page_step(q, k, v, stride, n, scale, st, acc, scratch)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2 and FMA and a multiple of 8.
            Kernel::Avx2 => unsafe { avx2::page_step(q, k, v, stride, n, scale, st, acc, scratch) },
            Kernel::Portable => portable(q, k, v, stride, n, scale, st, acc, scratch),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn portable(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    stride: usize,
    n: usize,
    scale: f32,
    st: &mut Stat,
    acc: &mut [f32],
    s: &mut [f32],
) {
    let hd = q.len();
    for (j, s) in s[..n].iter_mut().enumerate() {
        *s = dot(q, &k[j * stride..][..hd]) * scale;
    }
    let m = s[..n].iter().fold(st.m, |a, &b| a.max(b));
    let alpha = if m == st.m { 1.0 } else { (st.m - m).exp() };
    let mut sum = 0.0;
    for s in &mut s[..n] {
        *s = (*s - m).exp();
        sum += *s;
    }
    st.l = st.l * alpha + sum;
    st.m = m;
    if alpha != 1.0 {
        acc.iter_mut().for_each(|a| *a *= alpha);
    }
    for (j, &p) in s[..n].iter().enumerate() {
        axpy(acc, p, &v[j * stride..][..hd]);
    }
}

/// Cephes' single-precision `exp` polynomial, shared by the vector kernels.
#[cfg(target_arch = "x86_64")]
mod expf {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
    /// Inputs are clamped here first (the result of `exp(-87.3)` is ~1e-38).
    pub const LO: f32 = -87.3;
    pub const HI: f32 = 88.0;
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{expf, Stat};

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
        let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(expf::LOG2E)),
        );
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

    /// `super::Kernel::widen` eight lanes at a time (`hd` a multiple of 8).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn widen(
        src: &[u16],
        stride: usize,
        hd: usize,
        slots: usize,
        dst: &mut [f32],
    ) {
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

    /// `super::portable` with eight keys' dot products at a time and the
    /// exponentials eight lanes at a time.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn page_step(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        stride: usize,
        n: usize,
        scale: f32,
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
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::avx2::{exponentials, hsum, hsum8};
    use super::Stat;

    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    unsafe fn half_sum(a: __m512) -> __m256 {
        _mm256_add_ps(
            _mm512_castps512_ps256(a),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
        )
    }

    /// `super::Kernel::widen` sixteen lanes at a time (`hd` a multiple of 16).
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn widen(
        src: &[u16],
        stride: usize,
        hd: usize,
        slots: usize,
        dst: &mut [f32],
    ) {
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

    /// `super::portable` with 16-lane registers: eight keys' dot products at a
    /// time, the exponentials eight lanes at a time.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn page_step(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        stride: usize,
        n: usize,
        scale: f32,
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_core::ModelFingerprint;
    use pie_kv::KvLayout;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The attention this kernel replaced, kept as the reference: per row and
    /// query head, a score vector over every key, softmax, weighted sum of V.
    fn reference(
        pool: &KvPool,
        seqs: &[SeqRows],
        h: Heads,
        q: &[f32],
        q_stride: usize,
    ) -> Vec<f32> {
        let (ps, hd) = (pool.layout().page_size, h.head_dim);
        let group = h.heads / h.kv_heads;
        let rows: usize = seqs.iter().map(|s| s.len).sum();
        let mut out = vec![0f32; rows * h.heads * hd];
        let scale = 1.0 / (hd as f32).sqrt();
        for s in seqs {
            for i in 0..s.len {
                let (row, pos) = (s.row0 + i, s.start + i);
                for head in 0..h.heads {
                    let kvh = head / group;
                    let qv = &q[row * q_stride + head * hd..][..hd];
                    let mut scores: Vec<f32> = (0..=pos)
                        .map(|j| {
                            let (page, slot) = s.table.slot(j, ps);
                            dot(qv, &pool.read(0, page, slot).0[kvh * hd..][..hd]) * scale
                        })
                        .collect();
                    softmax(&mut scores);
                    let dst = &mut out[row * h.heads * hd + head * hd..][..hd];
                    for (j, &p) in scores.iter().enumerate() {
                        let (page, slot) = s.table.slot(j, ps);
                        axpy(dst, p, &pool.read(0, page, slot).1[kvh * hd..][..hd]);
                    }
                }
            }
        }
        out
    }

    fn softmax(x: &mut [f32]) {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for v in x.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in x.iter_mut() {
            *v /= sum;
        }
    }

    /// Sequences' pages (interleaved in the pool) filled with random K and V for
    /// every key each will need, and random queries.
    struct Setup {
        pool: KvPool,
        tables: Vec<PageTable>,
        heads: Heads,
        q: Vec<f32>,
        q_stride: usize,
    }

    impl Setup {
        /// `lens[i]`: keys sequence `i` holds; `rows`: query rows to allocate;
        /// pages of `dtype` (the same values for either, before rounding).
        fn new(
            dtype: KvDtype,
            seed: u64,
            page_size: usize,
            heads: Heads,
            lens: &[usize],
            rows: usize,
        ) -> Self {
            let mut rng = StdRng::seed_from_u64(seed);
            let hd = heads.head_dim;
            let kv_dim = heads.kv_heads * hd;
            let layout = KvLayout {
                layers: 1,
                page_size,
                kv_dim,
            };
            let pages: usize = lens.iter().map(|l| l.div_ceil(page_size)).sum();
            let mut pool = KvPool::with_dtype(layout, dtype, pages + 1, ModelFingerprint(7));
            let mut tables: Vec<PageTable> = lens.iter().map(|_| PageTable::new()).collect();
            // Interleave the sequences' pages so no table is contiguous.
            let max = lens.iter().copied().max().unwrap_or(0);
            for upto in (page_size..=max.next_multiple_of(page_size)).step_by(page_size) {
                for (t, &len) in tables.iter_mut().zip(lens) {
                    t.reserve(&mut pool, upto.min(len)).unwrap();
                }
            }
            let mut rand_vec =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen::<f32>() * 2.0 - 1.0).collect() };
            for (t, &len) in tables.iter().zip(lens) {
                for pos in 0..len {
                    let (page, slot) = t.slot(pos, page_size);
                    // Keys scaled up so some softmaxes are sharp.
                    let k: Vec<f32> = rand_vec(kv_dim).iter().map(|x| x * 3.0).collect();
                    pool.write(0, page, slot, &k, &rand_vec(kv_dim));
                }
            }
            let q_stride = heads.heads * hd + 3;
            let q = rand_vec(rows * q_stride);
            Self {
                pool,
                tables,
                heads,
                q,
                q_stride,
            }
        }

        /// `(sequence, start, len)` spans, rows in this order.
        fn seqs(&self, spans: &[(usize, usize, usize)]) -> Vec<SeqRows<'_>> {
            let mut row0 = 0;
            spans
                .iter()
                .map(|&(t, start, len)| {
                    let s = SeqRows {
                        table: &self.tables[t],
                        row0,
                        start,
                        len,
                    };
                    row0 += len;
                    s
                })
                .collect()
        }

        fn run(&self, kernel: Kernel, seqs: &[SeqRows]) -> Vec<f32> {
            let rows: usize = seqs.iter().map(|s| s.len).sum();
            let mut out = vec![f32::NAN; rows * self.heads.heads * self.heads.head_dim];
            attention_with(
                kernel,
                &self.pool,
                0,
                seqs,
                self.heads,
                &self.q,
                self.q_stride,
                &mut out,
            );
            out
        }
    }

    fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol,
                "{what}: element {i}: got {g}, want {w}"
            );
        }
    }

    fn all_kernels() -> Vec<Kernel> {
        #[cfg(target_arch = "x86_64")]
        return vec![Kernel::Portable, Kernel::Avx2, Kernel::Avx512];
        #[cfg(not(target_arch = "x86_64"))]
        vec![Kernel::Portable]
    }

    const SHAPES: [(usize, usize, usize, usize); 6] = [
        // page size, heads, KV heads, head dim
        (16, 9, 3, 64), // SmolLM2-135M
        (4, 4, 2, 16),
        (1, 2, 1, 8),
        (7, 6, 2, 32),
        (32, 8, 8, 128),
        (5, 3, 3, 24),
    ];

    /// Prefill from zero, prefill after a cached prefix (crossing chunk
    /// boundaries), decode shallow and deep, one step.
    const MIXED: [(usize, usize, usize); 5] = [
        (0, 0, 37),
        (1, 300, 20),
        (2, 600, 1),
        (3, 17, 1),
        (4, 100, 50),
    ];

    fn lens(spans: &[(usize, usize, usize)]) -> Vec<usize> {
        spans.iter().map(|&(_, s, l)| s + l).collect()
    }

    const DTYPES: [KvDtype; 2] = [KvDtype::F32, KvDtype::F16];

    /// On f32 and f16 pages alike (f16: the reference reads the widened values).
    #[test]
    fn every_kernel_matches_the_reference() {
        for (case, &(ps, heads, kv_heads, hd)) in SHAPES.iter().enumerate() {
            let h = Heads {
                heads,
                kv_heads,
                head_dim: hd,
            };
            let rows = MIXED.iter().map(|s| s.2).sum();
            for dtype in DTYPES {
                let setup = Setup::new(dtype, case as u64, ps, h, &lens(&MIXED), rows);
                let case = format!("{case} {dtype:?}");
                // The whole mixed step; decode alone (split into chunk units).
                for spans in [&MIXED[..], &MIXED[2..3], &MIXED[3..4]] {
                    let seqs = setup.seqs(spans);
                    let want = reference(&setup.pool, &seqs, h, &setup.q, setup.q_stride);
                    let portable = setup.run(Kernel::Portable, &seqs);
                    assert_close(&portable, &want, 2e-5, &format!("portable, shape {case}"));
                    for kernel in all_kernels() {
                        if !kernel.available(hd) {
                            eprintln!(
                            "SKIPPED: {kernel:?} attention kernel not tested for head dim {hd}: \
                             this CPU lacks it or the head dim does not fit its registers"
                        );
                            continue;
                        }
                        let got = setup.run(kernel, &seqs);
                        let what = format!("{kernel:?} vs portable, shape {case}");
                        assert_close(&got, &portable, 1e-5, &what);
                        assert_close(&got, &want, 2e-5, &format!("{kernel:?}, shape {case}"));
                    }
                }
            }
        }
    }

    /// f16 pages holding the same values as f32 pages give the same attention to
    /// within f16's rounding of K and V (relative 2^-11 each).
    #[test]
    fn f16_pages_are_close_to_f32_pages() {
        let (ps, heads, kv_heads, hd) = SHAPES[0];
        let h = Heads {
            heads,
            kv_heads,
            head_dim: hd,
        };
        let rows = MIXED.iter().map(|s| s.2).sum();
        let [full, half] = DTYPES.map(|d| Setup::new(d, 3, ps, h, &lens(&MIXED), rows));
        let kernel = Kernel::detect(hd);
        let (a, b) = (
            full.run(kernel, &full.seqs(&MIXED)),
            half.run(kernel, &half.seqs(&MIXED)),
        );
        assert_close(&b, &a, 5e-3, "f16 vs f32 pages");
        assert_ne!(a, b, "the pages differ by rounding");
    }

    /// Chunked prefill: a prompt attended in pieces of any size (each piece after
    /// the ones before it, as the engine's chunks are) gives every row the same
    /// bits as the whole prompt in one step, and so does each row alone (a decode
    /// step, split into chunk units) and the rows among other sequences.
    #[test]
    fn a_rows_output_does_not_depend_on_the_step() {
        for (case, &(ps, heads, kv_heads, hd)) in SHAPES.iter().enumerate() {
            let h = Heads {
                heads,
                kv_heads,
                head_dim: hd,
            };
            let total = 530;
            let width = heads * hd;
            for dtype in DTYPES {
                let setup = Setup::new(dtype, 10 + case as u64, ps, h, &[total, 300], total + 40);
                let case = format!("{case} {dtype:?}");
                for kernel in all_kernels().into_iter().filter(|k| k.available(hd)) {
                    let whole = setup.run(kernel, &setup.seqs(&[(0, 0, total)]));
                    for piece in [1, 5, 64, 200] {
                        let mut start = 0;
                        while start < total {
                            let len = piece.min(total - start);
                            // A piece's rows read the queries of the same rows of the
                            // whole prompt.
                            let seqs = setup.seqs(&[(0, start, len)]);
                            let mut out = vec![0f32; len * width];
                            attention_with(
                                kernel,
                                &setup.pool,
                                0,
                                &seqs,
                                h,
                                &setup.q[start * setup.q_stride..],
                                setup.q_stride,
                                &mut out,
                            );
                            assert_eq!(
                                out,
                                whole[start * width..(start + len) * width],
                                "{kernel:?}, shape {case}, pieces of {piece}, at {start}"
                            );
                            start += len;
                        }
                    }
                    // Among another sequence's rows, after them in the step (the
                    // prompt's rows keep their queries).
                    let qs = setup.q_stride;
                    let q: Vec<f32> =
                        [&setup.q[total * qs..][..40 * qs], &setup.q[..total * qs]].concat();
                    let seqs = setup.seqs(&[(1, 260, 40), (0, 0, total)]);
                    let mut mixed = vec![0f32; (40 + total) * width];
                    attention_with(kernel, &setup.pool, 0, &seqs, h, &q, qs, &mut mixed);
                    assert_eq!(
                        mixed[40 * width..],
                        whole[..],
                        "{kernel:?}, shape {case}, mixed"
                    );
                }
            }
        }
    }

    #[test]
    fn detect_picks_the_widest_available() {
        let k = Kernel::detect(64);
        eprintln!("attention kernel on this CPU for head dim 64: {k:?}");
        assert!(k.available(64));
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512.available(64) {
            assert_eq!(k, Kernel::Avx512);
        } else if Kernel::Avx2.available(64) {
            assert_eq!(k, Kernel::Avx2);
        }
        // A head dim no vector kernel fits falls back.
        assert_eq!(Kernel::detect(12), Kernel::Portable);
    }

    /// One layer of SmolLM2-135M's attention, per kernel and KV dtype: a
    /// 2,048-token prefill in one step and one decode row at depth 2,048, the
    /// best of five timings.
    /// `cargo test --release -p pie-model attention_throughput -- --ignored --nocapture`
    /// (`MB_KERNEL=Avx2` for one kernel).
    #[test]
    #[ignore]
    fn attention_throughput() {
        let h = Heads {
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
        };
        let n = 2048;
        // Aggregate decode: 32 sequences one row each, at depth 128.
        let (batch, depth) = (32, 128);
        let only = std::env::var("MB_KERNEL").ok();
        for dtype in DTYPES {
            let mut lens = vec![depth + 1; batch];
            lens.insert(0, n + 1);
            let setup = Setup::new(dtype, 1, 16, h, &lens, n);
            let decode_batch: Vec<_> = (1..=batch).map(|t| (t, depth, 1)).collect();
            let cases: [(&str, Vec<_>); 3] = [
                ("prefill 2048", vec![(0, 0, n)]),
                ("decode at 2048", vec![(0, n, 1)]),
                ("decode 32 at 128", decode_batch),
            ];
            for kernel in all_kernels().into_iter().filter(|k| k.available(64)) {
                if only.as_ref().is_some_and(|o| *o != format!("{kernel:?}")) {
                    continue;
                }
                for (what, spans) in &cases {
                    let seqs = setup.seqs(spans);
                    let mut best = f64::MAX;
                    for _ in 0..20 {
                        let t = std::time::Instant::now();
                        std::hint::black_box(setup.run(kernel, &seqs));
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    let pairs: usize = spans
                        .iter()
                        .map(|s| (s.1 + 1..=s.1 + s.2).sum::<usize>() * h.heads)
                        .sum();
                    println!(
                        "{kernel:?} {dtype:?} {what}: {:.3} ms per layer, {:.2} ns per (query head, key) pair",
                        best * 1e3,
                        best * 1e9 / pairs as f64
                    );
                }
            }
        }
    }
}
