//! The stored forms the kernels read: [`QWeight`] (a weight matrix in 32-element
//! blocks, 4- or 8-bit, in kernel order) and its construction, [`Acts`]
//! (activations quantised once per call) and [`Out`] (where a call's results go).

use half::f16;
use rayon::prelude::*;

use super::layout::{kernel_order, pack_q4, pack_q6, BLOCK, GROUP};
use super::quantize::{self, quantize_block};
use crate::ggml_blocks::{q4k_nibbles, BlockType, Q4kSteps, Q6kParts};

pub(super) enum Quants {
    /// 4-bit values, two per byte, in kernel order (see `layout::pack_q4`); `m` holds
    /// the per-block minimum, in the form of the scales.
    Q4 { qs: Vec<u8>, m: Scales },
    /// One signed byte per element, in `-127..=127`, in kernel order.
    Q8 { qs: Vec<i8> },
    /// Q6_K's values `q` in `0..64` (each weight `d * (q - 32)`), in kernel
    /// order as low nibbles and high bit pairs (see `layout::pack_q6`). A
    /// Q6_K scale covers 16 values, half a block: the weight's `d` holds each
    /// block's first half's, `d_hi` its second half's.
    Q6 {
        lo: Vec<u8>,
        hi: Vec<u8>,
        d_hi: Scales,
    },
}

/// A weight matrix of `n` output rows by `k` inputs, in 32-element blocks.
pub struct QWeight {
    pub(super) n: usize,
    /// Inputs the caller passes; `k` is this rounded up to a whole block.
    pub(super) k_in: usize,
    pub(super) k: usize,
    /// Block scales, `n` rows of `k / 32` padded to a multiple of [`GROUP`].
    pub(super) d: Scales,
    pub(super) quants: Quants,
    /// `kernel_order(k)`, kept so each call's activations are laid out without
    /// recomputing it.
    pub(super) order: Vec<u32>,
    /// The weights as f32, made on the first `forward_float` (see `float.rs`).
    pub(super) float: std::sync::OnceLock<Vec<f32>>,
}

/// A GGML 4-bit block type as stored in GGUF.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q4Source {
    /// `d: f16, qs: [u8; 16]`, value `d * (q - 8)`.
    Q4_0,
    /// `d: f16, m: f16, qs: [u8; 16]`, value `d * q + m`.
    Q4_1,
    /// 256-value super-blocks of eight `d * sc * q - dmin * m` sub-blocks
    /// (see `ggml_blocks::Q4kSteps`), kept as [`Scales::Stepped`].
    Q4K,
}

/// One number per block (a scale, or a 4-bit block's minimum), `n` rows of
/// [`QWeight::padded_blocks`] each (the padding zero).
pub(super) enum Scales {
    /// An f16 per block.
    Half(Vec<f16>),
    /// The K-quants' own form: an f16 `unit` per group of [`GROUP`] blocks
    /// (one super-block) times a small integer `step` per block, exact, and
    /// with the values 4.5 bits a weight for Q4_K where an f16 per block made
    /// it 5.
    Stepped { unit: Vec<f16>, step: Vec<i8> },
}

impl Scales {
    /// Block `i`'s number, `i` counting blocks from row 0's first.
    pub(super) fn get(&self, i: usize) -> f32 {
        match self {
            Scales::Half(h) => h[i].to_f32(),
            Scales::Stepped { unit, step } => unit[i / GROUP].to_f32() * f32::from(step[i]),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Scales::Half(h) => std::mem::size_of_val(h.as_slice()),
            Scales::Stepped { unit, step } => std::mem::size_of_val(unit.as_slice()) + step.len(),
        }
    }

    fn same_form(&self, other: &Scales) -> bool {
        matches!(
            (self, other),
            (Scales::Half(_), Scales::Half(_)) | (Scales::Stepped { .. }, Scales::Stepped { .. })
        )
    }

