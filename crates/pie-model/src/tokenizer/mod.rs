//! The tokenizer stored in a GGUF file (`tokenizer.ggml.*`), built with the
//! `tokenizers` crate: GPT-2-style byte-level BPE (`byte_level`) or a
//! SentencePiece vocabulary (`sentencepiece`), plus the model's Jinja chat
//! template.

mod byte_level;
mod sentencepiece;
mod template;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file::Value;
pub use pie_core::chat::ChatMessage;
use pie_core::tools::{ToolFormat, ToolRequest};
use serde::{Deserialize, Serialize};
use tokenizers::models::bpe::Vocab;
use tokenizers::AddedToken;

pub use byte_level::byte_level_char;

use crate::gguf::GgufFile;
use template::chat_environment;

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

/// How a vocabulary writes its pieces.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Vocabulary {
    ByteLevel,
    SentencePiece,
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// For text that continues other tokens, where `inner` would add a
    /// space before it (SentencePiece).
    continuation: Option<tokenizers::Tokenizer>,
    vocabulary: Vocabulary,
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
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama`
    /// (SentencePiece).
    #[serde(default = "gpt2")]
    pub model: String,
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
    /// SentencePiece: each piece's score (merge rank).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scores: Vec<f32>,
    /// SentencePiece: a space before text that starts the input or follows
    /// a special token.
    #[serde(default)]
    pub add_space_prefix: bool,
}

fn gpt2() -> String {
    "gpt2".into()
}

impl TokenizerSpec {
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let kind = f
            .get("tokenizer.ggml.model")?
            .to_string()
            .map_err(|e| anyhow!("{e}"))?
            .clone();
        if kind != "gpt2" && kind != "llama" {
            bail!("unsupported tokenizer.ggml.model `{kind}`: Pie reads byte-level BPE (gpt2) and SentencePiece (llama) vocabularies");
        }
        let spm = kind == "llama";
        let merges = if f.metadata().contains_key("tokenizer.ggml.merges") {
            string_array(f, "tokenizer.ggml.merges")?
        } else {
            Vec::new()
        };
        let text = |key: &str| f.get(key).ok().and_then(|v| v.to_string().ok().cloned());
        let id = |key: &str| f.get_usize(key).ok().map(|x| x as u32);
        let flag = |key: &str, default: bool| {
            (f.get(key).ok())
                .and_then(|v| v.to_bool().ok())
                .unwrap_or(default)
        };
        let scores = match (spm, f.get("tokenizer.ggml.scores")) {
            (false, _) => Vec::new(),
            (true, Ok(Value::Array(v))) => v.iter().map(|x| x.to_f32().unwrap_or(0.0)).collect(),
            (true, _) => bail!("a SentencePiece vocabulary needs tokenizer.ggml.scores"),
        };
        Ok(Self {
            model: kind,
            scores,
            add_space_prefix: spm && flag("tokenizer.ggml.add_space_prefix", true),
            pre: text("tokenizer.ggml.pre").unwrap_or_default(),
            tokens: string_array(f, "tokenizer.ggml.tokens")?,
            merges,
            token_types: match f.get("tokenizer.ggml.token_type") {
                Ok(Value::Array(v)) => v.iter().map(|x| x.to_i32().unwrap_or(1)).collect(),
                _ => Vec::new(),
            },
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos: flag("tokenizer.ggml.add_bos_token", false),
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
impl Tokenizer {
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        Self::from_spec(TokenizerSpec::from_gguf(f)?)
    }

    /// The tokenizer a [`TokenizerSpec`] describes (read from a GGUF, or sent
    /// by a worker to a controller).
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self> {
        let vocab: Vocab = spec
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let vocabulary = match spec.model.as_str() {
            "llama" => Vocabulary::SentencePiece,
            _ => Vocabulary::ByteLevel,
        };
        let pieces = sentencepiece::Pieces {
            tokens: &spec.tokens,
            scores: &spec.scores,
            token_types: &spec.token_types,
        };
        let (mut inner, mut continuation) = match vocabulary {
            Vocabulary::ByteLevel => (
                byte_level::build(&spec.merges, &spec.pre, vocab.clone())?,
                None,
            ),
            Vocabulary::SentencePiece => (
                sentencepiece::build(&pieces, vocab.clone(), spec.add_space_prefix)?,
                (spec.add_space_prefix)
                    .then(|| sentencepiece::build(&pieces, vocab.clone(), false))
                    .transpose()?,
            ),
        };
        let specials: Vec<AddedToken> = spec
            .tokens
            .iter()
            .zip(&spec.token_types)
            .filter(|(_, t)| matches!(**t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        for t in std::iter::once(&mut inner).chain(continuation.as_mut()) {
            t.add_special_tokens(specials.clone())
                .map_err(|e| anyhow!("adding the special tokens: {e}"))?;
        }
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
            continuation,
            vocabulary,
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
        ids.extend(encoded(&self.inner, text)?);
        Ok(ids)
    }

    /// The BOS [`Tokenizer::encode`] puts first, where the model adds one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Token ids of `text` where it continues other tokens: no BOS, and no
    /// space put before it.
    pub fn encode_continuation(&self, text: &str) -> Result<Vec<u32>> {
        encoded(self.continuation.as_ref().unwrap_or(&self.inner), text)
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    /// Text of `ids`, special tokens' own text included where
    /// `keep_special` (an OpenAI server's `skip_special_tokens: false`).
    pub fn decode_with(&self, ids: &[u32], keep_special: bool) -> Result<String> {
        self.inner
            .decode(ids, !keep_special)
            .map_err(|e| anyhow!("detokenizing: {e}"))
    }

    /// The bytes token `id` stands for: its piece read back as the
    /// vocabulary writes it, or a special token's own text.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        Some(match self.vocabulary {
            Vocabulary::ByteLevel => {
                byte_level::piece_bytes(&piece).unwrap_or_else(|| piece.into_bytes())
            }
            Vocabulary::SentencePiece => sentencepiece::piece_bytes(&piece),
        })
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
        self.apply_chat_template_ending(messages, tools, ChatEnding::GenerationPrompt)
    }

    /// [`Tokenizer::apply_chat_template`], ending as `ending` says.
    pub fn apply_chat_template_ending(
        &self,
        messages: &[ChatMessage],
        tools: Option<&ToolRequest>,
        ending: ChatEnding,
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
        let render = |messages: &[ChatMessage]| {
            let ctx = minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => ending == ChatEnding::GenerationPrompt,
                bos_token => self.bos_text,
                eos_token => self.eos_text,
            };
            env.get_template("chat").and_then(|t| t.render(ctx))
        };
        // A template that refuses a system turn (Gemma 2's) gets it at the
        // head of the first user turn, as llama.cpp gives it.
        let text = render(&messages)
            .or_else(|e| match system_folded(&messages) {
                Some(folded) => render(&folded),
                None => Err(e),
            })
            .map_err(|e| anyhow!("chat template: {e}"))?;
        let text = match ending {
            ChatEnding::ContinueFinal => continued_final(text, &messages)?,
            _ => text,
        };
        Ok(self.without_leading_bos(text))
    }

    /// `text` without the BOS a template wrote first (Llama 3's, Gemma's)
    /// where [`Tokenizer::encode`] adds one, so the prompt has one BOS, not
    /// two: llama.cpp strips it the same way.
    fn without_leading_bos(&self, text: String) -> String {
        match self.bos.is_some() && !self.bos_text.is_empty() {
            true => match text.strip_prefix(&self.bos_text) {
                Some(rest) => rest.to_string(),
                None => text,
            },
            false => text,
        }
    }
}

/// `messages` with a leading system turn folded into the user turn after
/// it (`system\n\nuser`); `None` when they do not start that way.
fn system_folded(messages: &[ChatMessage]) -> Option<Vec<ChatMessage>> {
    match messages {
        [system, user, rest @ ..] if system.role == "system" && user.role == "user" => {
            let content = format!("{}\n\n{}", system.content, user.content);
            let first = ChatMessage {
                content,
                ..user.clone()
            };
            Some(std::iter::once(first).chain(rest.iter().cloned()).collect())
        }
        _ => None,
    }
}

fn encoded(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tokenizer
        .encode_fast(text, false)
        .map_err(|e| anyhow!("tokenizing: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// How a chat prompt ends (OpenAI servers' `add_generation_prompt` and
/// `continue_final_message`, as vLLM and SGLang define them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatEnding {
    /// The assistant's generation prompt: a new turn (the default).
    GenerationPrompt,
    /// The last message's end: the template's text and nothing more.
    LastMessage,
    /// Inside the last message, an assistant's: the answer continues its
    /// text (the template's end of turn after it is cut off).
    ContinueFinal,
}

impl ChatEnding {
    /// The ending a request's two switches ask for: an error names the
    /// contradiction (both true) or the last message that cannot be
    /// continued.
    pub fn of(
        add_generation_prompt: Option<bool>,
        continue_final_message: Option<bool>,
        messages: &[ChatMessage],
    ) -> std::result::Result<Self, String> {
        match (add_generation_prompt, continue_final_message) {
            (Some(true), Some(true)) => Err("continue_final_message and \
                 add_generation_prompt cannot both be true"
                .into()),
            (_, Some(true)) => match messages.last() {
                Some(m) if m.role == "assistant" => Ok(ChatEnding::ContinueFinal),
                _ => Err("continue_final_message needs the last message to be the \
                     assistant's"
                    .into()),
            },
            (Some(false), _) => Ok(ChatEnding::LastMessage),
            _ => Ok(ChatEnding::GenerationPrompt),
        }
    }
}

/// `text` cut right after the last message's content, which the template
/// rendered last (vLLM cuts the same way): the answer goes on from there.
fn continued_final(text: String, messages: &[ChatMessage]) -> Result<String> {
    let content = messages.last().map(|m| m.content.trim()).unwrap_or("");
    match text.rfind(content) {
        Some(at) if !content.is_empty() => Ok(text[..at + content.len()].to_string()),
        _ => bail!(
            "continue_final_message: the chat template does not write the last message's text"
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
    keep_special: bool,
}

impl IncrementalDecoder {
    /// A decoder that writes special tokens' text too where `keep_special`.
    pub fn keeping_special(keep_special: bool) -> Self {
        Self {
            keep_special,
            ..Self::default()
        }
    }

    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let keep = self.keep_special;
        let before =
            tokenizer.decode_with(&self.ids[self.prefix_offset..self.read_offset], keep)?;
        let now = tokenizer.decode_with(&self.ids[self.prefix_offset..], keep)?;
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

    /// The tiny test model's tokenizer spec (`name` keeps parallel tests'
    /// files apart).
    fn test_spec(name: &str) -> TokenizerSpec {
        let path = std::env::temp_dir().join(format!("pie-{name}-{}.gguf", std::process::id()));
        write_test_model(&path, &SynthSpec::default()).expect("writes");
        let spec = TokenizerSpec::from_gguf(&GgufFile::open(&path).expect("opens")).expect("reads");
        let _ = std::fs::remove_file(&path);
        spec
    }

    #[test]
    fn a_continuation_has_no_bos() {
        let mut spec = test_spec("bos");
        spec.bos = Some(256);
        spec.add_bos = true;
        let tk = Tokenizer::from_spec(spec).expect("builds");
        let prompt = tk.encode("hi there").unwrap();
        assert_eq!(prompt[0], 256);
        assert_eq!(tk.encode_continuation("hi there").unwrap(), prompt[1..]);
    }

    /// A template that writes `bos_token` first, on a tokenizer that adds
    /// BOS itself, gives a prompt with one BOS; without `add_bos`, the
    /// template's BOS stays.
    #[test]
    fn a_template_that_writes_bos_gives_one_bos() {
        let mut spec = test_spec("one-bos");
        spec.chat_template =
            Some("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}".into());
        spec.bos = Some(256);
        for add_bos in [true, false] {
            spec.add_bos = add_bos;
            let tk = Tokenizer::from_spec(spec.clone()).expect("builds");
            let text = tk
                .apply_chat_template(&[ChatMessage::text("user", "hi".into())], None)
                .unwrap();
            let ids = tk.encode(&text).unwrap();
            assert_eq!(ids.iter().filter(|&&t| t == 256).count(), 1, "{add_bos}");
            assert_eq!(ids[0], 256, "{add_bos}");
            assert_eq!(ids.len(), 3, "{add_bos}: BOS, h, i");
        }
    }

    /// The three endings of a chat prompt: a new assistant turn, the last
    /// message's end, or inside the last (assistant) message.
    #[test]
    fn a_chat_prompt_ends_as_asked() {
        let mut spec = test_spec("endings");
        spec.chat_template = Some(crate::synth::CHATML_TEMPLATE.into());
        let tk = Tokenizer::from_spec(spec).expect("builds");
        let messages = [
            ChatMessage::text("user", "Name a city.".into()),
            ChatMessage::text("assistant", "The city is".into()),
        ];
        let ending = |e| tk.apply_chat_template_ending(&messages, None, e).unwrap();
        assert!(
            ending(ChatEnding::GenerationPrompt).ends_with("<|im_end|>\n<|im_start|>assistant\n")
        );
        assert!(ending(ChatEnding::LastMessage).ends_with("The city is<|im_end|>\n"));
        assert!(ending(ChatEnding::ContinueFinal).ends_with("<|im_start|>assistant\nThe city is"));
        let of = |add, cont, m: &[ChatMessage]| ChatEnding::of(add, cont, m);
        assert_eq!(of(None, None, &messages), Ok(ChatEnding::GenerationPrompt));
        assert_eq!(
            of(Some(false), Some(false), &messages),
            Ok(ChatEnding::LastMessage)
        );
        assert_eq!(
            of(Some(false), Some(true), &messages),
            Ok(ChatEnding::ContinueFinal)
        );
        assert!(of(Some(true), Some(true), &messages)
            .unwrap_err()
            .contains("both"));
        let e = of(None, Some(true), &messages[..1]).unwrap_err();
        assert!(e.contains("assistant"), "{e}");
    }

    /// Templates written for Python's Jinja call str methods; they render.
    #[test]
    fn a_template_calling_python_string_methods_renders() {
        let mut spec = test_spec("pycompat");
        spec.chat_template = Some(
            "{% for m in messages %}{% if m.content.startswith('/') %}cmd:{% endif %}{{ m.content.strip() | upper }};{% endfor %}"
                .into(),
        );
        let tk = Tokenizer::from_spec(spec).expect("builds");
        let messages = [
            ChatMessage::text("user", "  hi  ".into()),
            ChatMessage::text("user", "/go".into()),
        ];
        assert_eq!(
            tk.apply_chat_template(&messages, None).unwrap(),
            "HI;cmd:/GO;"
        );
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
