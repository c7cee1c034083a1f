//! Real chat templates, as their models ship them, render through Pie's
//! template environment: a system and a user turn, and a tool round trip
//! (an assistant's call, the tool's answer) with `tools` offered. The
//! families' templates are fixtures here (`tests/templates/`, from
//! llama.cpp's `models/templates/`); `PIE_LLAMA_CPP_TEMPLATES=DIR` renders
//! every `.jinja` there too (all but one of 77 render: firefunction-v2
//! needs variables of its own). And each family's assistant turn ends with
//! a token that stops generation, in the tiny vocabulary given the family's
//! control tokens, in the fixtures' real vocabularies, and with
//! `PIE_LLAMA_CPP_VOCABS=DIR` in the Qwen and Llama 3 ones.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use pie_core::tools::ToolRequest;
use pie_model::synth::{write_test_model, SynthSpec};
use pie_model::{ChatMessage, Tokenizer, TokenizerSpec};
use serde_json::json;

/// A tokenizer (the tiny test model's vocabulary) with `template`.
fn tokenizer(template: String) -> Tokenizer {
    tokenizer_with(template, &[])
}

/// GGUF's token type of control tokens.
const CONTROL: i32 = 3;

/// The tiny test model's vocabulary with `controls` added as control
/// tokens, and `template`.
fn tokenizer_with(template: String, controls: &[&str]) -> Tokenizer {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let path =
        std::env::temp_dir().join(format!("pie-templates-{}-{call}.gguf", std::process::id()));
    write_test_model(&path, &SynthSpec::default()).unwrap();
    let gguf = pie_model::gguf::GgufFile::open(&path).unwrap();
    let mut spec = TokenizerSpec::from_gguf(&gguf).unwrap();
    let _ = std::fs::remove_file(&path);
    for control in controls {
        spec.tokens.push(control.to_string());
        spec.token_types.push(CONTROL);
    }
    spec.chat_template = Some(template);
    Tokenizer::from_spec(spec).unwrap()
}

/// A vocabulary-only GGUF's tokenizer with `template`.
fn vocabulary_with(path: &Path, template: String) -> Tokenizer {
    let gguf = pie_model::gguf::GgufFile::open(path).unwrap();
    let mut spec = TokenizerSpec::from_gguf(&gguf).unwrap();
    spec.chat_template = Some(template);
    Tokenizer::from_spec(spec).unwrap()
}

fn template(name: &str) -> String {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/templates");
    std::fs::read_to_string(dir.join(name)).unwrap()
}

/// The first token after an assistant's answer in a rendered chat: what the
/// template ends the turn with, which the model learnt to write there.
fn turn_end(tk: &Tokenizer) -> u32 {
    let chat = [
        ChatMessage::text("user", "What is the capital of France?".into()),
        ChatMessage::text("assistant", "Paris.".into()),
        ChatMessage::text("user", "And of Italy?".into()),
    ];
    let text = tk.apply_chat_template(&chat, None).unwrap();
    let (_, after) = text
        .split_once("Paris.")
        .unwrap_or_else(|| panic!("the answer is missing: {text:?}"));
    first_token(tk, after)
}

/// The first token of `text` (after the BOS the tokenizer adds, if any).
fn first_token(tk: &Tokenizer, text: &str) -> u32 {
    tk.encode(text).unwrap()[usize::from(tk.bos().is_some())]
}

/// The end-of-turn token `tk` writes after an answer, checked to be one of
/// its stop tokens and to be `want`.
fn assert_turn_ends(family: &str, tk: &Tokenizer, want: &str) {
    let id = turn_end(tk);
    let want_id = first_token(tk, want);
    assert_eq!(
        tk.encode(want).unwrap().len(),
        1 + usize::from(tk.bos().is_some()),
        "{family}: {want} is one token"
    );
    assert_eq!(
        id, want_id,
        "{family}: the turn ends with token {id}, not {want} ({want_id})"
    );
    assert!(
        tk.stop_tokens().contains(&id),
        "{family}: {want} ({id}) is not a stop token: {:?}",
        tk.stop_tokens()
    );
}

fn tools() -> ToolRequest {
    let body = json!({
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}
        }}]
    });
    ToolRequest::from_body(body.as_object().unwrap())
        .unwrap()
        .unwrap()
}