    /// `other`'s rows after these (both of one form).
    fn append(&mut self, other: Scales) {
        match (self, other) {
            (Scales::Half(h), Scales::Half(h2)) => h.extend(h2),
            (Scales::Stepped { unit, step }, Scales::Stepped { unit: u2, step: s2 }) => {
                unit.extend(u2);
                step.extend(s2);
            }
            _ => panic!("fused weights share a scale form"),
        }
    }
}

/// One 32-value block as the 4-bit store keeps it: `d * q + m`.
struct Q4Block {
    d: f16,
    m: f16,
    q: [u8; BLOCK],
}

impl Q4Source {
    fn block_type(self) -> BlockType {
        match self {
            Q4Source::Q4_0 => BlockType::Q4_0,
            Q4Source::Q4_1 => BlockType::Q4_1,
            Q4Source::Q4K => BlockType::Q4K,
        }
    }
}

/// The nibbles of a Q4_0/Q4_1 block's 16 bytes, in value order.
fn legacy_nibbles(qs: &[u8]) -> [u8; BLOCK] {
    std::array::from_fn(|j| (qs[j % 16] >> (4 * (j / 16))) & 0xF)
}

fn half(b: &[u8]) -> f16 {
    f16::from_le_bytes([b[0], b[1]])
}

/// A Q4_0 block (`d: f16, qs`) as the store keeps it, exactly: `d * (q -
/// 8)` is `d * q + (-8 d)`, and scaling by 8 is exact in f16.
fn q4_0_block(blk: &[u8]) -> Q4Block {
    Q4Block {
        d: half(blk),
        m: f16::from_f32(-8.0 * half(blk).to_f32()),
        q: legacy_nibbles(&blk[2..18]),
    }
}

/// A Q4_1 block (`d: f16, m: f16, qs`) as the store keeps it, exactly.
fn q4_1_block(blk: &[u8]) -> Q4Block {
    Q4Block {
        d: half(blk),
        m: half(&blk[2..]),
        q: legacy_nibbles(&blk[4..20]),
    }
}

/// A row of Q4_K super-blocks: its values (file order) into `q`, its
/// scales and minimums into `d` and `m`, the row's first super-block being
/// `first`.
fn q4k_row(stored: &[u8], q: &mut [u8], first: usize, d: &mut Steps, m: &mut Steps) {
    for (sb, blk) in stored.chunks_exact(BlockType::Q4K.bytes()).enumerate() {
        let steps = Q4kSteps::of(blk);
        d.set(first + sb, steps.d, steps.sc.map(|s| s as i8));
        m.set(first + sb, -steps.dmin, steps.m.map(|s| s as i8));
        for i in 0..GROUP {
            q[(sb * GROUP + i) * BLOCK..][..BLOCK].copy_from_slice(&q4k_nibbles(blk, i));
        }
    }
}

/// [`Scales::Stepped`] being read from a file, a super-block at a time.
struct Steps {
    unit: Vec<f16>,
    step: Vec<i8>,
}

impl Steps {
    /// For `blocks` blocks (whole groups).
    fn new(blocks: usize) -> Self {
        Self {
            unit: vec![f16::ZERO; blocks / GROUP],
            step: vec![0; blocks],
        }
    }

    /// Super-block `sb`: its unit and its [`GROUP`] blocks' steps.
    fn set(&mut self, sb: usize, unit: f16, steps: [i8; GROUP]) {
        self.unit[sb] = unit;
        self.step[sb * GROUP..][..GROUP].copy_from_slice(&steps);
    }

    fn done(self) -> Scales {
        Scales::Stepped {
            unit: self.unit,
            step: self.step,
        }
    }
}

/// `q` (one row, element order) in `order`, the kernels' order.
fn in_order<'a, T: Copy>(order: &'a [u32], q: &'a [T]) -> impl Iterator<Item = T> + 'a {
    order.iter().map(|&i| q[i as usize])
}

