use super::layout::{kernel_order, BLOCK};
use super::quantize::quantize_block;
use super::store::Quants;
use super::*;
use candle_core::quantized::GgmlDType;
use half::f16;
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
    dense(w, &x, n, k)
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
            logical[i] = w.d.get(c * nbp + i / BLOCK) * q as f32;
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
    let inputs = kernel.inputs(std::slice::from_ref(w), x, rows);
    let mut out = vec![f32::NAN; rows * w.n];
    let dst = Out {
        ptr: out.as_mut_ptr(),
        stride: w.n,
    };
    // SAFETY: `out` holds `rows x n`, written by this thread alone.
    unsafe { kernel.run(w, &inputs, 0, w.n, dst) };
    out
}

/// Every kernel this CPU runs but the portable one, each to be checked against
/// it; the others are named as SKIPPED so a machine without them never passes
/// their tests silently.
fn simd_kernels() -> Vec<Kernel> {
    let (run, skip): (Vec<Kernel>, Vec<Kernel>) = Kernel::ALL
        .iter()
        .copied()
        .filter(|&k| k != Kernel::Portable)
        .partition(|k| k.available());
    for k in skip {
        eprintln!(
            "SKIPPED: {} matmul kernel not tested: this CPU lacks its instructions",
            k.name()
        );
    }
    run
}

/// Every kernel on `w` and `x`: the portable one within `tol` of `want`, every
/// other within 1e-4 of the portable one (they differ only in the order of f32
/// additions).
fn check_kernels(w: &QWeight, x: &[f32], rows: usize, want: &[f32], tol: f32) {
    let portable = run_with(Kernel::Portable, w, x, rows);
    assert_close(&portable, want, tol);
    for kernel in simd_kernels() {
        let got = run_with(kernel, w, x, rows);
        assert_close(&got, &portable, 1e-4);
        assert_close(&got, want, tol);
    }
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
        check_kernels(&w, &x, rows, &want, 1e-3);
        assert_close(&w.forward(Kernel::detect(), &x, rows), &want, 1e-3);
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
    check_kernels(&w, &x, 3, &reference(&deq, &x, n, k), 1e-3);
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
        check_kernels(&w, &x, rows, &want, 1e-3);
    }
}

/// A linear layer's parts keep their own storage where kinds differ (a
/// Q4_K_M file's 8-bit `attn_v` beside 4-bit Q and K), adjacent parts of one
/// kind merge into one matrix, and on every kernel the result is each part's
/// own result, side by side, bit for bit.
#[test]
fn a_linear_layer_keeps_mixed_kinds_apart_and_merges_the_rest() {
    let k = 96;
    let part_sizes = [40, 24, 8, 56];
    // The same parts twice: one set for the layer, one to run alone.
    let parts = || {
        let mut rng = StdRng::seed_from_u64(4);
        part_sizes
            .iter()
            .map(|&n| match n {
                8 => QWeight::from_f32(&random(&mut rng, n * k), n, k),
                _ => {
                    let (raw, _) = q4_1_blocks(&random(&mut rng, n * k));
                    QWeight::from_q4(&raw, Q4Source::Q4_1, n, k)
                }
            })
            .collect::<Vec<_>>()
    };
    let alone = parts();
    let parts = parts();
    let linear = Linear::new(parts);
    assert_eq!(linear.parts.len(), 3, "the two leading 4-bit parts merge");
    assert_eq!(linear.rows(), part_sizes.iter().sum::<usize>());
    let rows = 6;
    let x = random(&mut StdRng::seed_from_u64(5), rows * k);
    for kernel in simd_kernels().into_iter().chain([Kernel::Portable]) {
        let got = linear.forward(kernel, &x, rows);
        let each: Vec<Vec<f32>> = alone.iter().map(|p| p.forward(kernel, &x, rows)).collect();
        for r in 0..rows {
            let want: Vec<f32> = each
                .iter()
                .zip(part_sizes)
                .flat_map(|(y, n)| y[r * n..][..n].to_vec())
                .collect();
            assert_eq!(
                got[r * linear.rows()..][..linear.rows()],
                want,
                "{kernel:?}"
            );
        }
    }
    let float: Vec<f32> = linear.forward_float(&x, rows);
    assert_eq!(float.len(), rows * linear.rows());
    assert_close(&float, &linear.forward(Kernel::Portable, &x, rows), 0.05);
}

/// A GGML tensor of `w` (`n x k`) in `dtype`: its raw blocks and candle's
/// dequantisation of them (ggml's rule).
fn ggml_tensor(dtype: GgmlDType, w: Vec<f32>, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let (t, deq) = crate::ggml_blocks::reference::quantized(dtype, w, n, k);
    (t.data().unwrap().into_owned(), deq)
}

