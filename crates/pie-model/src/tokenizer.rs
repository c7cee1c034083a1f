//! The tokenizer stored in a GGUF file (`tokenizer.ggml.*`): GPT-2-style byte-level
//! BPE built with the `tokenizers` crate, plus the model's Jinja chat template.
//!
//! Pre-tokenisation follows `tokenizer.ggml.pre`, as each family's own
//! tokenizer.json splits: GPT-2's regex (`gpt2`, or no key), `smollm` (every
//! digit apart, then GPT-2's), `llama-bpe` (Llama 3) and `qwen2`; any other
//! is refused. No prefix space is added: "The" is one token.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
pub use pie_core::chat::ChatMessage;
use pie_core::tools::{ToolFormat, ToolRequest};
use serde::{Deserialize, Serialize};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;
use tokenizers::SplitDelimiterBehavior;

use crate::gguf::GgufFile;

/// GGUF `tokenizer.ggml.token_type` values for special tokens.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Names of end-of-turn tokens that stop generation when the vocabulary has them.
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "</s>",
    "<end_of_turn>",
    "<|end|>",
];

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    stop_tokens: Vec<u32>,
    /// The chat template compiled once (compiling it took about as long as
    /// tokenizing 1,000 tokens, per request); Err: its syntax error.
    chat_template: Option<Result<minijinja::Environment<'static>, String>>,
    tool_format: ToolFormat,
    bos_text: String,
    eos_text: String,
}

/// What a tokenizer is built from: the GGUF's `tokenizer.*` metadata, as
/// plain data, so that a worker can hand its tokenizer to a controller that
/// has no copy of the model (`GET /v1/internal/tokenizer`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.pre` (`smollm` splits digits first).
    pub pre: String,
    pub tokens: Vec<String>,
    /// "a b" pairs, in rank order.
    pub merges: Vec<String>,
    pub token_types: Vec<i32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

impl TokenizerSpec {
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let kind = f
            .get("tokenizer.ggml.model")?
            .to_string()
            .map_err(|e| anyhow!("{e}"))?
            .clone();
        if kind != "gpt2" {
            bail!("unsupported tokenizer `{kind}`: Pie reads GPT-2-style byte-level BPE vocabularies (tokenizer.ggml.model = gpt2)");
        }
        let merges = if f.metadata().contains_key("tokenizer.ggml.merges") {
            string_array(f, "tokenizer.ggml.merges")?
        } else {
            Vec::new()
        };
        let text = |key: &str| f.get(key).ok().and_then(|v| v.to_string().ok().cloned());
        let id = |key: &str| f.get_usize(key).ok().map(|x| x as u32);
        Ok(Self {
            pre: text("tokenizer.ggml.pre").unwrap_or_default(),
            tokens: string_array(f, "tokenizer.ggml.tokens")?,
            merges,
            token_types: match f.get("tokenizer.ggml.token_type") {
                Ok(Value::Array(v)) => v.iter().map(|x| x.to_i32().unwrap_or(1)).collect(),
                _ => Vec::new(),
            },
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos: f
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.to_bool().map_err(|e| anyhow!("{e}")))
                .unwrap_or(false),
            chat_template: text("tokenizer.chat_template"),
        })
    }
}

