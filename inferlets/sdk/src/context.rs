//! Contexts: token sequences in the engine's KV pool.

use crate::bindings::pie::inferlet0_1_0::inference;
use crate::bindings::pie::inferlet0_2_0::{reporting, shaping, structured};
use crate::bindings::pie::inferlet0_3_0::{passes, steering};
use crate::pending::{self, Pending};
use crate::{
    Distribution, GenerateOptions, Generation, LogitShaping, OutputFormat, Report, TokenLogprob,
};

/// A context: a token sequence whose KV pages live in the engine's pool.
/// Dropping it frees its pages (full pages stay in the prefix cache).
#[derive(Debug)]
pub struct Context {
    handle: inference::Context,
}

impl Context {
    /// An empty context (a process holds at most 1,024 at once).
    pub fn new() -> Result<Self, String> {
        inference::create().map(|handle| Self { handle })
    }

    /// A context holding `prompt`, in the model's chat template as one user
    /// message when `chat`; an empty prompt is an error.
    pub fn with_prompt(prompt: &str, chat: bool) -> Result<Self, String> {
        let ctx = Self::new()?;
        let text = match chat {
            true => crate::model::apply_chat_template(&[crate::Message::user(prompt)])?,
            false => prompt.to_string(),
        };
        if ctx.append_text(&text)? == 0 {
            return Err("the prompt must not be empty".into());
        }
        Ok(ctx)
    }

    /// The raw handle, for the [`bindings`](crate::bindings); still owned by `self`.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// A copy sharing this context's computed pages (nothing copied until
    /// the two differ). Call [`prefill`](Self::prefill) first to share the
    /// prompt's pages.
    pub fn fork(&self) -> Result<Context, String> {
        inference::fork(self.handle).map(|handle| Context { handle })
    }

    /// Tokenizes `text` and appends it; returns how many tokens it made.
    pub fn append_text(&self, text: &str) -> Result<u32, String> {
        inference::append_text(self.handle, text)
    }

    /// Appends token ids (each below [`model::vocab_size`](crate::model::vocab_size)).
    pub fn append_tokens(&self, tokens: &[u32]) -> Result<(), String> {
        inference::append_tokens(self.handle, tokens)
    }

    /// The context's tokens.
    pub fn tokens(&self) -> Result<Vec<u32>, String> {
        inference::tokens(self.handle)
    }

    /// Computes the KV of every token now, so forks made after share it.
    pub fn prefill(&self) -> Result<(), String> {
        inference::prefill(self.handle)
    }

    /// Generates in the engine; the tokens made are appended to the context.
    pub fn generate(&self, options: &GenerateOptions) -> Result<Generation, String> {
        inference::generate(self.handle, options)
    }

    /// [`generate`](Self::generate) whose output matches `format` (a JSON
    /// schema, any JSON object, a regular expression or a Lark grammar); it
    /// stops when the grammar is complete. Needs a worker serving
    /// `pie:inferlet@0.2.0`; a component that never calls it imports only
    /// 0.1.0 and loads on any worker.
    pub fn generate_constrained(
        &self,
        options: &GenerateOptions,
        format: &OutputFormat,
    ) -> Result<Generation, String> {
        structured::generate_constrained(self.handle, options, format)
    }

    /// Whether generations over this context report each token's
    /// log-probability (on for a new context; forks made after take the
    /// setting). A program that never reads `Generation::logprobs` turns it
    /// off, and the engine skips a log-softmax over the vocabulary per
    /// token. Needs `pie:inferlet@0.2.0`, as
    /// [`generate_constrained`](Self::generate_constrained) does.
    pub fn report_logprobs(&self, on: bool) -> Result<(), String> {
        reporting::report_logprobs(self.handle, on)
    }

    /// Penalties and biases for every later generation over this context
    /// (and forks made from it after), as the OpenAI routes apply them;
    /// [`GenArgs::shaping`](crate::GenArgs::shaping) reads them from args. Needs `pie:inferlet@0.2.0`.
    pub fn set_shaping(&self, shaping: &LogitShaping) -> Result<(), String> {
        shaping::set_shaping(self.handle, shaping)
    }

    /// The `k` (at most 64) most likely next tokens with their
    /// log-probabilities, most likely first. The context is unchanged.
    pub fn forward(&self, k: u32) -> Result<Vec<TokenLogprob>, String> {
        inference::forward(self.handle, k)
    }

    /// Keeps the first `len` tokens: the rest go, and the pages that held
    /// only them are freed. `len` above the context's length is an error.
    /// Needs `pie:inferlet@0.3.0`.
    pub fn truncate(&self, len: u32) -> Result<(), String> {
        passes::truncate(self.handle, len)
    }

    /// Every later generation over this context (and forks made from it
    /// after) samples only tokens of `allowed` (`None`: any) that are not
    /// in `banned`, greedy choice included. At most 8,192 ids each, every
    /// one in the vocabulary, `allowed` not empty. Passes and `forward`
    /// report the model's own distribution either way. Needs
    /// `pie:inferlet@0.3.0`.
    pub fn set_token_sets(&self, allowed: Option<&[u32]>, banned: &[u32]) -> Result<(), String> {
        steering::set_token_sets(self.handle, allowed, banned)
    }

    /// [`generate`](Self::generate), started: it runs alongside every other
    /// operation in flight; the context gains its tokens when its result is
    /// taken. Until then the context takes no other operation, append or
    /// truncate. Needs `pie:inferlet@0.3.0`.
    pub fn start_generate(
        &self,
        options: &GenerateOptions,
    ) -> Result<Pending<'_, Generation>, String> {
        passes::start_generate(self.handle, options).map(pending::generation)
    }

    /// Appends `tokens` (at most 128) and computes them in one pass,
    /// reporting the model's next-token distribution after each of
    /// `positions`, in their order: 0 is after the context's last token
    /// before the pass, `i` after the `i`-th appended token (so
    /// `0..=tokens.len()`). The logits are, bit for bit, those of appending
    /// the tokens one by one. The context must not be empty after the
    /// append; at most 4 MiB of [`Report::Full`] results per pass. The
    /// context gains the tokens when the result is taken. Needs
    /// `pie:inferlet@0.3.0`.
    pub fn start_pass(
        &self,
        tokens: &[u32],
        positions: &[u32],
        report: Report,
    ) -> Result<Pending<'_, Vec<Distribution>>, String> {
        passes::start_pass(self.handle, tokens, positions, report).map(pending::pass)
    }

    /// [`start_pass`](Self::start_pass), waited for.
    pub fn pass(
        &self,
        tokens: &[u32],
        positions: &[u32],
        report: Report,
    ) -> Result<Vec<Distribution>, String> {
        self.start_pass(tokens, positions, report)?.wait()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let _ = inference::drop_context(self.handle);
    }
}

/// Generates on several contexts in the same engine steps, with the same
/// options; one result per context, in order. With `seed: None` the host
/// draws each context's randomness independently.
pub fn generate_all(
    contexts: &[&Context],
    options: &GenerateOptions,
) -> Vec<Result<Generation, String>> {
    let handles: Vec<u32> = contexts.iter().map(|c| c.handle).collect();
    inference::generate_all(&handles, options)
}
