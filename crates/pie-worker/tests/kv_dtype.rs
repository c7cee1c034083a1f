//! f16 KV pages against f32 ones. Over a set of prompts, fed one token per
//! forward (so every position's logits read the keys and values of the
//! positions before it back from the pages), the next-token logits of an f16
//! pool are compared with an f32 pool's: the share of positions with the same
//! top-1, and the largest logit difference over the standard deviation of that
//! position's f32 logits.
//!
//! Issue 17 asked for >= 99% and < 0.05 before f16 becomes the default. With
//! the linear layers in f32 (`Model::with_float_activations`), so that f16's
//! rounding is the only difference, the default model meets it (100% and
//! about 0.014), and f16 is the default. The engine's matmuls quantise their
//! activations to 8 bits, and there any change in the last bit of an attention
//! output (f16 rounding, or summing keys in another order) flips some
//! activation quanta and moves the logits by that quantisation's noise: f16
//! gives about 97.7% and 0.59, f32 against itself with 8-token instead of
//! 16-token pages about 97.9% and 0.54. So the engine's own path is held to
//! that floor: f16 no worse than the page-size change by more than a little
//! (1.5 points of top-1, 1.5 x the difference); on the test model (random
//! weights, near-tied logits) at least 96% top-1 and under 0.1.
//!
//! On the default model (SmolLM2-135M-Instruct Q4_1; skipped without it, as in
//! `default_model.rs`) and on the synthesized test model.

mod common;

use std::sync::Arc;

use pie_kv::{KvDtype, KvPool, PageTable};
use pie_model::synth::{write_test_model, SynthSpec};
use pie_model::{Model, SeqInput};

/// The logits after each of `tokens`, one forward per token over `page`-token
/// pages of `dtype`.
fn logits_per_position(
    model: &Model,
    dtype: KvDtype,
    page: usize,
    tokens: &[u32],
) -> Vec<Vec<f32>> {
    let pages = tokens.len().div_ceil(page) + 1;
    let mut pool = KvPool::with_dtype(model.kv_layout(page), dtype, pages, model.fingerprint);
    let mut table = PageTable::new();
    (0..tokens.len())
        .map(|pos| {
            table.reserve(&mut pool, pos + 1).unwrap();
            let input = SeqInput {
                tokens: &tokens[pos..pos + 1],
                start: pos,
                table: &table,
                logit_rows: 1,
            };
            model.forward(&mut pool, &[input]).unwrap().remove(0)
        })
        .collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        })
        .0
}

fn std_dev(x: &[f32]) -> f64 {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    (x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
}

/// How far the logits of one run are from another's.
#[derive(Debug)]
struct Agreement {
    positions: usize,
    /// Share of positions whose top-1 token is the same.
    top1: f64,
    /// The largest |logit difference| / std of the first run's logits there.
    worst: f64,
}

/// Runs `a` and `b` (dtype, page size) over `prompts`, compared.
fn compare(
    model: &Model,
    prompts: &[Vec<u32>],
    a: (KvDtype, usize),
    b: (KvDtype, usize),
) -> Agreement {
    let (mut positions, mut agree, mut worst) = (0usize, 0usize, 0f64);
    for tokens in prompts {
        let first = logits_per_position(model, a.0, a.1, tokens);
        let second = logits_per_position(model, b.0, b.1, tokens);
        for (x, y) in first.iter().zip(&second) {
            positions += 1;
            agree += usize::from(argmax(x) == argmax(y));
            let diff = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs() as f64)
                .fold(0.0, f64::max);
            worst = worst.max(diff / std_dev(x));
        }
    }
    Agreement {
        positions,
        top1: agree as f64 / positions as f64,
        worst,
    }
}

/// f16 against f32 and the f32 floor (24- against 16-token pages), printed.
fn measure(what: &str, model: &Model, prompts: &[Vec<u32>]) -> (Agreement, Agreement) {
    let f16 = compare(model, prompts, (KvDtype::F32, 16), (KvDtype::F16, 16));
    // f32 rounding alone: 24-token pages group the keys into other spans and
    // chunks, so the online softmax sums in another order (8-token pages
    // would not: their spans are the same 64 keys as 16-token pages').
    let floor = compare(model, prompts, (KvDtype::F32, 16), (KvDtype::F32, 24));
    for (name, a) in [("f16 vs f32", &f16), ("f32, 24- vs 16-token pages", &floor)] {
        println!(
            "{what}: {name}: {} positions, top-1 agrees at {:.2}%, largest logit difference \
             {:.4} x the logits' standard deviation",
            a.positions,
            a.top1 * 100.0,
            a.worst
        );
    }
    (f16, floor)
}

#[test]
fn f16_kv_moves_the_default_models_logits_no_more_than_f32_rounding_does() {
    let Some(path) = common::cached_default_model() else {
        return;
    };
    let model = Model::load(&path).unwrap();
    let texts = [
        "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and \
         the clocks were striking thirteen. Write a short story about a fox who learns to read.",
        "Explain how a hash table works, including collisions, load factor and resizing. Give \
         an example in Python and discuss the time complexity of insertion and lookup.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + \
         fibonacci(n - 2)\n\n# Rewrite this function iteratively and explain why it is faster.\n",
        "List the planets of the solar system in order from the Sun, with one fact about each: \
         its size, its moons, or its atmosphere. Then say which planet you would visit first.",
    ];
    let mut prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| {
            let chat = [pie_model::ChatMessage::text("user", (*t).into())];
            let text = model.tokenizer.apply_chat_template(&chat, None).unwrap();
            model.tokenizer.encode(&text).unwrap()
        })
        .collect();
    // One long context: every text in turn, so later positions read hundreds of
    // f16 keys.
    prompts.push(
        texts
            .iter()
            .flat_map(|t| model.tokenizer.encode(t).unwrap())
            .collect(),
    );
    let (f16, floor) = measure("default model", &model, &prompts);
    // With 8-bit activations a last-bit change can flip a near-tie's top-1
    // token, and how often a kernel's rounding does varies by ISA (AVX2 flips
    // more than AVX-512: 16 against 6 of 438 on an AVX2 EPYC); the strict
    // bound on f16's own rounding is the float-activation check below.
    let flips = |a: &Agreement| (1.0 - a.top1) * a.positions as f64;
    let allowed = 3.0 * flips(&floor) + 0.015 * f16.positions as f64;
    assert!(flips(&f16) <= allowed, "{f16:?} against {floor:?}");
    assert!(f16.worst <= 1.5 * floor.worst, "{f16:?} against {floor:?}");

    // Issue 17's bound, on f16's rounding by itself: linear layers in f32
    // without activation quantisation, so nothing amplifies a last-bit change.
    let model = model.with_float_activations();
    let f16 = compare(&model, &prompts, (KvDtype::F32, 16), (KvDtype::F16, 16));
    println!("default model, float activations: f16 vs f32: {f16:?}");
    assert!(f16.top1 >= 0.99 && f16.worst < 0.05, "{f16:?}");
}

#[test]
fn f16_kv_stays_close_to_f32_on_the_test_model() {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kv-dtype-test-model.gguf");
    write_test_model(&path, &SynthSpec::default()).unwrap();
    let model = Arc::new(Model::load(&path).unwrap());
    let vocab = model.config.vocab as u32;
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|p| {
            (0..150u32)
                .map(|i| (p * 7919 + i * 31) % (vocab - 1) + 1)
                .collect()
        })
        .collect();
    let (f16, _) = measure("test model", &model, &prompts);
    assert!(f16.top1 >= 0.96 && f16.worst < 0.1, "{f16:?}");
}
