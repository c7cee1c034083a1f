//! This machine's streaming-read bandwidth: the bound single-stream decode works
//! against, since each decoded token reads every weight once.
//!
//! Two threads (the thread count `scripts/bench-engine.sh` gives the engine) each
//! sum one half of a buffer far larger than the caches, in eight independent
//! integer lanes the compiler turns into vector adds, so the loop waits on memory,
//! never on arithmetic. The best of a few passes is taken, like the benchmark's
//! other figures, so a busy neighbour only lowers a pass that is then discarded.

use std::time::Instant;

/// Threads reading at once.
pub const THREADS: usize = 2;
/// Bytes read per pass: far above any CPU's last-level cache, so every pass
/// streams from memory.
pub const BUFFER_BYTES: usize = 1 << 30;
/// Passes timed; the fastest counts.
pub const PASSES: usize = 10;

/// Best streaming-read rate over `passes` passes of `bytes` bytes, in bytes per
/// second, and the buffer's sum (checked by the tests, so the reads are real).
pub fn measure(bytes: usize, threads: usize, passes: usize) -> (f64, u64) {
    let words = (bytes / 8).next_multiple_of(8 * threads);
    // Non-zero values, so every page is written (backed) before any pass.
    let buf: Vec<u64> = (0..words as u64).collect();
    let per_thread = words / threads;
    let mut best = f64::INFINITY;
    let mut total = 0;
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        total = std::thread::scope(|s| {
            let parts: Vec<_> = buf
                .chunks(per_thread)
                .map(|part| s.spawn(move || sum(part)))
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().expect("bandwidth thread panicked"))
                .fold(0u64, u64::wrapping_add)
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    ((words * 8) as f64 / best, total)
}

/// Wrapping sum of `xs` in eight lanes (`xs.len()` a multiple of eight).
fn sum(xs: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    for chunk in xs.chunks_exact(8) {
        for (l, x) in lanes.iter_mut().zip(chunk) {
            *l = l.wrapping_add(*x);
        }
    }
    std::hint::black_box(lanes.iter().fold(0, |a, &b| a.wrapping_add(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_whole_buffer() {
        // 8 MiB in three threads: the buffer rounds up to whole lanes per thread.
        let (rate, total) = measure(8 << 20, 3, 2);
        let words = ((8u64 << 20) / 8).next_multiple_of(24);
        assert_eq!(total, words * (words - 1) / 2);
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
    }
}
