//! A tiny random-weights model (any served architecture: `SynthSpec::arch`) written as
//! a real GGUF file, so tests run the real loader, tokenizer and forward pass
//! without downloading anything.
//!
//! Byte-level vocabulary (256 byte tokens, no merges) plus `<|endoftext|>`,
//! `<|im_start|>` and `<|im_end|>`, a ChatML chat template, and weights in every
//! tensor type the loader must read: Q8_0, Q4_0, Q4_1, F16 and F32.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use anyhow::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::architecture::{architecture, Architecture};
use crate::tokenizer::byte_level_char;

pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The ChatML template SmolLM2 ships (its default system prompt included).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub seed: u64,
    /// `general.architecture`: `llama`, `qwen2` (Q/K/V biases, NeoX RoPE,
    /// Qwen's pre-tokenizer), `qwen3` (Q/K norms instead of biases) or
    /// `phi3` (Q/K/V and gate/up fused), `gemma2` (scaled embedding,
    /// post-norms, GELU, every other layer windowed) or `gemma3` (Gemma 2's
    /// with Q/K norms, five windowed layers to a global one).
    pub arch: &'static str,
    /// `attention.key_length`, when a head is not hidden / heads wide.
    pub head_dim: Option<usize>,
    /// `rope.dimension_count`, when fewer than a head's elements rotate.
    pub rope_dims: Option<usize>,
    /// Write Llama 3's `rope_freqs.weight` (a frequency divisor per pair).
    pub rope_freqs: bool,
    /// `ffn_down`'s type (a K-quant needs `intermediate` a multiple of 256).
    pub ffn_down_type: GgmlDType,
    /// `attention.sliding_window`, when set.
    pub sliding_window: Option<usize>,
    /// `rope.freq_base`.
    pub rope_theta: f32,
    /// `rope.freq_base_swa` (the sliding-window layers'), when set.
    pub rope_theta_swa: Option<f32>,
    /// LongRoPE: `rope_factors_long` and `_short` tensors, with
    /// `rope.scaling.original_context_length` and `.attn_factor`.
    pub longrope: Option<(usize, f32)>,
    /// `rope.scaling.type`, `.factor` and `.original_context_length`
    /// (`("yarn", 4.0, 64)`).
    pub rope_scaling: Option<(&'static str, f32, usize)>,
    /// `attn_logit_softcapping` and `final_logit_softcapping`, when set.
    pub softcaps: Option<(f32, f32)>,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub context_length: usize,
}

impl Default for SynthSpec {
    fn default() -> Self {
        Self {
            seed: 0,
            arch: "llama",
            head_dim: None,
            rope_dims: None,
            rope_freqs: false,
            ffn_down_type: GgmlDType::F32,
            sliding_window: None,
            rope_theta: 10_000.0,
            rope_theta_swa: None,
            longrope: None,
            rope_scaling: None,
            softcaps: None,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            layers: 2,
            intermediate: 128,
            context_length: 1024,
        }
    }
}

struct Weights {
    rng: StdRng,
}

impl Weights {
    fn tensor(
        &mut self,
        rows: usize,
        cols: usize,
        scale: f32,
        offset: f32,
        dtype: GgmlDType,
    ) -> Result<QTensor> {
        let data: Vec<f32> = (0..rows * cols)
            .map(|_| offset + scale * (self.rng.gen::<f32>() * 2.0 - 1.0))
            .collect();
        let shape: Vec<usize> = if rows == 1 {
            vec![cols]
        } else {
            vec![rows, cols]
        };
        Ok(QTensor::quantize(
            &Tensor::from_vec(data, shape, &Device::Cpu)?,
            dtype,
        )?)
    }

    fn linear(&mut self, out: usize, inp: usize, dtype: GgmlDType) -> Result<QTensor> {
        self.tensor(out, inp, 1.5 / (inp as f32).sqrt(), 0.0, dtype)
    }

    fn norm(&mut self, dim: usize) -> Result<QTensor> {
        self.tensor(1, dim, 0.1, 1.0, GgmlDType::F32)
    }
}

