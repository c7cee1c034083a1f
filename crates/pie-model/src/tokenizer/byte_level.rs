//! GPT-2-style byte-level BPE (`tokenizer.ggml.model = gpt2`): merges, a
//! pre-tokenizer per family (`tokenizer.ggml.pre`, as each family's own
//! tokenizer.json splits: GPT-2's regex for `gpt2` or no key, `smollm`
//! every digit apart then GPT-2's, `llama-bpe` for Llama 3, `qwen2`; any
//! other refused), and the byte alphabet its vocabulary is written in.

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

/// The byte-level tokenizer of `vocab` with `merges` ("a b", by rank) and
/// the `pre` split (special tokens not added yet).
pub(super) fn build(merges: &[String], pre: &str, vocab: Vocab) -> Result<tokenizers::Tokenizer> {
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .with_context(|| format!("bad merge `{m}`"))
        })
        .collect::<Result<Vec<_>>>()?;
    // Llama 3's tokenizer takes a split that is a whole vocabulary piece as
    // it is, before any merge (as Hugging Face's `ignore_merges` and
    // llama.cpp do): its merges alone would not always reach that piece.
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(matches!(pre, "llama-bpe" | "llama3"))
        .build()
        .map_err(|e| anyhow!("building BPE: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// The bytes a vocabulary piece stands for, through the byte alphabet.
pub(super) fn piece_bytes(piece: &str) -> Option<Vec<u8>> {
    piece.chars().map(level_char_byte).collect()
}

/// GPT-2's reversible map from bytes to printable characters (the byte-level vocabulary).
pub fn byte_level_char(byte: u8) -> char {
    if printable(byte) {
        return byte as char;
    }
    let shifted = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + shifted).expect("valid code point")
}

/// The byte `c` stands for in the byte-level vocabulary (the inverse of
/// [`byte_level_char`]), if it is one of its characters.
fn level_char_byte(c: char) -> Option<u8> {
    let code = c as u32;
    match u8::try_from(code) {
        Ok(b) if printable(b) => Some(b),
        _ => (0..=255u8)
            .filter(|&b| !printable(b))
            .nth(code.checked_sub(256)? as usize),
    }
}

/// Bytes GPT-2's alphabet keeps as their own character.
fn printable(b: u8) -> bool {
    (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
}

/// Llama 3's split (`llama-bpe`): digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split: every digit alone.
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer `tokenizer.ggml.pre` names, as the model's own
/// `tokenizer.json` has it: a split (GPT-2's regex, or the family's) before
/// the byte-level alphabet. One this reader does not know is refused: it
/// would split text differently without a word.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let split = |regex: &str| -> Result<PreTokenizerWrapper> {
        let pattern = SplitPattern::Regex(regex.to_string());
        let split = Split::new(pattern, SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| anyhow!("the {pre} pre-tokenizer: {e}"))?;
        let bytes = ByteLevel::new(false, true, false);
        Ok(Sequence::new(vec![split.into(), bytes.into()]).into())
    };
    let gpt2 = ByteLevel::new(false, true, true);
    match pre {
        "" | "default" | "gpt2" | "gpt-2" => Ok(gpt2.into()),
        "smollm" => Ok(Sequence::new(vec![Digits::new(true).into(), gpt2.into()]).into()),
        "llama-bpe" | "llama3" => split(LLAMA3_SPLIT),
        "qwen2" => split(QWEN2_SPLIT),
        other => bail!(
            "tokenizer.ggml.pre `{other}` is not supported (Pie splits text as gpt2, smollm, llama-bpe or qwen2 do)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_alphabet_maps_back_to_its_bytes() {
        for b in 0..=255u8 {
            assert_eq!(level_char_byte(byte_level_char(b)), Some(b));
        }
        assert_eq!(level_char_byte('\u{3000}'), None);
    }

    #[test]
    fn each_family_splits_digits_and_spaces_as_its_own_tokenizer_does() {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let pieces = |pre: &str, text: &str| -> Vec<String> {
            let mut s = PreTokenizedString::from(text);
            pre_tokenizer(pre).unwrap().pre_tokenize(&mut s).unwrap();
            (s.get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter())
            .map(|(piece, _, _)| piece.replace('Ġ', " ").replace('Ċ', "\n"))
            .collect()
        };
        let text = "Hi you 12345 it's\n\nok";
        assert_eq!(
            pieces("llama-bpe", text),
            ["Hi", " you", " ", "123", "45", " it", "'s", "\n\n", "ok"]
        );
        assert_eq!(
            pieces("qwen2", text),
            ["Hi", " you", " ", "1", "2", "3", "4", "5", " it", "'s", "\n\n", "ok"]
        );
        let e = pre_tokenizer("starcoder").unwrap_err().to_string();
        assert!(e.contains("`starcoder`") && e.contains("qwen2"), "{e}");
    }

    /// A split that is a whole piece is that piece under Llama 3's rule,
    /// though no merge reaches it; under GPT-2's the merges decide.
    #[test]
    fn llama3_takes_a_whole_piece_before_merging() {
        let vocab: Vocab = ["a", "b", "c", "ab", "abc"]
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges = ["a b".to_string()];
        let ids = |pre: &str| {
            let t = build(&merges, pre, vocab.clone()).unwrap();
            t.encode("abc", false).unwrap().get_ids().to_vec()
        };
        assert_eq!(ids("llama-bpe"), [4]);
        assert_eq!(ids("gpt-2"), [3, 2]);
    }
}