/// The weights `w` stores (`n x k_in`, row-major), read back exactly through
/// the f32 path: `forward_float` of the identity is `w` transposed.
fn stored_weights(w: &QWeight) -> Vec<f32> {
    let k = w.k_in;
    let eye: Vec<f32> = (0..k * k)
        .map(|i| if i / k == i % k { 1.0 } else { 0.0 })
        .collect();
    let t = w.forward_float(&eye, k);
    (0..w.n * k).map(|i| t[(i % k) * w.n + i / k]).collect()
}

/// Q4_K super-blocks repack into the 4-bit store exactly (their scales and
/// minimums kept as the file's f16 unit times a 6-bit step), and every
/// kernel computes with what was stored; the store is Q4_K's size plus the
/// steps' unpacking (148 bytes a super-block against 144).
#[test]
fn q4_k_keeps_the_files_values_exactly() {
    let mut rng = StdRng::seed_from_u64(31);
    for (n, k, rows) in [(19, 768, 5), (8, 256, 1), (12, 1280, 4)] {
        let (raw, deq) = ggml_tensor(GgmlDType::Q4K, random(&mut rng, n * k), n, k);
        let w = QWeight::from_q4(&raw, Q4Source::Q4K, n, k);
        assert_eq!(stored_weights(&w), deq);
        assert_eq!(w.bytes(), n * k / 256 * 148);
        let x = random(&mut rng, rows * k);
        check_kernels(&w, &x, rows, &reference(&deq, &x, n, k), 1e-3);
    }
}

/// Q6_K super-blocks are stored exactly (6-bit values as nibbles and bit
/// pairs, each half-block's scale the file's f16 `d` times its 8-bit step),
/// in 212 bytes a super-block against the file's 210, and every kernel
/// computes with what was stored, on single rows (decode's tiles) and on
/// four at a time.
#[test]
fn q6_k_keeps_the_files_values_exactly() {
    let mut rng = StdRng::seed_from_u64(33);
    for (n, k, rows) in [(19, 768, 5), (8, 256, 1), (6, 1280, 9)] {
        let (raw, deq) = ggml_tensor(GgmlDType::Q6K, random(&mut rng, n * k), n, k);
        let w = QWeight::from_q6k(&raw, n, k);
        assert_eq!(stored_weights(&w), deq);
        assert_eq!(w.bytes(), n * k / 256 * 212);
        let x = random(&mut rng, rows * k);
        check_kernels(&w, &x, rows, &reference(&deq, &x, n, k), 1e-3);
    }
}

/// Q8_0 blocks are stored as they are (no requantisation); a -128, which the
/// kernels' sums cannot take, is refused so the loader widens instead.
#[test]
fn q8_0_keeps_the_files_values_exactly() {
    let mut rng = StdRng::seed_from_u64(32);
    let (n, k, rows) = (21, 15 * BLOCK, 6);
    let (mut raw, deq) = ggml_tensor(GgmlDType::Q8_0, random(&mut rng, n * k), n, k);
    let w = QWeight::from_q8_0(&raw, n, k).expect("no -128");
    assert_eq!(stored_weights(&w), deq);
    let x = random(&mut rng, rows * k);
    check_kernels(&w, &x, rows, &reference(&deq, &x, n, k), 1e-3);
    raw[2 + 34 * 3] = 0x80;
    assert!(QWeight::from_q8_0(&raw, n, k).is_none());
}

/// The same-tokens guarantee: a row's output is bit-identical whether it runs
/// alone or among others, at any position in the batch, on every kernel and
/// storage.
#[test]
fn rows_are_independent_of_the_batch() {
    // Enough rows for the AMX kernel (`amx::MIN_ROWS`), one tile partly filled.
    const ROWS: usize = 40;
    let mut rng = StdRng::seed_from_u64(5);
    let (n, k) = (70, 576);
    let (raw, _) = q4_1_blocks(&random(&mut rng, n * k));
    let q4 = QWeight::from_q4(&raw, Q4Source::Q4_1, n, k);
    let q8 = QWeight::from_f32(&random(&mut rng, n * k), n, k);
    // Rows long enough that a many-row call splits a task's columns into
    // chunks whose scales it widens (see `x86_tiles::walk`).
    let (nk, kk) = (64, 8192);
    let (raw, _) = ggml_tensor(GgmlDType::Q4K, random(&mut rng, nk * kk), nk, kk);
    let q4k = QWeight::from_q4(&raw, Q4Source::Q4K, nk, kk);
    let (raw, _) = ggml_tensor(GgmlDType::Q6K, random(&mut rng, nk * kk), nk, kk);
    let q6k = QWeight::from_q6k(&raw, nk, kk);
    for kernel in simd_kernels().into_iter().chain([Kernel::Portable]) {
        for w in [&q4, &q8, &q4k, &q6k] {
            let (n, k) = (w.n, w.k_in);
            let x = random(&mut StdRng::seed_from_u64(6), ROWS * k);
            let all = w.forward(kernel, &x, ROWS);
            for r in 0..ROWS {
                let alone = w.forward(kernel, &x[r * k..][..k], 1);
                assert_eq!(alone, all[r * n..][..n], "{kernel:?}: row {r}");
                let pair = w.forward(
                    kernel,
                    &x[r * k..(r + 1).min(ROWS - 1) * k + k],
                    1 + (r < ROWS - 1) as usize,
                );
                assert_eq!(
                    pair[..n],
                    all[r * n..][..n],
                    "{kernel:?}: row {r} in a pair"
                );
            }
        }
    }
}

