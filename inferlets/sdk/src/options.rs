//! Generation options, the built-in inferlets' args, chat messages.

use crate::{Context, GenerateOptions, Generation, LogitShaping, Message, Sampling};

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
