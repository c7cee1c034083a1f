//! The model this worker serves: tokenizer and chat template.

use crate::Message;
use crate::bindings::pie::inferlet0_1_0::model as raw;

/// The model's name as the worker serves it.
pub fn name() -> String {
    raw::name()
}
/// Token ids are below this.
pub fn vocab_size() -> u32 {
    raw::vocab_size()
}
/// Text to token ids (no special tokens added).
pub fn encode(text: &str) -> Result<Vec<u32>, String> {
    raw::encode(text)
}
/// Token ids to text.
pub fn decode(tokens: &[u32]) -> Result<String, String> {
    raw::decode(tokens)
}
/// The messages rendered by the model's chat template, ready for the
/// assistant's turn.
pub fn apply_chat_template(messages: &[Message]) -> Result<String, String> {
    raw::apply_chat_template(messages)
}
/// The model's end-of-turn tokens.
pub fn stop_tokens() -> Vec<u32> {
    raw::stop_tokens()
}
