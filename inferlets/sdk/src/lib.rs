//! Guest SDK for Pie inferlets: programs the worker runs as processes, built
//! as WebAssembly components for the `pie:inferlet@0.2.0` world (`wit/`: the
//! 0.1.0 interfaces, `structured`, `reporting` and `shaping`).
//!
//! ```ignore
//! use pie_inferlet::{Context, GenerateOptions};
//!
//! fn run() -> Result<(), String> {
//!     let ctx = Context::new()?;
//!     ctx.append_text("The capital of France is")?;
//!     ctx.generate(&GenerateOptions::new().max_tokens(16).stream(true))?;
//!     Ok(())
//! }
//!
//! pie_inferlet::main!(run);
//! ```
//!
//! - [`Context`]: a token sequence in the engine's KV pool, freed on drop.
//! - [`GenerateOptions`] / [`Sampling`]: greedy, 256 tokens, no streaming by default.
//! - [`model`]: the served model's tokenizer and chat template.
//! - Process functions at the root: [`args`], [`props`], [`set_prop`],
//!   [`emit`], [`emit_json`], [`receive`], [`log`], [`sleep`], ...
//! - [`bindings`]: the raw generated bindings, for what the API leaves out.
//!
//! A panic traps the process; its message is also sent to the host's log at
//! the error level (and, as usual, to stderr).

/// The raw bindings `wit-bindgen` generates for the `inferlet` world.
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "inferlet",
        generate_all,
        pub_export_macro: true,
        default_bindings_module: "pie_inferlet::bindings",
    });
}

use bindings::pie::inferlet0_1_0::{inference, process};

pub use bindings::pie::inferlet0_1_0::inference::{
    FinishReason, GenerateOptions, Generation, Sampling, TokenLogprob,
};
pub use bindings::pie::inferlet0_1_0::model::Message;
pub use bindings::pie::inferlet0_1_0::process::Level;
pub use bindings::pie::inferlet0_2_0::shaping::LogitShaping;
pub use bindings::pie::inferlet0_2_0::structured::OutputFormat;
pub use serde;
pub use serde_json;

/// Declares the inferlet's entry point: `fn run() -> Result<(), E>` with any
/// `E: Display` (usually `String`). An `Err` fails the process with its text.
///
/// ```ignore
/// fn run() -> Result<(), String> { pie_inferlet::emit("hi") }
/// pie_inferlet::main!(run);
/// ```
#[macro_export]
macro_rules! main {
    ($run:path) => {
        struct __PieInferlet;

        impl $crate::bindings::Guest for __PieInferlet {
            fn run() -> ::core::result::Result<(), ::std::string::String> {
                $crate::__install_panic_hook();
                $run().map_err(|e| ::std::string::ToString::to_string(&e))
            }
        }

        $crate::bindings::export!(__PieInferlet with_types_in $crate::bindings);
    };
}

#[doc(hidden)]
pub fn __install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        log(Level::Error, &info.to_string());
        default(info);
    }));
}

// ---------------------------------------------------------------- contexts

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

    /// The raw handle, for the [`bindings`]; still owned by `self`.
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

    /// Appends token ids (each below [`model::vocab_size`]).
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
        bindings::pie::inferlet0_2_0::structured::generate_constrained(self.handle, options, format)
    }

    /// Whether generations over this context report each token's
    /// log-probability (on for a new context; forks made after take the
    /// setting). A program that never reads `Generation::logprobs` turns it
    /// off, and the engine skips a log-softmax over the vocabulary per
    /// token. Needs `pie:inferlet@0.2.0`, as
    /// [`generate_constrained`](Self::generate_constrained) does.
    pub fn report_logprobs(&self, on: bool) -> Result<(), String> {
        bindings::pie::inferlet0_2_0::reporting::report_logprobs(self.handle, on)
    }

    /// Penalties and biases for every later generation over this context
    /// (and forks made from it after), as the OpenAI routes apply them;
    /// [`GenArgs::shaping`] reads them from args. Needs `pie:inferlet@0.2.0`.
    pub fn set_shaping(&self, shaping: &LogitShaping) -> Result<(), String> {
        bindings::pie::inferlet0_2_0::shaping::set_shaping(self.handle, shaping)
    }

    /// The `k` (at most 64) most likely next tokens with their
    /// log-probabilities, most likely first. The context is unchanged.
    pub fn forward(&self, k: u32) -> Result<Vec<TokenLogprob>, String> {
        inference::forward(self.handle, k)
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

// ---------------------------------------------------------------- options

impl Default for Sampling {
    /// Greedy: temperature 0, top-p 1, top-k 0, min-p 0, no seed.
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
        }
    }
}

impl Sampling {
    /// Greedy sampling (the default).
    pub fn greedy() -> Self {
        Self::default()
    }
}

impl Default for GenerateOptions {
    /// Greedy, at most 256 tokens, no stop strings, stops at end of turn,
    /// not streamed.
    fn default() -> Self {
        GenerateOptions {
            sampling: Sampling::default(),
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
            stream: false,
        }
    }
}

