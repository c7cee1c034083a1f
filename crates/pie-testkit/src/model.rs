//! The synthesized test model: a tiny random-weights GGUF written by
//! `pie_model::synth`, so every test runs the real loading path.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use pie_model::synth::{write_test_model, SynthSpec};

/// The test model of `seed`, written once per test process (beside the
/// workspace's binaries, under `target/<profile>/tmp`).
pub fn test_model(seed: u64) -> PathBuf {
    static WRITTEN: Mutex<Option<HashMap<u64, PathBuf>>> = Mutex::new(None);
    let mut written = WRITTEN.lock().unwrap_or_else(|e| e.into_inner());
    let written = written.get_or_insert_with(HashMap::new);
    written
        .entry(seed)
        .or_insert_with(|| {
            let path = tmp_dir().join(format!("test-model-{}-{seed}.gguf", std::process::id()));
            let spec = SynthSpec {
                seed,
                ..SynthSpec::default()
            };
            write_test_model(&path, &spec).expect("the test model is written");
            path
        })
        .clone()
}

fn tmp_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .map_or_else(std::env::temp_dir, |profile| profile.join("tmp"));
    std::fs::create_dir_all(&dir).expect("the test directory is writable");
    dir
}
