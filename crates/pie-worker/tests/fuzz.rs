//! Property-based fuzzing of the worker's file and wire inputs: `config.toml`
//! (the default file, mutated) and the page framing of `/v1/internal/prefill`
//! (`offload::split_pages`). No input panics; a config error names the file and
//! the line or key; a torn body says what is torn. `PROPTEST_CASES` overrides
//! the case count.

use std::path::Path;

use pie_worker::config::{Config, DEFAULT_CONFIG};
use pie_worker::offload::{join_pages, split_pages};
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

    /// Any body splits into pages that frame back to it, or is refused as torn.
    #[test]
    fn page_bodies_split_exactly_or_are_torn(
        pages in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..4),
        cut in any::<prop::sample::Index>(),
        noise in proptest::collection::vec(any::<u8>(), 0..12),
    ) {
        let body = join_pages(&pages);
        prop_assert_eq!(split_pages(&body).unwrap(), pages);
        let mut damaged = body[..cut.index(body.len() + 1)].to_vec();
        damaged.extend(&noise);
        match split_pages(&damaged) {
            Ok(split) => prop_assert_eq!(join_pages(&split), damaged),
            Err(why) => prop_assert!(why.starts_with("truncated page"), "{}", why),
        }
    }
}
