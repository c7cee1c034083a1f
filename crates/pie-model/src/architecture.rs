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

/// The FFN's gate activation: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU.
    Silu,
    /// GeGLU with GELU's tanh approximation (Gemma).
    GeluTanh,
}

/// What the file's `attention.sliding_window` means.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Window {
    /// Every layer's window: sequences are held to its length, which makes
    /// the window exact without masking (Phi-3).
    HoldsSequences,
    /// Every layer but each `global_every`th (layers `global_every - 1`,
    /// `2 * global_every - 1`, ...) attends within the window, with RoPE of
    /// base `local_rope_theta` and no scaling where that is set (Gemma 3;
    /// Gemma 2's windowed layers keep the file's RoPE); the others see the
    /// whole sequence.
    Interleaved {
        global_every: usize,
        local_rope_theta: Option<f32>,
    },
}

#[derive(Debug, PartialEq)]
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
    /// The token embedding is scaled by `sqrt(hidden)` (Gemma).
    pub embed_scale: bool,
    /// Attention's and the FFN's outputs are RMS-normalised before the
    /// residual add (`blk.N.post_attention_norm`, `blk.N.post_ffw_norm`).
    pub post_norms: bool,
    pub activation: Activation,
    pub window: Window,
    /// A model of this many layers scales queries by `1 / sqrt(hidden /
    /// heads)`, not by the head width's (Gemma 2 and 3 27B, as llama.cpp
    /// tells them apart).
    pub wide_query_scale_layers: Option<usize>,
}

/// What most architectures are: Llama's.
const LLAMA: Architecture = Architecture {
    name: "llama",
    qkv_bias: false,
    qk_norm: false,
    fused: false,
    rope: RopeLayout::Adjacent,
    embed_scale: false,
    post_norms: false,
    activation: Activation::Silu,
    window: Window::HoldsSequences,
    wide_query_scale_layers: None,
};

// As llama.cpp builds Gemma: the file's norm weights already hold its
// `1 +`; Gemma 2's score caps are read from the file.
const GEMMA2: Architecture = Architecture {
    name: "gemma2",
    rope: RopeLayout::Halves,
    embed_scale: true,
    post_norms: true,
    activation: Activation::GeluTanh,
    window: Window::Interleaved {
        global_every: 2,
        local_rope_theta: None,
    },
    wide_query_scale_layers: Some(46),
    ..LLAMA
};

const SUPPORTED: &[Architecture] = &[
    LLAMA,
    Architecture {
        name: "qwen2",
        qkv_bias: true,
        rope: RopeLayout::Halves,
        ..LLAMA
    },
    Architecture {
        name: "qwen3",
        qk_norm: true,
        rope: RopeLayout::Halves,
        ..LLAMA
    },
    Architecture {
        name: "phi3",
        fused: true,
        rope: RopeLayout::Halves,
        ..LLAMA
    },
    GEMMA2,
    Architecture {
        name: "gemma3",
        qk_norm: true,
        window: Window::Interleaved {
            global_every: 6,
            local_rope_theta: Some(10_000.0),
        },
        wide_query_scale_layers: Some(62),
        ..GEMMA2
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
        assert_eq!(architecture("qwen2").unwrap().activation, Activation::Silu);
        let e = architecture("gemma3n").unwrap_err().to_string();
        assert!(
            e.contains("`gemma3n`") && e.contains("llama, qwen2, qwen3, phi3, gemma2, gemma3"),
            "{e}"
        );
    }
}
