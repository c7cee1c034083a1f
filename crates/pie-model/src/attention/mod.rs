//! Causal attention over paged KV: a cache-blocked kernel with an online softmax
//! (flash-attention style), SIMD where the CPU has it.
//!
//! Owns the attention of one layer for every row of a step, given the rotated
//! queries and the pages (the step's own K and V already written to them).
//!
//! - **Work units.** One unit is (sequence, KV head, block of up to
//!   `QUERY_BLOCK` consecutive rows of that sequence): the unit walks the
//!   sequence's pages once, and every query of the block (rows x the query heads
//!   sharing the KV head) is scored against a span of pages while it sits in L1. Units run
//!   in parallel on the rayon pool (sequences, KV heads and query blocks alike).
//! - **Online softmax.** Per query and per span (a few pages, `SPAN_BYTES` of
//!   f32 K and V, at fixed positions): scores, the running maximum and sum,
//!   the accumulator rescaled when the maximum grows, then `p * V` added.
//!   Pages group into fixed chunks of about `CHUNK_TOKENS` keys; each chunk has its
//!   own running state, merged into the query's state in chunk order. When a
//!   step has too few units to keep the threads busy (decode of a few sequences at
//!   depth), chunks become units of their own and are merged afterwards, in the
//!   same order with the same arithmetic.
//! - **Causal masking** is exact: a query at position `p` sees the keys `0..=p`
//!   and nothing else (keys beyond it are never read). A sliding-window layer's
//!   query sees only its window's keys `p + 1 - w..=p`: the walk starts at the
//!   page (and chunk) holding the block's first such key, and each query's
//!   step starts at its own first key, so keys behind the window are neither
//!   read nor scored.
//! - **Kernels.** The per-(query, span) step (dot products, exponentials, the V
//!   accumulation) has an AVX-512F and an AVX2+FMA version chosen at run time
//!   (`Kernel::detect`, as `matmul.rs` chooses), and a portable one.
//! - **f16 pages.** A unit widens the K and V of its KV head in a span's pages
//!   to f32 once (F16C / AVX-512F conversions, or `half`; f32 pages are
//!   copied), into a block that stays in L1 for every query of the unit, and
//!   runs the f32 step on it: the widening is exact, so everything above
//!   holds for f16 pages as for f32 pages holding the same values, and all
//!   arithmetic is f32.
//!
//! Files, leaves first (each imports only the ones before it): `softmax.rs`
//! (a query's running state, merging two), `expf.rs` (the vector `exp`),
//! `avx2.rs` and `avx512.rs` (the vector steps), `kernel.rs` (`Kernel`: the
//! choice, the dispatch and the portable step), this file (units, chunks, the
//! parallel walk, normalising into the output).
//!
//! Invariant (tested): the output equals plain attention (a score vector over all
//! keys, softmax, weighted sum of V) to within float rounding, for every kernel,
//! page size, GQA group, cached prefix, chunked prefill and decode; and a row's
//! output is bit-identical whatever else is in the step (its block, the other
//! rows and sequences, whether its chunks were split into units), so a prompt
//! gives the same tokens with or without a prefix hit, chunked or whole.

use pie_kv::{KvPool, PageKv, PageTable};
use rayon::prelude::*;

pub(crate) use kernel::sum_exp;
use kernel::Kernel;
pub(crate) use softmax::Scoring;
use softmax::{merge, Stat, EMPTY};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod expf;
mod kernel;
mod softmax;

/// Rows of one sequence per unit: a page of K/V is read once per block.
const QUERY_BLOCK: usize = 16;
/// Keys per chunk (rounded down to whole pages, at least one page).
const CHUNK_TOKENS: usize = 256;
/// The most bytes of f32 K and V a unit steps its queries over at once:
/// within L1 beside the queries, and few enough calls per query that the
/// per-call work (the running maximum, the rescaling) stays small.
const SPAN_BYTES: usize = 32 << 10;

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