impl QWeight {
    pub(super) fn blocks(&self) -> usize {
        self.k / BLOCK
    }

    /// The bytes the matrix is stored in: quantised values and block scales
    /// (and minimums), padding included, as the kernels read them.
    pub(crate) fn bytes(&self) -> usize {
        let quants = match &self.quants {
            Quants::Q4 { qs, m } => qs.len() + m.bytes(),
            Quants::Q8 { qs } => qs.len(),
            Quants::Q6 { lo, hi, d_hi } => lo.len() + hi.len() + d_hi.bytes(),
        };
        quants + self.d.bytes()
    }

    /// The block scales and the second set a kernel reads: a 4-bit
    /// weight's minimums, a Q6_K weight's second halves' scales, or for an
    /// 8-bit weight (which has none) the scales again.
    pub(super) fn scales(&self) -> (&Scales, &Scales) {
        match &self.quants {
            Quants::Q4 { m, .. } => (&self.d, m),
            Quants::Q6 { d_hi, .. } => (&self.d, d_hi),
            Quants::Q8 { .. } => (&self.d, &self.d),
        }
    }

    /// The bytes of one output row's quantised values (scales excluded).
    pub(super) fn row_bytes(&self) -> usize {
        match &self.quants {
            Quants::Q4 { .. } => self.k / 2,
            Quants::Q6 { .. } => self.k * 3 / 4,
            Quants::Q8 { .. } => self.k,
        }
    }

    pub(super) fn is_q6(&self) -> bool {
        matches!(self.quants, Quants::Q6 { .. })
    }

    pub(super) fn padded_blocks(&self) -> usize {
        self.blocks().next_multiple_of(GROUP)
    }

    /// Output rows (the matrix's height).
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Row-major f32 weights (`n x k_in`), quantised to 8 bits per 32-block.
    pub fn from_f32(w: &[f32], n: usize, k_in: usize) -> Self {
        assert_eq!(w.len(), n * k_in, "weight size");
        Self::from_rows(n, k_in, |row, dst| {
            dst.copy_from_slice(&w[row * k_in..][..k_in])
        })
    }

    /// As [`QWeight::from_f32`], each row written by `fill(row, dst)` in
    /// turn, so a matrix is quantised without ever being whole in f32.
    pub fn from_rows(n: usize, k_in: usize, mut fill: impl FnMut(usize, &mut [f32])) -> Self {
        let k = k_in.next_multiple_of(BLOCK);
        let nbp = (k / BLOCK).next_multiple_of(GROUP);
        let order = kernel_order(k);
        let mut d = vec![f16::ZERO; n * nbp];
        let mut qs = Vec::with_capacity(n * k);
        let mut padded = vec![0f32; k];
        let mut q = vec![0i8; k];
        for row in 0..n {
            fill(row, &mut padded[..k_in]);
            for (b, (x, q)) in padded
                .chunks_exact(BLOCK)
                .zip(q.chunks_exact_mut(BLOCK))
                .enumerate()
            {
                d[row * nbp + b] = f16::from_f32(quantize_block(x, q));
            }
            qs.extend(in_order(&order, &q));
        }
        Self {
            n,
            k_in,
            k,
            d: Scales::Half(d),
            quants: Quants::Q8 { qs },
            order,
            float: Default::default(),
        }
    }

