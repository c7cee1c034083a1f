//! Request arguments shared by the native and the OpenAI routes: sampling
//! and length (checked into [`GenOptions`]), the prompt's shapes, and props.

use std::collections::BTreeMap;

use pie_core::Props;
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
    /// Checked options; `default_temperature` differs between OpenAI (1) and native (0).
    pub fn options(&self, default_temperature: f32) -> Result<GenOptions, ApiError> {
        let temperature = self.temperature.unwrap_or(default_temperature);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad_request(format!(
                "temperature must be between 0 and 2, got {temperature}"
            ))
            .param("temperature"));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(
                ApiError::bad_request(format!("top_p must be in (0, 1], got {top_p}"))
                    .param("top_p"),
            );
        }
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
        Ok(GenOptions {
            max_tokens: self.max_tokens,
            sampling: pie_model::SamplingParams {
                temperature,
                top_k: self.top_k.unwrap_or(0),
                top_p,
                seed: self.seed,
                ..self.shaping()?
            },
            stop,
            ignore_eos: self.ignore_eos,
            prefill_from: None,
            cache_salt: None,
            resume: None,
            logprobs: None,
            grammar: None,
        })
    }

    /// The penalties, biases and min-p, checked (OpenAI's ranges for its
    /// penalties; vLLM's meaning for `repetition_penalty` and `min_p`).
    fn shaping(&self) -> Result<pie_model::SamplingParams, ApiError> {
        let within = |field: &str, v: Option<f32>, ok: fn(f32) -> bool, range: &str| match v {
            Some(v) if !ok(v) => {
                Err(ApiError::bad_request(format!("{field} must be {range}, got {v}")).param(field))
            }
            _ => Ok(v),
        };
        let penalty = |v: f32| (-2.0..=2.0).contains(&v);
        let frequency_penalty = within(
            "frequency_penalty",
            self.frequency_penalty,
            penalty,
            "in [-2, 2]",
        )?;
        let presence_penalty = within(
            "presence_penalty",
            self.presence_penalty,
            penalty,
            "in [-2, 2]",
        )?;
        let repetition_penalty = within(
            "repetition_penalty",
            self.repetition_penalty,
            |v| v > 0.0 && v.is_finite(),
            "positive",
        )?;
        let min_p = within(
            "min_p",
            self.min_p,
            |v| (0.0..=1.0).contains(&v),
            "in [0, 1]",
        )?;
        let logit_bias = (self.logit_bias.iter().flatten())
            .map(|(token, bias)| match token.parse::<u32>() {
                Ok(t) if bias.is_finite() => Ok((t, *bias)),
                _ => Err(ApiError::bad_request(format!(
                    "logit_bias maps token ids to numbers; got {token:?}: {bias}"
                ))
                .param("logit_bias")),
            })
            .collect::<Result<_, _>>()?;
        Ok(pie_model::SamplingParams {
            frequency_penalty: frequency_penalty.unwrap_or(0.0),
            presence_penalty: presence_penalty.unwrap_or(0.0),
            repetition_penalty: repetition_penalty.unwrap_or(1.0),
            min_p: min_p.unwrap_or(0.0),
            logit_bias,
            ..pie_model::SamplingParams::default()
        })
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
