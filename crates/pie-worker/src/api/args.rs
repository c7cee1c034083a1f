//! Request arguments shared by the native and the OpenAI routes: sampling
//! and length (checked into [`GenOptions`]), the prompt's shapes, and props.

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
    "seed",
    "stop",
    "ignore_eos",
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
            },
            stop,
            ignore_eos: self.ignore_eos,
            prefill_from: None,
            cache_salt: None,
            resume: None,
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
            "top_k": 4, "seed": 1, "stop": "x", "ignore_eos": true});
        assert_eq!(all.as_object().unwrap().len(), GEN_FIELDS.len());
        assert!(GEN_FIELDS.iter().all(|f| all.get(f).is_some()));
        let a: GenArgs = serde_json::from_value(all).unwrap();
        assert!(a.max_tokens.is_some() && a.temperature.is_some() && a.top_p.is_some());
        assert!(a.top_k.is_some() && a.seed.is_some() && a.stop.is_some() && a.ignore_eos);
    }
}
