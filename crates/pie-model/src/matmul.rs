//! Quantised linear layers: `x (rows x k) @ w^T (k x n)`.
//!
//! Weights are stored in 32-element blocks, either 4-bit (`d * q + m`, GGML's
//! Q4_1, which Q4_0 maps onto exactly) or 8-bit (`d * q`, Q8_0). Every other GGUF
//! type is dequantised and requantised to 8-bit. Activations are quantised to 8
//! bits once per call (per row and block, like GGML's Q8_1).
//!
//! The AVX2 kernel multiplies a tile of rows by a tile of columns, so each
//! unpacked weight vector serves several rows and each activation vector several
//! columns, and calls run in parallel over column ranges. Rows are stored in the
//! kernel's element order (see [`kernel_order`]), in which eight blocks' integer
//! dot products accumulate side by side in one register: the block scales then
//! apply as one vector multiply per eight blocks instead of a broadcast per block.
//!
//! A row's result never depends on which other rows share the call: every
//! (row, column) pair accumulates in the same order whatever the tile shape.

use half::f16;
use rayon::prelude::*;

const BLOCK: usize = 32;
/// Blocks per scale vector: scales are stored padded (with zeros) to a multiple
/// of this, so the kernel loads and converts eight at once.
const GROUP: usize = 8;

enum Quants {
    /// 4-bit values, two per byte, in kernel order (see [`pack_q4`]); `m` holds
    /// the per-block minimum, padded like the scales.
    Q4 { qs: Vec<u8>, m: Vec<f16> },
    /// One signed byte per element, in `-127..=127`, in kernel order.
    Q8 { qs: Vec<i8> },
}

/// A weight matrix of `n` output rows by `k` inputs, in 32-element blocks.
pub struct QWeight {
    n: usize,
    /// Inputs the caller passes; `k` is this rounded up to a whole block.
    k_in: usize,
    k: usize,
    /// Block scales, `n` rows of `k / 32` padded to a multiple of [`GROUP`].
    d: Vec<f16>,
    quants: Quants,
    /// `kernel_order(k)`, kept so each call's activations are laid out without
    /// recomputing it.
    order: Vec<u32>,
}

/// A GGML 4-bit block as stored in GGUF.
pub enum Q4Source {
    /// `d: f16, qs: [u8; 16]`, value `d * (q - 8)`.
    Q4_0,
    /// `d: f16, m: f16, qs: [u8; 16]`, value `d * q + m`.
    Q4_1,
}

/// The runs of blocks the kernel works in, as `(first block, blocks)`: groups of
/// eight, then the rest as at most one run each of four, two and one.
fn runs(nb: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut b = 0;
    for g in [8, 4, 2, 1] {
        while nb - b >= g {
            out.push((b, g));
            b += g;
        }
    }
    out
}

/// For each position of a row in kernel order, the element it holds. A run of
/// `g` blocks is `g` vectors of 32 bytes in which byte `j` of vector `v` is
/// element `v * w + j % w` of the run's block `j / w`, with `w = 32 / g`. Summing
/// byte quads (maddubs, then madd) leaves i32 lane `l` of every vector with the
/// single block `l * g / 8`, so the run's dot products sit side by side.
fn kernel_order(k: usize) -> Vec<u32> {
    let mut order = Vec::with_capacity(k);
    for (start, g) in runs(k / BLOCK) {
        let w = BLOCK / g;
        for v in 0..g {
            order.extend((0..BLOCK).map(|j| ((start + j / w) * BLOCK + v * w + j % w) as u32));
        }
    }
    order
}

/// Pack one row of 4-bit values (in kernel order) at two per byte, run by run:
/// in a run of two or more blocks each 32 bytes hold a pair of vectors (the first
/// in the low nibbles), so one load and two masks unpack 64 values; a single block
/// keeps GGML's layout (element `j` low, element `j + 16` high).
fn pack_q4(q: &[u8], out: &mut Vec<u8>) {
    for (start, g) in runs(q.len() / BLOCK) {
        let run = &q[start * BLOCK..(start + g) * BLOCK];
        if g == 1 {
            out.extend((0..16).map(|j| run[j] | run[j + 16] << 4));
        } else {
            for pair in run.chunks_exact(2 * BLOCK) {
                out.extend((0..BLOCK).map(|j| pair[j] | pair[j + BLOCK] << 4));
            }
        }
    }
}

