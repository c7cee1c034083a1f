//! Text emitted as tokens come, whole characters only.

use crate::{emit, model};

/// Emits the text of a growing token sequence as it grows: each
/// [`push`](Self::push) decodes every token so far and emits what extends
/// the text already emitted, holding back a trailing partial UTF-8
/// character (decoded as U+FFFD) until it is complete.
#[derive(Debug, Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    emitted: String,
}

impl TextStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `tokens` and emits the new text, if any.
    pub fn push(&mut self, tokens: &[u32]) -> Result<(), String> {
        self.tokens.extend_from_slice(tokens);
        let text = model::decode(&self.tokens)?;
        if text.len() > self.emitted.len()
            && text.starts_with(self.emitted.as_str())
            && !text.ends_with('\u{FFFD}')
        {
            emit(&text[self.emitted.len()..])?;
            self.emitted = text;
        }
        Ok(())
    }

    /// The tokens pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}