    /// Raw GGUF 4-bit blocks of an `n x k` matrix, their values kept exactly
    /// (Q4_K's scales in their own form, see [`Scales::Stepped`]).
    pub fn from_q4(raw: &[u8], source: Q4Source, n: usize, k: usize) -> Self {
        let kind = source.block_type();
        assert!(
            k.is_multiple_of(kind.values()),
            "4-bit rows are whole blocks"
        );
        let nb = k / BLOCK;
        let nbp = nb.next_multiple_of(GROUP);
        let row_bytes = k / kind.values() * kind.bytes();
        assert_eq!(raw.len(), n * row_bytes, "4-bit weight size");
        let order = kernel_order(k);
        let mut qs = Vec::with_capacity(n * k / 2);
        let mut q = vec![0u8; k];
        let pack_row = |q: &[u8], qs: &mut Vec<u8>| {
            pack_q4(&in_order(&order, q).collect::<Vec<_>>(), qs);
        };
        let rows = raw.chunks_exact(row_bytes).enumerate();
        let read: fn(&[u8]) -> Q4Block = match source {
            Q4Source::Q4K => {
                let (mut d, mut m) = (Steps::new(n * nbp), Steps::new(n * nbp));
                for (row, stored) in rows {
                    q4k_row(stored, &mut q, row * nbp / GROUP, &mut d, &mut m);
                    pack_row(&q, &mut qs);
                }
                return Self::q4(n, k, d.done(), m.done(), qs, order);
            }
            Q4Source::Q4_0 => q4_0_block,
            Q4Source::Q4_1 => q4_1_block,
        };
        let (mut d, mut m) = (vec![f16::ZERO; n * nbp], vec![f16::ZERO; n * nbp]);
        for (row, stored) in rows {
            for (b, blk) in stored.chunks_exact(kind.bytes()).enumerate() {
                let block = read(blk);
                d[row * nbp + b] = block.d;
                m[row * nbp + b] = block.m;
                q[b * BLOCK..][..BLOCK].copy_from_slice(&block.q);
            }
            pack_row(&q, &mut qs);
        }
        Self::q4(n, k, Scales::Half(d), Scales::Half(m), qs, order)
    }

    /// A 4-bit weight of its parts.
    fn q4(n: usize, k: usize, d: Scales, m: Scales, qs: Vec<u8>, order: Vec<u32>) -> Self {
        Self {
            n,
            k_in: k,
            k,
            d,
            quants: Quants::Q4 { qs, m },
            order,
            float: Default::default(),
        }
    }

    /// Raw GGUF Q8_0 blocks (`d: f16, qs: [i8; 32]`) of an `n x k` matrix,
    /// kept exactly; `None` when a value is -128 (the kernels' sums need
    /// `|q| <= 127`, and ggml's quantiser never writes it).
    pub fn from_q8_0(raw: &[u8], n: usize, k: usize) -> Option<Self> {
        const Q8_0_BYTES: usize = 34;
        assert!(k.is_multiple_of(BLOCK), "8-bit rows are whole blocks");
        let nb = k / BLOCK;
        let nbp = nb.next_multiple_of(GROUP);
        assert_eq!(raw.len(), n * nb * Q8_0_BYTES, "Q8_0 weight size");
        let order = kernel_order(k);
        let mut d = vec![f16::ZERO; n * nbp];
        let mut qs = Vec::with_capacity(n * k);
        let mut q = vec![0i8; k];
        for (row, stored) in raw.chunks_exact(nb * Q8_0_BYTES).enumerate() {
            for (b, blk) in stored.chunks_exact(Q8_0_BYTES).enumerate() {
                d[row * nbp + b] = f16::from_le_bytes([blk[0], blk[1]]);
                for (dst, &byte) in q[b * BLOCK..][..BLOCK].iter_mut().zip(&blk[2..]) {
                    *dst = byte as i8;
                }
            }
            if q.contains(&i8::MIN) {
                return None;
            }
            qs.extend(in_order(&order, &q));
        }
        Some(Self {
            n,
            k_in: k,
            k,
            d: Scales::Half(d),
            quants: Quants::Q8 { qs },
            order,
            float: Default::default(),
        })
    }

