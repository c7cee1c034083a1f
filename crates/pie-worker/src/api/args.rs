//! Request arguments shared by the native and the OpenAI routes: sampling
//! and length (checked into [`GenOptions`]), the prompt's shapes, and props.

use std::collections::BTreeMap;

use pie_core::Props;
use pie_model::SamplingRequest;
use serde::Deserialize;
use serde_json::Value;

use super::state::ApiError;
use crate::runtime::{GenOptions, Prompt};

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
];

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
        }
        .check(vocab)
        .map_err(|e| ApiError::bad_request(e.message).param(e.field))?;
        Ok(GenOptions {
            max_tokens: self.max_tokens,
            sampling,
            stop,
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
            "logit_bias": {"5": -100}, "response_format": {"type": "text"}});
        assert_eq!(all.as_object().unwrap().len(), GEN_FIELDS.len());
        assert!(GEN_FIELDS.iter().all(|f| all.get(f).is_some()));
        let a: GenArgs = serde_json::from_value(all).unwrap();
        assert!(a.max_tokens.is_some() && a.temperature.is_some() && a.top_p.is_some());
        assert!(a.top_k.is_some() && a.seed.is_some() && a.stop.is_some() && a.ignore_eos);
        assert!(a.min_p.is_some() && a.frequency_penalty.is_some() && a.presence_penalty.is_some());
        assert!(a.repetition_penalty.is_some() && a.logit_bias.is_some());
        assert!(a.response_format.is_some());
    }
}
