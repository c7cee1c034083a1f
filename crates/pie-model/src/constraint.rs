//! Constrained generation: the tokens a sequence may sample next, so that its
//! output matches a JSON schema, any JSON object, a regular expression or a
//! Lark grammar. The grammars are `llguidance`'s (what llama.cpp, vLLM and
//! SGLang embed: an Earley parser over a lazily built lexer, with masks
//! computed against a token trie in well under a millisecond on a 50k
//! vocabulary). The trie is built here from the model's own tokenizer bytes
//! (special tokens marked, so text never spells them), so any vocabulary the
//! tokenizer reads works.
//!
//! [`Grammars`] is one per model: the trie and the parser factory (its token
//! slices are the costly part, built once), and the grammars compiled
//! lately. [`Grammar`] is a compiled request (compiling is where a bad schema
//! fails, before anything is accepted); each sequence runs its own
//! [`Constraint`] from it.
//!
//! Clients repeat their schemas (an agent's step, an application's one
//! `response_format`), and compiling one costs 0.3-0.9 ms on the default
//! model's vocabulary against 3-6 us for a copy of a compiled one, so the
//! last [`CACHED_GRAMMARS`] are kept, by their text, as vLLM and SGLang keep
//! theirs.
//!
//! JSON output is compact (no free whitespace, as OpenAI's is): free
//! whitespace lets a model pad forever, which a length stop then cuts.
//! For the same reason a schema's unbounded values get default bounds
//! ([`with_default_bounds`]), a documented deviation from JSON Schema: an
//! `integer` or `number` without `maximum` / `minimum` stays within
//! +-[`MAX_MAGNITUDE`] (15 digits), a `number` without `multipleOf` has at
//! most [`MAX_FRACTION_DIGITS`] decimals, and a `string` without `maxLength`
//! at most [`MAX_STRING_CHARS`] characters. A schema that sets its own bound
//! keeps it, however large.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use lru::LruCache;
use serde_json::{json, Value};

use crate::tokenizer::Tokenizer;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// A value valid under this JSON schema.
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// Text matching this regular expression.
    Regex(String),
    /// Text in this Lark grammar (llguidance's dialect).
    Lark(String),
}

/// How many compiled grammars a model keeps.
pub const CACHED_GRAMMARS: usize = 64;

/// The longest spec text kept: a cache of [`CACHED_GRAMMARS`] holds at most
/// that many times this, whatever size a request body may have.
const CACHED_SPEC_BYTES: usize = 64 * 1024;

/// The grammar machinery for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    /// Compiled grammars, never advanced, by [`GrammarSpec::key`].
    cache: Mutex<LruCache<String, Grammar>>,
    compiled: AtomicU64,
    reused: AtomicU64,
}

/// How often [`Grammars::compile`] compiled and how often it reused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrammarCounts {
    pub compiled: u64,
    pub reused: u64,
}

impl GrammarSpec {
    /// The text that names this grammar: equal specs give equal keys.
    fn key(&self) -> String {
        match self {
            Self::JsonSchema(schema) => format!("schema\0{schema}"),
            Self::JsonObject => "object".to_string(),
            Self::Regex(rx) => format!("regex\0{rx}"),
            Self::Lark(lark) => format!("lark\0{lark}"),
        }
    }
}

impl Grammars {
    /// For `tokenizer`, with `vocab` logits a step (ids past the tokenizer's
    /// are never allowed); `stop_tokens` end a generation the grammar
    /// accepts.
    pub fn new(tokenizer: &Tokenizer, vocab: usize) -> Result<Self, String> {
        let special = tokenizer.special_tokens();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                Some(bytes) if special.contains(&id) => {
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend(bytes);
                    marked
                }
                Some(bytes) => bytes,
                None => Vec::new(),
            })
            .collect();
        let stop = tokenizer.stop_tokens();
        let eos = *stop
            .first()
            .ok_or("the tokenizer names no end-of-sequence token")?;
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words).with_eos_tokens(stop);
        let env: Arc<dyn TokenizerEnv + Sync> = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        let capacity = NonZeroUsize::new(CACHED_GRAMMARS).ok_or("no room for grammars")?;
        Ok(Self {
            factory,
            cache: Mutex::new(LruCache::new(capacity)),
            compiled: AtomicU64::new(0),
            reused: AtomicU64::new(0),
        })
    }

    /// `spec` compiled, or a copy of its compiled grammar when one of the
    /// last [`CACHED_GRAMMARS`] was the same; the error names what the
    /// library could not use (a spec that fails is not kept).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, String> {
        let key = spec.key();
        if let Some(grammar) = self.lock_cache().get(&key) {
            self.reused.fetch_add(1, Ordering::Relaxed);
            return Ok(grammar.clone());
        }
        let grammar = self.compile_uncached(spec)?;
        self.compiled.fetch_add(1, Ordering::Relaxed);
        if key.len() <= CACHED_SPEC_BYTES {
            self.lock_cache().put(key, grammar.clone());
        }
        Ok(grammar)
    }

    /// How often [`Self::compile`] compiled and reused, since the start.
    pub fn counts(&self) -> GrammarCounts {
        GrammarCounts {
            compiled: self.compiled.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
        }
    }

    /// The cache holds only whole, never-advanced grammars, so one a
    /// panicking thread left behind is still good.
    fn lock_cache(&self) -> std::sync::MutexGuard<'_, LruCache<String, Grammar>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn compile_uncached(&self, spec: &GrammarSpec) -> Result<Grammar, String> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(schema.clone())?)
            }
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))?)
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        Ok(Grammar { parser })
    }
}