/// Write the test model described by `spec` to `path`.
pub fn write_test_model(path: &Path, spec: &SynthSpec) -> Result<()> {
    let arch = architecture(spec.arch)?;
    let mut w = Weights {
        rng: StdRng::seed_from_u64(spec.seed),
    };
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| byte_level_char(b).to_string())
        .collect();
    tokens.extend(SPECIAL_TOKENS.iter().map(|s| s.to_string()));
    let vocab = tokens.len();
    let mut tensors: Vec<(String, QTensor)> = vec![
        (
            "token_embd.weight".into(),
            w.tensor(vocab, spec.hidden, 1.0, 0.0, GgmlDType::F16)?,
        ),
        ("output_norm.weight".into(), w.norm(spec.hidden)?),
    ];
    // An untied output head: tied to random embeddings the model just repeats its input.
    let head_scale = 4.0 / (spec.hidden as f32).sqrt();
    tensors.push((
        "output.weight".into(),
        w.tensor(vocab, spec.hidden, head_scale, 0.0, GgmlDType::Q8_0)?,
    ));
    if spec.rope_freqs {
        tensors.push(("rope_freqs.weight".into(), rope_freqs(spec, 8.0)?));
    }
    if spec.longrope.is_some() {
        tensors.push(("rope_factors_long.weight".into(), rope_freqs(spec, 16.0)?));
        tensors.push(("rope_factors_short.weight".into(), rope_freqs(spec, 1.5)?));
    }
    for i in 0..spec.layers {
        tensors.extend(layer_tensors(&mut w, spec, arch, i)?);
    }
    let metadata = metadata(spec, tokens);
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = BufWriter::new(File::create(path)?);
    gguf_file::write(&mut out, &md, &ts)?;
    Ok(())
}

fn head_dim(spec: &SynthSpec) -> usize {
    spec.head_dim.unwrap_or(spec.hidden / spec.heads)
}

/// Divisors from 1 towards `top`, as Llama 3.1's and LongRoPE's slow their
/// low frequencies.
fn rope_freqs(spec: &SynthSpec, top: f32) -> Result<QTensor> {
    let pairs = spec.rope_dims.unwrap_or(head_dim(spec)) / 2;
    let divisors: Vec<f32> = (0..pairs)
        .map(|i| 1.0 + (top - 1.0) * i as f32 / pairs as f32)
        .collect();
    let t = Tensor::from_vec(divisors, pairs, &Device::Cpu)?;
    Ok(QTensor::quantize(&t, GgmlDType::F32)?)
}

/// Layer `i`'s tensors, in the order their random values are drawn.
fn layer_tensors(
    w: &mut Weights,
    spec: &SynthSpec,
    arch: &Architecture,
    i: usize,
) -> Result<Vec<(String, QTensor)>> {
    let hd = head_dim(spec);
    let (hidden, q_dim, kv_dim) = (spec.hidden, spec.heads * hd, spec.kv_heads * hd);
    let p = |n: &str| format!("blk.{i}.{n}.weight");
    let mut t = vec![(p("attn_norm"), w.norm(hidden)?)];
    match arch.fused {
        true => t.push((
            p("attn_qkv"),
            w.linear(q_dim + 2 * kv_dim, hidden, GgmlDType::Q8_0)?,
        )),
        false => t.extend([
            (p("attn_q"), w.linear(q_dim, hidden, GgmlDType::Q8_0)?),
            (p("attn_k"), w.linear(kv_dim, hidden, GgmlDType::Q8_0)?),
            (p("attn_v"), w.linear(kv_dim, hidden, GgmlDType::Q8_0)?),
        ]),
    }
    if arch.qkv_bias {
        for (n, width) in [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
            let bias = w.tensor(1, width, 0.5, 0.0, GgmlDType::F32)?;
            t.push((format!("blk.{i}.{n}.bias"), bias));
        }
    }
    if arch.qk_norm {
        t.push((p("attn_q_norm"), w.norm(hd)?));
        t.push((p("attn_k_norm"), w.norm(hd)?));
    }
    let ffn = spec.intermediate;
    t.extend([
        (p("attn_output"), w.linear(hidden, q_dim, GgmlDType::Q8_0)?),
        (p("ffn_norm"), w.norm(hidden)?),
    ]);
    match arch.fused {
        true => t.push((p("ffn_up"), w.linear(2 * ffn, hidden, GgmlDType::Q4_1)?)),
        false => t.extend([
            (p("ffn_gate"), w.linear(ffn, hidden, GgmlDType::Q4_0)?),
            (p("ffn_up"), w.linear(ffn, hidden, GgmlDType::Q4_1)?),
        ]),
    }
    t.push((p("ffn_down"), w.linear(hidden, ffn, spec.ffn_down_type)?));
    if arch.post_norms {
        t.push((p("post_attention_norm"), w.norm(hidden)?));
        t.push((p("post_ffw_norm"), w.norm(hidden)?));
    }
    Ok(t)
}

