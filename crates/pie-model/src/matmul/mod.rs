//! Quantised linear layers: `x (rows x k) @ w^T (k x n)`.
//!
//! Weights are stored in 32-element blocks, 4-bit (`d * q + m`, GGML's
//! Q4_1, which Q4_0 maps onto exactly, and Q4_K's sub-blocks, whose `d` and
//! `m` stay in Q4_K's form: see `store::Scales`), 6-bit (Q6_K's, `d * (q -
//! 32)` with a scale per half block) or 8-bit (`d * q`, Q8_0). Every other
//! GGUF type is dequantised and requantised to 8-bit. Activations are quantised to 8
//! bits once per call (per row and block, like GGML's Q8_1).
//!
//! This file owns the parallel split over column ranges and the choice of
//! [`Kernel`]; the storage and each kernel have files of their own, leaves first:
//!
//! - `layout`: the element order rows are stored in (shared by every kernel);
//! - `quantize`: the block rule, for weights and activations alike;
//! - `store`: [`QWeight`] and its construction, [`Acts`], `Out`;
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
//! - `amx`: many-row calls' integer dot products on Intel's tile unit, scaled
//!   in `avx512`'s f32 operations and order, so its results are `avx512`'s.
//!
//! A row's result never depends on which other rows share the call: every
//! (row, column) pair accumulates in the same order whatever the tile shape.

use anyhow::{bail, Result};
use rayon::prelude::*;

use store::{Acts, Out};
pub use store::{Q4Source, QWeight};

#[cfg(target_arch = "x86_64")]
mod amx;
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
mod store;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86_tiles;

/// A linear layer: [`QWeight`]s whose outputs follow one another as columns
/// of one result (Q, K and V fused into one call). Parts of one storage kind
/// are merged into one matrix; parts of different kinds stay apart, so a
/// Q4_K_M file's Q6_K `attn_v` (widened to 8 bits) does not widen the Q4_K
/// Q and K beside it. The parts share one quantisation of the activations
/// and one parallel split of the columns.
pub struct Linear {
    parts: Vec<QWeight>,
}

impl Linear {
    /// `parts` in output order; all take the same inputs.
    pub fn new(parts: Vec<QWeight>) -> Self {
        let mut merged: Vec<Vec<QWeight>> = Vec::new();
        for part in parts {
            match merged.last_mut() {
                Some(run) if run[0].same_kind(&part) => run.push(part),
                _ => merged.push(vec![part]),
            }
        }
        let parts: Vec<QWeight> = merged.into_iter().map(QWeight::concat).collect();
        assert!(!parts.is_empty(), "a linear layer has a weight");
        for p in &parts {
            assert_eq!(
                (p.k, p.k_in),
                (parts[0].k, parts[0].k_in),
                "parts share inputs"
            );
        }
        Self { parts }
    }

    /// Output columns (the matrix's height).
    pub fn rows(&self) -> usize {
        self.parts.iter().map(QWeight::rows).sum()
    }

    /// Weight values in all, and those the AMX kernel takes in a prefill.
    #[cfg(target_arch = "x86_64")]
    fn values_on_amx(&self) -> (usize, usize) {
        self.parts.iter().fold((0, 0), |(all, amx), p| {
            let values = p.n * p.k;
            (
                all + values,
                amx + if amx::takes_weight(p) { values } else { 0 },
            )
        })
    }

    /// The bytes the parts are stored in (see [`QWeight::bytes`]).
    pub(crate) fn bytes(&self) -> usize {
        self.parts.iter().map(QWeight::bytes).sum()
    }

    /// `x (rows x k_in) @ self^T`, row-major `rows x self.rows()`, on `kernel`.
    pub(crate) fn forward(&self, kernel: Kernel, x: &[f32], rows: usize) -> Vec<f32> {
        forward_parts(&self.parts, kernel, x, rows)
    }

    /// As [`Linear::forward`], in f32 without quantising `x` (see `float.rs`).
    pub(crate) fn forward_float(&self, x: &[f32], rows: usize) -> Vec<f32> {
        if let [one] = self.parts.as_slice() {
            return one.forward_float(x, rows);
        }
        let n = self.rows();
        let mut out = vec![0f32; rows * n];
        let mut c0 = 0;
        for part in &self.parts {
            let y = part.forward_float(x, rows);
            for (dst, src) in out.chunks_exact_mut(n).zip(y.chunks_exact(part.n)) {
                dst[c0..c0 + part.n].copy_from_slice(src);
            }
            c0 += part.n;
        }
        out
    }
}

