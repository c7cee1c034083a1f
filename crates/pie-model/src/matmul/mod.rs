//! Quantised linear layers: `x (rows x k) @ w^T (k x n)`.
//!
//! Weights are stored in 32-element blocks, either 4-bit (`d * q + m`, GGML's
//! Q4_1, which Q4_0 maps onto exactly) or 8-bit (`d * q`, Q8_0). Every other GGUF
//! type is dequantised and requantised to 8-bit. Activations are quantised to 8
//! bits once per call (per row and block, like GGML's Q8_1).
//!
//! This file owns the storage ([`QWeight`], [`Acts`]), the parallel split over
//! column ranges and the choice of [`Kernel`]; each kernel has a file of its own:
//!
//! - `layout`: the element order rows are stored in (shared by every kernel);
//! - `portable`: plain per-(row, column) dot products, the reference;
//! - `x86_tiles`: what the x86 kernels share, a tile of rows times a tile of
//!   columns, so each unpacked weight vector serves several rows and each
//!   activation vector several columns. In the storage order eight blocks'
//!   integer dot products accumulate side by side in one register, so the block
//!   scales apply as one vector multiply per eight blocks instead of a
//!   broadcast per block.
//! - `avx2`, `avx512`: those tiles over the integer dot products of AVX2
//!   (maddubs + madd) and of 512-bit VNNI (`vpdpbusd`, two 32-byte vectors per
//!   register).
//!
//! A row's result never depends on which other rows share the call: every
//! (row, column) pair accumulates in the same order whatever the tile shape.

use anyhow::{bail, Result};
use half::f16;
use rayon::prelude::*;

use layout::{kernel_order, pack_q4};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod bench;
mod float;
mod layout;
mod portable;
mod quantize;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86_tiles;

const BLOCK: usize = 32;
/// Blocks per scale vector: scales are stored padded (with zeros) to a multiple
/// of this, so the kernel loads and converts eight at once.
const GROUP: usize = 8;

enum Quants {
    /// 4-bit values, two per byte, in kernel order (see `layout::pack_q4`); `m` holds
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
    /// The weights as f32, made on the first `forward_float` (see `float.rs`).
    float: std::sync::OnceLock<Vec<f32>>,
}

/// A GGML 4-bit block as stored in GGUF.
pub enum Q4Source {
    /// `d: f16, qs: [u8; 16]`, value `d * (q - 8)`.
    Q4_0,
    /// `d: f16, m: f16, qs: [u8; 16]`, value `d * q + m`.
    Q4_1,
}

impl QWeight {
    fn blocks(&self) -> usize {
        self.k / BLOCK
    }

    /// The bytes the matrix is stored in: quantised values and block scales
    /// (and minimums), padding included, as the kernels read them.
    pub(crate) fn bytes(&self) -> usize {
        let quants = match &self.quants {
            Quants::Q4 { qs, m } => qs.len() + std::mem::size_of_val(m.as_slice()),
            Quants::Q8 { qs } => qs.len(),
        };
        quants + std::mem::size_of_val(self.d.as_slice())
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
            float: Default::default(),
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
            float: Default::default(),
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

    /// `x (rows x k_in) @ self^T`, row-major `rows x n`, on `kernel`.
    pub(crate) fn forward(&self, kernel: Kernel, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k_in, "activation size");
        let acts = Acts::quantize(x, rows, self.k_in, &self.order);
        // Enough column ranges to balance the pool's threads, but each a few
        // dozen columns so a task's work dwarfs the scheduling.
        let tasks = rayon::current_num_threads() * 4;
        let cols = self.n.div_ceil(tasks).next_multiple_of(8).max(32);
        let mut out = vec![0f32; rows * self.n];
        let dst = Out {
            ptr: out.as_mut_ptr(),
            stride: self.n,
        };
        (0..self.n.div_ceil(cols)).into_par_iter().for_each(|t| {
            let c0 = t * cols;
            let nc = cols.min(self.n - c0);
            // SAFETY: `out` holds `rows x n`, outlives the loop, and each task
            // writes only its own columns `c0..c0 + nc`.
            unsafe { kernel.run(self, &acts, c0, nc, dst.at(0, c0)) };
        });
        out
    }
}

