//! GGUF reading: hyper-parameters, weights (in the layouts of `matmul`) and the
//! model fingerprint.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use pie_core::ModelFingerprint;

use crate::architecture::{architecture, Architecture, Window};
use crate::ggml_blocks::BlockType;
use crate::matmul::{Linear, Q4Source, QWeight};
use crate::ops::RopeScaling;

/// Hyper-parameters of a model, from its `{architecture}.*` GGUF keys.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: &'static Architecture,
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// How many of a head's elements RoPE rotates (`rope.dimension_count`).
    pub rope_dims: usize,
    /// `rope.scaling.*`: how the global layers' RoPE stretches.
    pub rope_scaling: RopeScaling,
    /// `rope.scaling.original_context_length`: LongRoPE's long factors
    /// apply when the context is longer.
    pub rope_original_context: Option<usize>,
    /// `rope.scaling.attn_factor`: rotated elements scaled by it (1: none).
    pub rope_attn_factor: f32,
    pub rope_theta: f32,
    /// The sliding-window layers' own RoPE base, unscaled (Gemma 3: the
    /// file's `rope.freq_base_swa`, else 10,000); `None`: theirs is the
    /// others'.
    pub local_rope_theta: Option<f32>,
    /// Queries' scale in attention scores: `1 / sqrt(head_dim)` for most.
    pub attn_scale: f32,
    /// `attn_logit_softcapping`: scores capped to `cap * tanh(s / cap)`.
    pub attn_softcap: Option<f32>,
    /// `final_logit_softcapping`: logits capped the same way.
    pub final_softcap: Option<f32>,
    pub rms_eps: f32,
    /// `attention.sliding_window`, applied as the architecture's
    /// [`Window`] says.
    pub sliding_window: Option<usize>,
    /// The most positions a sequence may have: the file's context length,
    /// or a sliding window that holds sequences where shorter.
    pub context_length: usize,
}

