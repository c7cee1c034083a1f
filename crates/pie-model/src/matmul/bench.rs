//! Kernel throughput, the best of seven timings, for every kernel this CPU
//! runs but the portable one, so they compare in one run:
//!
//! - `kernel_throughput`: SmolLM2- and Llama-3.2-1B-shaped matrices (random
//!   weights), each called again and again: `cargo test --release -p pie-model
//!   kernel_throughput -- --ignored --nocapture`; `MB=<name>` and
//!   `MB_ROWS=1,32` narrow it, `MB_KERNEL=amx` keeps one kernel, `MB_COPIES=8` cycles through that many copies
//!   of each so the weights stream from memory instead of the last-level cache.
//! - `layer_sequence`: one-row calls in a 1B model's order (16 layers of
//!   QKV, output, gate/up and down projections, every matrix its own), from a
//!   pool thread as the engine calls them, so each call pays what it pays in
//!   decode: a cold start and streaming from memory.
use super::*;
use rand::Rng;
use std::time::Instant;

/// How a bench matrix is stored.
#[derive(Clone, Copy)]
enum Form {
    /// Q4_1 blocks.
    Q4,
    /// Q4_K super-blocks.
    Q4K,
    /// Q6_K super-blocks.
    Q6,
    /// 8-bit blocks.
    Q8,
}

/// A random `n x k` matrix stored as `form`.
fn random_weight(rng: &mut impl Rng, n: usize, k: usize, form: Form) -> QWeight {
    match form {
        Form::Q4 => {
            let raw: Vec<u8> = (0..n * k / 32 * 20)
                .map(|i| if i % 20 < 4 { 0x10 } else { rng.gen() })
                .collect();
            QWeight::from_q4(&raw, Q4Source::Q4_1, n, k)
        }
        Form::Q4K => {
            // Any bytes are a Q4_K block; its first four, `d` and `dmin`,
            // small f16s.
            let raw: Vec<u8> = (0..n * k / 256 * 144)
                .map(|i| match i % 144 {
                    0 | 2 => 0x00,
                    1 | 3 => 0x10,
                    _ => rng.gen(),
                })
                .collect();
            QWeight::from_q4(&raw, Q4Source::Q4K, n, k)
        }
        Form::Q6 => {
            // Any bytes are a Q6_K block; its last two, `d`, a small f16.
            let raw: Vec<u8> = (0..n * k / 256 * 210)
                .map(|i| match i % 210 {
                    208 => 0x00,
                    209 => 0x10,
                    _ => rng.gen(),
                })
                .collect();
            QWeight::from_q6k(&raw, n, k)
        }
        Form::Q8 => {
            let wf: Vec<f32> = (0..n * k).map(|_| rng.gen::<f32>() - 0.5).collect();
            QWeight::from_f32(&wf, n, k)
        }
    }
}

/// Every kernel this CPU runs but the portable one (`MB_KERNEL=<name>`: that
/// one only).
fn simd_kernels() -> impl Iterator<Item = Kernel> {
    let only = std::env::var("MB_KERNEL").ok();
    (Kernel::ALL.iter().copied()).filter(move |&k| {
        k != Kernel::Portable && k.available() && only.as_deref().is_none_or(|o| o == k.name())
    })
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
    })
}

#[test]
#[ignore]
fn kernel_throughput() {
    let mut rng = rand::thread_rng();
    let only = std::env::var("MB").ok();
    let rows_list: Vec<usize> = std::env::var("MB_ROWS")
        .map(|s| s.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![1, 8, 32, 512]);
    let copies = env_or("MB_COPIES", 1usize);
    for (name, n, k, form) in [
        ("gate_up", 3072usize, 576usize, Form::Q4),
        ("lm_head", 49152, 576, Form::Q8),
        ("down", 576, 1536, Form::Q4),
        ("big_q4", 49152, 576, Form::Q4),
        ("gate_up_1b", 16384, 2048, Form::Q4),
        ("gate_up_1b_q4k", 16384, 2048, Form::Q4K),
        ("down_1b", 2048, 8192, Form::Q4),
        ("down_1b_q6", 2048, 8192, Form::Q6),
        ("down_1b_q8", 2048, 8192, Form::Q8),
        ("gate_up_qwen3_q4k", 6144, 1024, Form::Q4K),
        ("down_qwen3_q6", 1024, 3072, Form::Q6),
    ] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let ws: Vec<QWeight> = (0..copies)
            .map(|_| random_weight(&mut rng, n, k, form))
            .collect();
        for &rows in &rows_list {
            let x: Vec<f32> = (0..rows * k).map(|_| rng.gen::<f32>() - 0.5).collect();
            let reps = (4_000_000_000 / (n * k * rows))
                .max(1)
                .next_multiple_of(copies);
            for kernel in simd_kernels() {
                let mut dt = f64::MAX;
                for _ in 0..7 {
                    let t = Instant::now();
                    for w in ws.iter().cycle().take(reps) {
                        std::hint::black_box(w.forward(kernel, &x, rows));
                    }
                    dt = dt.min(t.elapsed().as_secs_f64() / reps as f64);
                }
                let bytes = ws[0].bytes();
                println!(
                    "{name} n={n} k={k} rows={rows} {}: {:.3} ms, {:.2} GB/s, {:.1} GMAC/s",
                    kernel.name(),
                    dt * 1e3,
                    bytes as f64 / dt / 1e9,
                    (n * k * rows) as f64 / dt / 1e9
                );
            }
        }
    }
}

#[test]
#[ignore]
fn layer_sequence() {
    const LAYERS: usize = 16;
    const PASSES: usize = 20;
    let shapes = [
        ("qkv", 3072, 2048, Form::Q4),
        ("out", 2048, 2048, Form::Q4),
        ("gate_up", 16384, 2048, Form::Q4),
        ("down", 2048, 8192, Form::Q4),
        ("down_q6", 2048, 8192, Form::Q6),
        ("down_q8", 2048, 8192, Form::Q8),
    ];
    let mut rng = rand::thread_rng();
    let layers: Vec<Vec<QWeight>> = (0..LAYERS)
        .map(|_| {
            shapes
                .iter()
                .map(|&(_, n, k, form)| random_weight(&mut rng, n, k, form))
                .collect()
        })
        .collect();
    for kernel in simd_kernels() {
        let mut seconds = vec![0f64; shapes.len()];
        rayon::scope(|_| {
            for layer in layers.iter().cycle().take(LAYERS * PASSES) {
                for (w, s) in layer.iter().zip(seconds.iter_mut()) {
                    let x: Vec<f32> = (0..w.k_in).map(|j| (j % 7) as f32 - 3.0).collect();
                    let t = Instant::now();
                    std::hint::black_box(w.forward(kernel, &x, 1));
                    *s += t.elapsed().as_secs_f64();
                }
            }
        });
        for ((name, ..), (s, w)) in shapes.iter().zip(seconds.iter().zip(&layers[0])) {
            let calls = (LAYERS * PASSES) as f64;
            println!(
                "{name} n={} k={} {}: {:.3} ms a call, {:.1} GB/s",
                w.n,
                w.k,
                kernel.name(),
                s / calls * 1e3,
                w.bytes() as f64 * calls / s / 1e9
            );
        }
    }
}