/// The 4-bit value at kernel-order position `pos` of a row packed by [`pack_q4`].
fn unpack_q4(row: &[u8], pos: usize) -> u8 {
    let (start, g) = runs(row.len() * 2 / BLOCK)
        .into_iter()
        .find(|&(s, g)| pos < (s + g) * BLOCK)
        .expect("position inside the row");
    let (v, j) = ((pos - start * BLOCK) / BLOCK, pos % BLOCK);
    let base = &row[start * BLOCK / 2..];
    let byte = if g == 1 {
        base[j % 16] >> (4 * (j / 16))
    } else {
        base[v / 2 * BLOCK + j] >> (4 * (v % 2))
    };
    byte & 0xf
}

impl QWeight {
    fn blocks(&self) -> usize {
        self.k / BLOCK
    }

    fn padded_blocks(&self) -> usize {
        self.blocks().next_multiple_of(GROUP)
    }

    /// Row-major f32 weights (`n x k_in`), quantised to 8 bits per 32-block.
    pub fn from_f32(w: &[f32], n: usize, k_in: usize) -> Self {
        assert_eq!(w.len(), n * k_in, "weight size");
        let k = k_in.next_multiple_of(BLOCK);
        let nbp = (k / BLOCK).next_multiple_of(GROUP);
        let order = kernel_order(k);
        let mut d = vec![f16::ZERO; n * nbp];
        let mut qs = Vec::with_capacity(n * k);
        let mut padded = vec![0f32; k];
        let mut q = vec![0i8; k];
        for (row, src) in w.chunks_exact(k_in).enumerate() {
            padded[..k_in].copy_from_slice(src);
            for (b, (x, q)) in padded
                .chunks_exact(BLOCK)
                .zip(q.chunks_exact_mut(BLOCK))
                .enumerate()
            {
                d[row * nbp + b] = f16::from_f32(quantize_block(x, q));
            }
            qs.extend(order.iter().map(|&i| q[i as usize]));
        }
        Self {
            n,
            k_in,
            k,
            d,
            quants: Quants::Q8 { qs },
            order,
        }
    }

