//! What a launch asks for: the built-in inferlets and their input, the
//! generation options, one generation of an inferlet's context, the fields a controller forwards (`pie_prompt_tokens`,
//! `pie_resume`), and why a launch is refused. Plain data, below the
//! [`Runtime`](super::Runtime) that checks and runs it.

use pie_core::tools::ToolRequest;
use pie_model::{ChatEnding, ChatMessage, SamplingParams};

/// A prompt as text or as token ids.
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `pie_prompt_tokens`: a prompt's token ids as a controller computed them
/// (completions: the prompt; chat: the messages after the chat template),
/// so the worker need not tokenize again. Trusted only from a `worker`-role
/// key (see `api::auth::trusted_prompt_tokens`); checked here against this
/// worker's model fingerprint and vocabulary, so a mismatch is a 400, never
/// other tokens than the text names.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTokens {
    pub fingerprint: u64,
    pub ids: Vec<u32>,
}

/// `pie_resume`: a process that ran on another worker goes on here (a
/// controller's migration, or its recovery from a dead worker). Trusted only
/// from a `worker`-role key (see `api::auth::trusted_resume`).
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resume {
    /// The ids the process generated so far, in order: the engine continues
    /// after prompt + these, the sampler after as many samples, and the text
    /// they made is not sent again.
    pub tokens: Vec<u32>,
    /// A live worker that holds their pages: pulled from it (never prefilled
    /// there); None after a crash: computed here.
    #[serde(default)]
    pub from: Option<String>,
    /// The tokens are output here too, first (a native process: its client
    /// reads the whole output from the record and its events by index, so
    /// the record here must hold what the source's held); an OpenAI stream's
    /// client has them already.
    #[serde(skip)]
    pub replay: bool,
    /// A native chat resuming a session: the session's turns before this
    /// one, as its first worker had them; they replace this worker's own.
    #[serde(default)]
    pub turns: Option<Vec<ChatMessage>>,
}

/// A built-in inferlet and its input.
#[derive(Clone, Debug)]
pub enum Inferlet {
    TextCompletion {
        prompt: Prompt,
    },
    /// With a `session` prop and `resume_session`, the session's earlier turns are
    /// prepended and this turn's messages and answer are appended to it.
    Chat {
        messages: Vec<ChatMessage>,
        resume_session: bool,
        /// The tools the template offers (an OpenAI chat's `tools`).
        tools: Option<ToolRequest>,
        /// How the prompt ends (a new assistant turn unless the request says).
        ending: ChatEnding,
    },
}

impl Inferlet {
    pub fn name(&self) -> &'static str {
        match self {
            Inferlet::TextCompletion { .. } => "text-completion",
            Inferlet::Chat { .. } => "chat",
        }
    }
}

/// How a sequence's tokens become its output text, and where a stop string
/// ends it.
#[derive(Clone, Debug, Default)]
pub struct TextRules {
    /// Strings that end the output.
    pub stop: Vec<String>,
    /// The stop string found is output too (vLLM's
    /// `include_stop_str_in_output`, SGLang's `no_stop_trim`).
    pub keep_stop: bool,
    /// Special tokens' text is output (`skip_special_tokens: false`).
    pub keep_special: bool,
    /// No stop token or stop string ends the output before this many
    /// tokens (`min_tokens`).
    pub min_tokens: usize,
}

#[derive(Clone, Debug, Default)]
pub struct GenOptions {
    /// None: as many as fit.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub text: TextRules,
    /// Tokens that end the output besides the model's end-of-turn tokens.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// The tenant's cache salt: its KV is shared only with the same salt.
    pub cache_salt: Option<String>,
    /// A peer worker (URL) that prefills the prompt; this worker pulls its
    /// pages (a controller's `disaggregate`, see `api::trusted_prefill_from`).
    pub prefill_from: Option<String>,
    /// The process ran elsewhere until now.
    pub resume: Option<Resume>,
    /// Each token's log-probability and this many alternatives' go with
    /// its text (None: none).
    pub logprobs: Option<usize>,
    /// The output's constraint (`response_format`), compiled.
    pub grammar: Option<pie_model::Grammar>,
}

/// Why a launch was refused (mapped to HTTP statuses by the API).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("too many queued processes ({0}); retry later")]
    Overloaded(usize),
    /// The client holds its share of the queue while others want places
    /// (`pie_policy::shares`).
    #[error(
        "client `{client}` has {queued} queued processes, at or past its share of [server] \
         max_queued, and the places left are kept for other keys (per-key shares); retry later"
    )]
    OverShare { client: String, queued: usize },
    #[error("{0}")]
    BadRequest(String),
    /// The engine panicked or stalls (see `Runtime::health`).
    #[error("the worker is unhealthy: {0}")]
    Unhealthy(String),
    /// Draining: it takes no new processes (see `Runtime::start_drain`).
    #[error("the worker is draining: it takes no new processes")]
    Draining,
}

/// What one generation asks for.
pub struct Generate {
    /// The context's tokens: the prompt of this sequence.
    pub tokens: Vec<u32>,
    /// How many of `tokens` the process's usage already counts (an earlier
    /// generation's prompt and output): the rest are its prompt tokens.
    pub counted: usize,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub text: TextRules,
    pub ignore_eos: bool,
    /// Each sample's log-probability, with this many alternatives (`forward`
    /// asks for its k with the first); None: none (`report-logprobs` off).
    pub logprobs: Option<usize>,
    /// The key its pages are retained under when it ends (keep-session).
    pub retain_as: String,
    /// The retained keys whose partial page it may copy, best first (see
    /// `inferlets::contexts::Context::resume_from`).
    pub resume_from: Vec<String>,
    pub cache_salt: Option<String>,
    /// Its text goes to the process's output as it comes.
    pub stream: bool,
    /// The output's constraint (`structured.generate-constrained`).
    pub grammar: Option<pie_model::Grammar>,
    /// The prompt positions a pass reports (`passes.start-pass`).
    pub score: Option<crate::engine::Score>,
    /// How long its pages stay retained after it, for the context's next
    /// call (`max_idle_ms`).
    pub hold_ms: u64,
}

/// What a generation made.
#[derive(Debug, Default)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub text: String,
    /// Each token's log-probability, in order.
    pub logprobs: Vec<f32>,
    /// The first sample's most likely tokens (as many as asked).
    pub first_top: Vec<(u32, f32)>,
    /// An end-of-turn token or a stop string ended it (else its length).
    pub stopped: bool,
    /// What its pass reported, by position (a preempted pass's rows come
    /// again, the same bits: the last is kept).
    pub scored: std::collections::BTreeMap<usize, crate::engine::Scored>,
}
