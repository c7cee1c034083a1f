//! The batched forward pass over paged KV.
//!
//! One call runs every sequence of an engine step together: the linear layers see
//! all of the batch's tokens as one matrix (one matmul per weight per step), while
//! attention runs per sequence over that sequence's pages.

use std::path::Path;

use anyhow::{bail, ensure, Result};
use pie_core::ModelFingerprint;
use pie_kv::{KvLayout, KvPool, PageTable};
use rayon::prelude::*;

use crate::architecture::{Activation, Window};
use crate::attention::{self, Heads, Scoring, SeqRows};
use crate::constraint::{GrammarCounts, Grammars};
use crate::embedding::Embedding;
use crate::gguf::{GgufFile, ModelConfig};
use crate::matmul::{Kernel, Linear};
use crate::ops::{gelu_tanh, rms_norm, silu, softcap, Rope, RopeScaling, RopeSpec};
use crate::tokenizer::{Tokenizer, TokenizerSpec};

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Linear,
    /// Q, K and V's biases, concatenated as `qkv`'s rows are.
    qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of Q and K.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    out: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Linear,
    down: Linear,
    /// RMSNorm weights of attention's and the FFN's outputs.
    post_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// How this layer's queries score keys: a window makes it one of the
    /// sliding-window layers, rotated with their RoPE (see [`Window`]).
    scoring: Scoring,
}

pub struct Model {
    pub config: ModelConfig,
    pub fingerprint: ModelFingerprint,
    pub tokenizer: Tokenizer,
    /// What `tokenizer` was built from, for a controller without the model.
    pub tokenizer_spec: TokenizerSpec,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    rope: Rope,
    /// The sliding-window layers' RoPE, where it differs (see [`Window`]).
    local_rope: Option<Rope>,
    /// The matmul kernel every linear layer runs on, chosen at load (see
    /// `matmul::KERNEL_ENV`).
    matmul: Kernel,
    /// Linear layers in f32 without activation quantisation (see
    /// [`Model::with_float_activations`]).
    float_activations: bool,
    /// Weight types widened to 8-bit blocks at load (no compact kernel for
    /// them), with how many tensors each: named at start-up.
    pub widened: Vec<(String, usize)>,
    /// Why the matmul kernel is not the fastest this CPU runs, where the
    /// model's weights decided it: named at start-up.
    pub matmul_choice: Option<String>,
    /// Built on the first constrained request (see [`Model::grammars`]).
    grammars: std::sync::OnceLock<Result<Grammars, String>>,
}

/// One sequence's part of a step: its new tokens, starting at position `start`
/// (the tokens before are already in `table`'s pages, which must have room for
/// `start + tokens.len()`).
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub table: &'a PageTable,
    /// How many of `tokens`' last rows return next-token logits (0: none;
    /// 1: after the last token; more for a pass that scores drafted
    /// tokens). A row's logits are the same bits whatever else the step holds.
    pub logit_rows: usize,
}