    /// Raw GGUF 4-bit blocks of an `n x k` matrix; the values stay exactly as they are.
    pub fn from_q4(raw: &[u8], source: Q4Source, n: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(BLOCK), "4-bit rows are whole blocks");
        let nb = k / BLOCK;
        let nbp = nb.next_multiple_of(GROUP);
        let block_bytes = match source {
            Q4Source::Q4_0 => 18,
            Q4Source::Q4_1 => 20,
        };
        assert_eq!(raw.len(), n * nb * block_bytes, "4-bit weight size");
        let order = kernel_order(k);
        let mut d = vec![f16::ZERO; n * nbp];
        let mut m = vec![f16::ZERO; n * nbp];
        let mut qs = Vec::with_capacity(n * k / 2);
        let mut q = vec![0u8; k];
        let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]);
        for (row, blocks) in raw.chunks_exact(nb * block_bytes).enumerate() {
            for (b, blk) in blocks.chunks_exact(block_bytes).enumerate() {
                let at = row * nbp + b;
                d[at] = half(blk);
                m[at] = match source {
                    // `d * (q - 8)` is `d * q + (-8 d)`; scaling by 8 is exact in f16.
                    Q4Source::Q4_0 => f16::from_f32(-8.0 * d[at].to_f32()),
                    Q4Source::Q4_1 => half(&blk[2..]),
                };
                for (j, &byte) in blk[block_bytes - 16..].iter().enumerate() {
                    q[b * BLOCK + j] = byte & 0xf;
                    q[b * BLOCK + j + 16] = byte >> 4;
                }
            }
            let ordered: Vec<u8> = order.iter().map(|&i| q[i as usize]).collect();
            pack_q4(&ordered, &mut qs);
        }
        Self {
            n,
            k_in: k,
            k,
            d,
            quants: Quants::Q4 { qs, m },
            order,
        }
    }

    /// Rows concatenated (e.g. Q, K and V fused into one matmul). All parts must
    /// share `k` and the storage kind.
    pub fn concat(parts: Vec<QWeight>) -> Self {
        let mut it = parts.into_iter();
        let mut w = it.next().expect("at least one part");
        for p in it {
            assert_eq!((p.k, p.k_in), (w.k, w.k_in), "fused weights share inputs");
            w.n += p.n;
            w.d.extend(p.d);
            match (&mut w.quants, p.quants) {
                (Quants::Q4 { qs, m }, Quants::Q4 { qs: q2, m: m2 }) => {
                    qs.extend(q2);
                    m.extend(m2);
                }
                (Quants::Q8 { qs }, Quants::Q8 { qs: q2 }) => qs.extend(q2),
                _ => panic!("fused weights share a storage kind"),
            }
        }
        w
    }

    /// `x (rows x k_in) @ self^T`, row-major `rows x n`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k_in, "activation size");
        let acts = Acts::quantize(x, rows, self.k_in, &self.order);
        let kernel = Kernel::detect();
        // Enough column ranges to balance the pool's threads, but each a few
        // dozen columns so a task's work dwarfs the scheduling.
        let tasks = rayon::current_num_threads() * 4;
        let cols = self.n.div_ceil(tasks).next_multiple_of(8).max(32);
        let parts: Vec<(usize, Vec<f32>)> = (0..self.n.div_ceil(cols))
            .into_par_iter()
            .map(|t| {
                let c0 = t * cols;
                let nc = cols.min(self.n - c0);
                let mut out = vec![0f32; rows * nc];
                kernel.run(self, &acts, c0, nc, &mut out);
                (c0, out)
            })
            .collect();
        let mut out = vec![0f32; rows * self.n];
        for (c0, part) in parts {
            let nc = part.len() / rows;
            for (dst, src) in out.chunks_exact_mut(self.n).zip(part.chunks_exact(nc)) {
                dst[c0..c0 + nc].copy_from_slice(src);
            }
        }
        out
    }
}

/// Quantise 32 values to `d * q`; returns `d`. The same rule for weights and
/// activations: `d = max|x| / 127`, `q = round(x / d)`, so `|q| <= 127` (the
/// kernel's 16-bit sums rely on it).
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    d
}

