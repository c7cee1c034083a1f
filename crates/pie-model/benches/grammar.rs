//! A grammar's cost on the default model's vocabulary (49,152 tokens):
//! compiling one (what a request whose spec is new pays), taking one from the
//! model's cache of compiled grammars (what a repeated spec pays), and a
//! constraint started from a compiled grammar with its first token's mask.
//! The model is the one `pie serve` fetches (`$PIE_HOME/models`);
//! `PIE_BENCH_MODEL` names another GGUF.

use criterion::{criterion_group, criterion_main, Criterion};
use pie_model::{GrammarSpec, Model};
use serde_json::json;

/// The agent benchmark's step (`scripts/agent-bench.py`, `inferlets/agent`).
const AGENT_STEP: &str = r"Thought: [ -~]{1,100}\n(Action: (search|calculate)\[[a-zA-Z0-9 +*/.-]{1,40}\]|Final Answer: [ -~]{1,100})";

fn model() -> Model {
    let path = std::env::var_os("PIE_BENCH_MODEL").map_or_else(
        || {
            pie_core::config_file::pie_home()
                .join("models")
                .join("SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        Into::into,
    );
    Model::load(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run `pie serve` once to fetch it, or set PIE_BENCH_MODEL)",
            path.display()
        )
    })
}

/// A spec's `n`th variant: the same grammar but for an alternative the
/// output never reaches, so every `n` is a spec the cache has not seen.
type Variant = fn(u64) -> GrammarSpec;

/// The specs measured, by name.
fn specs() -> [(&'static str, Variant); 2] {
    [
        ("agent-step-regex", |n| {
            GrammarSpec::Regex(format!("{AGENT_STEP}|never{n}"))
        }),
        ("json-schema", |n| {
            GrammarSpec::JsonSchema(json!({
                "type": "object", "additionalProperties": false,
                "required": ["kind", "age", "tags", "code"],
                "description": n.to_string(),
                "properties": {
                    "kind": {"enum": ["cat", "dog", "fox"]},
                    "age": {"type": "integer", "minimum": 1, "maximum": 30},
                    "tags": {"type": "array", "minItems": 2, "items": {"enum": ["a", "b", "c"]}},
                    "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}
                }
            }))
        }),
    ]
}

fn grammar(c: &mut Criterion) {
    let model = model();
    let grammars = model.grammars().expect("the model's vocabulary has a trie");
    let mut group = c.benchmark_group("grammar");
    for (name, variant) in specs() {
        let mut n = 0;
        group.bench_function(format!("{name}/compile"), |b| {
            b.iter(|| {
                n += 1;
                grammars.compile(&variant(n)).expect("compiles")
            })
        });
        let repeated = variant(0);
        group.bench_function(format!("{name}/cached"), |b| {
            b.iter(|| grammars.compile(&repeated).expect("compiles"))
        });
        let compiled = grammars.compile(&repeated).expect("compiles");
        group.bench_function(format!("{name}/first-mask"), |b| {
            b.iter(|| compiled.start().compute_mask().expect("a first token"))
        });
    }
    group.finish();
}

criterion_group!(benches, grammar);
criterion_main!(benches);
