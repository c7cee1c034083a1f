//! GGUF reading: hyper-parameters, weights (requantised for our kernels) and the
//! model fingerprint.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Tensor};
use pie_core::ModelFingerprint;

/// Hyper-parameters of a Llama-family model, from the `llama.*` GGUF keys.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context_length: usize,
}

impl LlamaConfig {
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// An open GGUF file: its metadata and a reader for its tensors.
pub struct GgufFile {
    pub content: Content,
    reader: BufReader<File>,
    pub fingerprint: ModelFingerprint,
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

    pub fn llama_config(&self) -> Result<LlamaConfig> {
        let arch = self
            .get("general.architecture")?
            .to_string()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .clone();
        if arch != "llama" {
            bail!("unsupported model architecture `{arch}`: Pie serves Llama-family GGUF models");
        }
        let hidden = self.get_usize("llama.embedding_length")?;
        let heads = self.get_usize("llama.attention.head_count")?;
        let kv_heads = self
            .get_usize("llama.attention.head_count_kv")
            .unwrap_or(heads);
        let vocab = match self.get("tokenizer.ggml.tokens") {
            Ok(Value::Array(tokens)) => tokens.len(),
            _ => self.get_usize("llama.vocab_size")?,
        };
        Ok(LlamaConfig {
            vocab,
            hidden,
            intermediate: self.get_usize("llama.feed_forward_length")?,
            layers: self.get_usize("llama.block_count")?,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            rope_theta: self.get_f32("llama.rope.freq_base").unwrap_or(10_000.0),
            rms_eps: self
                .get_f32("llama.attention.layer_norm_rms_epsilon")
                .unwrap_or(1e-5),
            context_length: self.get_usize("llama.context_length").unwrap_or(2048),
        })
    }

    /// One linear layer from the row-wise concatenation of `names` (e.g. Q, K and V
    /// fused so the batch makes one matmul instead of three).
    pub fn linear(&mut self, names: &[&str]) -> Result<QMatMul> {
        let parts = names
            .iter()
            .map(|n| self.tensor(n))
            .collect::<Result<Vec<_>>>()?;
        let dtype = compute_dtype(parts[0].dtype(), parts[0].shape().dims()[1]);
        let qt = if parts.len() == 1 && parts[0].dtype() == dtype {
            parts.into_iter().next().expect("one part")
        } else {
            let dense = parts
                .iter()
                .map(|p| p.dequantize(&Device::Cpu))
                .collect::<candle_core::Result<Vec<_>>>()?;
            QTensor::quantize(&Tensor::cat(&dense, 0)?, dtype)?
        };
        Ok(QMatMul::from_qtensor(qt)?)
    }
}

/// The dtype a weight is computed in. Every block-quantised format becomes Q8_0:
/// candle has AVX2 kernels for Q8_0 but none for Q4_1, and Q8_0 keeps the quality
/// of the 4-bit source (it represents every 4-bit value exactly up to the scale's
/// rounding). Dense weights stay dense.
fn compute_dtype(stored: GgmlDType, in_dim: usize) -> GgmlDType {
    match stored {
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => GgmlDType::F32,
        _ if in_dim.is_multiple_of(32) => GgmlDType::Q8_0,
        _ => GgmlDType::F32,
    }
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