fn metadata(spec: &SynthSpec, tokens: Vec<String>) -> Vec<(String, Value)> {
    let u32v = |x: usize| Value::U32(x as u32);
    let string = |s: &str| Value::String(s.to_string());
    let mut token_types = vec![Value::I32(1); 256];
    token_types.extend(SPECIAL_TOKENS.iter().map(|_| Value::I32(3)));
    let key = |k: &str| format!("{}.{k}", spec.arch);
    let pre = if spec.arch == "llama" {
        "smollm"
    } else {
        "qwen2"
    };
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), string(spec.arch)),
        ("general.name".into(), string("pie-test-tiny")),
        (key("context_length"), u32v(spec.context_length)),
        (key("embedding_length"), u32v(spec.hidden)),
        (key("block_count"), u32v(spec.layers)),
        (key("feed_forward_length"), u32v(spec.intermediate)),
        (key("attention.head_count"), u32v(spec.heads)),
        (key("attention.head_count_kv"), u32v(spec.kv_heads)),
        (key("rope.freq_base"), Value::F32(spec.rope_theta)),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (key("vocab_size"), u32v(tokens.len())),
        ("tokenizer.ggml.model".into(), string("gpt2")),
        ("tokenizer.ggml.pre".into(), string(pre)),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.iter().map(|t| string(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(token_types),
        ),
        ("tokenizer.ggml.bos_token_id".into(), u32v(256)),
        ("tokenizer.ggml.eos_token_id".into(), u32v(258)),
        ("tokenizer.chat_template".into(), string(CHATML_TEMPLATE)),
    ];
    if let Some(d) = spec.head_dim {
        metadata.push((key("attention.key_length"), u32v(d)));
        metadata.push((key("attention.value_length"), u32v(d)));
    }
    if let Some(d) = spec.rope_dims {
        metadata.push((key("rope.dimension_count"), u32v(d)));
    }
    if let Some(w) = spec.sliding_window {
        metadata.push((key("attention.sliding_window"), u32v(w)));
    }
    if let Some((original, attn_factor)) = spec.longrope {
        metadata.push((key("rope.scaling.original_context_length"), u32v(original)));
        metadata.push((key("rope.scaling.attn_factor"), Value::F32(attn_factor)));
    }
    if let Some((kind, factor, original)) = spec.rope_scaling {
        metadata.push((key("rope.scaling.type"), Value::String(kind.into())));
        metadata.push((key("rope.scaling.factor"), Value::F32(factor)));
        metadata.push((key("rope.scaling.original_context_length"), u32v(original)));
    }
    if let Some(base) = spec.rope_theta_swa {
        metadata.push((key("rope.freq_base_swa"), Value::F32(base)));
    }
    if let Some((attn, last)) = spec.softcaps {
        metadata.push((key("attn_logit_softcapping"), Value::F32(attn)));
        metadata.push((key("final_logit_softcapping"), Value::F32(last)));
    }
    metadata
}