impl ModelConfig {
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The width of Q (and of attention's output): `hidden` for most
    /// models, not for Qwen 3 (`key_length` wider than hidden / heads).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// The head width: `attention.key_length` where the file has it (equal to
/// `value_length`: a page holds K and V of one width), else `implied`
/// (hidden / heads). Refused, naming the keys, when they differ.
fn checked_head_dim(
    arch: &str,
    implied: usize,
    key: Option<usize>,
    value: Option<usize>,
) -> Result<usize> {
    match (key, value) {
        (Some(k), Some(v)) if k != v => bail!(
            "{arch}.attention.key_length {k} differs from value_length {v}: KV pages hold K and V of one width"
        ),
        (Some(k), _) | (None, Some(k)) if k == 0 || !k.is_multiple_of(2) => {
            bail!("{arch}.attention.key_length {k} must be even and above 0")
        }
        (Some(k), _) | (None, Some(k)) => Ok(k),
        (None, None) => Ok(implied),
    }
}

/// An open GGUF file: its metadata and a reader for its tensors.
pub struct GgufFile {
    pub content: Content,
    reader: BufReader<File>,
    pub fingerprint: ModelFingerprint,
    /// Tensors of fewer than 8 bits a weight that [`GgufFile::linear`]
    /// widened to 8-bit blocks (no compact kernel for their type), by type.
    pub widened: BTreeMap<String, usize>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let fingerprint = fingerprint_file(path)?;
        let mut reader = BufReader::new(
            File::open(path).with_context(|| format!("opening model {}", path.display()))?,
        );
        let content = Content::read(&mut reader)
            .map_err(|e| anyhow::anyhow!("{}: not a valid GGUF file: {e}", path.display()))?;
        Ok(Self {
            content,
            reader,
            fingerprint,
            widened: BTreeMap::new(),
        })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn get(&self, key: &str) -> Result<&Value> {
        self.content
            .metadata
            .get(key)
            .with_context(|| format!("GGUF metadata key `{key}` is missing"))
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        Ok(v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x as u64))
            .map_err(|e| anyhow::anyhow!("GGUF key `{key}`: {e}"))? as usize)
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.get(key)?
            .to_f32()
            .map_err(|e| anyhow::anyhow!("GGUF key `{key}`: {e}"))
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| anyhow::anyhow!("GGUF tensor `{name}`: {e}"))
    }

    /// A tensor dequantised to f32, flattened.
    pub fn f32_tensor(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self
            .tensor(name)?
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    pub fn model_config(&self) -> Result<ModelConfig> {
        let name = self
            .get("general.architecture")?
            .to_string()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .clone();
        let arch = architecture(&name)?;
        let key = |k: &str| format!("{name}.{k}");
        let hidden = self.get_usize(&key("embedding_length"))?;
        let heads = self.get_usize(&key("attention.head_count"))?;
        let kv_heads = self
            .get_usize(&key("attention.head_count_kv"))
            .unwrap_or(heads);
        let head_dim = self.head_dim(&name, hidden, heads)?;
        // 0 is how Phi-4's files say they have none.
        let sliding_window =
            (self.get_usize(&key("attention.sliding_window")).ok()).filter(|&w| w > 0);
        // A window every layer keeps holds sequences to its length, so each
        // layer's window covers the whole sequence.
        let (held, local_rope_theta) = match arch.window {
            Window::HoldsSequences => (sliding_window, None),
            // llama.cpp reads the windowed layers' base where a file has it.
            Window::Interleaved {
                local_rope_theta, ..
            } if sliding_window.is_some() => (
                None,
                self.get_f32(&key("rope.freq_base_swa"))
                    .ok()
                    .or(local_rope_theta),
            ),
            Window::Interleaved { .. } => (None, None),
        };
        let layers = self.get_usize(&key("block_count"))?;
        let query_width = match arch.wide_query_scale_layers == Some(layers) {
            true => hidden / heads,
            false => head_dim,
        };
        let cap = |k: &str| -> Result<Option<f32>> {
            match self.get_f32(&key(k)) {
                Err(_) => Ok(None),
                Ok(c) if c > 0.0 && c.is_finite() => Ok(Some(c)),
                Ok(c) => bail!("{name}.{k} {c} must be above 0"),
            }
        };
        let rope_dims = self
            .get_usize(&key("rope.dimension_count"))
            .unwrap_or(head_dim);
        if !rope_dims.is_multiple_of(2) || rope_dims > head_dim {
            bail!("{name}.rope.dimension_count {rope_dims} must be even and at most the head width {head_dim}");
        }
        let trained = self.get_usize(&key("context_length")).unwrap_or(2048);
        let vocab = match self.get("tokenizer.ggml.tokens") {
            Ok(Value::Array(tokens)) => tokens.len(),
            _ => self.get_usize(&key("vocab_size"))?,
        };
        Ok(ModelConfig {
            arch,
            vocab,
            hidden,
            intermediate: self.get_usize(&key("feed_forward_length"))?,
            layers,
            heads,
            kv_heads,
            head_dim,
            rope_dims,
            rope_scaling: self.rope_scaling(&name, trained)?,
            rope_original_context: self
                .get_usize(&key("rope.scaling.original_context_length"))
                .ok(),
            rope_attn_factor: self
                .get_f32(&key("rope.scaling.attn_factor"))
                .unwrap_or(1.0),
            rope_theta: self.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            local_rope_theta,
            attn_scale: 1.0 / (query_width as f32).sqrt(),
            attn_softcap: cap("attn_logit_softcapping")?,
            final_softcap: cap("final_logit_softcapping")?,
            rms_eps: self
                .get_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
            sliding_window,
            context_length: trained.min(held.unwrap_or(usize::MAX)),
        })
    }

    /// The RoPE scaling `rope.scaling.type` names (none, linear or YaRN);
    /// other types are refused, naming the type. YaRN's original context is
    /// `rope.scaling.original_context_length`, else the file's context
    /// length `trained` (as llama.cpp takes it).
    fn rope_scaling(&self, arch: &str, trained: usize) -> Result<RopeScaling> {
        let key = |k: &str| format!("{arch}.rope.scaling.{k}");
        let kind = (self.get(&key("type")).ok()).and_then(|v| v.to_string().ok().cloned());
        let factor = || -> Result<f32> {
            let factor = self.get_f32(&key("factor"))?;
            match factor > 0.0 {
                true => Ok(factor),
                false => bail!("{} {factor} must be above 0", key("factor")),
            }
        };
        let or = |k: &str, default: f32| self.get_f32(&key(k)).unwrap_or(default);
        match kind.as_deref() {
            None | Some("none") => Ok(RopeScaling::None),
            Some("linear") => Ok(RopeScaling::Linear { factor: factor()? }),
            Some("yarn") if or("yarn_log_multiplier", 0.0) != 0.0 => bail!(
                "{} (DeepSeek's YaRN attention scale) is not served",
                key("yarn_log_multiplier")
            ),
            Some("yarn") => Ok(RopeScaling::Yarn {
                factor: factor()?,
                original_context: self
                    .get_usize(&key("original_context_length"))
                    .unwrap_or(trained),
                beta_fast: or("yarn_beta_fast", 32.0),
                beta_slow: or("yarn_beta_slow", 1.0),
                ext_factor: or("yarn_ext_factor", 1.0),
            }),
            Some(other) => bail!(
                "{} `{other}` is not served (none, linear and yarn are; Llama 3's rope_freqs tensor is read)",
                key("type")
            ),
        }
    }

    /// The head width (see [`checked_head_dim`]).
    fn head_dim(&self, arch: &str, hidden: usize, heads: usize) -> Result<usize> {
        let width = |k: &str| self.get_usize(&format!("{arch}.attention.{k}")).ok();
        checked_head_dim(
            arch,
            hidden / heads,
            width("key_length"),
            width("value_length"),
        )
    }

    /// One linear layer from the row-wise concatenation of `names` (e.g. Q, K and V
    /// fused so the batch makes one matmul instead of three).
    pub fn linear(&mut self, names: &[&str]) -> Result<Linear> {
        let parts = names
            .iter()
            .map(|n| self.weight(n))
            .collect::<Result<Vec<_>>>()?;
        Ok(Linear::new(parts))
    }

    /// One weight matrix. Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 blocks keep their
    /// values (see `QWeight::from_q4`, `QWeight::from_q6k`, `QWeight::from_q8_0`); every other type, and
    /// a Q8_0 block with a -128, becomes 8-bit blocks, counted in
    /// [`GgufFile::widened`] when that widens it.
    fn weight(&mut self, name: &str) -> Result<QWeight> {
        let t = self.tensor(name)?;
        let (n, k) = t
            .shape()
            .dims2()
            .with_context(|| format!("GGUF tensor `{name}` is not a matrix"))?;
        // A row of partial blocks is no file ggml writes; it goes the
        // dequantising way below rather than into the block readers.
        let whole_blocks = BlockType::of(t.dtype()).is_some_and(|b| k.is_multiple_of(b.values()));
        let four_bit = |source| -> Result<Option<QWeight>> {
            Ok(Some(QWeight::from_q4(&t.data()?, source, n, k)))
        };
        let kept = match t.dtype() {
            _ if !whole_blocks => None,
            GgmlDType::Q4_0 => four_bit(Q4Source::Q4_0)?,
            GgmlDType::Q4_1 => four_bit(Q4Source::Q4_1)?,
            GgmlDType::Q4K => four_bit(Q4Source::Q4K)?,
            GgmlDType::Q6K => Some(QWeight::from_q6k(&t.data()?, n, k)),
            GgmlDType::Q8_0 => QWeight::from_q8_0(&t.data()?, n, k),
            _ => None,
        };
        if let Some(w) = kept {
            return Ok(w);
        }
        if below_eight_bits(t.dtype()) {
            *self.widened.entry(format!("{:?}", t.dtype())).or_default() += 1;
        }
        // Row by row where the block rule is ours: a 49,152 x 2,048 Q6_K
        // head is 403 MB in f32, and peak memory at load would hold it all.
        match BlockType::of(t.dtype()).filter(|b| k.is_multiple_of(b.values())) {
            Some(kind) => {
                let data = t.data()?;
                let row_bytes = k / kind.values() * kind.bytes();
                let mut wide = Vec::with_capacity(k);
                Ok(QWeight::from_rows(n, k, |row, dst| {
                    wide.clear();
                    for block in data[row * row_bytes..][..row_bytes].chunks_exact(kind.bytes()) {
                        kind.widen(block, &mut wide);
                    }
                    dst.copy_from_slice(&wide);
                }))
            }
            None => {
                let dense = t.dequantize(&Device::Cpu)?.flatten_all()?;
                Ok(QWeight::from_f32(&dense.to_vec1::<f32>()?, n, k))
            }
        }
    }
}