/// Renders `template` both ways; returns the text of the plain chat.
fn render(name: &str, template: String) -> Result<String, String> {
    let tk = tokenizer(template);
    let plain = [
        ChatMessage::text("system", "Answer briefly.".into()),
        ChatMessage::text("user", "What is the capital of France?".into()),
    ];
    let text = tk
        .apply_chat_template(&plain, None)
        .map_err(|e| format!("{name}: plain chat: {e:#}"))?;
    for turn in ["Answer briefly.", "What is the capital of France?"] {
        if !text.contains(turn) {
            return Err(format!("{name}: {turn:?} is missing: {text:?}"));
        }
    }
    let call = json!({"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}});
    let round_trip = [
        ChatMessage::text("user", "Weather in Paris?".into()),
        ChatMessage {
            tool_calls: Some(vec![call]),
            ..ChatMessage::text("assistant", String::new())
        },
        ChatMessage {
            tool_call_id: Some("call_1".into()),
            ..ChatMessage::text("tool", "18 C, clear".into())
        },
    ];
    let with_tools = tk
        .apply_chat_template(&round_trip, Some(&tools()))
        .map_err(|e| format!("{name}: tool round trip: {e:#}"))?;
    if !with_tools.contains("18 C, clear") {
        return Err(format!(
            "{name}: the tool's answer is missing: {with_tools:?}"
        ));
    }
    Ok(text)
}

fn render_all(dir: &Path) -> Vec<String> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
        .collect();
    names.sort();
    let mut failures = Vec::new();
    for path in names {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        match render(&name, std::fs::read_to_string(&path).unwrap()) {
            Ok(_) => eprintln!("{name}: renders"),
            Err(e) => {
                eprintln!("{e}");
                failures.push(e);
            }
        }
    }
    failures
}

#[test]
fn every_familys_template_renders() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/templates");
    let failures = render_all(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn every_llama_cpp_template_renders() {
    let Ok(dir) = std::env::var("PIE_LLAMA_CPP_TEMPLATES") else {
        eprintln!("SKIPPED: PIE_LLAMA_CPP_TEMPLATES (llama.cpp's models/templates/) is not set");
        return;
    };
    let failures = render_all(Path::new(&dir));
    // It needs variables of its own (`functions`, `datetime`).
    let own_variables = "fireworks-ai-llama-3-firefunction-v2";
    let failures: Vec<_> = failures
        .into_iter()
        .filter(|f| !f.starts_with(own_variables))
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Each family's template with its control tokens in the tiny vocabulary,
/// and the real Phi-3 and Llama 2 vocabularies that are fixtures here.
#[test]
fn every_familys_turn_ends_with_a_stop_token() {
    let llama3 = [
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ];
    let phi3 = ["<|user|>", "<|assistant|>", "<|end|>", "<|system|>"];
    let gemma = ["<start_of_turn>", "<end_of_turn>"];
    let cases: [(&str, &[&str], &str); 6] = [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", &[], "<|im_end|>"),
        ("Qwen-Qwen3-0.6B.jinja", &[], "<|im_end|>"),
        (
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
            &llama3,
            "<|eot_id|>",
        ),
        (
            "meta-llama-Llama-3.2-3B-Instruct.jinja",
            &llama3,
            "<|eot_id|>",
        ),
        ("google-gemma-2-2b-it.jinja", &gemma, "<end_of_turn>"),
        ("microsoft-Phi-3.5-mini-instruct.jinja", &phi3, "<|end|>"),
    ];
    for (name, controls, want) in cases {
        assert_turn_ends(name, &tokenizer_with(template(name), controls), want);
    }
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let phi = vocabulary_with(
        &fixtures.join("ggml-vocab-phi-3.gguf"),
        template("microsoft-Phi-3.5-mini-instruct.jinja"),
    );
    assert_turn_ends("phi-3", &phi, "<|end|>");
    let mistral = vocabulary_with(
        &fixtures.join("ggml-vocab-llama-spm.gguf"),
        template("mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    );
    assert_turn_ends("llama-spm with Mistral's template", &mistral, "</s>");
}

/// The Qwen and Llama 3 vocabularies from llama.cpp's `models/`.
#[test]
fn real_vocabularies_end_turns_with_a_stop_token() {
    let Ok(dir) = std::env::var("PIE_LLAMA_CPP_VOCABS") else {
        eprintln!("SKIPPED: PIE_LLAMA_CPP_VOCABS (llama.cpp's models/ directory) is not set");
        return;
    };
    for (vocab, name, want) in [
        ("qwen2", "Qwen-Qwen2.5-7B-Instruct.jinja", "<|im_end|>"),
        ("qwen2", "Qwen-Qwen3-0.6B.jinja", "<|im_end|>"),
        (
            "llama-bpe",
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
            "<|eot_id|>",
        ),
    ] {
        let path = Path::new(&dir).join(format!("ggml-vocab-{vocab}.gguf"));
        assert_turn_ends(vocab, &vocabulary_with(&path, template(name)), want);
    }
}
