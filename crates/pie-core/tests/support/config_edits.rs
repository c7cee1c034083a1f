//! Mutations of a config file's text, for the fuzz tests of every binary that
//! reads one (`#[path]`-included by `pie-worker` and `pie-controller` tests).

use proptest::prelude::*;

/// One edit of a config text.
#[derive(Clone, Debug)]
pub enum Edit {
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

pub fn edit() -> impl Strategy<Value = Edit> {
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

pub fn apply(text: &str, edit: &Edit) -> String {
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