/// Layer `i`'s weights, with what its architecture adds.
fn load_layer(f: &mut GgufFile, config: &ModelConfig, i: usize) -> Result<Layer> {
    let p = |n: &str| format!("blk.{i}.{n}.weight");
    let bias = |n: &str| format!("blk.{i}.{n}.bias");
    let qkv_bias = match config.arch.qkv_bias {
        true => Some(
            [bias("attn_q"), bias("attn_k"), bias("attn_v")]
                .iter()
                .map(|name| f.f32_tensor(name))
                .collect::<Result<Vec<_>>>()?
                .concat(),
        ),
        false => None,
    };
    let qk_norm = match config.arch.qk_norm {
        true => Some((
            f.f32_tensor(&p("attn_q_norm"))?,
            f.f32_tensor(&p("attn_k_norm"))?,
        )),
        false => None,
    };
    let (qkv, gate_up) = match config.arch.fused {
        true => (f.linear(&[&p("attn_qkv")])?, f.linear(&[&p("ffn_up")])?),
        false => (
            f.linear(&[&p("attn_q"), &p("attn_k"), &p("attn_v")])?,
            f.linear(&[&p("ffn_gate"), &p("ffn_up")])?,
        ),
    };
    let expected = [
        (
            "Q, K and V",
            qkv.rows(),
            config.q_dim() + 2 * config.kv_dim(),
        ),
        (
            "the FFN's gate and up",
            gate_up.rows(),
            2 * config.intermediate,
        ),
    ];
    for (what, rows, want) in expected {
        ensure!(
            rows == want,
            "layer {i}: {what} have {rows} rows, expected {want}"
        );
    }
    let post_norms = match config.arch.post_norms {
        true => Some((
            f.f32_tensor(&p("post_attention_norm"))?,
            f.f32_tensor(&p("post_ffw_norm"))?,
        )),
        false => None,
    };
    Ok(Layer {
        attn_norm: f.f32_tensor(&p("attn_norm"))?,
        qkv,
        qkv_bias,
        qk_norm,
        out: f.linear(&[&p("attn_output")])?,
        ffn_norm: f.f32_tensor(&p("ffn_norm"))?,
        gate_up,
        down: f.linear(&[&p("ffn_down")])?,
        post_norms,
        scoring: Scoring {
            scale: config.attn_scale,
            softcap: config.attn_softcap,
            window: config.sliding_window.filter(|_| is_local(config, i)),
        },
    })
}

/// Whether layer `i` is one of the architecture's sliding-window layers.
fn is_local(config: &ModelConfig, i: usize) -> bool {
    match config.arch.window {
        Window::Interleaved { global_every, .. } => {
            config.sliding_window.is_some() && !(i + 1).is_multiple_of(global_every)
        }
        Window::HoldsSequences => false,
    }
}

/// The tensor of per-pair frequency divisors the file has, as llama.cpp
/// picks it: Llama 3's `rope_freqs`, else LongRoPE's long factors when the
/// context is longer than the original one, else its short ones.
fn divisor_tensor(f: &GgufFile, c: &ModelConfig) -> Option<&'static str> {
    let original = c.rope_original_context.unwrap_or(c.context_length);
    let longrope = match c.context_length > original {
        true => "rope_factors_long.weight",
        false => "rope_factors_short.weight",
    };
    ["rope_freqs.weight", longrope]
        .into_iter()
        .find(|name| f.has_tensor(name))
}

/// The RoPE tables the file describes (with its frequency divisors, one per
/// rotated pair, and LongRoPE's attention factor), and the sliding-window
/// layers' own where the architecture gives them one.
fn load_rope(f: &mut GgufFile, c: &ModelConfig) -> Result<(Rope, Option<Rope>)> {
    let divisors = match divisor_tensor(f, c) {
        Some(name) => {
            let d = f.f32_tensor(name)?;
            ensure!(
                d.len() == c.rope_dims / 2,
                "{name} has {} values, expected one per rotated pair ({})",
                d.len(),
                c.rope_dims / 2
            );
            Some(d)
        }
        None => None,
    };
    let spec = RopeSpec {
        head_dim: c.head_dim,
        dims: c.rope_dims,
        theta: c.rope_theta,
        scaling: c.rope_scaling,
        freq_divisors: divisors.as_deref(),
        layout: c.arch.rope,
        max_pos: c.context_length,
        mscale: c.rope_attn_factor,
    };
    let local = c.local_rope_theta.map(|theta| {
        Rope::new(&RopeSpec {
            theta,
            scaling: RopeScaling::None,
            freq_divisors: None,
            mscale: 1.0,
            ..spec
        })
    });
    Ok((Rope::new(&spec), local))
}

/// Where a batch row goes: its sequence and position.
#[derive(Clone, Copy)]
struct Row {
    seq: usize,
    pos: usize,
}

