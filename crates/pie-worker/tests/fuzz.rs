//! Property-based fuzzing of the worker's file and wire inputs: `config.toml`
//! (the default file, mutated) and the page framing of `/v1/internal/prefill`
//! (`offload::split_pages`). No input panics; a config error names the file and
//! the line or key; a torn body says what is torn. `PROPTEST_CASES` overrides
//! the case count.

use std::path::Path;

use pie_worker::config::{Config, DEFAULT_CONFIG};
use pie_worker::offload::{join_pages, split_pages};
use proptest::prelude::*;

/// One edit of a config text.
#[derive(Clone, Debug)]
enum Edit {
    DeleteLine(usize),
    DuplicateLine(usize),
    /// Replace what follows `=` on a line.
    Value(usize, String),
    /// Insert text at a byte offset (on a char boundary at or after it).
    Insert(usize, String),
    Truncate(usize),
    /// Drop a line's leading `# ` (the default file comments keys out).
    Uncomment(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let token = prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("\"\"".to_string()),
        Just("[]".to_string()),
        Just("{}".to_string()),
        Just("true".to_string()),
        Just("18446744073709551616".to_string()),
        "\"[a-z-]{0,12}\"",
        ".{0,6}",
    ];
    prop_oneof![
        any::<usize>().prop_map(Edit::DeleteLine),
        any::<usize>().prop_map(Edit::DuplicateLine),
        (any::<usize>(), token.clone()).prop_map(|(l, t)| Edit::Value(l, t)),
        (any::<usize>(), token).prop_map(|(at, t)| Edit::Insert(at, t)),
        any::<usize>().prop_map(Edit::Truncate),
        any::<usize>().prop_map(Edit::Uncomment),
    ]
}

fn apply(text: &str, edit: &Edit) -> String {
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let line = |i: usize| i % lines.len().max(1);
    let boundary = |at: usize| {
        let at = at % (text.len() + 1);
        (at..=text.len())
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(text.len())
    };
    match edit {
        Edit::DeleteLine(i) if !lines.is_empty() => {
            lines.remove(line(*i));
        }
        Edit::DuplicateLine(i) if !lines.is_empty() => {
            let l = lines[line(*i)].clone();
            lines.insert(line(*i), l);
        }
        Edit::Value(i, v) if !lines.is_empty() => {
            let at = line(*i);
            if let Some((key, _)) = lines[at].split_once('=') {
                lines[at] = format!("{key}= {v}");
            }
        }
        Edit::Insert(at, t) => {
            let at = boundary(*at);
            return format!("{}{t}{}", &text[..at], &text[at..]);
        }
        Edit::Truncate(at) => return text[..boundary(*at)].to_string(),
        Edit::Uncomment(i) if !lines.is_empty() => {
            let at = line(*i);
            lines[at] = lines[at].trim_start_matches("# ").to_string();
        }
        _ => {}
    }
    lines.join("\n")
}

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
