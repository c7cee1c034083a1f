//! `response_format`: constrained output on both OpenAI routes and in a
//! built-in inferlet's `args`. OpenAI's shapes: `{"type": "text"}` (no
//! constraint), `{"type": "json_object"}` (any JSON object) and
//! `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
//! Pie's own: `{"type": "regex", "regex": ...}` and `{"type": "grammar",
//! "grammar": ...}` (a Lark grammar in llguidance's dialect). A schema is
//! enforced whatever `strict` says (vLLM does the same). Anything the
//! grammar library cannot compile is a 400 naming the problem, before the
//! request is accepted.

use pie_model::{Grammar, GrammarSpec};
use serde_json::Value;

use super::args::GenArgs;
use super::state::ApiError;
use crate::runtime::{GenOptions, Runtime};

const PARAM: &str = "response_format";

/// What `response_format` asks for; None: free text.
pub(super) fn grammar_spec(format: Option<&Value>) -> Result<Option<GrammarSpec>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let text = |field: &str| {
        format[field]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| bad(format!("{PARAM}.{field} must be a string")))
    };
    match format["type"].as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => match &format["json_schema"]["schema"] {
            Value::Object(_) => Ok(Some(GrammarSpec::JsonSchema(
                format["json_schema"]["schema"].clone(),
            ))),
            Value::Null => Err(bad(format!("{PARAM}.json_schema.schema is required"))),
            _ => Err(bad(format!("{PARAM}.json_schema.schema must be an object"))),
        },
        Some("regex") => Ok(Some(GrammarSpec::Regex(text("regex")?))),
        Some("grammar") => Ok(Some(GrammarSpec::Lark(text("grammar")?))),
        _ => Err(bad(format!(
            "{PARAM}.type must be text, json_object, json_schema, regex or grammar; got {}",
            format["type"]
        ))),
    }
}

/// `gen`'s checked options, its `response_format` compiled.
pub(super) async fn checked_options(
    rt: &Runtime,
    gen: &GenArgs,
    default_temperature: f32,
) -> Result<GenOptions, ApiError> {
    let mut opts = gen.options(default_temperature, rt.model.config.vocab)?;
    if let Some(spec) = grammar_spec(gen.response_format.as_ref())? {
        opts.grammar = Some(compile(rt, spec, PARAM).await?);
    }
    Ok(opts)
}

/// `spec` compiled for the worker's model (off the async threads: the first
/// one builds the vocabulary's token trie); errors name `param`.
pub(super) async fn compile(
    rt: &Runtime,
    spec: GrammarSpec,
    param: &str,
) -> Result<Grammar, ApiError> {
    let model = rt.model.clone();
    let compiled = tokio::task::spawn_blocking(move || model.grammars()?.compile(&spec))
        .await
        .map_err(|e| {
            ApiError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                format!("{param}: the compilation stopped: {e}"),
            )
            .param(param)
        })?;
    compiled.map_err(|e| ApiError::bad_request(format!("{param} cannot be used: {e}")).param(param))
}

fn bad(message: String) -> ApiError {
    ApiError::bad_request(message).param(PARAM)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_shape_reads_as_its_grammar_and_a_bad_one_names_the_field() {
        let schema = json!({"type": "object"});
        let cases = [
            (json!({"type": "text"}), None),
            (
                json!({"type": "json_object"}),
                Some(GrammarSpec::JsonObject),
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}),
                Some(GrammarSpec::JsonSchema(schema.clone())),
            ),
            (
                json!({"type": "regex", "regex": "a+"}),
                Some(GrammarSpec::Regex("a+".into())),
            ),
        ];
        for (format, expected) in cases {
            assert_eq!(grammar_spec(Some(&format)).unwrap(), expected, "{format}");
        }
        for bad in [
            json!({"type": "xml"}),
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            json!({"type": "regex"}),
        ] {
            let e = grammar_spec(Some(&bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(PARAM), "{bad}");
        }
    }
}