/// The largest magnitude an unbounded `integer` or `number` may take:
/// 15 digits, exact in a double.
pub const MAX_MAGNITUDE: i64 = 999_999_999_999_999;
/// The most decimals an unbounded `number` may write.
pub const MAX_FRACTION_DIGITS: i32 = 6;
/// The most characters a `string` without `maxLength` may hold.
pub const MAX_STRING_CHARS: u64 = 1024;

/// The keywords whose subschemas describe values the output holds (not
/// conditions on them: `not`, `if`, `contains` are left as written).
const VALUE_SUBSCHEMAS: &[&str] = &[
    "items",
    "additionalProperties",
    "additionalItems",
    "then",
    "else",
];
const VALUE_SUBSCHEMA_LISTS: &[&str] = &["prefixItems", "anyOf", "oneOf", "allOf"];
const VALUE_SUBSCHEMA_MAPS: &[&str] = &["properties", "patternProperties", "$defs", "definitions"];

/// `schema` with the default bounds (module doc) on every value it
/// describes that has none.
pub fn with_default_bounds(schema: &mut Value) {
    let Some(node) = schema.as_object_mut() else {
        return;
    };
    let types: Vec<&str> = match node.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let literal = node.contains_key("enum") || node.contains_key("const");
    let (numeric, fractional, string) = (
        types.iter().any(|t| *t == "integer" || *t == "number"),
        types.contains(&"number"),
        types.contains(&"string"),
    );
    if numeric && !literal {
        if !node.contains_key("maximum") && !node.contains_key("exclusiveMaximum") {
            node.insert("maximum".into(), json!(MAX_MAGNITUDE));
        }
        if !node.contains_key("minimum") && !node.contains_key("exclusiveMinimum") {
            node.insert("minimum".into(), json!(-MAX_MAGNITUDE));
        }
    }
    if fractional && !literal && !node.contains_key("multipleOf") {
        node.insert("multipleOf".into(), json!(10f64.powi(-MAX_FRACTION_DIGITS)));
    }
    if string && !literal && !node.contains_key("maxLength") {
        node.insert("maxLength".into(), json!(MAX_STRING_CHARS));
    }
    for key in VALUE_SUBSCHEMAS {
        if let Some(sub) = node.get_mut(*key) {
            with_default_bounds(sub);
        }
    }
    for key in VALUE_SUBSCHEMA_LISTS {
        if let Some(Value::Array(subs)) = node.get_mut(*key) {
            subs.iter_mut().for_each(with_default_bounds);
        }
    }
    for key in VALUE_SUBSCHEMA_MAPS {
        if let Some(Value::Object(subs)) = node.get_mut(*key) {
            subs.values_mut().for_each(with_default_bounds);
        }
    }
}

/// `schema` with llguidance's option for compact JSON, unless it sets its
/// own, and the default bounds.
fn compact(mut schema: Value) -> Result<Value, String> {
    with_default_bounds(&mut schema);
    let object = schema
        .as_object_mut()
        .ok_or("a JSON schema must be an object")?;
    object
        .entry("x-guidance")
        .or_insert_with(|| json!({"whitespace_flexible": false}));
    Ok(schema)
}

/// A compiled grammar, ready to constrain any number of sequences.
pub struct Grammar {
    parser: TokenParser,
}

