//! Property-based fuzzing of what clients and operators hand `pie-core`: props
//! (`Props::from_json`) and key files (`auth::parse_key_file`). No input
//! panics, and every error names its cause: the prop key, or the line.
//! `PROPTEST_CASES` overrides the case count.

use pie_core::auth::parse_key_file;
use pie_core::props::{KNOWN_PROPS, MAX_KEY_BYTES, MAX_PROPS, MAX_STRING_BYTES};
use pie_core::{PropValue, Props};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

/// Any JSON value, nested a little.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "[a-z]{0,8}".prop_map(Value::String),
        (0usize..1100).prop_map(|n| Value::String("x".repeat(n))),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z]{1,4}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Prop keys: the known ones, plausible ones, and broken ones.
fn prop_key() -> impl Strategy<Value = String> {
    let known: Vec<String> = KNOWN_PROPS.iter().map(|(k, _)| k.to_string()).collect();
    prop_oneof![
        proptest::sample::select(known),
        "[a-z0-9-]{1,10}",
        ".{0,6}",
        (60usize..70).prop_map(|n| "k".repeat(n)),
    ]
}

fn props_object() -> impl Strategy<Value = Value> {
    prop_oneof![
        9 => proptest::collection::vec((prop_key(), json_value()), 0..8)
            .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        1 => (0usize..80).prop_map(|n| {
            Value::Object((0..n).map(|i| (format!("p{i}"), json!(i))).collect())
        }),
        1 => json_value(),
    ]
}

fn valid_key(key: &str) -> bool {
    (1..=MAX_KEY_BYTES).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Accepted props keep every limit; a refusal names the offending key
    /// (or `props` itself) and why.
    #[test]
    fn props_are_within_limits_or_refused_naming_the_key(value in props_object()) {
        match Props::from_json(&value) {
            Ok(props) => {
                prop_assert!(props.len() <= MAX_PROPS);
                for (key, v) in props.iter() {
                    prop_assert!(valid_key(key), "accepted key {:?}", key);
                    if let PropValue::Str(s) = v {
                        prop_assert!(s.len() <= MAX_STRING_BYTES);
                    }
                }
            }
            Err(e) => {
                let named = e.key == "props"
                    || value.as_object().is_some_and(|o| o.contains_key(&e.key));
                prop_assert!(named, "error names no input key: {}", e);
                prop_assert!(!e.reason.is_empty());
                let shown = format!("prop `{}`", e.key);
                prop_assert!(e.to_string().starts_with(&shown), "{}", e);
            }
        }
    }

    /// A key file parses into non-empty names and keys, or the error names a
    /// line that really has no `name key` pair, or the role or limits on it
    /// that are wrong.
    #[test]
    fn key_files_parse_or_name_the_bad_line(
        lines in proptest::collection::vec(
            prop_oneof![
                "[a-z]{1,6} [A-Za-z0-9]{1,12}",
                "[a-z]{1,6}\t +[A-Za-z0-9 ]{0,12}",
                "[a-z]{1,6} sk-[a-z]{1,4} (client|worker|admin|[a-z_]{1,12}=[0-9a-z.\"-]{0,6}|weight=-?[0-9]{1,2})",
                "# .{0,10}",
                "[ \t]{0,3}",
                ".{0,16}",
            ],
            0..8,
        ),
        crlf in any::<bool>(),
    ) {
        let text = lines.join(if crlf { "\r\n" } else { "\n" });
        match parse_key_file(&text) {
            Ok(keys) => {
                for k in keys {
                    prop_assert!(!k.name.is_empty() && !k.key.is_empty(), "{:?}", k);
                    prop_assert!(!k.name.contains(char::is_whitespace), "{:?}", k);
                }
            }
            Err((line, message)) => {
                let bad = text.lines().nth(line.wrapping_sub(1));
                prop_assert!(bad.is_some(), "line {} of {:?}", line, text);
                let words: Vec<&str> = bad.unwrap_or_default().split_whitespace().collect();
                prop_assert!(!words.is_empty(), "an empty line is never an error");
                if words.len() < 2 {
                    prop_assert!(message.contains("name key"), "{}", message);
                } else {
                    // After `name key`: a role or `limit=value` words; the error names which.
                    let named = words[2..].iter().any(|w| {
                        message.contains(&format!("`{w}`")) || w.contains('=') && message.starts_with("limits")
                    });
                    prop_assert!(named, "{} (line {:?})", message, words);
                }
            }
        }
    }
}
