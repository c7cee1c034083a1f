//! `pie engine-bench`: the engine alone, timed on the shapes `scripts/bench-engine.sh`
//! sets beside llama.cpp's `llama-bench` and `llama-batched-bench`.
//!
//! - prefill: one `prompt_tokens`-token prompt in one step, after `depth` tokens
//!   already in the prefix cache (`llama-bench -p P -d D`);
//! - decode: `n` sequences at once, each after a prompt of `depth` tokens (32 when
//!   `depth` is 0), timed once every prompt is in (`llama-bench -n N -d D` for one
//!   sequence, `llama-batched-bench` for more).
//!
//! A `prompt_tokens` of 0 skips the prefill figure, a concurrency of 0 is skipped.
//! Every figure runs on pages of one KV dtype (`--kv-dtype`), whose bytes per
//! token are printed first, with the matmul kernel and the weight bytes a decode
//! step reads per token. With a single-sequence decode figure, the machine's
//! streaming-read bandwidth is measured in the same run (`bandwidth`) and the
//! decode's weight traffic (bytes per token x tok/s) printed as a share of it.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use pie_kv::KvDtype;
use pie_model::Model;
use pie_policy::Fcfs;
use pie_worker::engine::{Engine, EngineConfig, Request};

mod bandwidth;

const PAGE: usize = 16;

/// Distinct prompts per sequence so no run is helped by the prefix cache
/// (except the depth prefill's own prefix, on purpose).
fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((i * 7919 + j * 31) % 20_000 + 100) as u32)
        .collect()
}

fn fresh(
    model: &Arc<Model>,
    kv_dtype: KvDtype,
    kv_pages: usize,
    max_batch_tokens: usize,
) -> Engine {
    Engine::new(
        model.clone(),
        EngineConfig {
            page_size: PAGE,
            kv_pages,
            kv_dtype,
            max_batch_tokens,
            max_running: 256,
        },
        Box::new(Fcfs),
    )
}

fn run_to_end(engine: &mut Engine) -> Result<()> {
    while engine.has_work() {
        engine.step(0)?;
    }
    Ok(())
}

pub fn run(
    model: Arc<Model>,
    kv_dtype: KvDtype,
    prompt_tokens: usize,
    decode_tokens: usize,
    concurrency: &[usize],
    depth: usize,
) -> Result<()> {
    println!(
        "kv: {} bytes per token ({})",
        model.kv_layout(PAGE).page_bytes(kv_dtype) / PAGE,
        kv_dtype.name()
    );
    let weight_bytes = model.decode_weight_bytes();
    println!("matmul: {} kernel", model.matmul_kernel());
    println!(
        "weights: {weight_bytes} bytes ({:.1} MiB) read per decoded token",
        weight_bytes as f64 / (1 << 20) as f64
    );
    // Measured before the engines allocate their pages, and only when a figure
    // uses it (it costs a second or two).
    let bandwidth = concurrency.contains(&1).then(|| {
        let (rate, _) = bandwidth::measure(
            bandwidth::BUFFER_BYTES,
            bandwidth::THREADS,
            bandwidth::PASSES,
        );
        println!(
            "memory: {:.2} GB/s streaming read ({} threads over {} MiB, best of {})",
            rate / 1e9,
            bandwidth::THREADS,
            bandwidth::BUFFER_BYTES >> 20,
            bandwidth::PASSES
        );
        rate
    });
    if prompt_tokens > 0 {
        let pages = 2 * (depth + prompt_tokens) / PAGE + 8;
        // The new tokens in one step, like llama-bench's batch (the prefix in
        // chunks of the same size).
        let mut engine = fresh(&model, kv_dtype, pages, prompt_tokens);
        let mut tokens = prompt(0, depth);
        if depth > 0 {
            // Compute the prefix once; its full pages stay in the prefix cache.
            engine.add(Request::fixed_length(tokens.clone(), 1))?;
            run_to_end(&mut engine)?;
        }
        tokens.extend(prompt(1, prompt_tokens));
        let before = engine.counters();
        engine.add(Request::fixed_length(tokens, 1))?;
        let t = Instant::now();
        run_to_end(&mut engine)?;
        let dt = t.elapsed().as_secs_f64();
        let after = engine.counters();
        let cached = after.prefix_hit_tokens - before.prefix_hit_tokens;
        let computed = after.prefill_tokens - before.prefill_tokens;
        ensure!(
            cached as usize == depth / PAGE * PAGE,
            "expected {} cached tokens, the engine attached {cached}",
            depth / PAGE * PAGE
        );
        let at = at_depth(depth);
        println!(
            "prefill: {prompt_tokens}-token prompt{at}: {:.1} tok/s",
            computed as f64 / dt
        );
        eprintln!("  ({computed} tokens computed, {cached} cached, {dt:.3} s)");
    }

    for &n in concurrency.iter().filter(|&&n| n > 0) {
        let plen = if depth > 0 { depth } else { 32 };
        let pages = n * (plen + decode_tokens).div_ceil(PAGE) + n * 2 + 8;
        let mut engine = fresh(&model, kv_dtype, pages, 2048);
        for i in 0..n {
            engine.add(Request::fixed_length(
                prompt(i + 1, plen),
                decode_tokens + 1,
            ))?;
        }
        // Prefill every sequence (and its first token) before timing decode.
        while engine.counters().generated_tokens < n as u64 {
            engine.step(0)?;
        }
        let start_tokens = engine.counters().generated_tokens;
        let t = Instant::now();
        run_to_end(&mut engine)?;
        let rate =
            (engine.counters().generated_tokens - start_tokens) as f64 / t.elapsed().as_secs_f64();
        let at = at_depth(depth);
        println!("decode: {n} concurrent sequences{at}: {rate:.1} tok/s aggregate");
        if let (1, Some(bw)) = (n, bandwidth) {
            let traffic = weight_bytes as f64 * rate;
            println!(
                "bandwidth share: 1 sequence{at}: {:.2} GB/s of weights, {:.1}% of {:.2} GB/s",
                traffic / 1e9,
                100.0 * traffic / bw,
                bw / 1e9
            );
        }
    }
    Ok(())
}

fn at_depth(depth: usize) -> String {
    if depth > 0 {
        format!(" at depth {depth}")
    } else {
        String::new()
    }
}