    /// Raw GGUF Q6_K super-blocks of an `n x k` matrix, kept exactly (see
    /// [`Quants::Q6`]): 6.6 bits a weight where widening made 8.5.
    pub fn from_q6k(raw: &[u8], n: usize, k: usize) -> Self {
        let kind = BlockType::Q6K;
        assert!(
            k.is_multiple_of(kind.values()),
            "Q6_K rows are whole super-blocks"
        );
        let nbp = k / BLOCK;
        let row_bytes = k / kind.values() * kind.bytes();
        assert_eq!(raw.len(), n * row_bytes, "Q6_K weight size");
        let order = kernel_order(k);
        let mut halves = [Steps::new(n * nbp), Steps::new(n * nbp)];
        let (mut lo, mut hi) = (Vec::with_capacity(n * k / 2), Vec::with_capacity(n * k / 4));
        let mut q = vec![0u8; k];
        for (row, stored) in raw.chunks_exact(row_bytes).enumerate() {
            for (sb, blk) in stored.chunks_exact(kind.bytes()).enumerate() {
                let parts = Q6kParts::of(blk);
                for (h, steps) in halves.iter_mut().enumerate() {
                    let half = std::array::from_fn(|b| parts.sc[2 * b + h]);
                    steps.set(row * nbp / GROUP + sb, parts.d, half);
                }
                q[sb * kind.values()..][..kind.values()].copy_from_slice(&parts.q);
            }
            pack_q6(&in_order(&order, &q).collect::<Vec<_>>(), &mut lo, &mut hi);
        }
        let [first, second] = halves;
        Self {
            n,
            k_in: k,
            k,
            d: first.done(),
            quants: Quants::Q6 {
                lo,
                hi,
                d_hi: second.done(),
            },
            order,
            float: Default::default(),
        }
    }

    /// Whether `other` is stored as this is (4-bit or 8-bit blocks, scales
    /// of one form), so the two can be concatenated.
    pub(super) fn same_kind(&self, other: &QWeight) -> bool {
        let quants = matches!(
            (&self.quants, &other.quants),
            (Quants::Q4 { .. }, Quants::Q4 { .. })
                | (Quants::Q8 { .. }, Quants::Q8 { .. })
                | (Quants::Q6 { .. }, Quants::Q6 { .. })
        );
        quants && self.d.same_form(&other.d)
    }

    /// Rows concatenated (e.g. Q, K and V fused into one matmul). All parts must
    /// share `k` and the storage kind.
    pub fn concat(parts: Vec<QWeight>) -> Self {
        let mut it = parts.into_iter();
        let mut w = it.next().expect("at least one part");
        for p in it {
            assert_eq!((p.k, p.k_in), (w.k, w.k_in), "fused weights share inputs");
            w.n += p.n;
            w.d.append(p.d);
            match (&mut w.quants, p.quants) {
                (Quants::Q4 { qs, m }, Quants::Q4 { qs: q2, m: m2 }) => {
                    qs.extend(q2);
                    m.append(m2);
                }
                (Quants::Q8 { qs }, Quants::Q8 { qs: q2 }) => qs.extend(q2),
                (
                    Quants::Q6 { lo, hi, d_hi },
                    Quants::Q6 {
                        lo: lo2,
                        hi: hi2,
                        d_hi: d2,
                    },
                ) => {
                    lo.extend(lo2);
                    hi.extend(hi2);
                    d_hi.append(d2);
                }
                _ => panic!("fused weights share a storage kind"),
            }
        }
        w
    }
}

/// Where a call's results go: `ptr` is (row 0, first column) of a row-major
/// matrix whose rows are `stride` floats apart. The tasks of one call share
/// the matrix, each writing its own columns in place (no per-task buffer to
/// allocate, clear and copy back).
#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub(super) ptr: *mut f32,
    pub(super) stride: usize,
}

