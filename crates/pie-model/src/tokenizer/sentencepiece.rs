//! SentencePiece vocabularies (`tokenizer.ggml.model = llama`: Llama 2,
//! Mistral, TinyLlama, Gemma, Phi-3): pieces with scores, spaces written
//! `▁`, bytes outside the vocabulary as `<0xXX>` pieces. Built as the
//! `tokenizers` crate's BPE with merges taken from the scores (a piece that
//! two others make merges at its score's rank, as Hugging Face converts
//! these vocabularies), byte fallback, and a space before text that starts
//! the input or follows a special token (`tokenizer.ggml.add_space_prefix`,
//! as llama.cpp does). Decoding keeps the spaces: an answer's first word
//! may start with one.

use std::collections::HashMap;

use anyhow::{anyhow, ensure, Result};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence};
use tokenizers::NormalizerWrapper;

/// GGUF `tokenizer.ggml.token_type` of the unknown piece.
const TOKEN_TYPE_UNKNOWN: i32 = 2;
const SPACE: &str = "\u{2581}";

/// A SentencePiece vocabulary: each piece, its score and its GGUF type.
pub(super) struct Pieces<'a> {
    pub tokens: &'a [String],
    pub scores: &'a [f32],
    pub token_types: &'a [i32],
}

/// The SentencePiece tokenizer of `pieces` (special tokens not added yet);
/// `space_prefix`: a space goes before text that starts a segment.
pub(super) fn build(
    pieces: &Pieces,
    vocab: Vocab,
    space_prefix: bool,
) -> Result<tokenizers::Tokenizer> {
    let merges = merges_from_scores(pieces)?;
    let unknown = (pieces.tokens.iter().zip(pieces.token_types))
        .find(|(_, t)| **t == TOKEN_TYPE_UNKNOWN)
        .map(|(piece, _)| piece.clone());
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unknown) = unknown {
        bpe = bpe.unk_token(unknown);
    }
    let bpe = bpe.build().map_err(|e| anyhow!("building BPE: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let spaces = Replace::new(" ", SPACE).map_err(|e| anyhow!("{e}"))?;
    let normalizer: NormalizerWrapper = match space_prefix {
        true => Sequence::new(vec![Prepend::new(SPACE.into()).into(), spaces.into()]).into(),
        false => spaces.into(),
    };
    inner
        .with_normalizer(Some(normalizer))
        .map_err(|e| anyhow!("the SentencePiece normalizer: {e}"))?;
    let unspaced = Replace::new(SPACE, " ").map_err(|e| anyhow!("{e}"))?;
    inner.with_decoder(Some(DecoderSequence::new(vec![
        unspaced.into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ])));
    Ok(inner)
}

/// The bytes a piece stands for: `<0xXX>` one byte, else its text with `▁`
/// as a space.
pub(super) fn piece_bytes(piece: &str) -> Vec<u8> {
    let byte = (piece.strip_prefix("<0x"))
        .and_then(|rest| rest.strip_suffix('>'))
        .filter(|hex| hex.len() == 2)
        .and_then(|hex| u8::from_str_radix(hex, 16).ok());
    match byte {
        Some(b) => vec![b],
        None => piece.replace(SPACE, " ").into_bytes(),
    }
}

/// Every split of a piece into two pieces, ranked by the whole piece's
/// score (highest first), a piece's own splits by their parts' ids.
fn merges_from_scores(spec: &Pieces) -> Result<Vec<(String, String)>> {
    ensure!(
        spec.scores.len() == spec.tokens.len(),
        "tokenizer.ggml.scores has {} values for {} tokens",
        spec.scores.len(),
        spec.tokens.len()
    );
    let ids: HashMap<&str, usize> = (spec.tokens.iter().enumerate())
        .map(|(id, piece)| (piece.as_str(), id))
        .collect();
    let mut merges: Vec<(f32, usize, usize)> = Vec::new();
    for (id, piece) in spec.tokens.iter().enumerate() {
        let mut own: Vec<(f32, usize, usize)> = (piece.char_indices().skip(1))
            .filter_map(|(at, _)| {
                let (left, right) = piece.split_at(at);
                Some((spec.scores[id], *ids.get(left)?, *ids.get(right)?))
            })
            .collect();
        own.sort_by_key(|&(_, l, r)| (l, r));
        merges.extend(own);
    }
    // Stable: equal scores keep the pieces' order.
    merges.sort_by(|a, b| b.0.total_cmp(&a.0));
    Ok(merges
        .into_iter()
        .map(|(_, l, r)| (spec.tokens[l].clone(), spec.tokens[r].clone()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_byte_piece_is_its_byte_and_a_space_is_a_space() {
        assert_eq!(piece_bytes("<0xC3>"), [0xC3]);
        assert_eq!(piece_bytes("\u{2581}the"), b" the");
        assert_eq!(piece_bytes("<0x4>"), b"<0x4>");
    }
}