/// The AMX kernel gives the AVX-512 kernel's bits on every storage, with
/// row tiles partly filled, columns left over past whole tiles, and rows
/// that are not whole groups (which it leaves to the AVX-512 tiles).
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_gives_the_avx512_kernels_bits() {
    if !Kernel::Amx.available() {
        eprintln!("SKIPPED: amx matmul kernel not tested: this CPU or OS lacks AMX-INT8");
        return;
    }
    let mut rng = StdRng::seed_from_u64(41);
    let (raw, _) = q4_1_blocks(&random(&mut rng, 70 * 768));
    let q4_1 = QWeight::from_q4(&raw, Q4Source::Q4_1, 70, 768);
    let (raw, _) = ggml_tensor(GgmlDType::Q4K, random(&mut rng, 48 * 2048), 48, 2048);
    let q4k = QWeight::from_q4(&raw, Q4Source::Q4K, 48, 2048);
    let q8 = QWeight::from_f32(&random(&mut rng, 37 * 512), 37, 512);
    let (raw, _) = ggml_tensor(GgmlDType::Q8_0, random(&mut rng, 19 * 1024), 19, 1024);
    let q8_0 = QWeight::from_q8_0(&raw, 19, 1024).expect("no -128");
    let (raw, _) = ggml_tensor(GgmlDType::Q6K, random(&mut rng, 20 * 512), 20, 512);
    let q6k = QWeight::from_q6k(&raw, 20, 512);
    let ragged = QWeight::from_f32(&random(&mut rng, 33 * 320), 33, 320);
    for w in [&q4_1, &q4k, &q8, &q8_0, &q6k, &ragged] {
        for rows in [32, 47, 80] {
            let x = random(&mut rng, rows * w.k_in);
            // Every storage goes to the tile unit but the ragged rows, so
            // the bits below compare its path, not the AVX-512 fallback.
            let takes = amx::takes(w, rows);
            assert_eq!(takes, w.blocks() % 8 == 0);
            assert_eq!(takes, !std::ptr::eq(w, &ragged), "{rows} rows");
            assert!(!amx::takes(w, amx::MIN_ROWS - 1));
            let want = run_with(Kernel::Avx512, w, &x, rows);
            assert_eq!(run_with(Kernel::Amx, w, &x, rows), want, "{rows} rows");
            assert_eq!(w.forward(Kernel::Amx, &x, rows), want, "{rows} rows, split");
        }
    }
}

/// A model runs on the AMX kernel only where it takes nearly all of the
/// weights (rows of whole groups); the choice needs no AMX to test.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_runs_a_model_only_where_it_takes_most_weights() {
    let mut rng = StdRng::seed_from_u64(43);
    let whole = Linear::new(vec![QWeight::from_f32(
        &random(&mut rng, 64 * 512),
        64,
        512,
    )]);
    let ragged = Linear::new(vec![QWeight::from_f32(
        &random(&mut rng, 64 * 576),
        64,
        576,
    )]);
    assert_eq!(Kernel::Amx.for_layers([&whole]), (Kernel::Amx, None));
    let (kernel, why) = Kernel::Amx.for_layers([&whole, &ragged]);
    assert_eq!(kernel, Kernel::Avx512);
    let why = why.expect("a reason");
    assert!(why.contains("47%") && why.contains("90%"), "{why}");
    assert_eq!(Kernel::Avx512.for_layers([&ragged]), (Kernel::Avx512, None));
}

/// `PIE_MATMUL_KERNEL` names a kernel exactly; anything else is refused with
/// the names there are (the variable itself is not set here: tests share it).
#[test]
fn kernel_names_are_checked() {
    for &k in Kernel::ALL.iter().filter(|k| k.available()) {
        assert_eq!(Kernel::named(k.name()).unwrap(), k);
    }
    for bad in ["AVX2", "avx-2", "fast", " portable"] {
        let err = Kernel::named(bad).unwrap_err().to_string();
        assert!(
            err.contains("no such matmul kernel") && err.contains("portable"),
            "{err}"
        );
    }
}