impl Clone for Grammar {
    fn clone(&self) -> Self {
        Self {
            parser: self.parser.deep_clone(),
        }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Grammar {
    /// A fresh constraint at the start of the output.
    pub fn start(&self) -> Constraint {
        Constraint {
            matcher: Matcher::new(Ok(self.parser.deep_clone())),
            mask: None,
        }
    }
}

/// One sequence's position in its grammar.
pub struct Constraint {
    matcher: Matcher,
    /// The mask for the next token, once computed.
    mask: Option<SimpleVob>,
}

impl Constraint {
    /// Advance over tokens the sequence produced (a resumed one's included).
    pub fn advance(&mut self, tokens: &[u32]) -> Result<(), String> {
        self.mask = None;
        self.matcher
            .consume_tokens(tokens)
            .map_err(|e| e.to_string())
    }

    /// Compute the next token's mask (off the engine thread: the caller
    /// overlaps it with the forward pass); how long it took.
    pub fn compute_mask(&mut self) -> Result<Duration, String> {
        let started = Instant::now();
        let mask = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        if mask.is_zero() {
            return Err("the grammar allows no next token".into());
        }
        self.mask = Some(mask);
        Ok(started.elapsed())
    }

    /// Forbid in `logits` every token the mask does not allow (all of them
    /// when no mask was computed: a constrained sequence never samples
    /// unchecked).
    pub fn apply(&self, logits: &mut [f32]) {
        for (id, l) in logits.iter_mut().enumerate() {
            let allowed = self.mask.as_ref().is_some_and(|m| m.is_allowed(id as u32));
            if !allowed {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{write_test_model, SynthSpec};

    fn grammars() -> (crate::Model, Grammars) {
        let path = std::env::temp_dir().join(format!(
            "pie-constraint-{}-{:?}.gguf",
            std::process::id(),
            std::thread::current().id()
        ));
        write_test_model(&path, &SynthSpec::default()).unwrap();
        let model = crate::Model::load(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let grammars = Grammars::new(&model.tokenizer, model.config.vocab).unwrap();
        (model, grammars)
    }

    /// Sample greedily from `logits` under `constraint` until it stops:
    /// whatever the logits favour, the text matches.
    fn drive(tokenizer: &Tokenizer, constraint: &mut Constraint, vocab: usize) -> String {
        let mut out = Vec::new();
        for step in 0..200 {
            if constraint.is_stopped() {
                break;
            }
            constraint.compute_mask().unwrap();
            // Logits that favour a different token every step.
            let mut logits: Vec<f32> = (0..vocab)
                .map(|i| ((i * 7919 + step * 104_729) % 1000) as f32)
                .collect();
            constraint.apply(&mut logits);
            let token = crate::sampling::argmax(&logits);
            if tokenizer.stop_tokens().contains(&token) {
                break;
            }
            out.push(token);
            constraint.advance(&[token]).unwrap();
        }
        tokenizer.decode(&out).unwrap()
    }

    /// Unbounded values get the default bounds, wherever they sit; a
    /// schema's own bounds, literals and conditions stay as written.
    #[test]
    fn unbounded_values_get_default_bounds_and_bounded_ones_keep_theirs() {
        let mut schema = json!({"type": "object", "properties": {
            "n": {"type": "integer"},
            "x": {"type": ["number", "null"], "maximum": 5},
            "s": {"type": "string"},
            "t": {"type": "string", "maxLength": 100000},
            "e": {"type": "string", "enum": ["a", "b"]},
            "list": {"type": "array", "items": {"anyOf": [{"type": "integer"}]}},
            "ref": {"$ref": "#/$defs/d"}},
            "$defs": {"d": {"type": "string"}},
            "not": {"type": "integer"}});
        with_default_bounds(&mut schema);
        let p = &schema["properties"];
        assert_eq!(p["n"]["maximum"], MAX_MAGNITUDE);
        assert_eq!(p["n"]["minimum"], -MAX_MAGNITUDE);
        assert!(p["n"].get("multipleOf").is_none(), "integers are whole");
        assert_eq!(p["x"]["maximum"], 5);
        assert_eq!(p["x"]["minimum"], -MAX_MAGNITUDE);
        assert_eq!(p["x"]["multipleOf"], 1e-6);
        assert_eq!(p["s"]["maxLength"], MAX_STRING_CHARS);
        assert_eq!(p["t"]["maxLength"], 100000);
        assert!(p["e"].get("maxLength").is_none());
        assert_eq!(p["list"]["items"]["anyOf"][0]["maximum"], MAX_MAGNITUDE);
        assert_eq!(schema["$defs"]["d"]["maxLength"], MAX_STRING_CHARS);
        assert!(
            schema["not"].get("maximum").is_none(),
            "a condition is left alone"
        );
    }

    /// Under the default bounds logits that favour digits cannot make a
    /// number run on: an integer ends within 15 digits, a number within 6
    /// decimals.
    #[test]
    fn logits_that_favour_digits_do_not_make_a_number_run_on() {
        let (model, grammars) = grammars();
        let tk = &model.tokenizer;
        let id = |s: &str| tk.encode_continuation(s).unwrap()[0] as usize;
        let mut logits = vec![0.0f32; model.config.vocab];
        for digit in ["1", "2", "3", "4", "5", "6", "7", "8", "9"] {
            logits[id(digit)] = 10.0;
        }
        logits[id(".")] = 5.0;
        for (schema, what) in [
            (json!({"type": "integer"}), "integer"),
            (json!({"type": "number"}), "number"),
        ] {
            let grammar = grammars.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
            let mut constraint = grammar.start();
            let mut out = Vec::new();
            while !constraint.is_stopped() && out.len() < 100 {
                constraint.compute_mask().unwrap();
                let mut masked = logits.clone();
                constraint.apply(&mut masked);
                let token = crate::sampling::argmax(&masked);
                if tk.stop_tokens().contains(&token) {
                    break;
                }
                out.push(token);
                constraint.advance(&[token]).unwrap();
            }
            let text = tk.decode(&out).unwrap();
            let value: f64 = text
                .parse()
                .unwrap_or_else(|e| panic!("{what} {text:?}: {e}"));
            assert!(value.abs() <= MAX_MAGNITUDE as f64, "{what} {text}");
            let decimals = text.split_once('.').map_or(0, |(_, f)| f.len());
            assert!(decimals <= MAX_FRACTION_DIGITS as usize, "{what} {text}");
        }
    }

    #[test]
    fn any_logits_under_a_schema_give_a_valid_value() {
        let (model, grammars) = grammars();
        let tokenizer = &model.tokenizer;
        let schema = json!({
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog"]},
                "age": {"type": "integer", "minimum": 1, "maximum": 20}
            },
            "required": ["kind", "age"],
            "additionalProperties": false
        });
        let grammar = grammars.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
        let text = drive(tokenizer, &mut grammar.start(), grammars_vocab(&grammars));
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(
            ["cat", "dog"].contains(&value["kind"].as_str().unwrap()),
            "{text}"
        );
        let age = value["age"].as_i64().unwrap();
        assert!((1..=20).contains(&age), "{text}");
        assert_eq!(value.as_object().unwrap().len(), 2, "{text}");
    }

    #[test]
    fn a_regex_constrains_and_a_resumed_constraint_continues() {
        let (model, grammars) = grammars();
        let tokenizer = &model.tokenizer;
        let grammar = grammars
            .compile(&GrammarSpec::Regex("(yes|no), [0-9]{3}".into()))
            .unwrap();
        let text = drive(tokenizer, &mut grammar.start(), grammars_vocab(&grammars));
        let (word, digits) = text.split_once(", ").unwrap_or_else(|| panic!("{text}"));
        assert!(["yes", "no"].contains(&word), "{text}");
        assert!(
            digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{text}"
        );
        let yes = tokenizer.encode_continuation("yes").unwrap();
        let mut resumed = grammar.start();
        resumed.advance(&yes).unwrap();
        let rest = drive(tokenizer, &mut resumed, grammars_vocab(&grammars));
        assert!(rest.starts_with(", ") && rest.len() == 5, "{rest}");
        let mut wrong = grammar.start();
        let maybe = tokenizer.encode_continuation("maybe").unwrap();
        assert!(
            wrong.advance(&maybe).is_err(),
            "a token outside the grammar is refused"
        );
    }

    #[test]
    fn a_schema_the_library_cannot_use_is_an_error_naming_it() {
        let (_, grammars) = grammars();
        let bad = json!({"type": "object", "properties": {"a": {"type": "no-such-type"}}});
        let e = grammars.compile(&GrammarSpec::JsonSchema(bad)).unwrap_err();
        assert!(e.contains("no-such-type"), "{e}");
        let e = grammars
            .compile(&GrammarSpec::JsonSchema(json!([1])))
            .unwrap_err();
        assert!(e.contains("must be an object"), "{e}");
        let e = grammars
            .compile(&GrammarSpec::Regex("(".into()))
            .unwrap_err();
        assert!(!e.is_empty());
        let again = grammars
            .compile(&GrammarSpec::Regex("(".into()))
            .unwrap_err();
        assert_eq!(again, e, "a spec that fails is compiled, and fails, again");
        assert_eq!(grammars.counts(), GrammarCounts::default());
    }

    /// A repeated spec reuses its compiled grammar, which constraints from it
    /// never advance; the cache keeps the last `CACHED_GRAMMARS` specs, none
    /// longer than `CACHED_SPEC_BYTES`.
    #[test]
    fn a_repeated_spec_is_compiled_once_and_the_cache_is_bounded() {
        let (model, grammars) = grammars();
        let vocab = grammars_vocab(&grammars);
        let spec = |i: usize| GrammarSpec::Regex(format!("(yes|no), {i}"));
        let first = grammars.compile(&spec(0)).unwrap();
        let text = drive(&model.tokenizer, &mut first.start(), vocab);
        for _ in 0..2 {
            let reused = grammars.compile(&spec(0)).unwrap();
            assert_eq!(drive(&model.tokenizer, &mut reused.start(), vocab), text);
        }
        let counts = |compiled, reused| GrammarCounts { compiled, reused };
        assert_eq!(grammars.counts(), counts(1, 2));
        let schema = || GrammarSpec::JsonSchema(json!({"type": "object"}));
        grammars.compile(&schema()).unwrap();
        grammars.compile(&GrammarSpec::JsonObject).unwrap();
        assert_eq!(
            grammars.counts(),
            counts(3, 2),
            "a spec of another kind is another grammar"
        );
        for i in 1..=CACHED_GRAMMARS {
            grammars.compile(&spec(i)).unwrap();
        }
        grammars.compile(&spec(CACHED_GRAMMARS)).unwrap();
        assert_eq!(grammars.counts(), counts(3 + CACHED_GRAMMARS as u64, 3));
        grammars.compile(&spec(0)).unwrap();
        assert_eq!(
            grammars.counts(),
            counts(4 + CACHED_GRAMMARS as u64, 3),
            "the least recently used spec was dropped"
        );
        let long = GrammarSpec::JsonSchema(
            json!({"type": "object", "description": "x".repeat(CACHED_SPEC_BYTES)}),
        );
        grammars.compile(&long).unwrap();
        grammars.compile(&long).unwrap();
        assert_eq!(
            grammars.counts(),
            counts(6 + CACHED_GRAMMARS as u64, 3),
            "a spec longer than CACHED_SPEC_BYTES is compiled every time"
        );
    }

    /// Whatever the logits, a required call in either tool format reads
    /// back as calls of offered tools with arguments valid under their
    /// schemas (at most the parallel limit of them).
    #[test]
    fn any_logits_under_a_tool_constraint_give_calls_that_parse() {
        use pie_core::tools::{ToolConstraint, ToolFormat, ToolOutput, ToolRequest};
        let (model, grammars) = grammars();
        let tool = |name: &str| {
            json!({"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"], "additionalProperties": false}}})
        };
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Generic,
        ] {
            for parallel in [false, true] {
                let request = ToolRequest::from_fields(
                    &json!([tool("weather"), tool("clock")]),
                    &json!("required"),
                    &json!(parallel),
                )
                .unwrap()
                .unwrap();
                let spec = match format
                    .constraint(&request)
                    .expect("required is constrained")
                {
                    ToolConstraint::JsonSchema(s) => GrammarSpec::JsonSchema(s),
                    ToolConstraint::Lark(g) => GrammarSpec::Lark(g),
                };
                let grammar = grammars
                    .compile(&spec)
                    .unwrap_or_else(|e| panic!("{format:?}: {e}"));
                let text = drive(
                    &model.tokenizer,
                    &mut grammar.start(),
                    grammars_vocab(&grammars),
                );
                let mut output = ToolOutput::new(format);
                let streamed = output.push(&text);
                let (rest, calls) = output.finish();
                assert_eq!(format!("{streamed}{rest}"), "", "{format:?}: {text}");
                let most = if parallel {
                    pie_core::tools::MAX_PARALLEL_CALLS
                } else {
                    1
                };
                assert!((1..=most).contains(&calls.len()), "{format:?}: {text}");
                for call in calls {
                    assert!(["weather", "clock"].contains(&call.name.as_str()), "{text}");
                    let args: Value = serde_json::from_str(&call.arguments).unwrap();
                    assert!(
                        ["c", "f"].contains(&args["unit"].as_str().unwrap()),
                        "{text}"
                    );
                }
            }
        }
    }

    fn grammars_vocab(g: &Grammars) -> usize {
        g.factory.tok_env().tok_trie().vocab_size()
    }
}