/// Whether `dtype` stores a weight in fewer than 8 bits (so 8-bit blocks
/// widen it).
fn below_eight_bits(dtype: GgmlDType) -> bool {
    !matches!(
        dtype,
        GgmlDType::F32
            | GgmlDType::F16
            | GgmlDType::BF16
            | GgmlDType::Q8_0
            | GgmlDType::Q8_1
            | GgmlDType::Q8K
    )
}

/// XXH3-64 over the whole file: names the exact weights and tokenizer.
fn fingerprint_file(path: &Path) -> Result<ModelFingerprint> {
    let mut f = File::open(path).with_context(|| format!("opening model {}", path.display()))?;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(ModelFingerprint(h.digest()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{write_test_model, SynthSpec};

    fn config_of(name: &str, spec: SynthSpec) -> Result<ModelConfig> {
        let path =
            std::env::temp_dir().join(format!("pie-config-{name}-{}.gguf", std::process::id()));
        write_test_model(&path, &spec).unwrap();
        let config = GgufFile::open(&path).unwrap().model_config();
        let _ = std::fs::remove_file(&path);
        config
    }

    /// A Gemma of the 27B's layer count scales queries by hidden / heads
    /// (16 here), any other by the head width (32); the caps are read, and
    /// a cap of 0 is refused naming its key.
    #[test]
    fn gemma_query_scale_and_caps_come_from_the_file() {
        let gemma2 = |layers, softcaps| SynthSpec {
            arch: "gemma2",
            layers,
            head_dim: Some(32),
            softcaps,
            ..SynthSpec::default()
        };
        let wide = config_of("27b", gemma2(46, Some((50.0, 30.0)))).unwrap();
        assert_eq!(wide.attn_scale, 0.25);
        assert_eq!(
            (wide.attn_softcap, wide.final_softcap),
            (Some(50.0), Some(30.0))
        );
        let plain = config_of("2b", gemma2(4, None)).unwrap();
        assert_eq!(plain.attn_scale, 1.0 / 32f32.sqrt());
        assert_eq!((plain.attn_softcap, plain.final_softcap), (None, None));
        let e = config_of("cap0", gemma2(4, Some((0.0, 30.0))))
            .unwrap_err()
            .to_string();
        assert!(e.contains("gemma2.attn_logit_softcapping 0"), "{e}");
    }

    /// `rope.scaling` as the file says: YaRN with llama.cpp's defaults for
    /// the keys a file leaves out, linear; an unknown type or a factor of 0
    /// is refused naming its key.
    #[test]
    fn rope_scaling_comes_from_the_file() {
        let scaled = |kind, factor| SynthSpec {
            rope_scaling: Some((kind, factor, 64)),
            ..SynthSpec::default()
        };
        let yarn = config_of("yarn", scaled("yarn", 4.0)).unwrap();
        let expected = RopeScaling::Yarn {
            factor: 4.0,
            original_context: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            ext_factor: 1.0,
        };
        assert_eq!(yarn.rope_scaling, expected);
        let linear = config_of("linear", scaled("linear", 2.0)).unwrap();
        assert_eq!(linear.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        let e = config_of("su", scaled("su", 2.0)).unwrap_err().to_string();
        assert!(
            e.contains("llama.rope.scaling.type `su` is not served"),
            "{e}"
        );
        let e = config_of("yarn0", scaled("yarn", 0.0))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("llama.rope.scaling.factor 0 must be above 0"),
            "{e}"
        );
    }

    #[test]
    fn the_head_width_is_the_key_length_and_k_and_v_must_agree() {
        assert_eq!(checked_head_dim("qwen2", 64, None, None).unwrap(), 64);
        assert_eq!(
            checked_head_dim("qwen2", 64, Some(64), Some(64)).unwrap(),
            64
        );
        let e = checked_head_dim("llama", 64, Some(128), Some(64))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("llama.attention.key_length 128 differs from value_length 64"),
            "{e}"
        );
        assert_eq!(
            checked_head_dim("qwen3", 64, Some(128), Some(128)).unwrap(),
            128
        );
        let e = checked_head_dim("qwen3", 64, Some(7), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("qwen3.attention.key_length 7"), "{e}");
    }
}