#[cfg(test)]
impl QWeight {
    /// `x (rows x k_in) @ self^T`, row-major `rows x n`, on `kernel`.
    pub(crate) fn forward(&self, kernel: Kernel, x: &[f32], rows: usize) -> Vec<f32> {
        forward_parts(std::slice::from_ref(self), kernel, x, rows)
    }
}

/// `x @ parts^T` with the parts' columns side by side, row-major.
fn forward_parts(parts: &[QWeight], kernel: Kernel, x: &[f32], rows: usize) -> Vec<f32> {
    let inputs = kernel.inputs(parts, x, rows);
    let n: usize = parts.iter().map(|p| p.n).sum();
    // Enough column ranges to balance the pool's threads, but each a few
    // dozen columns so a task's work dwarfs the scheduling; for the AMX
    // kernel, whole tiles of its sixteen columns.
    let threads = rayon::current_num_threads() * 4;
    let cols = n
        .div_ceil(threads)
        .next_multiple_of(kernel.columns_per_task_multiple())
        .max(32);
    // (part, its first column, columns, the result's column of the first).
    let mut tasks = Vec::new();
    let mut at = 0;
    for part in parts {
        for c0 in (0..part.n).step_by(cols) {
            tasks.push((part, c0, cols.min(part.n - c0), at + c0));
        }
        at += part.n;
    }
    let mut out = vec![0f32; rows * n];
    let dst = Out {
        ptr: out.as_mut_ptr(),
        stride: n,
    };
    tasks.into_par_iter().for_each(|(part, c0, nc, col)| {
        // SAFETY: `out` holds `rows x n`, outlives the loop, and each task
        // writes only its own columns `col..col + nc`.
        unsafe { kernel.run(part, &inputs, c0, nc, dst.at(0, col)) };
    });
    out
}

/// A call's activations in the forms its kernel reads: quantised, and for
/// the AMX kernel, when it takes one of the parts, also in tiles.
pub(super) struct Inputs {
    acts: Acts,
    #[cfg(target_arch = "x86_64")]
    tiles: Option<amx::TileActs>,
}

/// A matmul implementation. They all give the same results (the tests hold
/// each to the portable one); they differ only in speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Amx,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

/// The share of a model's weights the AMX kernel must take for a model to run
/// on it (see [`Kernel::for_layers`]).
const AMX_MIN_SHARE: f64 = 0.9;

/// Forces a matmul kernel by name (see [`Kernel::name`]) instead of the fastest
/// this CPU runs, so kernels can be compared in one run of the same binary.
pub(crate) const KERNEL_ENV: &str = "PIE_MATMUL_KERNEL";