// SAFETY: an `Out` is only a place to write; `QWeight::forward` gives the tasks
// sharing one disjoint columns.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The same matrix from (row `r`, column `c`) on.
    ///
    /// # Safety
    /// The element is inside the matrix.
    pub(super) unsafe fn at(self, r: usize, c: usize) -> Self {
        Self {
            ptr: self.ptr.add(r * self.stride + c),
            ..self
        }
    }

    /// Writes `values` to row `r` from column 0 on, relative to this `Out`.
    ///
    /// # Safety
    /// The elements are inside the matrix, and no other thread writes them.
    #[inline]
    pub(super) unsafe fn row(self, r: usize, values: &[f32]) {
        std::ptr::copy_nonoverlapping(values.as_ptr(), self.ptr.add(r * self.stride), values.len());
    }

    /// Writes (row `r`, column `c`), relative to this `Out`.
    ///
    /// # Safety
    /// The element is inside the matrix, and no other thread writes it.
    #[inline]
    pub(super) unsafe fn set(self, r: usize, c: usize, v: f32) {
        *self.ptr.add(r * self.stride + c) = v;
    }
}

/// Activations quantised per row and 32-block: values `d * q` (in kernel order),
/// plus `s = d * sum(q)` for the 4-bit weights' minimum term. Scales are padded
/// like [`QWeight::d`].
pub(super) struct Acts {
    pub(super) k: usize,
    pub(super) nbp: usize,
    pub(super) qs: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) s: Vec<f32>,
    /// `-32 * sum(q)` over each block's first and over its second 16 values
    /// (per row, `nbp` first halves then `nbp` second halves): Q6_K's values
    /// are `q - 32` for `q` in `0..64`, and its scales cover half a block, so
    /// a kernel starts each half's integer dot product of the unsigned `q`
    /// from this and has the signed one. Left zero (one per row) when no
    /// Q6_K weight takes these activations.
    pub(super) q6_offsets: Vec<i32>,
}

impl Acts {
    pub(super) fn rows(&self) -> usize {
        self.qs.len() / self.k
    }

    /// `order` is the weight's `kernel_order(k)`; `q6`: whether a Q6_K
    /// weight will read [`Acts::q6_offsets`]. Rows are independent, so a
    /// prefill's thousands of blocks are quantised in parallel.
    pub(super) fn quantize(x: &[f32], rows: usize, k_in: usize, order: &[u32], q6: bool) -> Self {
        let k = order.len();
        let nbp = (k / BLOCK).next_multiple_of(GROUP);
        let offsets_per_row = if q6 { 2 * nbp } else { 1 };
        let mut a = Self {
            k,
            nbp,
            qs: vec![0; rows * k],
            d: vec![0.0; rows * nbp],
            s: vec![0.0; rows * nbp],
            q6_offsets: vec![0; rows * offsets_per_row],
        };
        a.qs.par_chunks_mut(k)
            .zip(a.d.par_chunks_mut(nbp))
            .zip(a.s.par_chunks_mut(nbp))
            .zip(a.q6_offsets.par_chunks_mut(offsets_per_row))
            .zip(x.par_chunks(k_in))
            .with_min_len(16)
            .for_each_init(
                || (vec![0f32; k], vec![0i8; k]),
                |(padded, q), ((((qs, d), s), offsets), src)| {
                    padded[..k_in].copy_from_slice(src);
                    quantize::blocks(padded, q, d, s);
                    if q6 {
                        q6_offsets(q, offsets);
                    }
                    for (dst, &i) in qs.iter_mut().zip(order) {
                        *dst = q[i as usize];
                    }
                },
            );
        a
    }
}

/// `-32 * sum(q)` over each 16 values of `q` (blocks in element order),
/// first halves then second halves (see [`Acts::q6_offsets`]).
fn q6_offsets(q: &[i8], out: &mut [i32]) {
    let (first, second) = out.split_at_mut(out.len() / 2);
    for (b, block) in q.chunks_exact(BLOCK).enumerate() {
        let offset = |h: &[i8]| -32 * h.iter().map(|&v| i32::from(v)).sum::<i32>();
        first[b] = offset(&block[..BLOCK / 2]);
        second[b] = offset(&block[BLOCK / 2..]);
    }
}
