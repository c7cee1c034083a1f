//! A grammar's cost on the default model's vocabulary (49,152 tokens):
//! compiling one (what a request whose spec is new pays), taking one from the
//! model's cache of compiled grammars (what a repeated spec pays), and one
//! token's mask. The model is the one `pie serve` fetches
//! (`$PIE_HOME/models`); `PIE_BENCH_MODEL` names another GGUF.

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

fn specs() -> [(&'static str, GrammarSpec); 2] {
    let schema = json!({
        "type": "object", "additionalProperties": false,
        "required": ["kind", "age", "tags", "code"],
        "properties": {
            "kind": {"enum": ["cat", "dog", "fox"]},
            "age": {"type": "integer", "minimum": 1, "maximum": 30},
            "tags": {"type": "array", "minItems": 2, "items": {"enum": ["a", "b", "c"]}},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}
        }
    });
    [
        ("agent-step-regex", GrammarSpec::Regex(AGENT_STEP.into())),
        ("json-schema", GrammarSpec::JsonSchema(schema)),
    ]
}

fn grammar(c: &mut Criterion) {
    let model = model();
    let grammars = model.grammars().expect("the model's vocabulary has a trie");
    let mut group = c.benchmark_group("grammar");
    for (name, spec) in specs() {
        let mut n = 0u64;
        group.bench_function(format!("{name}/compile"), |b| {
            b.iter(|| {
                // A spec the cache never saw: its text differs by a trailing
                // alternative the output never reaches.
                n += 1;
                let fresh = match &spec {
                    GrammarSpec::Regex(rx) => GrammarSpec::Regex(format!("{rx}|never{n}")),
                    GrammarSpec::JsonSchema(s) => {
                        let mut s = s.clone();
                        s["description"] = json!(n.to_string());
                        GrammarSpec::JsonSchema(s)
                    }
                    other => other.clone(),
                };
                grammars.compile(&fresh).expect("compiles")
            })
        });
        group.bench_function(format!("{name}/cached"), |b| {
            b.iter(|| grammars.compile(&spec).expect("compiles"))
        });
        let compiled = grammars.compile(&spec).expect("compiles");
        group.bench_function(format!("{name}/first-mask"), |b| {
            b.iter(|| compiled.start().compute_mask().expect("a first token"))
        });
    }
    group.finish();
}

criterion_group!(benches, grammar);
criterion_main!(benches);