/// Attention of every row: `q` holds each row's query heads at the start of a
/// row of `q_stride` floats; `out` gets `rows x heads * head_dim`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    pool: &KvPool,
    layer: usize,
    seqs: &[SeqRows],
    heads: Heads,
    scoring: Scoring,
    q: &[f32],
    q_stride: usize,
    out: &mut [f32],
) {
    let kernel = Kernel::detect(heads.head_dim);
    attention_with(kernel, pool, layer, seqs, heads, scoring, q, q_stride, out);
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
    scoring: Scoring,
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
                let pos0 = seqs[u.seq].start + u.first;
                let first = scoring.first_key(pos0) / chunk_len;
                let last = (pos0 + u.rows - 1) / chunk_len;
                (first..=last).map(move |c| Unit {
                    chunk: Some(c),
                    ..u.clone()
                })
            })
            .collect();
    }
    let parts: Vec<Part> = units
        .par_iter()
        .map(|u| {
            let s = &seqs[u.seq];
            run_unit(
                kernel, pool, layer, s, h, q, q_stride, u, chunk_len, scoring,
            )
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
    scoring: Scoring,
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
    let span = span_pages(ps, hd, chunk_len) * ps;
    let mut scratch = vec![0f32; group * span.next_multiple_of(16)];
    // K then V of one span's slots for this unit's KV head, in f32.
    let mut block = SpanBlock::take(2 * span * hd);
    let wide = &mut block.0;
    let pos0 = s.start + u.first;
    let last = pos0 + u.rows - 1;
    // The block's first row sees the earliest key any of its rows sees.
    let first_key = scoring.first_key(pos0);
    let chunks = match u.chunk {
        Some(c) => c..c + 1,
        None => first_key / chunk_len..last / chunk_len + 1,
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
        let key_end = (c0 + chunk_len).min(last + 1);
        let key_first = c0.max(first_key);
        for s0 in (key_first / span * span..key_end).step_by(span) {
            let (wk, wv) = wide.split_at_mut(span * hd);
            let page_first = (s0 / ps).max(key_first / ps);
            let page_end = (s0 + span).min(key_end).div_ceil(ps);
            for (p, &page) in pages.iter().enumerate().take(page_end).skip(page_first) {
                let at = (p * ps - s0) * hd;
                let slots = (last + 1 - p * ps).min(ps);
                let kv = pool.page_kv(layer, page);
                gather(
                    kernel,
                    kv,
                    (u.kvh * hd, kv_dim, hd),
                    slots,
                    &mut wk[at..],
                    &mut wv[at..],
                );
            }
            for i in s0.saturating_sub(pos0)..u.rows {
                let end = (pos0 + i + 1 - s0).min(span);
                // Slots of this span behind the row's window.
                let skip = scoring.first_key(pos0 + i).saturating_sub(s0);
                if skip >= end {
                    continue;
                }
                let row = s.row0 + u.first + i;
                let qi = i * group;
                kernel.span_step(
                    &q[row * q_stride + u.kvh * group * hd..][..group * hd],
                    &wk[skip * hd..],
                    &wv[skip * hd..],
                    hd,
                    end - skip,
                    scoring,
                    &mut cst[qi..qi + group],
                    &mut cacc[qi * hd..][..group * hd],
                    &mut scratch,
                );
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

thread_local! {
    static SPAN_BLOCKS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A pool thread's span block, kept from unit to unit and given back on
/// drop: a fresh one would be zeroed for every unit, and decode runs
/// hundreds of units a layer. Every value read was gathered first.
struct SpanBlock(Vec<f32>);

impl SpanBlock {
    fn take(len: usize) -> Self {
        let mut block = SPAN_BLOCKS.take();
        if block.len() < len {
            block.resize(len, 0.0);
        }
        Self(block)
    }
}

impl Drop for SpanBlock {
    fn drop(&mut self) {
        SPAN_BLOCKS.set(std::mem::take(&mut self.0));
    }
}

/// Pages of keys a query steps over in one call: as many as fit, as f32 K
/// and V, in [`SPAN_BYTES`], and a divisor of a chunk's pages, so spans
/// begin at fixed positions (a row meets the same spans in any step) and
/// never cross a chunk.
fn span_pages(page_size: usize, head_dim: usize, chunk_len: usize) -> usize {
    let chunk_pages = chunk_len / page_size;
    let fit = (SPAN_BYTES / (2 * 4 * head_dim * page_size)).clamp(1, chunk_pages);
    (1..=fit)
        .rev()
        .find(|d| chunk_pages.is_multiple_of(*d))
        .unwrap_or(1)
}

/// `slots` slots of one KV head (`(offset, stride, head_dim)` into the page's
/// rows) of a page's K and V into `k` and `v`, slot after slot, in f32.
fn gather(
    kernel: Kernel,
    kv: PageKv,
    (offset, stride, hd): (usize, usize, usize),
    slots: usize,
    k: &mut [f32],
    v: &mut [f32],
) {
    match kv {
        PageKv::F32(pk, pv) => {
            for (src, dst) in [(pk, k), (pv, v)] {
                for (j, row) in dst.chunks_exact_mut(hd).take(slots).enumerate() {
                    row.copy_from_slice(&src[offset + j * stride..][..hd]);
                }
            }
        }
        PageKv::F16(pk, pv) => {
            kernel.widen(&pk[offset..], stride, hd, slots, k);
            kernel.widen(&pv[offset..], stride, hd, slots, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{axpy, dot};
    use pie_core::ModelFingerprint;
    use pie_kv::KvDtype;
    use pie_kv::KvLayout;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The attention this kernel replaced, kept as the reference: per row and
    /// query head, a score vector over every key, softmax, weighted sum of V.
    fn reference(
        pool: &KvPool,
        seqs: &[SeqRows],
        h: Heads,
        scoring: Scoring,
        q: &[f32],
        q_stride: usize,
    ) -> Vec<f32> {
        let (ps, hd) = (pool.layout().page_size, h.head_dim);
        let group = h.heads / h.kv_heads;
        let rows: usize = seqs.iter().map(|s| s.len).sum();
        let mut out = vec![0f32; rows * h.heads * hd];
        for s in seqs {
            for i in 0..s.len {
                let (row, pos) = (s.row0 + i, s.start + i);
                for head in 0..h.heads {
                    let kvh = head / group;
                    let qv = &q[row * q_stride + head * hd..][..hd];
                    let keys = scoring.window.map_or(0, |w| (pos + 1).saturating_sub(w))..=pos;
                    let mut scores: Vec<f32> = keys
                        .clone()
                        .map(|j| {
                            let (page, slot) = s.table.slot(j, ps);
                            let score = dot(qv, &pool.read(0, page, slot).0[kvh * hd..][..hd])
                                * scoring.scale;
                            scoring.softcap.map_or(score, |c| c * (score / c).tanh())
                        })
                        .collect();
                    softmax(&mut scores);
                    let dst = &mut out[row * h.heads * hd + head * hd..][..hd];
                    for (j, &p) in keys.zip(&scores) {
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
            self.run_scored(kernel, seqs, causal(self.heads.head_dim))
        }

        fn run_scored(&self, kernel: Kernel, seqs: &[SeqRows], scoring: Scoring) -> Vec<f32> {
            let rows: usize = seqs.iter().map(|s| s.len).sum();
            let mut out = vec![f32::NAN; rows * self.heads.heads * self.heads.head_dim];
            attention_with(
                kernel,
                &self.pool,
                0,
                seqs,
                self.heads,
                scoring,
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

    fn causal(hd: usize) -> Scoring {
        Scoring {
            scale: 1.0 / (hd as f32).sqrt(),
            softcap: None,
            window: None,
        }
    }

    /// Causal, soft-capped, and sliding windows of one key, of less than a
    /// page or chunk, and of more than a chunk (with another scale).
    fn scorings(hd: usize) -> [Scoring; 5] {
        let window = |w| Scoring {
            scale: 0.3,
            softcap: None,
            window: Some(w),
        };
        let capped = Scoring {
            softcap: Some(1.5),
            ..causal(hd)
        };
        [causal(hd), capped, window(1), window(45), window(290)]
    }

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
                // The whole mixed step; decode alone (split into chunk units);
                // causal, and windows inside a page, across pages and chunks.
                let spans = [&MIXED[..], &MIXED[2..3], &MIXED[3..4]];
                for (spans, scoring) in spans.into_iter().flat_map(|s| scorings(hd).map(|c| (s, c)))
                {
                    let case = format!("{case} {:?}", scoring.window);
                    let seqs = setup.seqs(spans);
                    let want = reference(&setup.pool, &seqs, h, scoring, &setup.q, setup.q_stride);
                    let portable = setup.run_scored(Kernel::Portable, &seqs, scoring);
                    assert_close(&portable, &want, 2e-5, &format!("portable, shape {case}"));
                    for kernel in all_kernels() {
                        if !kernel.available(hd) {
                            eprintln!(
                            "SKIPPED: {kernel:?} attention kernel not tested for head dim {hd}: \
                             this CPU lacks it or the head dim does not fit its registers"
                        );
                            continue;
                        }
                        let got = setup.run_scored(kernel, &seqs, scoring);
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
                let kernels = all_kernels().into_iter().filter(|k| k.available(hd));
                for (kernel, scoring) in kernels.flat_map(|k| scorings(hd).map(|s| (k, s))) {
                    let whole = setup.run_scored(kernel, &setup.seqs(&[(0, 0, total)]), scoring);
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
                                scoring,
                                &setup.q[start * setup.q_stride..],
                                setup.q_stride,
                                &mut out,
                            );
                            assert_eq!(
                                out,
                                whole[start * width..(start + len) * width],
                                "{kernel:?} {scoring:?}, shape {case}, pieces of {piece}, at {start}"
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
                    let pool = &setup.pool;
                    attention_with(kernel, pool, 0, &seqs, h, scoring, &q, qs, &mut mixed);
                    assert_eq!(
                        mixed[40 * width..],
                        whole[..],
                        "{kernel:?} {scoring:?}, shape {case}, mixed"
                    );
                }
            }
        }
    }

    /// One layer of SmolLM2-135M's attention, per kernel and KV dtype: a
    /// 2,048-token prefill in one step and one decode row at depth 2,048, the
    /// best of twenty timings.
    /// `cargo test --release -p pie-model attention_throughput -- --ignored --nocapture`
    /// (`MB_KERNEL=Avx2` for one kernel; `MB_HEADS=16,8,128` for other
    /// heads, Qwen3-0.6B's here; `MB_TOKENS=512` for another length,
    /// `MB_PAGE=32` another page size).
    #[test]
    #[ignore]
    fn attention_throughput() {
        let var = |name: &str| std::env::var(name).ok();
        let heads: Vec<usize> = var("MB_HEADS").map_or(vec![9, 3, 64], |v| {
            v.split(',')
                .map(|x| x.parse().expect("MB_HEADS: three numbers"))
                .collect()
        });
        let h = Heads {
            heads: heads[0],
            kv_heads: heads[1],
            head_dim: heads[2],
        };
        let n = var("MB_TOKENS").map_or(2048, |v| v.parse().expect("MB_TOKENS: a number"));
        let page_size = var("MB_PAGE").map_or(16, |v| v.parse().expect("MB_PAGE: a number"));
        // Aggregate decode: 32 sequences one row each, at depth 128.
        let (batch, depth) = (32, 128);
        let only = std::env::var("MB_KERNEL").ok();
        for dtype in DTYPES {
            let mut lens = vec![depth + 1; batch];
            lens.insert(0, n + 1);
            let setup = Setup::new(dtype, 1, page_size, h, &lens, n);
            let decode_batch: Vec<_> = (1..=batch).map(|t| (t, depth, 1)).collect();
            let (prefill, decode) = (format!("prefill {n}"), format!("decode at {n}"));
            let cases: [(&str, Vec<_>); 3] = [
                (&prefill, vec![(0, 0, n)]),
                (&decode, vec![(0, n, 1)]),
                ("decode 32 at 128", decode_batch),
            ];
            for kernel in all_kernels()
                .into_iter()
                .filter(|k| k.available(h.head_dim))
            {
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