impl Model {
    pub fn load(path: &Path) -> Result<Self> {
        // Checked first so a bad kernel name fails before a long load.
        Kernel::from_env()?;
        let mut f = GgufFile::open(path)?;
        let config = f.model_config()?;
        let tokenizer_spec = TokenizerSpec::from_gguf(&f)?;
        let tokenizer = Tokenizer::from_spec(tokenizer_spec.clone())?;
        let layers = (0..config.layers)
            .map(|i| load_layer(&mut f, &config, i))
            .collect::<Result<Vec<_>>>()?;
        let embed = Embedding::new(&f.tensor("token_embd.weight")?, config.vocab, config.hidden)?;
        let head_name = if f.has_tensor("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let lm_head = f.linear(&[head_name])?;
        let norm = f.f32_tensor("output_norm.weight")?;
        let linears = layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.out, &l.gate_up, &l.down]);
        let (matmul, matmul_choice) = Kernel::for_model(linears)?;
        let (rope, local_rope) = load_rope(&mut f, &config)?;
        Ok(Self {
            fingerprint: f.fingerprint,
            widened: f.widened.into_iter().collect(),
            config,
            tokenizer,
            tokenizer_spec,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            local_rope,
            matmul,
            matmul_choice,
            float_activations: false,
            grammars: std::sync::OnceLock::new(),
        })
    }

    /// The model with its linear layers in f32, activations not quantised: many
    /// times slower, and four times the weights' memory. For measuring what a
    /// change does by itself, below the 8-bit activations' noise (as
    /// `pie-worker/tests/kv_dtype.rs` measures f16 KV pages).
    pub fn with_float_activations(mut self) -> Self {
        self.float_activations = true;
        self
    }

    /// This model with `template` as its chat template in place of the
    /// file's (`--chat-template`); the tokenizer a worker hands a controller
    /// carries it too. A template that does not compile is an error.
    pub fn with_chat_template(mut self, template: String) -> Result<Self> {
        self.tokenizer_spec.chat_template = Some(template);
        self.tokenizer = Tokenizer::from_spec(self.tokenizer_spec.clone())?;
        match self.tokenizer.chat_template_error() {
            Some(e) => bail!("the chat template does not compile: {e}"),
            None => Ok(self),
        }
    }

    /// The grammar machinery over this model's vocabulary, built once on
    /// first use (its token slices take a moment on a large vocabulary).
    pub fn grammars(&self) -> Result<&Grammars, String> {
        self.grammars
            .get_or_init(|| Grammars::new(&self.tokenizer, self.config.vocab))
            .as_ref()
            .map_err(|e| format!("constrained generation is unavailable for this model: {e}"))
    }

    /// How often grammars were compiled and reused (none before the first
    /// constrained request; asking builds nothing).
    pub fn grammar_counts(&self) -> GrammarCounts {
        match self.grammars.get() {
            Some(Ok(grammars)) => grammars.counts(),
            _ => GrammarCounts::default(),
        }
    }

    /// One linear layer over `rows` rows of `x`.
    fn linear(&self, w: &Linear, x: &[f32], rows: usize) -> Vec<f32> {
        if self.float_activations {
            w.forward_float(x, rows)
        } else {
            w.forward(self.matmul, x, rows)
        }
    }

    /// The name of the matmul kernel the linear layers run on (`amx`, `avx512`,
    /// `avx2`, `portable`).
    pub fn matmul_kernel(&self) -> &'static str {
        self.matmul.name()
    }

    /// Why the CPU's fastest matmul kernel is not the one running, when the
    /// OS refused it (for start-up to say).
    pub fn matmul_refusal(&self) -> Option<&'static str> {
        Kernel::refusal()
    }

    /// The weight bytes one decode step of a single sequence reads: every stored
    /// weight matrix (with its scales) and norm vector, plus the one embedding
    /// row of its token. With batch 1 each is read once per token, so this times
    /// tokens per second is the memory traffic decode must sustain.
    pub fn decode_weight_bytes(&self) -> usize {
        fn f32s(v: &[f32]) -> usize {
            std::mem::size_of_val(v)
        }
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                f32s(&l.attn_norm)
                    + f32s(&l.ffn_norm)
                    + l.qkv_bias.as_deref().map_or(0, f32s)
                    + l.qk_norm.as_ref().map_or(0, |(q, k)| f32s(q) + f32s(k))
                    + l.post_norms.as_ref().map_or(0, |(a, f)| f32s(a) + f32s(f))
                    + [&l.qkv, &l.out, &l.gate_up, &l.down]
                        .iter()
                        .map(|w| w.bytes())
                        .sum::<usize>()
            })
            .sum();
        layers + f32s(&self.norm) + self.lm_head.bytes() + self.embed.row_bytes()
    }

    /// The KV page shape this model needs for `page_size`-token pages.
    pub fn kv_layout(&self, page_size: usize) -> KvLayout {
        KvLayout {
            layers: self.config.layers,
            page_size,
            kv_dim: self.config.kv_dim(),
        }
    }

    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// Run one step. Writes the new tokens' K and V into `pool` and returns the
    /// next-token logits of every row asked for (`SeqInput::logit_rows`), in
    /// input order.
    pub fn forward(&self, pool: &mut KvPool, batch: &[SeqInput]) -> Result<Vec<Vec<f32>>> {
        // Run the whole step on a pool thread: a parallel loop started from
        // outside the pool hands off to it and sleeps until woken, which for a
        // single-token step costs more than some of the matmuls themselves.
        rayon::scope(|_| self.forward_in_pool(pool, batch))
    }

    fn forward_in_pool(&self, pool: &mut KvPool, batch: &[SeqInput]) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let rows = self.rows(batch, pool.layout().page_size)?;
        let mut x = Vec::with_capacity(rows.len() * c.hidden);
        for s in batch {
            for &t in s.tokens {
                crate::sampling::check_token_ids(&[t], c.vocab)?;
                self.embed.push_row(t as usize, &mut x);
            }
        }
        if c.arch.embed_scale {
            let scale = (c.hidden as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= scale);
        }
        for (li, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, c.rms_eps);
            let mut qkv = self.linear(&layer.qkv, &h, rows.len());
            if let Some(bias) = &layer.qkv_bias {
                add_to_rows(&mut qkv, bias);
            }
            self.store_kv(pool, (li, layer), batch, &rows, &mut qkv);
            let attn = self.attention(pool, (li, layer), batch, rows.len(), &qkv);
            let out = self.linear(&layer.out, &attn, rows.len());
            let post = layer.post_norms.as_ref();
            add_normed(&mut x, &out, post.map(|(attn, _)| &attn[..]), c.rms_eps);
            let h = rms_norm(&x, &layer.ffn_norm, c.rms_eps);
            let gate_up = self.linear(&layer.gate_up, &h, rows.len());
            let act = gated(&gate_up, c.intermediate, c.arch.activation);
            let down = self.linear(&layer.down, &act, rows.len());
            add_normed(&mut x, &down, post.map(|(_, ffn)| &ffn[..]), c.rms_eps);
        }
        self.logits(batch, &x)
    }

    fn rows(&self, batch: &[SeqInput], page_size: usize) -> Result<Vec<Row>> {
        let mut rows = Vec::new();
        for (seq, s) in batch.iter().enumerate() {
            ensure!(
                !s.tokens.is_empty(),
                "sequence {seq} has no tokens in this step"
            );
            let end = s.start + s.tokens.len();
            if end > self.max_positions() {
                bail!(
                    "sequence of {end} tokens exceeds the model's context length {}",
                    self.max_positions()
                );
            }
            ensure!(
                s.table.pages().len() * page_size >= end,
                "page table has no room for {end} tokens"
            );
            rows.extend((s.start..end).map(|pos| Row { seq, pos }));
        }
        Ok(rows)
    }

    /// Normalise (where the architecture does) and rotate Q and K of every
    /// row in place, and write K and V into layer `li`'s pages.
    fn store_kv(
        &self,
        pool: &mut KvPool,
        (li, layer): (usize, &Layer),
        batch: &[SeqInput],
        rows: &[Row],
        qkv: &mut [f32],
    ) {
        let c = &self.config;
        let qk_norm = layer.qk_norm.as_ref();
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let page_size = pool.layout().page_size;
        for (row, r) in qkv.chunks_exact_mut(q_dim + 2 * kv_dim).zip(rows) {
            let (q, kv) = row.split_at_mut(q_dim);
            let (k, v) = kv.split_at_mut(kv_dim);
            if let Some((q_norm, k_norm)) = qk_norm {
                q.copy_from_slice(&rms_norm(q, q_norm, c.rms_eps));
                k.copy_from_slice(&rms_norm(k, k_norm, c.rms_eps));
            }
            let rope = match (layer.scoring.window, &self.local_rope) {
                (Some(_), Some(local)) => local,
                _ => &self.rope,
            };
            rope.apply(q, r.pos);
            rope.apply(k, r.pos);
            let (page, slot) = batch[r.seq].table.slot(r.pos, page_size);
            pool.write(li, page, slot, k, v);
        }
    }

    /// Causal attention of every row over its sequence's pages (see
    /// `attention.rs`).
    fn attention(
        &self,
        pool: &KvPool,
        (li, layer): (usize, &Layer),
        batch: &[SeqInput],
        rows: usize,
        qkv: &[f32],
    ) -> Vec<f32> {
        let c = &self.config;
        let mut row0 = 0;
        let seqs: Vec<SeqRows> = batch
            .iter()
            .map(|s| {
                let r = SeqRows {
                    table: s.table,
                    row0,
                    start: s.start,
                    len: s.tokens.len(),
                };
                row0 += s.tokens.len();
                r
            })
            .collect();
        let heads = Heads {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        };
        let mut out = vec![0f32; rows * c.q_dim()];
        attention::attention(
            pool,
            li,
            &seqs,
            heads,
            layer.scoring,
            qkv,
            c.q_dim() + 2 * c.kv_dim(),
            &mut out,
        );
        out
    }

    fn logits(&self, batch: &[SeqInput], x: &[f32]) -> Result<Vec<Vec<f32>>> {
        let d = self.config.hidden;
        let mut asked = Vec::new();
        let mut end = 0;
        for s in batch {
            end += s.tokens.len();
            let rows = s.logit_rows.min(s.tokens.len());
            asked.extend_from_slice(&x[(end - rows) * d..end * d]);
        }
        let n = asked.len() / d;
        if n == 0 {
            return Ok(Vec::new());
        }
        let h = rms_norm(&asked, &self.norm, self.config.rms_eps);
        let mut logits = self.linear(&self.lm_head, &h, n);
        if let Some(cap) = self.config.final_softcap {
            softcap(&mut logits, cap);
        }
        Ok(logits
            .chunks_exact(self.config.vocab)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

/// `y` added to `x`, RMS-normalised first where the layer has a `norm`.
fn add_normed(x: &mut [f32], y: &[f32], norm: Option<&[f32]>, eps: f32) {
    match norm {
        Some(w) => add(x, &rms_norm(y, w, eps)),
        None => add(x, y),
    }
}

/// `act(gate) * up` of every row of `gate_up` (each row `gate ++ up`).
fn gated(gate_up: &[f32], intermediate: usize, activation: Activation) -> Vec<f32> {
    // One loop per activation, each with its function inlined (through a
    // function pointer every element would be a call).
    match activation {
        Activation::Silu => gated_by(gate_up, intermediate, silu),
        Activation::GeluTanh => gated_by(gate_up, intermediate, gelu_tanh),
    }
}

fn gated_by(gate_up: &[f32], intermediate: usize, act: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    // Rows on the pool's threads: a prefill's activations are millions of
    // `exp`s (3.4% of a Qwen3-0.6B 512-token prefill on one thread).
    let mut out = vec![0f32; gate_up.len() / 2];
    out.par_chunks_mut(intermediate)
        .zip(gate_up.par_chunks_exact(2 * intermediate))
        .for_each(|(out, r)| {
            let (g, u) = r.split_at(intermediate);
            for (o, (g, u)) in out.iter_mut().zip(g.iter().zip(u)) {
                *o = act(*g) * u;
            }
        });
    out
}

/// `bias` added to every row of `x`.
fn add_to_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add(row, bias);
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
