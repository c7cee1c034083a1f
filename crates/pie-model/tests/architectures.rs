//! Each served architecture's forward pass against a plain reference
//! written from the architecture's definition (dense f32 weights read back
//! from the file, no pages, no batching, no kernels): the same next-token
//! logits for every position of a prompt, on tiny random-weights models
//! whose outputs any misplaced bias, RoPE pairing or head mapping would
//! change.

use std::path::PathBuf;

use pie_kv::{KvLayout, KvPool, PageTable};
use pie_model::gguf::GgufFile;
use pie_model::synth::{write_test_model, SynthSpec};
use pie_model::{Model, RopeLayout, SeqInput};

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

fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mean = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    x.iter().zip(weight).map(|(v, w)| v * scale * w).collect()
}

/// RoPE of one head at `pos`, pairing elements as `layout` says.
fn rope(head: &mut [f32], pos: usize, theta: f32, layout: RopeLayout) {
    let d = head.len();
    for i in 0..d / 2 {
        let angle = pos as f64 / (theta as f64).powf(2.0 * i as f64 / d as f64);
        let (cos, sin) = (angle.cos() as f32, angle.sin() as f32);
        let (a, b) = match layout {
            RopeLayout::Adjacent => (2 * i, 2 * i + 1),
            RopeLayout::Halves => (i, i + d / 2),
        };
        let (x, y) = (head[a], head[b]);
        head[a] = x * cos - y * sin;
        head[b] = x * sin + y * cos;
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
    let (hd, group) = (c.head_dim, c.heads / c.kv_heads);
    let embed = dense.w("token_embd.weight");
    let mut xs: Vec<Vec<f32>> = (tokens.iter())
        .map(|&t| embed[t as usize * c.hidden..][..c.hidden].to_vec())
        .collect();
    for l in 0..c.layers {
        let p = |n: &str| format!("blk.{l}.{n}.weight");
        let (wq, wk, wv) = (
            dense.w(&p("attn_q")),
            dense.w(&p("attn_k")),
            dense.w(&p("attn_v")),
        );
        let bias = |d: &mut Dense, n: &str, len: usize| match c.arch.qkv_bias {
            true => d.w(&format!("blk.{l}.{n}.bias")),
            false => vec![0.0; len],
        };
        let (bq, bk, bv) = (
            bias(dense, "attn_q", c.hidden),
            bias(dense, "attn_k", c.kv_dim()),
            bias(dense, "attn_v", c.kv_dim()),
        );
        let plus =
            |v: Vec<f32>, b: &[f32]| -> Vec<f32> { v.iter().zip(b).map(|(x, y)| x + y).collect() };
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let h = rms_norm(x, &dense.w(&p("attn_norm")), c.rms_eps);
            let mut q = plus(matvec(&wq, &h), &bq);
            let mut k = plus(matvec(&wk, &h), &bk);
            q.chunks_exact_mut(hd)
                .for_each(|head| rope(head, pos, c.rope_theta, layout));
            k.chunks_exact_mut(hd)
                .for_each(|head| rope(head, pos, c.rope_theta, layout));
            qs.push(q);
            ks.push(k);
            vs.push(plus(matvec(&wv, &h), &bv));
        }
        let (wo, norm2) = (dense.w(&p("attn_output")), dense.w(&p("ffn_norm")));
        let (wg, wu, wd) = (
            dense.w(&p("ffn_gate")),
            dense.w(&p("ffn_up")),
            dense.w(&p("ffn_down")),
        );
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0f32; c.hidden];
            for h in 0..c.heads {
                let q = &qs[pos][h * hd..][..hd];
                let kv = (h / group) * hd;
                let scores: Vec<f32> = (0..=pos)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][kv..kv + hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f32::MIN, f32::max);
                let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = weights.iter().sum();
                for (j, w) in weights.iter().enumerate() {
                    for d in 0..hd {
                        attn[h * hd + d] += w / total * vs[j][kv + d];
                    }
                }
            }
            let out = matvec(&wo, &attn);
            x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
            let h = rms_norm(x, &norm2, c.rms_eps);
            let act: Vec<f32> = (matvec(&wg, &h).iter().zip(matvec(&wu, &h)))
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = matvec(&wd, &act);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
    }
    let (norm, head) = (dense.w("output_norm.weight"), dense.w("output.weight"));
    xs.iter()
        .map(|x| matvec(&head, &rms_norm(x, &norm, c.rms_eps)))
        .collect()
}

/// The engine's logits after each of `tokens`, one token a step over f32 pages.
fn engine(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let layout = KvLayout {
        layers: model.config.layers,
        page_size: 4,
        kv_dim: model.config.kv_dim(),
    };
    let mut pool = KvPool::new(layout, tokens.len().div_ceil(4) + 1, model.fingerprint);
    let mut table = PageTable::new();
    let mut out = Vec::new();
    for (pos, t) in tokens.iter().enumerate() {
        table.reserve(&mut pool, pos + 1).unwrap();
        let input = SeqInput {
            tokens: std::slice::from_ref(t),
            start: pos,
            table: &table,
            logits: true,
        };
        out.extend(model.forward(&mut pool, &[input]).unwrap());
    }
    out
}

fn synth(arch: &'static str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("pie-arch-{arch}-{}.gguf", std::process::id()));
    write_test_model(
        &path,
        &SynthSpec {
            arch,
            seed: 11,
            ..SynthSpec::default()
        },
    )
    .unwrap();
    path
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
    for arch in ["llama", "qwen2"] {
        let path = synth(arch);
        let model = Model::load(&path).unwrap().with_float_activations();
        assert_eq!(model.config.arch.name, arch);
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
        eprintln!("{arch}: {right} against {wrong} with the other pairing");
        assert!(right < 0.01, "{arch}: off by {right}");
        assert!(
            wrong > 10.0 * right.max(0.01),
            "{arch}: the other pairing is off by only {wrong}"
        );
    }
}