/// Activations quantised per row and 32-block: values `d * q` (in kernel order),
/// plus `s = d * sum(q)` for the 4-bit weights' minimum term. Scales are padded
/// like [`QWeight::d`].
struct Acts {
    k: usize,
    nbp: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Acts {
    /// `order` is the weight's `kernel_order(k)`. Rows are independent, so a
    /// prefill's thousands of blocks are quantised in parallel.
    fn quantize(x: &[f32], rows: usize, k_in: usize, order: &[u32]) -> Self {
        let k = order.len();
        let nbp = (k / BLOCK).next_multiple_of(GROUP);
        let mut a = Self {
            k,
            nbp,
            qs: vec![0; rows * k],
            d: vec![0.0; rows * nbp],
            s: vec![0.0; rows * nbp],
        };
        a.qs.par_chunks_mut(k)
            .zip(a.d.par_chunks_mut(nbp))
            .zip(a.s.par_chunks_mut(nbp))
            .zip(x.par_chunks(k_in))
            .with_min_len(16)
            .for_each_init(
                || (vec![0f32; k], vec![0i8; k]),
                |(padded, q), (((qs, d), s), src)| {
                    padded[..k_in].copy_from_slice(src);
                    for (b, (x, q)) in padded
                        .chunks_exact(BLOCK)
                        .zip(q.chunks_exact_mut(BLOCK))
                        .enumerate()
                    {
                        d[b] = quantize_block(x, q);
                        s[b] = d[b] * q.iter().map(|&v| v as i32).sum::<i32>() as f32;
                    }
                    for (dst, &i) in qs.iter_mut().zip(order) {
                        *dst = q[i as usize];
                    }
                },
            );
        a
    }
}

/// Which implementation runs, chosen once per call from the CPU's features.
#[derive(Clone, Copy)]
enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Kernel {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Kernel::Avx2;
        }
        Kernel::Portable
    }

    /// Output columns `c0..c0 + nc` for every row, into `out` (`rows x nc`).
    fn run(self, w: &QWeight, a: &Acts, c0: usize, nc: usize, out: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` checked the CPU has AVX2, FMA and F16C.
            Kernel::Avx2 => unsafe { avx2::run(w, a, c0, nc, out) },
            Kernel::Portable => portable(w, a, c0, nc, out),
        }
    }
}

/// Plain per-(row, column) dot products over the same data, block by block.
fn portable(w: &QWeight, a: &Acts, c0: usize, nc: usize, out: &mut [f32]) {
    let (nb, nbp, k) = (w.blocks(), w.padded_blocks(), w.k);
    let runs = runs(nb);
    for (r, out) in out.chunks_exact_mut(nc).enumerate() {
        let aq = &a.qs[r * k..][..k];
        for (j, o) in out.iter_mut().enumerate() {
            let c = c0 + j;
            let weight = |pos: usize| -> i32 {
                match &w.quants {
                    Quants::Q4 { qs, .. } => unpack_q4(&qs[c * k / 2..][..k / 2], pos) as i32,
                    Quants::Q8 { qs } => qs[c * k + pos] as i32,
                }
            };
            let mut acc = 0f32;
            for &(start, g) in &runs {
                let width = BLOCK / g;
                let mut dots = [0i32; GROUP];
                for pos in start * BLOCK..(start + g) * BLOCK {
                    dots[pos % BLOCK / width] += weight(pos) * aq[pos] as i32;
                }
                for (b, dot) in (start..).zip(&dots[..g]) {
                    acc += w.d[c * nbp + b].to_f32() * a.d[r * nbp + b] * *dot as f32;
                    if let Quants::Q4 { m, .. } = &w.quants {
                        acc += m[c * nbp + b].to_f32() * a.s[r * nbp + b];
                    }
                }
            }
            *o = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Acts, QWeight, Quants, BLOCK, GROUP};

    /// Tile shapes: four rows by two columns while four rows remain (each
    /// unpacked weight vector serves four rows), then single rows by four columns.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn run(w: &QWeight, a: &Acts, c0: usize, nc: usize, out: &mut [f32]) {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.gen::<f32>() * 2.0 - 1.0).collect()
    }

    /// f32 math on `w` and on `x` rounded the way `Acts` rounds it (to 8 bits per
    /// 32-block), so any difference is the kernels' arithmetic, not quantisation.
    fn reference(w: &[f32], x: &[f32], n: usize, k: usize) -> Vec<f32> {
        assert_eq!(w.len(), n * k);
        let mut x = x.to_vec();
        let mut q = [0i8; 32];
        for row in x.chunks_exact_mut(k) {
            for blk in row.chunks_mut(32) {
                let d = quantize_block(blk, &mut q);
                for (v, q) in blk.iter_mut().zip(q) {
                    *v = d * q as f32;
                }
            }
        }
        x.chunks_exact(k)
            .flat_map(|row| {
                w.chunks_exact(k)
                    .map(|col| col.iter().zip(row).map(|(a, b)| a * b).sum::<f32>())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// GGML Q4_1 blocks of `w`, the way llama.cpp's quantiser writes them.
    fn q4_1_blocks(w: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut raw = Vec::new();
        let mut deq = Vec::new();
        for x in w.chunks_exact(32) {
            let (lo, hi) = x
                .iter()
                .fold((f32::MAX, f32::MIN), |(l, h), v| (l.min(*v), h.max(*v)));
            let d = f16::from_f32((hi - lo) / 15.0);
            let m = f16::from_f32(lo);
            let q: Vec<u8> = x
                .iter()
                .map(|v| (((v - m.to_f32()) / d.to_f32()).round() as i32).clamp(0, 15) as u8)
                .collect();
            raw.extend(d.to_le_bytes());
            raw.extend(m.to_le_bytes());
            raw.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
            deq.extend(q.iter().map(|&q| d.to_f32() * q as f32 + m.to_f32()));
        }
        (raw, deq)
    }

    /// The f32 matrix an 8-bit `QWeight` stores (`n x k_in`).
    fn q8_dequant(w: &QWeight) -> Vec<f32> {
        let Quants::Q8 { qs } = &w.quants else {
            panic!("8-bit weight expected")
        };
        let (nbp, order) = (w.padded_blocks(), kernel_order(w.k));
        let mut out = Vec::new();
        for (c, row) in qs.chunks_exact(w.k).enumerate() {
            let mut logical = vec![0f32; w.k];
            for (&i, &q) in order.iter().zip(row) {
                let i = i as usize;
                logical[i] = w.d[c * nbp + i / BLOCK].to_f32() * q as f32;
            }
            out.extend_from_slice(&logical[..w.k_in]);
        }
        out
    }

    fn assert_close(got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w}");
        }
    }

    fn run_with(kernel: Kernel, w: &QWeight, x: &[f32], rows: usize) -> Vec<f32> {
        let acts = Acts::quantize(x, rows, w.k_in, &w.order);
        let mut out = vec![0f32; rows * w.n];
        kernel.run(w, &acts, 0, w.n, &mut out);
        out
    }

    fn kernels() -> Vec<Kernel> {
        let mut ks = vec![Kernel::Portable];
        if !matches!(Kernel::detect(), Kernel::Portable) {
            ks.push(Kernel::detect());
        }
        ks
    }

    #[test]
    fn q4_matches_reference() {
        let mut rng = StdRng::seed_from_u64(1);
        // Block counts 10, 15 and 48 cover runs of every length (8, 4, 2, 1).
        for (n, k, rows) in [(37, 320, 11), (9, 480, 6), (16, 1536, 4)] {
            let (raw, deq) = q4_1_blocks(&random(&mut rng, n * k));
            let w = QWeight::from_q4(&raw, Q4Source::Q4_1, n, k);
            let x = random(&mut rng, rows * k);
            let want = reference(&deq, &x, n, k);
            for kernel in kernels() {
                assert_close(&run_with(kernel, &w, &x, rows), &want, 1e-3);
            }
            assert_close(&w.forward(&x, rows), &want, 1e-3);
        }
    }

    #[test]
    fn q4_0_maps_exactly() {
        let mut rng = StdRng::seed_from_u64(2);
        let (n, k) = (5, 64);
        // Q4_0 blocks: d, then nibbles meaning d * (q - 8).
        let mut raw = Vec::new();
        let mut deq = Vec::new();
        for _ in 0..n * k / 32 {
            let d = f16::from_f32(rng.gen::<f32>() * 0.1);
            let q: Vec<u8> = (0..32).map(|_| rng.gen_range(0..16)).collect();
            raw.extend(d.to_le_bytes());
            raw.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
            deq.extend(q.iter().map(|&q| d.to_f32() * (q as f32 - 8.0)));
        }
        let w = QWeight::from_q4(&raw, Q4Source::Q4_0, n, k);
        let x = random(&mut rng, 3 * k);
        assert_close(&w.forward(&x, 3), &reference(&deq, &x, n, k), 1e-3);
    }

    #[test]
    fn q8_matches_reference_with_padding() {
        let mut rng = StdRng::seed_from_u64(3);
        // k = 70 is not a whole number of blocks: rows are zero-padded.
        for (n, k, rows) in [(29, 70, 9), (64, 288, 5), (3, 32, 1)] {
            let wf = random(&mut rng, n * k);
            let w = QWeight::from_f32(&wf, n, k);
            let x = random(&mut rng, rows * k);
            let want = reference(&q8_dequant(&w), &x, n, k);
            // Within half a step (plus the f16 scale's rounding) of the f32 weights.
            assert_close(&q8_dequant(&w), &wf, 0.6 / 127.0);
            for kernel in kernels() {
                assert_close(&run_with(kernel, &w, &x, rows), &want, 1e-3);
            }
        }
    }

    #[test]
    fn concat_stacks_rows() {
        let mut rng = StdRng::seed_from_u64(4);
        let (a, b) = (random(&mut rng, 3 * 64), random(&mut rng, 5 * 64));
        let fused = QWeight::concat(vec![
            QWeight::from_f32(&a, 3, 64),
            QWeight::from_f32(&b, 5, 64),
        ]);
        let x = random(&mut rng, 2 * 64);
        assert_eq!(fused.n, 8);
        assert_close(
            &fused.forward(&x, 2),
            &reference(&q8_dequant(&fused), &x, 8, 64),
            1e-3,
        );
    }

    /// The same-tokens guarantee: a row's output is bit-identical whether it runs
    /// alone or among others, at any position in the batch.
    #[test]
    fn rows_are_independent_of_the_batch() {
        let mut rng = StdRng::seed_from_u64(5);
        let (n, k) = (70, 576);
        let (raw, _) = q4_1_blocks(&random(&mut rng, n * k));
        let q4 = QWeight::from_q4(&raw, Q4Source::Q4_1, n, k);
        let q8 = QWeight::from_f32(&random(&mut rng, n * k), n, k);
        let x = random(&mut rng, 13 * k);
        for w in [&q4, &q8] {
            let all = w.forward(&x, 13);
            for r in 0..13 {
                let alone = w.forward(&x[r * k..][..k], 1);
                assert_eq!(alone, all[r * n..][..n], "row {r}");
                let pair = w.forward(&x[r * k..(r + 1).min(12) * k + k], 1 + (r < 12) as usize);
                assert_eq!(pair[..n], all[r * n..][..n], "row {r} in a pair");
            }
        }
    }
}

/// Kernel throughput on SmolLM2-shaped matrices (random weights), the best of
/// seven timings: `cargo test --release -p pie-model kernel_throughput --
/// --ignored --nocapture`; `MB=<name>` and `MB_ROWS=1,32` narrow it.
#[cfg(test)]
mod microbench {
    use super::*;
    use rand::Rng;
    use std::time::Instant;

    #[test]
    #[ignore]
    fn kernel_throughput() {
        let mut rng = rand::thread_rng();
        let only = std::env::var("MB").ok();
        let rows_list: Vec<usize> = std::env::var("MB_ROWS")
            .map(|s| s.split(',').map(|x| x.parse().unwrap()).collect())
            .unwrap_or(vec![1, 8, 32, 512]);
        for (name, n, k, q4) in [
            ("gate_up", 3072usize, 576usize, true),
            ("lm_head", 49152, 576, false),
            ("down", 576, 1536, true),
            ("big_q4", 49152, 576, true),
        ] {
            if only.as_deref().is_some_and(|o| o != name) {
                continue;
            }
            let w = if q4 {
                let raw: Vec<u8> = (0..n * k / 32 * 20)
                    .map(|i| if i % 20 < 4 { 0x10 } else { rng.gen() })
                    .collect();
                QWeight::from_q4(&raw, Q4Source::Q4_1, n, k)
            } else {
                let wf: Vec<f32> = (0..n * k).map(|_| rng.gen::<f32>() - 0.5).collect();
                QWeight::from_f32(&wf, n, k)
            };
            for &rows in &rows_list {
                let x: Vec<f32> = (0..rows * k).map(|_| rng.gen::<f32>() - 0.5).collect();
                let reps = (4_000_000_000 / (n * k * rows)).max(1);
                let mut dt = f64::MAX;
                for _ in 0..7 {
                    let t = Instant::now();
                    for _ in 0..reps {
                        std::hint::black_box(w.forward(&x, rows));
                    }
                    dt = dt.min(t.elapsed().as_secs_f64() / reps as f64);
                }
                let bytes = n * k / 32 * if q4 { 20 } else { 34 };
                println!(
                    "{name} n={n} k={k} rows={rows}: {:.3} ms, {:.2} GB/s, {:.1} GMAC/s",
                    dt * 1e3,
                    bytes as f64 / dt / 1e9,
                    (n * k * rows) as f64 / dt / 1e9
                );
            }
        }
    }
}
