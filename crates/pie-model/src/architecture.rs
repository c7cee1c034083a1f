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
    /// base `local_rope_theta` and no scaling; the others see the whole
    /// sequence with the file's RoPE (Gemma 3).
    Interleaved {
        global_every: usize,
        local_rope_theta: f32,
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
    // As llama.cpp builds it: five sliding-window layers (RoPE base 10,000)
    // to each global one. The file's norm weights already hold Gemma's `1 +`.
    Architecture {
        name: "gemma3",
        qk_norm: true,
        rope: RopeLayout::Halves,
        embed_scale: true,
        post_norms: true,
        activation: Activation::GeluTanh,
        window: Window::Interleaved {
            global_every: 6,
            local_rope_theta: 10_000.0,
        },
        ..LLAMA
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
        let e = architecture("gemma2").unwrap_err().to_string();
        assert!(
            e.contains("`gemma2`") && e.contains("llama, qwen2, qwen3, phi3, gemma3"),
            "{e}"
        );
    }
}
