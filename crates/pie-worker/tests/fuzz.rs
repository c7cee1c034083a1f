//! Property-based fuzzing of the worker's file inputs: `config.toml` (the
//! default file, mutated). No input panics; a config error names the file and
//! the line or key. `PROPTEST_CASES` overrides the case count. (The KV page
//! stream is fuzzed where it is defined, in `pie-kv`.)

use std::path::Path;

use pie_worker::config::{Config, DEFAULT_CONFIG};
use proptest::prelude::*;

#[path = "../../pie-core/tests/support/config_edits.rs"]
mod config_edits;

use config_edits::{apply, edit};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A mutated default config loads, or its error names the file and a line or key.
    #[test]
    fn config_errors_name_file_and_line_or_key(edits in proptest::collection::vec(edit(), 1..4)) {
        let text = edits.iter().fold(DEFAULT_CONFIG.to_string(), |t, e| apply(&t, e));
        if let Err(e) = Config::parse(&text, Path::new("config.toml")) {
            let shown = e.to_string();
            let located = shown.starts_with("config.toml")
                && (e.message.contains("key `") || e.location.starts_with("config.toml:"));
            prop_assert!(located, "{}\n--- from:\n{}", shown, text);
        }
    }
}
