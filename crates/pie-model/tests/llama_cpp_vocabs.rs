//! Tokenizer ids against llama.cpp's own reference vectors: the vocab-only
//! GGUFs of its `models/` directory (`ggml-vocab-NAME.gguf`) with their
//! inputs (`.inp`, separated by `__ggml_vocab_test__` lines) and the ids
//! llama.cpp's `test-tokenizer-0` expects (`.out`, one line per input, no
//! BOS, special tokens not parsed). The SentencePiece ones (Llama 2's and
//! Phi-3's) are fixtures here; `PIE_LLAMA_CPP_VOCABS=DIR` adds every family
//! Pie serves from a llama.cpp checkout's `models/`.

use std::path::{Path, PathBuf};

use pie_model::gguf::GgufFile;
use pie_model::Tokenizer;

const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// Every vocabulary a family Pie serves writes.
const FAMILIES: &[&str] = &["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2"];

/// (input, expected ids) of one vocabulary's vectors.
fn vectors(dir: &Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let read = |ext: &str| {
        let path = dir.join(format!("ggml-vocab-{name}.gguf.{ext}"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let inputs = read("inp");
    let outputs = read("out");
    let inputs: Vec<&str> = inputs
        .strip_suffix(SEPARATOR)
        .unwrap_or(&inputs)
        .split(SEPARATOR)
        .collect();
    let outputs: Vec<Vec<u32>> = outputs
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: inputs and outputs pair up"
    );
    inputs.into_iter().map(String::from).zip(outputs).collect()
}

/// The vectors of `name` in `dir` that Pie's tokenizer gets wrong, as
/// `(input, want, got)`.
fn mismatches(dir: &Path, name: &str) -> Vec<(String, Vec<u32>, Vec<u32>)> {
    let gguf = GgufFile::open(&dir.join(format!("ggml-vocab-{name}.gguf"))).unwrap();
    let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
    vectors(dir, name)
        .into_iter()
        .filter_map(|(text, want)| {
            let mut got = tokenizer.encode(&text).unwrap();
            if tokenizer.bos().is_some() {
                got.remove(0);
            }
            (got != want).then_some((text, want, got))
        })
        .collect()
}

fn check(dir: &Path, names: &[&str]) {
    for name in names {
        let wrong = mismatches(dir, name);
        let total = vectors(dir, name).len();
        eprintln!(
            "{name}: {} of {total} inputs as llama.cpp",
            total - wrong.len()
        );
        for (text, want, got) in wrong.iter().take(5) {
            eprintln!("  {text:?}\n    llama.cpp {want:?}\n    pie       {got:?}");
        }
        assert!(
            wrong.is_empty(),
            "{name}: {} of {total} differ",
            wrong.len()
        );
    }
}

#[test]
fn sentencepiece_vocabularies_tokenize_as_llama_cpp() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    check(&fixtures, &["llama-spm", "phi-3"]);
}

#[test]
fn every_served_family_tokenizes_as_llama_cpp() {
    let Ok(dir) = std::env::var("PIE_LLAMA_CPP_VOCABS") else {
        eprintln!("SKIPPED: PIE_LLAMA_CPP_VOCABS (llama.cpp's models/ directory) is not set");
        return;
    };
    check(Path::new(&dir), FAMILIES);
}
