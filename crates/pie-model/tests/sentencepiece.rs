//! A SentencePiece vocabulary (`tokenizer.ggml.model = llama`) tokenizes as
//! SentencePiece itself does. The fixture is a BPE model trained with the
//! `sentencepiece` Python package (0.2.0; 700 pieces, byte fallback, digits
//! split, a dummy prefix, as Llama's): its pieces, scores and types, and the
//! ids `SentencePieceProcessor.encode` gave for each text.

use pie_model::{Tokenizer, TokenizerSpec};
use serde_json::Value;

fn fixture() -> Value {
    let text = include_str!("fixtures/sentencepiece.json");
    serde_json::from_str(text).expect("the fixture is JSON")
}

fn tokenizer(f: &Value) -> Tokenizer {
    Tokenizer::from_spec(tokenizer_spec(f)).expect("the vocabulary builds")
}

fn tokenizer_spec(f: &Value) -> TokenizerSpec {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    TokenizerSpec {
        model: "llama".into(),
        pre: String::new(),
        tokens: strings(&f["tokens"]),
        merges: Vec::new(),
        token_types: (f["token_types"].as_array().unwrap().iter())
            .map(|t| t.as_i64().unwrap() as i32)
            .collect(),
        bos: Some(1),
        eos: Some(2),
        add_bos: false,
        chat_template: None,
        scores: (f["scores"].as_array().unwrap().iter())
            .map(|s| s.as_f64().unwrap() as f32)
            .collect(),
        add_space_prefix: true,
    }
}

#[test]
fn every_text_gets_sentencepieces_ids() {
    let f = fixture();
    let tk = tokenizer(&f);
    for case in f["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = (case["ids"].as_array().unwrap().iter())
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        let ids = tk.encode(text).unwrap();
        assert_eq!(ids, want, "{text:?}");
        // Decoding keeps the prefixed space; the pieces' bytes are the text's.
        assert_eq!(tk.decode(&ids).unwrap(), format!(" {text}"));
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tk.token_bytes(id).unwrap())
            .collect();
        assert_eq!(bytes, format!(" {text}").into_bytes(), "{text:?}");
    }
}

#[test]
fn a_continuation_gets_no_space_before_it() {
    let f = fixture();
    let tk = tokenizer(&f);
    let whole = tk.encode("Hello world").unwrap();
    let continued = tk.encode_continuation("world").unwrap();
    assert_ne!(continued, tk.encode("world").unwrap(), "no prefixed space");
    assert_eq!(tk.decode(&continued).unwrap(), "world");
    // A special token in the text is the token, and the text after it gets its space.
    let with_bos = tk.encode("<s>Hello world").unwrap();
    assert_eq!(with_bos[0], 1);
    assert_eq!(with_bos[1..], whole[..]);
}

/// The vocabulary as a GGUF carries it reads back as the same spec, with
/// llama.cpp's default of a space prefix where the file does not say.
#[test]
fn a_gguf_sentencepiece_vocabulary_reads_back_as_its_spec() {
    use candle_core::quantized::gguf_file::{self, Value as Gguf};
    let f = fixture();
    let want = tokenizer_spec(&f);
    let strings = |v: &[String]| Gguf::Array(v.iter().map(|s| Gguf::String(s.clone())).collect());
    let metadata = [
        ("general.architecture", Gguf::String("llama".into())),
        ("tokenizer.ggml.model", Gguf::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&want.tokens)),
        (
            "tokenizer.ggml.scores",
            Gguf::Array(want.scores.iter().map(|s| Gguf::F32(*s)).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Gguf::Array(want.token_types.iter().map(|t| Gguf::I32(*t)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", Gguf::U32(1)),
        ("tokenizer.ggml.eos_token_id", Gguf::U32(2)),
    ];
    let path = std::env::temp_dir().join(format!("pie-spm-{}.gguf", std::process::id()));
    let md: Vec<(&str, &Gguf)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let mut out = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut out, &md, &[]).unwrap();
    drop(out);
    let read = TokenizerSpec::from_gguf(&pie_model::gguf::GgufFile::open(&path).unwrap());
    let _ = std::fs::remove_file(&path);
    assert_eq!(read.unwrap(), want);
}
