//! What differs between the architectures the forward pass serves, in one
//! place: the forward pass reads an [`Architecture`], never the name. A GGUF
//! whose `general.architecture` is not listed is refused naming the ones
//! that are.

use anyhow::{bail, Result};

/// How RoPE pairs a head's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i + 1)`: GGUF's Llama layout (its converter permutes Q
    /// and K rows into it).
    Adjacent,
    /// Pairs `(i, i + d/2)`: the NeoX layout, as Qwen's weights keep it.
    Halves,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Architecture {
    /// `general.architecture`, and the prefix of its metadata keys.
    pub name: &'static str,
    /// Q, K and V carry biases (`blk.N.attn_{q,k,v}.bias`).
    pub qkv_bias: bool,
    /// Each head of Q and K is RMS-normalised before RoPE
    /// (`blk.N.attn_{q,k}_norm.weight`).
    pub qk_norm: bool,
    /// Q, K and V come as one tensor (`blk.N.attn_qkv.weight`), and the
    /// FFN's gate and up as one (`blk.N.ffn_up.weight`, gate rows first).
    pub fused: bool,
    pub rope: RopeLayout,
}

const SUPPORTED: &[Architecture] = &[
    Architecture {
        name: "llama",
        qkv_bias: false,
        qk_norm: false,
        fused: false,
        rope: RopeLayout::Adjacent,
    },
    Architecture {
        name: "qwen2",
        qkv_bias: true,
        qk_norm: false,
        fused: false,
        rope: RopeLayout::Halves,
    },
    Architecture {
        name: "qwen3",
        qkv_bias: false,
        qk_norm: true,
        fused: false,
        rope: RopeLayout::Halves,
    },
    Architecture {
        name: "phi3",
        qkv_bias: false,
        qk_norm: false,
        fused: true,
        rope: RopeLayout::Halves,
    },
];

/// The architecture a file names.
pub fn architecture(name: &str) -> Result<&'static Architecture> {
    match SUPPORTED.iter().find(|a| a.name == name) {
        Some(a) => Ok(a),
        None => {
            let served: Vec<&str> = SUPPORTED.iter().map(|a| a.name).collect();
            bail!(
                "unsupported model architecture `{name}`: Pie serves {}",
                served.join(", ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_architecture_is_refused_naming_the_served_ones() {
        assert_eq!(architecture("qwen2").unwrap().rope, RopeLayout::Halves);
        let e = architecture("gemma3").unwrap_err().to_string();
        assert!(
            e.contains("`gemma3`") && e.contains("llama, qwen2, qwen3, phi3"),
            "{e}"
        );
    }
}
