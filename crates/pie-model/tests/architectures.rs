//! Each served architecture's forward pass against a plain reference
//! written from the architecture's definition (dense f32 weights read back
//! from the file, no pages, no batching, no kernels): the same next-token
//! logits for every position of a prompt, on tiny random-weights models
//! whose outputs any misplaced bias, RoPE pairing or head mapping would
//! change.

use candle_core::quantized::GgmlDType;
use pie_kv::{KvLayout, KvPool, PageTable};
use pie_model::gguf::GgufFile;
use pie_model::synth::{write_test_model, SynthSpec};
use pie_model::{Activation, Model, ModelConfig, RopeLayout, RopeScaling, SeqInput, Window};

/// A model's weights as dense f32, read back from its file.
struct Dense {
    file: GgufFile,
}

impl Dense {
    fn w(&mut self, name: &str) -> Vec<f32> {
        self.file
            .f32_tensor(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    }
}

/// `w` (rows of `x.len()`) times `x`.
fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// Each `weight.len()` slice of `x` (a head, or the whole state) normalised.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    x.chunks_exact(weight.len())
        .flat_map(|part| {
            let mean = part.iter().map(|v| v * v).sum::<f32>() / part.len() as f32;
            let scale = 1.0 / (mean + eps).sqrt();
            part.iter().zip(weight).map(move |(v, w)| v * scale * w)
        })
        .collect()
}

/// What one layer does by its definition: its RoPE (base, scaling,
/// per-pair divisors, scale of the rotated elements, pairing) and its window.
struct LayerDef {
    theta: f32,
    scaling: RopeScaling,
    divisors: Vec<f32>,
    mscale: f32,
    layout: RopeLayout,
    window: Option<usize>,
}

/// Layer `l` as the architecture's [`Window`] defines it: a sliding-window
/// layer of an interleaved architecture has its own RoPE base, no scaling.
fn layer_def(c: &ModelConfig, dense: &mut Dense, l: usize, layout: RopeLayout) -> LayerDef {
    // LongRoPE's long factors where the context outgrows the original one.
    let long = c.context_length > c.rope_original_context.unwrap_or(usize::MAX);
    let longrope = ["rope_factors_short.weight", "rope_factors_long.weight"][long as usize];
    let divisors = match ["rope_freqs.weight", longrope]
        .into_iter()
        .find(|n| dense.file.has_tensor(n))
    {
        Some(name) => dense.w(name),
        None => Vec::new(),
    };
    let global = LayerDef {
        theta: c.rope_theta,
        scaling: c.rope_scaling,
        divisors,
        mscale: c.rope_attn_factor,
        layout,
        window: None,
    };
    match c.arch.window {
        Window::Interleaved { global_every, .. }
            if !(l + 1).is_multiple_of(global_every) && c.sliding_window.is_some() =>
        {
            match c.local_rope_theta {
                Some(theta) => LayerDef {
                    theta,
                    scaling: RopeScaling::None,
                    divisors: Vec::new(),
                    mscale: 1.0,
                    window: c.sliding_window,
                    ..global
                },
                None => LayerDef {
                    window: c.sliding_window,
                    ..global
                },
            }
        }
        _ => global,
    }
}

