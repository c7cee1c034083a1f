//! What one sequence asks of the engine ([`Request`]), and the one place a
//! request is made: [`Request::new`] (the runtime's launches, inferlet
//! generations, peers' prefills) and [`Request::fixed_length`]
//! (calibration, benchmarks, tests). `scripts/check-architecture.py`
//! refuses a `Request { .. }` literal anywhere else.

use pie_core::Props;
use pie_model::{Grammar, SamplingParams};

use super::score::Score;

/// What to generate.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra stop tokens besides the model's end-of-turn tokens.
    pub stop_tokens: Vec<u32>,
    /// Generate to `max_tokens` even past the model's end-of-turn tokens.
    pub ignore_eos: bool,
    /// No stop token is sampled before this many tokens (`min_tokens`).
    pub min_tokens: usize,
    pub arrival_ms: u64,
    /// Who is served (fair share is per client).
    pub client: String,
    /// The owning process's props (policies read them).
    pub props: Props,
    /// The tenant's cache salt: its pages chain from a salted root, so they
    /// are shared only with requests of the same salt.
    pub cache_salt: Option<String>,
    /// Tokens at the end of `prompt` this process sampled before, elsewhere
    /// (a resumed process): its sampler continues after them.
    pub sampled_before: usize,
    /// The worker's disk tier holds the prompt's pages: preempted and
    /// missing some of them when it could run again, the sequence waits
    /// until the runtime loaded them ([`StepOutput::to_reload`],
    /// [`Engine::reloaded`]) instead of recomputing them.
    pub reload_after_preemption: bool,
    /// Report each sampled token's log-probability and the this many most
    /// likely alternatives ([`StepOutput::logprobs`]); None: no logprobs.
    pub logprobs: Option<usize>,
    /// Constrain the output to this grammar (a resumed process's earlier
    /// tokens, `sampled_before`, are advanced over first).
    pub grammar: Option<Grammar>,
    /// The retained sessions (keep-session) this sequence may continue,
    /// best first; none: its own `session` prop's. The slots of the
    /// session's page after the whole pages it shares that hold this
    /// sequence's next tokens are copied, not computed (an inferlet's fork
    /// continues its parent's context).
    pub resume_from: Vec<String>,
    /// Report the distribution after these prompt positions (a pass);
    /// their rows are computed even where the prefix cache holds them.
    pub score: Option<Score>,
    /// Its pages are retained for its session this long after it
    /// finishes, whether or not keep-session is on (an inferlet's context
    /// holds its pages between its calls; `Scheduler::hold`).
    pub hold_ms: Option<u64>,
}

impl Request {
    /// The one constructor: up to `max_tokens` greedy tokens after `prompt`
    /// for `client`, whose process has `props`, arrived at `arrival_ms`;
    /// every option at its default (the callers set theirs on the result).
    pub fn new(
        prompt: Vec<u32>,
        max_tokens: usize,
        client: String,
        props: Props,
        arrival_ms: u64,
    ) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            arrival_ms,
            client,
            props,
            cache_salt: None,
            sampled_before: 0,
            reload_after_preemption: false,
            logprobs: None,
            grammar: None,
            resume_from: Vec::new(),
            score: None,
            hold_ms: None,
        }
    }

    /// Exactly `max_tokens` greedy tokens after `prompt` (end-of-turn tokens
    /// ignored), with no client or props: for calibration, benchmarks and tests.
    pub fn fixed_length(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            ignore_eos: true,
            ..Self::new(prompt, max_tokens, String::new(), Props::new(), 0)
        }
    }
}