/// Where a call's results go: `ptr` is (row 0, first column) of a row-major
/// matrix whose rows are `stride` floats apart. The tasks of one call share
/// the matrix, each writing its own columns in place (no per-task buffer to
/// allocate, clear and copy back).
#[derive(Clone, Copy)]
pub(crate) struct Out {
    ptr: *mut f32,
    stride: usize,
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
    unsafe fn at(self, r: usize, c: usize) -> Self {
        Self {
            ptr: self.ptr.add(r * self.stride + c),
            ..self
        }
    }

    /// Writes (row `r`, column `c`), relative to this `Out`.
    ///
    /// # Safety
    /// The element is inside the matrix, and no other thread writes it.
    #[inline]
    unsafe fn set(self, r: usize, c: usize, v: f32) {
        *self.ptr.add(r * self.stride + c) = v;
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
    fn rows(&self) -> usize {
        self.qs.len() / self.k
    }

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
                    quantize::blocks(padded, q, d, s);
                    for (dst, &i) in qs.iter_mut().zip(order) {
                        *dst = q[i as usize];
                    }
                },
            );
        a
    }
}

/// A matmul implementation. They all give the same results (the tests hold
/// each to the portable one); they differ only in speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

/// Forces a matmul kernel by name (see [`Kernel::name`]) instead of the fastest
/// this CPU runs, so kernels can be compared in one run of the same binary.
pub(crate) const KERNEL_ENV: &str = "PIE_MATMUL_KERNEL";

impl Kernel {
    /// Every kernel, fastest first.
    pub(crate) const ALL: &[Kernel] = &[
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2,
        Kernel::Portable,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => "avx512",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => "avx2",
            Kernel::Portable => "portable",
        }
    }

    /// Whether this CPU has the instructions the kernel uses.
    pub(crate) fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                    && Kernel::Avx2.available()
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            Kernel::Portable => true,
        }
    }

    /// The fastest kernel this CPU runs.
    pub(crate) fn detect() -> Self {
        Self::ALL
            .iter()
            .copied()
            .find(|k| k.available())
            .unwrap_or(Kernel::Portable)
    }

    /// The kernel [`KERNEL_ENV`] names, or [`Kernel::detect`]'s when it is unset
    /// or empty. A name no kernel has, or a kernel this CPU cannot run, is an
    /// error rather than a silent fallback: a comparison must run what it says.
    pub(crate) fn from_env() -> Result<Self> {
        match std::env::var(KERNEL_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Self::detect()),
            Err(std::env::VarError::NotUnicode(v)) => {
                bail!(
                    "{KERNEL_ENV}={v:?} is not a kernel name ({})",
                    Self::names()
                )
            }
            Ok(v) if v.is_empty() => Ok(Self::detect()),
            Ok(v) => Self::named(&v),
        }
    }

    fn named(name: &str) -> Result<Self> {
        let Some(&kernel) = Self::ALL.iter().find(|k| k.name() == name) else {
            bail!(
                "{KERNEL_ENV}={name}: no such matmul kernel (expected one of {})",
                Self::names()
            );
        };
        if !kernel.available() {
            bail!("{KERNEL_ENV}={name}: this CPU lacks the instructions that kernel uses");
        }
        Ok(kernel)
    }

    fn names() -> String {
        Self::ALL
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Output columns `c0..c0 + nc` for every row of `a`, into `out` (whose
    /// column 0 is column `c0`).
    ///
    /// # Safety
    /// `out` has room for `a`'s rows by `nc` columns, and no other thread
    /// writes them.
    unsafe fn run(self, w: &QWeight, a: &Acts, c0: usize, nc: usize, out: Out) {
        // Cheap (the features are cached), and it keeps a kernel value made
        // without `detect` or `named` from running instructions the CPU lacks.
        assert!(
            self.available(),
            "{} kernel on a CPU without it",
            self.name()
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: checked above: AVX-512 F, BW, VL and VNNI, AVX2, FMA, F16C.
            Kernel::Avx512 => unsafe { x86_tiles::walk(&avx512::TILES, w, a, c0, nc, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: checked above: the CPU has AVX2, FMA and F16C.
            Kernel::Avx2 => unsafe { x86_tiles::walk(&avx2::TILES, w, a, c0, nc, out) },
            Kernel::Portable => portable::run(w, a, c0, nc, out),
        }
    }
}