/// `bytes` counts what the kernels read: quantised values plus f16 scales (and
/// minimums), padded to whole groups of eight blocks.
#[test]
fn bytes_count_the_stored_matrix() {
    // k = 70 pads to 96 (3 blocks, scales padded to 8): 3 rows x (96 + 8 x 2).
    assert_eq!(
        QWeight::from_f32(&[0.5; 3 * 70], 3, 70).bytes(),
        3 * (96 + 16)
    );
    // 4-bit, 48 blocks a row: 16 rows x (768 + 48 x 2 x 2).
    let (raw, _) = q4_1_blocks(&[0.25; 16 * 1536]);
    let w = QWeight::from_q4(&raw, Q4Source::Q4_1, 16, 1536);
    assert_eq!(w.bytes(), 16 * (768 + 192));
}

/// f32 math on `w` and `x` as they are (no activation quantisation).
fn dense(w: &[f32], x: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert_eq!(w.len(), n * k);
    x.chunks_exact(k)
        .flat_map(|row| {
            w.chunks_exact(k)
                .map(|col| col.iter().zip(row).map(|(a, b)| a * b).sum::<f32>())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `unpack_row_q4` inverts `pack_q4` at every run shape, and agrees with the
/// per-position `unpack_q4`.
#[test]
fn a_packed_row_unpacks_to_its_values() {
    let mut rng = StdRng::seed_from_u64(22);
    for blocks in [1, 2, 3, 7, 8, 15, 18] {
        let q: Vec<u8> = (0..blocks * BLOCK).map(|_| rng.gen_range(0..16)).collect();
        let mut packed = Vec::new();
        layout::pack_q4(&q, &mut packed);
        let mut back = vec![-1i32; q.len()];
        layout::unpack_row_q4(&packed, &mut back);
        let want: Vec<i32> = q.iter().map(|&v| v as i32).collect();
        assert_eq!(back, want, "{blocks} blocks");
        for (pos, &v) in back.iter().enumerate() {
            assert_eq!(
                layout::unpack_q4(&packed, pos) as i32,
                v,
                "{blocks} blocks, {pos}"
            );
        }
    }
}

/// The AMX kernel's whole-row unpacking gives the values `unpack_row_q4`
/// and `unpack_q6` give, position by position (Q6_K's as `q - 32`).
#[test]
fn whole_groups_unpack_to_their_values() {
    let mut rng = StdRng::seed_from_u64(23);
    for groups in [1, 3] {
        let len = groups * 8 * BLOCK;
        let q4: Vec<u8> = (0..len).map(|_| rng.gen_range(0..16)).collect();
        let mut packed = Vec::new();
        layout::pack_q4(&q4, &mut packed);
        let mut bytes = vec![0u8; len];
        layout::unpack_q4_groups(&packed, &mut bytes);
        assert_eq!(bytes, q4, "4-bit, {groups} groups");
        let q6: Vec<u8> = (0..len).map(|_| rng.gen_range(0..64)).collect();
        let (mut lo, mut hi) = (Vec::new(), Vec::new());
        layout::pack_q6(&q6, &mut lo, &mut hi);
        layout::unpack_q6_groups(&lo, &hi, &mut bytes);
        for (pos, &b) in bytes.iter().enumerate() {
            let want = layout::unpack_q6(&lo, &hi, pos) as i32 - 32;
            assert_eq!(b as i8 as i32, want, "6-bit, {groups} groups, {pos}");
        }
    }
}

/// `forward_float` is the stored weights, dequantised, times the activations
/// unrounded: 4-bit rows of every run shape (15 blocks: runs of 8, 4, 2, 1),
/// 8-bit rows with a padded last block.
#[test]
fn float_activations_use_the_stored_weights_and_unrounded_inputs() {
    let mut rng = StdRng::seed_from_u64(21);
    let (n, rows) = (5, 3);
    let k = 15 * BLOCK;
    let (raw, deq) = q4_1_blocks(&random(&mut rng, n * k));
    let w = QWeight::from_q4(&raw, Q4Source::Q4_1, n, k);
    let x = random(&mut rng, rows * k);
    assert_close(&w.forward_float(&x, rows), &dense(&deq, &x, n, k), 1e-4);

    let k_in = 50;
    let w = QWeight::from_f32(&random(&mut rng, n * k_in), n, k_in);
    let x = random(&mut rng, rows * k_in);
    let want = dense(&q8_dequant(&w), &x, n, k_in);
    assert_close(&w.forward_float(&x, rows), &want, 1e-5);
    // The quantised path differs by the activations' rounding, not by nothing.
    assert_ne!(w.forward(Kernel::Portable, &x, rows), want);
}
