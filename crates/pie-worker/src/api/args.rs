//! Request arguments shared by the native and the OpenAI routes: sampling
//! and length (checked into [`GenOptions`]), the prompt's shapes, and props.

use std::collections::BTreeMap;

use pie_core::Props;
use pie_model::SamplingRequest;
use serde::Deserialize;
use serde_json::Value;

use super::state::ApiError;
use crate::runtime::{GenOptions, Prompt, TextRules};

/// The fields [`GenArgs`] reads: with its input (`prompt` or `messages`),
/// all a native process's `args` may hold.
pub const GEN_FIELDS: &[&str] = &[
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "no_stop_trim",
    "include_stop_str_in_output",
];

/// The most `stop_token_ids` a request may name.
const MAX_STOP_TOKEN_IDS: usize = 64;

/// Sampling and length arguments shared by every way of starting generation.
#[derive(Debug, Default, Deserialize)]
pub struct GenArgs {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub stop: Option<StopArg>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub min_p: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string, as OpenAI sends it) to a bias.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// Constrained output (see `api::response_format`).
    pub response_format: Option<Value>,
    /// vLLM's and SGLang's: no stop token or string ends the output before
    /// this many tokens.
    pub min_tokens: Option<usize>,
    /// Tokens that end the output (not output themselves).
    pub stop_token_ids: Option<Vec<u32>>,
    /// False: special tokens' text is output.
    pub skip_special_tokens: Option<bool>,
    /// SGLang's name for `include_stop_str_in_output`.
    #[serde(default)]
    pub no_stop_trim: bool,
    /// The stop string found is output too.
    #[serde(default)]
    pub include_stop_str_in_output: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopArg {
    One(String),
    Many(Vec<String>),
}

impl GenArgs {
    /// Checked options for a model of `vocab` tokens; `default_temperature`
    /// differs between OpenAI (1) and native (0).
    pub fn options(&self, default_temperature: f32, vocab: usize) -> Result<GenOptions, ApiError> {
        if self.max_tokens == Some(0) {
            return Err(ApiError::bad_request("max_tokens must be at least 1").param("max_tokens"));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopArg::One(s)) => vec![s.clone()],
            Some(StopArg::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return Err(ApiError::bad_request("at most 4 stop sequences").param("stop"));
        }
        let min_tokens = self.min_tokens.unwrap_or(0);
        if min_tokens > self.max_tokens.unwrap_or(usize::MAX) {
            return Err(ApiError::bad_request(format!(
                "min_tokens ({min_tokens}) must not exceed max_tokens ({})",
                self.max_tokens.unwrap_or(0)
            ))
            .param("min_tokens"));
        }
        let stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ApiError::bad_request(format!(
                "at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {}",
                stop_token_ids.len()
            ))
            .param("stop_token_ids"));
        }
        pie_model::check_token_ids(&stop_token_ids, vocab).map_err(|e| {
            ApiError::bad_request(format!("stop_token_ids: {e}")).param("stop_token_ids")
        })?;
        let sampling = SamplingRequest {
            temperature: Some(self.temperature.unwrap_or(default_temperature)),
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            repetition_penalty: self.repetition_penalty,
            logit_bias: self.logit_bias()?,
            token_sets: Default::default(),
        }
        .check(vocab)
        .map_err(|e| ApiError::bad_request(e.message).param(e.field))?;
        Ok(GenOptions {
            max_tokens: self.max_tokens,
            sampling,
            text: TextRules {
                stop,
                keep_stop: self.no_stop_trim || self.include_stop_str_in_output,
                keep_special: self.skip_special_tokens == Some(false),
                min_tokens,
            },
            stop_token_ids,
            ignore_eos: self.ignore_eos,
            prefill_from: None,
            cache_salt: None,
            resume: None,
            logprobs: None,
            grammar: None,
        })
    }

    /// `logit_bias` as (token, bias) pairs: OpenAI sends the ids as strings.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        (self.logit_bias.iter().flatten())
            .map(|(token, bias)| match token.parse::<u32>() {
                Ok(t) => Ok((t, *bias)),
                Err(_) => Err(ApiError::bad_request(format!(
                    "logit_bias maps token ids to numbers; got {token:?}: {bias}"
                ))
                .param("logit_bias")),
            })
            .collect()
    }
}

/// `prompt`: a string, a one-string array, or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum PromptArg {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

impl PromptArg {
    pub fn into_prompt(self) -> Result<Prompt, ApiError> {
        match self {
            PromptArg::Text(t) => Ok(Prompt::Text(t)),
            PromptArg::Texts(mut v) if v.len() == 1 => Ok(Prompt::Text(v.remove(0))),
            PromptArg::Texts(_) => Err(ApiError::bad_request(
                "prompt arrays must hold exactly one string",
            )
            .param("prompt")),
            PromptArg::Tokens(ids) => Ok(Prompt::Tokens(ids)),
        }
    }
}

pub fn props_of(value: Option<&Value>) -> Result<Props, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(Props::new()),
        Some(v) => Ok(Props::from_json(v)?),
    }
}

#[cfg(test)]
mod gen_fields_tests {
    use super::*;

    /// `GEN_FIELDS` names what `GenArgs` reads: each one, set, is read.
    #[test]
    fn gen_fields_are_what_gen_args_reads() {
        let all = serde_json::json!({"max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
            "top_k": 4, "min_p": 0.1, "seed": 1, "stop": "x", "ignore_eos": true,
            "frequency_penalty": 1, "presence_penalty": 1, "repetition_penalty": 1.1,
            "logit_bias": {"5": -100}, "response_format": {"type": "text"}, "min_tokens": 2,
            "stop_token_ids": [7], "skip_special_tokens": false, "no_stop_trim": true,
            "include_stop_str_in_output": true});
        assert_eq!(all.as_object().unwrap().len(), GEN_FIELDS.len());
        assert!(GEN_FIELDS.iter().all(|f| all.get(f).is_some()));
        let a: GenArgs = serde_json::from_value(all).unwrap();
        assert!(a.max_tokens.is_some() && a.temperature.is_some() && a.top_p.is_some());
        assert!(a.top_k.is_some() && a.seed.is_some() && a.stop.is_some() && a.ignore_eos);
        assert!(a.min_p.is_some() && a.frequency_penalty.is_some() && a.presence_penalty.is_some());
        assert!(a.repetition_penalty.is_some() && a.logit_bias.is_some());
        assert!(a.response_format.is_some() && a.min_tokens.is_some());
        assert!(a.stop_token_ids.is_some() && a.skip_special_tokens.is_some());
        assert!(a.no_stop_trim && a.include_stop_str_in_output);
    }
}