/// Pair `i`'s angle at `pos` and the scale of its rotated elements, as
/// llama.cpp's `rope_yarn` computes them: the angle `theta_extrap = pos *
/// theta^(-2i / d) / divisor_i`, interpolated as `theta_extrap / factor`
/// (linear and YaRN), YaRN mixing the two by its ramp between the
/// "correction dims" and scaling by `1 + 0.1 ln(factor)`.
fn rope_angle(pos: usize, i: usize, c: &ModelConfig, def: &LayerDef) -> (f64, f32) {
    let d = c.rope_dims as f64;
    let freq = 1.0 / (def.theta as f64).powf(2.0 * i as f64 / d);
    let divisor = def.divisors.get(i).copied().unwrap_or(1.0) as f64;
    let extrap = pos as f64 * freq / divisor;
    match def.scaling {
        RopeScaling::None => (extrap, def.mscale),
        RopeScaling::Linear { factor } => (extrap / factor as f64, def.mscale),
        RopeScaling::Yarn {
            factor,
            original_context,
            beta_fast,
            beta_slow,
            ext_factor,
        } => {
            let corr_dim = |rotations: f32| {
                d * (original_context as f64 / (rotations as f64 * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * (def.theta as f64).ln())
            };
            let low = corr_dim(beta_fast).floor().max(0.0);
            let high = corr_dim(beta_slow).ceil().min(d - 1.0);
            let y = (i as f64 - low) / (high - low).max(0.001);
            let mix = (1.0 - y.clamp(0.0, 1.0)) * ext_factor as f64;
            let interp = extrap / factor as f64;
            let mscale = def.mscale * (1.0 + 0.1 * factor.ln());
            (interp * (1.0 - mix) + extrap * mix, mscale)
        }
    }
}

/// RoPE of one head at `pos`: its first `dims` elements turn, pair `i` by
/// [`rope_angle`], paired as the layer says.
fn rope(head: &mut [f32], pos: usize, c: &ModelConfig, def: &LayerDef) {
    let d = c.rope_dims;
    for i in 0..d / 2 {
        let (angle, mscale) = rope_angle(pos, i, c, def);
        let (cos, sin) = (angle.cos() as f32, angle.sin() as f32);
        let (a, b) = match def.layout {
            RopeLayout::Adjacent => (2 * i, 2 * i + 1),
            RopeLayout::Halves => (i, i + d / 2),
        };
        let (x, y) = (head[a], head[b]);
        head[a] = (x * cos - y * sin) * mscale;
        head[b] = (x * sin + y * cos) * mscale;
    }
}

/// One layer's Q, K and V at every position, normalised and rotated as the
/// architecture says.
fn qkv(
    c: &ModelConfig,
    dense: &mut Dense,
    l: usize,
    xs: &[Vec<f32>],
    def: &LayerDef,
) -> [Vec<Vec<f32>>; 3] {
    let p = |n: &str| format!("blk.{l}.{n}.weight");
    let mut projection = |n: &str, width: usize| {
        let w = dense.w(&p(n));
        let b = match c.arch.qkv_bias {
            true => dense.w(&format!("blk.{l}.{n}.bias")),
            false => vec![0.0; width],
        };
        (w, b)
    };
    let (q, k, v) = match c.arch.fused {
        true => {
            let qkv = dense.w(&p("attn_qkv"));
            let (q, kv) = qkv.split_at(c.q_dim() * c.hidden);
            let (k, v) = kv.split_at(c.kv_dim() * c.hidden);
            let unbiased = |w: &[f32], width: usize| (w.to_vec(), vec![0.0; width]);
            (
                unbiased(q, c.q_dim()),
                unbiased(k, c.kv_dim()),
                unbiased(v, c.kv_dim()),
            )
        }
        false => (
            projection("attn_q", c.q_dim()),
            projection("attn_k", c.kv_dim()),
            projection("attn_v", c.kv_dim()),
        ),
    };
    let norms = c
        .arch
        .qk_norm
        .then(|| (dense.w(&p("attn_q_norm")), dense.w(&p("attn_k_norm"))));
    let norm = dense.w(&p("attn_norm"));
    let apply = |(w, b): &(Vec<f32>, Vec<f32>), h: &[f32]| -> Vec<f32> {
        matvec(w, h).iter().zip(b).map(|(x, y)| x + y).collect()
    };
    let mut out: [Vec<Vec<f32>>; 3] = Default::default();
    for (pos, x) in xs.iter().enumerate() {
        let h = rms_norm(x, &norm, c.rms_eps);
        let (mut qs, mut ks) = (apply(&q, &h), apply(&k, &h));
        if let Some((qn, kn)) = &norms {
            qs = rms_norm(&qs, qn, c.rms_eps);
            ks = rms_norm(&ks, kn, c.rms_eps);
        }
        for head in qs
            .chunks_exact_mut(c.head_dim)
            .chain(ks.chunks_exact_mut(c.head_dim))
        {
            rope(head, pos, c, def);
        }
        out[0].push(qs);
        out[1].push(ks);
        out[2].push(apply(&v, &h));
    }
    out
}

/// Causal attention of position `pos` over `qkv` (within `window` of it),
/// every query head reading its group's KV head.
fn attend(
    c: &ModelConfig,
    [qs, ks, vs]: &[Vec<Vec<f32>>; 3],
    pos: usize,
    window: Option<usize>,
) -> Vec<f32> {
    let (hd, group) = (c.head_dim, c.heads / c.kv_heads);
    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let mut attn = vec![0f32; c.q_dim()];
    for h in 0..c.heads {
        let q = &qs[pos][h * hd..][..hd];
        let kv = (h / group) * hd;
        let scores: Vec<f32> = (first..=pos)
            .map(|j| {
                let dot: f32 = q.iter().zip(&ks[j][kv..kv + hd]).map(|(a, b)| a * b).sum();
                capped(dot * c.attn_scale, c.attn_softcap)
            })
            .collect();
        let max = scores.iter().cloned().fold(f32::MIN, f32::max);
        let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f32 = weights.iter().sum();
        for (j, w) in (first..).zip(&weights) {
            for d in 0..hd {
                attn[h * hd + d] += w / total * vs[j][kv + d];
            }
        }
    }
    attn
}

/// `x` soft-capped to `cap * tanh(x / cap)`, where there is a cap.
fn capped(x: f32, cap: Option<f32>) -> f32 {
    cap.map_or(x, |c| c * (x / c).tanh())
}

/// The gate's activation, from its formula.
fn activation(kind: Activation, g: f32) -> f32 {
    match kind {
        Activation::Silu => g / (1.0 + (-g).exp()),
        Activation::GeluTanh => {
            let inner = (2.0 / std::f32::consts::PI).sqrt() * (g + 0.044715 * g.powi(3));
            0.5 * g * (1.0 + inner.tanh())
        }
    }
}

/// The next-token logits after each of `tokens`, computed from the definition.
fn reference(
    model: &Model,
    dense: &mut Dense,
    tokens: &[u32],
    layout: RopeLayout,
) -> Vec<Vec<f32>> {
    let c = &model.config;
    let embed = dense.w("token_embd.weight");
    let scale = match c.arch.embed_scale {
        true => (c.hidden as f32).sqrt(),
        false => 1.0,
    };
    let mut xs: Vec<Vec<f32>> = (tokens.iter())
        .map(|&t| {
            (embed[t as usize * c.hidden..][..c.hidden]
                .iter()
                .map(|v| v * scale))
            .collect()
        })
        .collect();
    for l in 0..c.layers {
        let p = |n: &str| format!("blk.{l}.{n}.weight");
        let def = layer_def(c, dense, l, layout);
        let qkv = qkv(c, dense, l, &xs, &def);
        let (wo, norm2) = (dense.w(&p("attn_output")), dense.w(&p("ffn_norm")));
        let (wg, wu) = match c.arch.fused {
            true => {
                let gate_up = dense.w(&p("ffn_up"));
                let (g, u) = gate_up.split_at(c.intermediate * c.hidden);
                (g.to_vec(), u.to_vec())
            }
            false => (dense.w(&p("ffn_gate")), dense.w(&p("ffn_up"))),
        };
        let wd = dense.w(&p("ffn_down"));
        let post = c.arch.post_norms.then(|| {
            let attn = dense.w(&p("post_attention_norm"));
            (attn, dense.w(&p("post_ffw_norm")))
        });
        let residual = |x: &mut Vec<f32>, y: Vec<f32>, norm: Option<&Vec<f32>>| {
            let y = norm.map_or(y.clone(), |w| rms_norm(&y, w, c.rms_eps));
            x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        };
        for (pos, x) in xs.iter_mut().enumerate() {
            let out = matvec(&wo, &attend(c, &qkv, pos, def.window));
            residual(x, out, post.as_ref().map(|p| &p.0));
            let h = rms_norm(x, &norm2, c.rms_eps);
            let act: Vec<f32> = (matvec(&wg, &h).iter().zip(matvec(&wu, &h)))
                .map(|(&g, u)| activation(c.arch.activation, g) * u)
                .collect();
            residual(x, matvec(&wd, &act), post.as_ref().map(|p| &p.1));
        }
    }
    let (norm, head) = (dense.w("output_norm.weight"), dense.w("output.weight"));
    xs.iter()
        .map(|x| {
            let logits = matvec(&head, &rms_norm(x, &norm, c.rms_eps));
            logits.iter().map(|&l| capped(l, c.final_softcap)).collect()
        })
        .collect()
}

/// An f32 page pool of 4-token pages with room for `tokens`.
fn pool_for(model: &Model, tokens: usize) -> KvPool {
    let layout = KvLayout {
        layers: model.config.layers,
        page_size: 4,
        kv_dim: model.config.kv_dim(),
    };
    KvPool::new(layout, tokens.div_ceil(4) + 1, model.fingerprint)
}

/// The engine's logits after each of `tokens`, one token a step over f32 pages.
fn engine(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut pool = pool_for(model, tokens.len());
    let mut table = PageTable::new();
    let mut out = Vec::new();
    for (pos, t) in tokens.iter().enumerate() {
        table.reserve(&mut pool, pos + 1).unwrap();
        let input = SeqInput {
            tokens: std::slice::from_ref(t),
            start: pos,
            table: &table,
            logit_rows: 1,
        };
        out.extend(model.forward(&mut pool, &[input]).unwrap());
    }
    out
}

/// The cases: each architecture; Llama with Llama 3's frequency divisors
/// and partial rotary; Qwen 3 with heads wider than hidden / heads; Llama
/// with a Q6_K layer and with a Q4_K one (each kept in its bits) and with a
/// Q5_K one (widened at load, and said so); Gemma 3 with five 5-key sliding-window layers before a
/// global one, each kind with its own RoPE base (the windowed layers' as
/// Gemma 3 defines it, or as the file says); Gemma 2 with every other
/// layer windowed and scores and logits soft-capped; Phi-3 with LongRoPE's
/// factors (long beyond the original context, short within) and attention
/// factor, once with Phi-4's window of 0 (none); Phi-3 with fused
/// projections and a sliding window that holds sequences to its length.
fn cases() -> Vec<(&'static str, SynthSpec)> {
    let spec = |arch| SynthSpec {
        arch,
        seed: 11,
        ..SynthSpec::default()
    };
    vec![
        ("llama", spec("llama")),
        (
            "llama-rope-freqs-partial",
            SynthSpec {
                rope_freqs: true,
                rope_dims: Some(8),
                ..spec("llama")
            },
        ),
        ("qwen2", spec("qwen2")),
        (
            "qwen3-wide-heads",
            SynthSpec {
                head_dim: Some(32),
                ..spec("qwen3")
            },
        ),
        (
            "phi3-fused-window",
            SynthSpec {
                sliding_window: Some(48),
                ..spec("phi3")
            },
        ),
        (
            "llama-q6k-down",
            SynthSpec {
                intermediate: 256,
                ffn_down_type: GgmlDType::Q6K,
                ..spec("llama")
            },
        ),
        (
            "llama-q5k-down",
            SynthSpec {
                intermediate: 256,
                ffn_down_type: GgmlDType::Q5K,
                ..spec("llama")
            },
        ),
        (
            "phi4-longrope-long-no-window",
            SynthSpec {
                longrope: Some((256, 1.19)),
                sliding_window: Some(0),
                ..spec("phi3")
            },
        ),
        (
            "qwen2-yarn",
            SynthSpec {
                rope_scaling: Some(("yarn", 4.0, 64)),
                ..spec("qwen2")
            },
        ),
        (
            "phi3-longrope-short",
            SynthSpec {
                longrope: Some((4096, 1.19)),
                ..spec("phi3")
            },
        ),
        (
            "gemma3-interleaved-windows",
            SynthSpec {
                layers: 6,
                sliding_window: Some(5),
                rope_theta: 1_000_000.0,
                head_dim: Some(32),
                ..spec("gemma3")
            },
        ),
        (
            "gemma3-windowed-base-from-file",
            SynthSpec {
                layers: 6,
                sliding_window: Some(5),
                rope_theta_swa: Some(40_000.0),
                ..spec("gemma3")
            },
        ),
        (
            "gemma2-capped-alternating-windows",
            SynthSpec {
                layers: 4,
                sliding_window: Some(6),
                softcaps: Some((3.0, 4.0)),
                ..spec("gemma2")
            },
        ),
        (
            "llama-q4k-down",
            SynthSpec {
                intermediate: 256,
                ffn_down_type: GgmlDType::Q4K,
                ..spec("llama")
            },
        ),
    ]
}

/// The largest difference between two runs' logits, relative to the
/// largest logit (at least 1).
fn worst(want: &[Vec<f32>], got: &[Vec<f32>]) -> f32 {
    (want.iter().zip(got))
        .map(|(w, g)| {
            let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
            w.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
        })
        .fold(0f32, f32::max)
}

/// Within 1% (the loader stores 8-bit weights as its kernels' 8-bit blocks,
/// which rounds the file's values again), where the other RoPE pairing is
/// off by far more than that: the check tells the layouts apart.
#[test]
fn every_architecture_computes_what_its_definition_says() {
    for (case, spec) in cases() {
        let path =
            std::env::temp_dir().join(format!("pie-arch-{case}-{}.gguf", std::process::id()));
        write_test_model(&path, &spec).unwrap();
        let model = Model::load(&path).unwrap().with_float_activations();
        assert_eq!(model.config.arch.name, spec.arch);
        let widened = match spec.ffn_down_type {
            GgmlDType::Q5K => vec![("Q5K".to_string(), spec.layers)],
            _ => Vec::new(),
        };
        assert_eq!(model.widened, widened, "{case}");
        let positions = match model.config.arch.window {
            Window::HoldsSequences => {
                (spec.sliding_window.filter(|&w| w > 0)).unwrap_or(spec.context_length)
            }
            Window::Interleaved { .. } => spec.context_length,
        };
        assert_eq!(model.max_positions(), positions, "{case}");
        let swa_base = match (model.config.arch.window, spec.rope_theta_swa) {
            (
                Window::Interleaved {
                    local_rope_theta, ..
                },
                None,
            ) => local_rope_theta,
            (_, from_file) => from_file,
        };
        assert_eq!(model.config.local_rope_theta, swa_base, "{case}");
        let attn_factor = spec.longrope.map_or(1.0, |(_, f)| f);
        assert_eq!(model.config.rope_attn_factor, attn_factor, "{case}");
        let mut dense = Dense {
            file: GgufFile::open(&path).unwrap(),
        };
        let tokens = model.tokenizer.encode("Tiny models, 42 tokens!").unwrap();
        let got = engine(&model, &tokens);
        let own = model.config.arch.rope;
        let other = match own {
            RopeLayout::Adjacent => RopeLayout::Halves,
            RopeLayout::Halves => RopeLayout::Adjacent,
        };
        let right = worst(&reference(&model, &mut dense, &tokens, own), &got);
        let wrong = worst(&reference(&model, &mut dense, &tokens, other), &got);
        let _ = std::fs::remove_file(&path);
        eprintln!("{case}: {right} against {wrong} with the other pairing");
        assert!(right < 0.01, "{case}: off by {right}");
        assert!(
            wrong > 10.0 * right.max(0.01),
            "{case}: the other pairing is off by only {wrong}"
        );
    }
}

/// The engine's logits after each of `tokens[split - 1..]`: the first
/// `split` tokens in one chunk, the rest in one pass that returns every row.
fn pass(model: &Model, tokens: &[u32], split: usize) -> Vec<Vec<f32>> {
    let mut pool = pool_for(model, tokens.len());
    let mut table = PageTable::new();
    table.reserve(&mut pool, tokens.len()).unwrap();
    let chunk = |range: std::ops::Range<usize>, logit_rows| SeqInput {
        tokens: &tokens[range.clone()],
        start: range.start,
        table: &table,
        logit_rows,
    };
    let mut out = model.forward(&mut pool, &[chunk(0..split, 1)]).unwrap();
    let rest = tokens.len() - split;
    out.extend(
        model
            .forward(&mut pool, &[chunk(split..tokens.len(), rest)])
            .unwrap(),
    );
    out
}

/// A pass over several tokens gives, after each of them, the same logits
/// bits as decoding them one a step, with the quantised activations the
/// server runs: what makes greedy speculative decoding exactly greedy
/// decoding.
#[test]
fn a_pass_over_several_tokens_gives_the_bits_of_decoding_them_one_by_one() {
    for (case, spec) in cases() {
        let path =
            std::env::temp_dir().join(format!("pie-pass-{case}-{}.gguf", std::process::id()));
        write_test_model(&path, &spec).unwrap();
        let model = Model::load(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let tokens = model.tokenizer.encode("Tiny models, 42 tokens!").unwrap();
        let split = tokens.len() / 2;
        let one_by_one = engine(&model, &tokens);
        let passed = pass(&model, &tokens, split);
        assert_eq!(passed.len(), tokens.len() - split + 1, "{case}");
        for (row, (a, b)) in one_by_one[split - 1..].iter().zip(&passed).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{case}: row {row} of the pass differs from decoding");
        }
    }
}