fn string_array(f: &GgufFile, key: &str) -> Result<Vec<String>> {
    match f.get(key)? {
        Value::Array(items) => items
            .iter()
            .map(|v| v.to_string().cloned().map_err(|e| anyhow!("{key}: {e}")))
            .collect(),
        _ => bail!("GGUF key `{key}` is not an array"),
    }
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

impl Tokenizer {
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        Self::from_spec(TokenizerSpec::from_gguf(f)?)
    }

    /// The tokenizer a [`TokenizerSpec`] describes (read from a GGUF, or sent
    /// by a worker to a controller).
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self> {
        let merges = spec
            .merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .with_context(|| format!("bad merge `{m}`"))
            })
            .collect::<Result<Vec<_>>>()?;
        let vocab: Vocab = spec
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab.clone(), merges)
            .build()
            .map_err(|e| anyhow!("building BPE: {e}"))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer(&spec.pre)?));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = spec
            .tokens
            .iter()
            .zip(&spec.token_types)
            .filter(|(_, t)| matches!(**t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| anyhow!("adding the special tokens: {e}"))?;
        let mut stop_tokens: Vec<u32> = END_OF_TURN_TOKENS
            .iter()
            .filter_map(|t| vocab.get(*t).copied())
            .collect();
        stop_tokens.extend(spec.eos);
        stop_tokens.sort_unstable();
        stop_tokens.dedup();
        let text_of = |id: Option<u32>| {
            id.and_then(|i| spec.tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        Ok(Self {
            bos_text: text_of(spec.bos),
            eos_text: text_of(spec.eos),
            inner,
            bos: spec.bos.filter(|_| spec.add_bos),
            stop_tokens,
            tool_format: ToolFormat::of_template(spec.chat_template.as_deref()),
            chat_template: spec.chat_template.map(chat_environment),
        })
    }

    /// Token ids of `text` as a prompt (the model's BOS first, where it
    /// adds one); special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        ids.extend(self.encode_continuation(text)?);
        Ok(ids)
    }

    /// Token ids of `text` where it continues other tokens: no BOS.
    pub fn encode_continuation(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("detokenizing: {e}"))
    }

    /// The bytes token `id` stands for: its vocabulary string mapped back
    /// through the byte-level alphabet, or a special token's own text.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        let bytes: Option<Vec<u8>> = piece.chars().map(level_char_byte).collect();
        Some(bytes.unwrap_or_else(|| piece.into_bytes()))
    }

    /// The ids of special tokens (control and user-defined: never text).
    pub fn special_tokens(&self) -> std::collections::HashSet<u32> {
        (self.inner.get_added_tokens_decoder().iter())
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect()
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Tokens that end a generation (end-of-sequence and end-of-turn).
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Why the chat template does not compile, if it does not.
    pub fn chat_template_error(&self) -> Option<&str> {
        match &self.chat_template {
            Some(Err(e)) => Some(e),
            _ => None,
        }
    }

    /// How the chat template asks for and writes tool calls.
    pub fn tool_format(&self) -> ToolFormat {
        self.tool_format
    }

    /// The prompt text for `messages` (and the `tools` offered) from the
    /// chat template, ending with the assistant's generation prompt.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        tools: Option<&ToolRequest>,
    ) -> Result<String> {
        let env = match &self.chat_template {
            None => bail!("this model has no chat template (tokenizer.chat_template)"),
            Some(Err(e)) => bail!("chat template: {e}"),
            Some(Ok(env)) => env,
        };
        let messages = self.tool_format.template_messages(messages, tools);
        let tools = tools
            .filter(|_| self.tool_format != ToolFormat::Generic)
            .map(ToolRequest::openai_tools);
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => true,
            bos_token => self.bos_text,
            eos_token => self.eos_text,
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| anyhow!("chat template: {e}"))
    }
}

/// A chat template compiled into its own environment (with the
/// `raise_exception` templates call), or its syntax error.
fn chat_environment(template: String) -> Result<minijinja::Environment<'static>, String> {
    let mut env = minijinja::Environment::new();
    // Templates written for Python's Jinja call str methods (`strip`, `startswith`, ...).
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template_owned("chat", template)
        .map_err(|e| e.to_string())?;
    Ok(env)
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
        "" | "default" | "gpt2" => Ok(gpt2.into()),
        "smollm" => Ok(Sequence::new(vec![Digits::new(true).into(), gpt2.into()]).into()),
        "llama-bpe" | "llama3" => split(LLAMA3_SPLIT),
        "qwen2" => split(QWEN2_SPLIT),
        other => bail!(
            "tokenizer.ggml.pre `{other}` is not supported (Pie splits text as gpt2, smollm, llama-bpe or qwen2 do)"
        ),
    }
}

/// Turns a stream of token ids into text deltas, holding back bytes of a
/// character that is not complete yet.
#[derive(Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let now = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        if now.len() > before.len()
            && now.is_char_boundary(before.len())
            && !now.ends_with('\u{FFFD}')
        {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(now[before.len()..].to_string())
        } else {
            Ok(String::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{write_test_model, SynthSpec};

    #[test]
    fn a_continuation_has_no_bos() {
        let path = std::env::temp_dir().join(format!("pie-bos-{}.gguf", std::process::id()));
        write_test_model(&path, &SynthSpec::default()).expect("writes");
        let gguf = GgufFile::open(&path).expect("opens");
        let mut spec = TokenizerSpec::from_gguf(&gguf).expect("reads");
        let _ = std::fs::remove_file(&path);
        spec.bos = Some(256);
        spec.add_bos = true;
        let tk = Tokenizer::from_spec(spec).expect("builds");
        let prompt = tk.encode("hi there").unwrap();
        assert_eq!(prompt[0], 256);
        assert_eq!(tk.encode_continuation("hi there").unwrap(), prompt[1..]);
    }

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

    #[test]
    fn a_spec_sent_as_json_builds_the_same_tokenizer() {
        let path = std::env::temp_dir().join(format!("pie-spec-{}.gguf", std::process::id()));
        write_test_model(&path, &SynthSpec::default()).expect("writes");
        let gguf = GgufFile::open(&path).expect("opens");
        let direct = Tokenizer::from_gguf(&gguf).expect("builds");
        let spec = TokenizerSpec::from_gguf(&gguf).expect("reads");
        let _ = std::fs::remove_file(&path);
        let sent: TokenizerSpec =
            serde_json::from_str(&serde_json::to_string(&spec).expect("serializes"))
                .expect("parses");
        assert_eq!(sent, spec);
        let rebuilt = Tokenizer::from_spec(sent).expect("builds");
        let text = "The 12 lighthouses<|endoftext|> shine.";
        assert_eq!(rebuilt.encode(text).unwrap(), direct.encode(text).unwrap());
        assert_eq!(rebuilt.stop_tokens(), direct.stop_tokens());
        assert_eq!(rebuilt.vocab_size(), direct.vocab_size());
    }
}