impl Kernel {
    /// Every kernel, fastest first.
    pub(crate) const ALL: &[Kernel] = &[
        #[cfg(target_arch = "x86_64")]
        Kernel::Amx,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2,
        Kernel::Portable,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => "amx",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => "avx512",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => "avx2",
            Kernel::Portable => "portable",
        }
    }

    /// What a task's column count is a multiple of.
    fn columns_per_task_multiple(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => 16,
            _ => 8,
        }
    }

    /// Whether this CPU has the instructions the kernel uses.
    pub(crate) fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => Kernel::Avx512.available() && amx::available(),
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

    /// Why this CPU's fastest kernel cannot run, where the OS refused it.
    pub(crate) fn refusal() -> Option<&'static str> {
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512.available() && amx::refused() {
            return Some(
                "this CPU has AMX-INT8 but the OS refused this process the tile state \
                 (arch_prctl): prefill's matmuls run on the avx512 kernel",
            );
        }
        None
    }

    /// `self` for a model of these `layers`, unless `self` is the AMX kernel
    /// and the tile unit would take less than [`AMX_MIN_SHARE`] of their
    /// weights: then the AVX-512 kernel, and the reason. On the default model
    /// (SmolLM2-135M: only its FFN down projection, a quarter of the
    /// weights, has whole groups of blocks) the AMX kernel prefilled 6-34%
    /// slower than the AVX-512 one in five runs, though that projection
    /// alone ran 1.4-1.5x faster on it (`kernel_throughput`); the rest of
    /// the step ran slower beside it (docs/benchmarks/models.md).
    pub(crate) fn for_layers<'a>(
        self,
        layers: impl IntoIterator<Item = &'a Linear>,
    ) -> (Self, Option<String>) {
        #[cfg(target_arch = "x86_64")]
        if self == Kernel::Amx {
            let (all, amx) = layers
                .into_iter()
                .map(Linear::values_on_amx)
                .fold((0, 0), |(all, amx), (a, b)| (all + a, amx + b));
            let share = amx as f64 / all.max(1) as f64;
            if share < AMX_MIN_SHARE {
                let why = format!(
                    "matmul kernel avx512, not amx: the tile unit would take {:.0}% of this model's \
                     weights (rows of whole 256-value groups), under {:.0}%",
                    100.0 * share,
                    100.0 * AMX_MIN_SHARE
                );
                return (Kernel::Avx512, Some(why));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = layers;
        (self, None)
    }

    /// The kernel a model of `layers` runs on: [`KERNEL_ENV`]'s when it names
    /// one, else [`Kernel::detect`]'s as [`Kernel::for_layers`] has it (with
    /// why, where that is not the fastest).
    pub(crate) fn for_model<'a>(
        layers: impl IntoIterator<Item = &'a Linear>,
    ) -> Result<(Self, Option<String>)> {
        let forced = std::env::var_os(KERNEL_ENV).is_some_and(|v| !v.is_empty());
        let kernel = Self::from_env()?;
        Ok(if forced {
            (kernel, None)
        } else {
            kernel.for_layers(layers)
        })
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

    /// `x (rows x k_in)` in the forms this kernel reads for a call on `parts`.
    fn inputs(self, parts: &[QWeight], x: &[f32], rows: usize) -> Inputs {
        let (k_in, order) = (parts[0].k_in, &parts[0].order);
        assert_eq!(x.len(), rows * k_in, "activation size");
        let acts = Acts::quantize(x, rows, k_in, order, parts.iter().any(QWeight::is_q6));
        #[cfg(target_arch = "x86_64")]
        let tiles = (self == Kernel::Amx && parts.iter().any(|p| amx::takes(p, rows)))
            .then(|| amx::TileActs::pack(&acts));
        Inputs {
            acts,
            #[cfg(target_arch = "x86_64")]
            tiles,
        }
    }

    /// Output columns `c0..c0 + nc` for every row of the call, into `out`
    /// (whose column 0 is column `c0`).
    ///
    /// # Safety
    /// `out` has room for the call's rows by `nc` columns, and no other
    /// thread writes them.
    unsafe fn run(self, w: &QWeight, inputs: &Inputs, c0: usize, nc: usize, out: Out) {
        let a = &inputs.acts;
        // Cheap (the features are cached), and it keeps a kernel value made
        // without `detect` or `named` from running instructions the CPU lacks.
        assert!(
            self.available(),
            "{} kernel on a CPU without it",
            self.name()
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: checked above: AMX-TILE and AMX-INT8, granted to this
            // process, and the AVX-512 kernel's features; `tiles` is `a` packed.
            Kernel::Amx => unsafe {
                let avx512 = |c, n, o| x86_tiles::walk(avx512::tiles(w), w, a, c, n, o);
                match &inputs.tiles {
                    Some(tiles) if amx::takes(w, a.rows()) => {
                        amx::walk(w, a, tiles, (c0, nc), out, avx512)
                    }
                    _ => avx512(c0, nc, out),
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: checked above: AVX-512 F, BW, VL and VNNI, AVX2, FMA, F16C.
            Kernel::Avx512 => unsafe { x86_tiles::walk(avx512::tiles(w), w, a, c0, nc, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: checked above: the CPU has AVX2, FMA and F16C.
            Kernel::Avx2 => unsafe { x86_tiles::walk(avx2::tiles(w), w, a, c0, nc, out) },
            Kernel::Portable => portable::run(w, a, c0, nc, out),
        }
    }
}
