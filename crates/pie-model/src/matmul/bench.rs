//! Kernel throughput on SmolLM2-shaped matrices (random weights), the best of
//! seven timings: `cargo test --release -p pie-model kernel_throughput --
//! --ignored --nocapture`; `MB=<name>` and `MB_ROWS=1,32` narrow it. Every
//! kernel this CPU runs but the portable one, so they compare in one run.
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
            QWeight::from_q4(&raw, Q4Source::Q4_1, n, k).expect("4-bit blocks")
        } else {
            let wf: Vec<f32> = (0..n * k).map(|_| rng.gen::<f32>() - 0.5).collect();
            QWeight::from_f32(&wf, n, k)
        };
        for &rows in &rows_list {
            let x: Vec<f32> = (0..rows * k).map(|_| rng.gen::<f32>() - 0.5).collect();
            let reps = (4_000_000_000 / (n * k * rows)).max(1);
            for &kernel in Kernel::ALL
                .iter()
                .filter(|&&k| k != Kernel::Portable && k.available())
            {
                let mut dt = f64::MAX;
                for _ in 0..7 {
                    let t = Instant::now();
                    for _ in 0..reps {
                        std::hint::black_box(w.forward(kernel, &x, rows));
                    }
                    dt = dt.min(t.elapsed().as_secs_f64() / reps as f64);
                }
                let bytes = n * k / 32 * if q4 { 20 } else { 34 };
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
