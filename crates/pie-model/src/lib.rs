//! A decoder of the Llama, Qwen (2, 3), Phi-3 and Gemma (2, 3) families (RMSNorm, RoPE, GQA
//! attention, sliding windows, gated MLP) on candle, computing over the paged KV cache of `pie-kv`.
//!
//! - [`allocator`]: keeping the forward pass's freed memory for reuse.
//! - [`architecture`]: what differs between the served architectures.
//! - [`gguf`]: reading a GGUF file: hyper-parameters, weights, fingerprint.
//! - [`model`]: the batched forward pass over paged KV.
//! - `attention`: causal attention over the pages (blocked, online softmax, SIMD).
//! - `matmul`: quantised linear layers (4- and 8-bit blocks, AVX2 kernel).
//! - [`tokenizer`]: the GGUF's byte-level BPE tokenizer and chat template.
//! - [`constraint`]: constrained generation (JSON schema, regex, grammar) via llguidance.
//! - [`sampling`]: greedy, temperature, top-k and top-p sampling with a seed.
//! - [`token_sets`]: the tokens a generation may sample (allowed, banned).
//! - [`synth`]: a tiny random-weights model of each architecture written as GGUF, for tests.

pub mod allocator;
pub mod architecture;
mod attention;
pub mod constraint;
mod embedding;
mod ggml_blocks;
pub mod gguf;
mod matmul;
pub mod model;
mod ops;
pub mod sampling;
pub mod synth;
pub mod token_sets;
pub mod tokenizer;

pub use architecture::{Activation, Architecture, RopeLayout, Window};
pub use constraint::{Constraint, Grammar, GrammarCounts, GrammarSpec, Grammars};
pub use gguf::ModelConfig;
pub use model::{Model, SeqInput};
pub use ops::RopeScaling;
pub use sampling::{
    check_token_ids, log_sum_exp, logprobs, BadSampling, OutOfVocab, Sampler, SamplingParams,
    SamplingRequest, TokenLogprobs, MAX_TOP_LOGPROBS,
};
pub use token_sets::{TokenSets, MAX_TOKEN_SET};
pub use tokenizer::{ChatEnding, ChatMessage, IncrementalDecoder, Tokenizer, TokenizerSpec};