impl GenerateOptions {
    /// The defaults (see [`Default`]).
    pub fn new() -> Self {
        Self::default()
    }
    pub fn max_tokens(mut self, n: u32) -> Self {
        self.max_tokens = n;
        self
    }
    pub fn sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = sampling;
        self
    }
    pub fn temperature(mut self, t: f32) -> Self {
        self.sampling.temperature = t;
        self
    }
    pub fn top_p(mut self, p: f32) -> Self {
        self.sampling.top_p = p;
        self
    }
    pub fn top_k(mut self, k: u32) -> Self {
        self.sampling.top_k = k;
        self
    }
    pub fn min_p(mut self, p: f32) -> Self {
        self.sampling.min_p = p;
        self
    }
    pub fn seed(mut self, seed: Option<u64>) -> Self {
        self.sampling.seed = seed;
        self
    }
    /// Stop strings: the output ends before the first one.
    pub fn stop<S: Into<String>>(mut self, stop: impl IntoIterator<Item = S>) -> Self {
        self.stop = stop.into_iter().map(Into::into).collect();
        self
    }
    /// Generate past the model's end-of-turn tokens.
    pub fn ignore_eos(mut self, yes: bool) -> Self {
        self.ignore_eos = yes;
        self
    }
    /// Send the text to the process's output as it is made.
    pub fn stream(mut self, yes: bool) -> Self {
        self.stream = yes;
        self
    }
}

impl Generation {
    /// The mean log-probability of the sampled tokens (-inf if none).
    pub fn mean_logprob(&self) -> f32 {
        if self.logprobs.is_empty() {
            f32::NEG_INFINITY
        } else {
            self.logprobs.iter().sum::<f32>() / self.logprobs.len() as f32
        }
    }
}

/// The built-in inferlets' args: their input (`prompt` or `messages`) and
/// the sampling fields, under the same names; any other key is an error.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenArgs {
    pub prompt: Option<String>,
    pub messages: Option<Vec<Turn>>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string, as OpenAI sends it) to a bias.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
}

/// One chat message in args.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    pub role: String,
    pub content: String,
}

/// `stop`: one string or a list.
#[derive(serde::Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl GenArgs {
    /// Their generation options (defaults: greedy, `default_max_tokens`).
    pub fn options(&self, default_max_tokens: u32) -> GenerateOptions {
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        GenerateOptions::new()
            .max_tokens(self.max_tokens.unwrap_or(default_max_tokens))
            .temperature(self.temperature.unwrap_or(0.0))
            .top_p(self.top_p.unwrap_or(1.0))
            .top_k(self.top_k.unwrap_or(0))
            .min_p(self.min_p.unwrap_or(0.0))
            .seed(self.seed)
            .stop(stop)
            .ignore_eos(self.ignore_eos)
    }

    /// Their penalties and biases on `ctx`'s generations, if any is set.
    pub fn shape(&self, ctx: &Context) -> Result<(), String> {
        match self.shaping()? {
            Some(shaping) => ctx.set_shaping(&shaping),
            None => Ok(()),
        }
    }

    /// Their penalties and biases, if any is set (for
    /// [`Context::set_shaping`]); a bias's key that is no token id is an error.
    pub fn shaping(&self) -> Result<Option<LogitShaping>, String> {
        let set = self.frequency_penalty.is_some()
            || self.presence_penalty.is_some()
            || self.repetition_penalty.is_some()
            || self.logit_bias.is_some();
        if !set {
            return Ok(None);
        }
        let logit_bias = (self.logit_bias.iter().flatten())
            .map(|(token, bias)| match token.parse::<u32>() {
                Ok(t) => Ok((t, *bias)),
                Err(_) => Err(format!(
                    "logit_bias maps token ids to numbers; got {token:?}"
                )),
            })
            .collect::<Result<_, _>>()?;
        Ok(Some(LogitShaping {
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            logit_bias,
        }))
    }
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

// ---------------------------------------------------------------- model

/// The model this worker serves: tokenizer and chat template.
pub mod model {
    use super::Message;
    use super::bindings::pie::inferlet0_1_0::model as raw;

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
}

// ---------------------------------------------------------------- process

/// The process's id.
pub fn process_id() -> String {
    process::id()
}

/// The launch's `args`, raw JSON.
pub fn args_json() -> String {
    process::args()
}

/// The launch's `args` deserialized; missing or `null` args read as `{}`.
pub fn args<T: serde::de::DeserializeOwned>() -> Result<T, String> {
    let raw = process::args();
    let raw = raw.trim();
    let raw = if raw.is_empty() || raw == "null" {
        "{}"
    } else {
        raw
    };
    serde_json::from_str(raw).map_err(|e| format!("bad args: {e}"))
}

/// The process's props, a JSON object.
pub fn props() -> serde_json::Value {
    serde_json::from_str(&process::props())
        .unwrap_or_else(|_| serde_json::Value::Object(Default::default()))
}

/// Sets one of the process's own props; applies from the next engine step.
pub fn set_prop(name: &str, value: &serde_json::Value) -> Result<(), String> {
    process::set_prop(name, &value.to_string())
}

/// Removes one of the process's own props.
pub fn remove_prop(name: &str) -> Result<(), String> {
    process::remove_prop(name)
}

/// Text to the process's output and event stream.
pub fn emit(text: &str) -> Result<(), String> {
    process::emit(text)
}

/// A JSON event to the process's event stream.
pub fn emit_json(value: &serde_json::Value) -> Result<(), String> {
    process::emit_json(&value.to_string())
}

/// The next message a client sent (waits for one).
pub fn receive() -> String {
    process::receive()
}

/// The next message if one is waiting.
pub fn try_receive() -> Option<String> {
    process::try_receive()
}

/// A line in the worker's log, tagged with the process.
pub fn log(level: Level, message: &str) {
    process::log(level, message)
}

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    process::now_ms()
}

/// Waits `ms` milliseconds; other processes run meanwhile.
pub fn sleep(ms: u64) {
    process::sleep(ms)
}
