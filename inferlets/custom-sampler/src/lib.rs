//! `custom-sampler`: a sampler the engine does not have, run in the guest.
//! Each step asks the engine for the `k` most likely next tokens
//! (`forward(k)`), picks one, appends it and emits the new text. At
//! temperature 0 it takes the most likely token, so its output equals greedy
//! generation; otherwise it samples from the `k` candidates' renormalized
//! softmax(logprob / temperature) with a seeded SplitMix64. It stops at the
//! model's end-of-turn tokens or after `max_tokens`.
//!
//! Args (any other key is an error): `{"prompt": string, "max_tokens"?: int
//! (default 64), "k"?: int (default 20, 1 to 64), "temperature"?: number
//! (default 0), "seed"?: int (default: from the clock)}`.

use pie_inferlet::{Context, TokenLogprob, emit, model, now_ms};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    max_tokens: Option<u32>,
    k: Option<u32>,
    temperature: Option<f32>,
    seed: Option<u64>,
}

/// SplitMix64: small, fast, good enough to sample with.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A token from `candidates` (most likely first, not empty).
fn pick(candidates: &[TokenLogprob], temperature: f32, rng: &mut SplitMix64) -> u32 {
    if temperature <= 0.0 {
        return candidates[0].token;
    }
    let top = candidates[0].logprob as f64;
    let t = temperature as f64;
    let weights: Vec<f64> = candidates
        .iter()
        .map(|c| ((c.logprob as f64 - top) / t).exp())
        .collect();
    let mut u = rng.next_f64() * weights.iter().sum::<f64>();
    for (c, w) in candidates.iter().zip(&weights) {
        if u < *w {
            return c.token;
        }
        u -= w;
    }
    candidates[candidates.len() - 1].token
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let max_tokens = args.max_tokens.unwrap_or(64);
    let k = args.k.unwrap_or(20);
    if !(1..=64).contains(&k) {
        return Err(format!("k must be between 1 and 64, got {k}"));
    }
    let temperature = args.temperature.unwrap_or(0.0);
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(format!("temperature must be at least 0, got {temperature}"));
    }
    let mut rng = SplitMix64(args.seed.unwrap_or_else(|| now_ms() ^ 0x5EED));
    let stop_tokens = model::stop_tokens();

    let ctx = Context::new()?;
    ctx.append_text(&args.prompt)?;
    let mut generated: Vec<u32> = Vec::new();
    let mut emitted = String::new();
    for _ in 0..max_tokens {
        let candidates = ctx.forward(k)?;
        if candidates.is_empty() {
            return Err("forward returned no candidates".into());
        }
        let token = pick(&candidates, temperature, &mut rng);
        if stop_tokens.contains(&token) {
            break;
        }
        ctx.append_tokens(&[token])?;
        generated.push(token);
        // Emit only whole characters: wait while the text ends in a partial
        // UTF-8 sequence (decoded as U+FFFD) or does not extend what went out.
        if let Ok(text) = model::decode(&generated)
            && text.len() > emitted.len()
            && text.starts_with(emitted.as_str())
            && !text.ends_with('\u{FFFD}')
        {
            emit(&text[emitted.len()..])?;
            emitted = text;
        }
    }
    // A trailing partial character is dropped, as the built-ins drop it.
    Ok(())
}

pie_inferlet::main!(run);
