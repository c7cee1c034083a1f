//! Real chat templates, as their models ship them, render through Pie's
//! template environment: a system and a user turn, and a tool round trip
//! (an assistant's call, the tool's answer) with `tools` offered. The
//! families' templates are fixtures here (`tests/templates/`, from
//! llama.cpp's `models/templates/`); `PIE_LLAMA_CPP_TEMPLATES=DIR` renders
//! every `.jinja` there too (all but one of 77 render: firefunction-v2
//! needs variables of its own).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use pie_core::tools::ToolRequest;
use pie_model::synth::{write_test_model, SynthSpec};
use pie_model::{ChatMessage, Tokenizer, TokenizerSpec};
use serde_json::json;

/// A tokenizer (the tiny test model's vocabulary) with `template`.
fn tokenizer(template: String) -> Tokenizer {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let path =
        std::env::temp_dir().join(format!("pie-templates-{}-{call}.gguf", std::process::id()));
    write_test_model(&path, &SynthSpec::default()).unwrap();
    let gguf = pie_model::gguf::GgufFile::open(&path).unwrap();
    let mut spec = TokenizerSpec::from_gguf(&gguf).unwrap();
    let _ = std::fs::remove_file(&path);
    spec.chat_template = Some(template);
    Tokenizer::from_spec(spec).unwrap()
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
