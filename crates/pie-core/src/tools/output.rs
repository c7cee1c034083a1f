//! A generated answer read back as text and tool calls, as it streams:
//! [`ToolOutput::push`] gives the text that can go to the client now
//! (holding back what may still turn out to be a call), [`ToolOutput::finish`]
//! the rest and the calls. An answer that does not parse as this format's
//! calls (cut by `max_tokens`, or a free-text model writing half a tag) is
//! returned as text, never dropped.

use serde_json::Value;

use super::format::{
    ToolFormat, GENERIC_RESPONSE_OPENING, HERMES_CLOSE, HERMES_OPEN, LLAMA_PYTHON_TAG,
};

/// One call as OpenAI returns it: the arguments are JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

pub struct ToolOutput {
    format: ToolFormat,
    text: String,
    /// Bytes of `text` (Hermes, Llama 3), or of the generic response's
    /// JSON string body, already given out as text.
    sent: usize,
    /// Where the calls begin in `text` (Hermes, Llama 3), once seen.
    calls_at: Option<usize>,
}

impl ToolOutput {
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            text: String::new(),
            sent: 0,
            calls_at: None,
        }
    }

    /// Adds generated text; returns the text that can be streamed now.
    pub fn push(&mut self, delta: &str) -> String {
        self.text.push_str(delta);
        match self.format {
            ToolFormat::Hermes => self.hermes_text(),
            ToolFormat::Llama3Json => self.llama_text(),
            ToolFormat::Generic => self.generic_text(),
        }
    }

    /// The text not given out yet, and the calls.
    pub fn finish(mut self) -> (String, Vec<ToolCall>) {
        match self.format {
            ToolFormat::Hermes => {
                let at = self.calls_at.unwrap_or(self.text.len());
                match hermes_calls(&self.text[at..]) {
                    Some(calls) => (self.text[self.sent..at].to_string(), calls),
                    None => (self.text[self.sent..].to_string(), Vec::new()),
                }
            }
            ToolFormat::Llama3Json => {
                match self.calls_at.and_then(|at| llama_call(&self.text[at..])) {
                    Some(call) => (String::new(), vec![call]),
                    None => (self.text[self.sent..].to_string(), Vec::new()),
                }
            }
            ToolFormat::Generic => match generic_answer(&self.text) {
                // A compact answer streamed as it came; any other spelling whole.
                Some(GenericAnswer::Text(t)) => {
                    match self.text.starts_with(GENERIC_RESPONSE_OPENING) {
                        true => (self.generic_text(), Vec::new()),
                        false => (t, Vec::new()),
                    }
                }
                Some(GenericAnswer::Calls(calls)) => (String::new(), calls),
                None if self.sent == 0 => (std::mem::take(&mut self.text), Vec::new()),
                // A text answer cut short: what was decoded went out.
                None => (String::new(), Vec::new()),
            },
        }
    }

    fn hermes_text(&mut self) -> String {
        if self.calls_at.is_some() {
            return String::new();
        }
        let unsent = &self.text[self.sent..];
        let until = match unsent.find(HERMES_OPEN) {
            Some(i) => {
                self.calls_at = Some(self.sent + i);
                i
            }
            // Hold back what may be the start of a tag.
            None => unsent.len() - longest_tag_prefix_suffix(unsent),
        };
        let out = unsent[..until].to_string();
        self.sent += until;
        out
    }

    /// A Llama 3 answer is a call when it opens with `{` (or the python
    /// tag), told at its first non-blank character; text streams after.
    fn llama_text(&mut self) -> String {
        if self.calls_at.is_some() {
            return String::new();
        }
        if self.sent == 0 {
            let opening = self.text.trim_start();
            let undecided = opening.is_empty()
                || (LLAMA_PYTHON_TAG.starts_with(opening)
                    && opening.len() < LLAMA_PYTHON_TAG.len());
            if undecided {
                return String::new();
            }
            if opening.starts_with('{') || opening.starts_with(LLAMA_PYTHON_TAG) {
                self.calls_at = Some(self.text.len() - opening.len());
                return String::new();
            }
        }
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }

    fn generic_text(&mut self) -> String {
        let Some(body) = self.text.strip_prefix(GENERIC_RESPONSE_OPENING) else {
            return String::new();
        };
        // Decoded from where the last delta's complete escapes ended.
        let (out, used) = decoded_prefix(&body[self.sent..]);
        self.sent += used;
        out
    }
}

fn longest_tag_prefix_suffix(text: &str) -> usize {
    (1..HERMES_OPEN.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && HERMES_OPEN.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Every `<tool_call>` block of `text` (from the first), or None when one
/// does not parse as a call.
fn hermes_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for block in text.split(HERMES_OPEN).skip(1) {
        // A missing close tag (the model stopped right after the JSON) is forgiven.
        let json = block.split(HERMES_CLOSE).next().unwrap_or(block);
        calls.push(call_of(&serde_json::from_str(json.trim()).ok()?)?);
    }
    (!calls.is_empty()).then_some(calls)
}

/// `{"name": ..., "arguments": {...}}` (Llama-style `parameters` too).
fn call_of(v: &Value) -> Option<ToolCall> {
    let name = v["name"].as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        Some(Value::String(s)) => s.clone(),
        Some(args) => args.to_string(),
        None => "{}".into(),
    };
    Some(ToolCall { name, arguments })
}

fn llama_call(text: &str) -> Option<ToolCall> {
    let json = text.strip_prefix(LLAMA_PYTHON_TAG).unwrap_or(text);
    call_of(&serde_json::from_str(json.trim()).ok()?)
}

enum GenericAnswer {
    Text(String),
    Calls(Vec<ToolCall>),
}

fn generic_answer(text: &str) -> Option<GenericAnswer> {
    let v: Value = serde_json::from_str(text).ok()?;
    if let Some(t) = v["response"].as_str() {
        return Some(GenericAnswer::Text(t.to_string()));
    }
    let calls = match (&v["tool_call"], &v["tool_calls"]) {
        (call @ Value::Object(_), _) => vec![call_of(call)?],
        (_, Value::Array(calls)) => calls.iter().map(call_of).collect::<Option<_>>()?,
        _ => return None,
    };
    Some(GenericAnswer::Calls(calls))
}

/// The decoded text of a JSON string's body as far as it is complete (up
/// to its closing quote, or before an escape that has not fully arrived),
/// and the bytes of `body` it took.
fn decoded_prefix(body: &str) -> (String, usize) {
    let bytes = body.as_bytes();
    let mut end = 0;
    while end < bytes.len() {
        match bytes[end] {
            b'"' => break,
            b'\\' => match escape_len(&bytes[end..]) {
                Some(n) if end + n <= bytes.len() => end += n,
                _ => break,
            },
            _ => end += 1,
        }
    }
    match serde_json::from_str(&format!("\"{}\"", &body[..end])) {
        Ok(text) => (text, end),
        Err(_) => (String::new(), 0),
    }
}

/// The length of the escape at the start of `rest` (a UTF-16 surrogate
/// pair is one), None when it cannot be told yet.
fn escape_len(rest: &[u8]) -> Option<usize> {
    match rest.get(1)? {
        b'u' => {
            let hex = std::str::from_utf8(rest.get(2..6)?).ok()?;
            let unit = u16::from_str_radix(hex, 16).ok()?;
            Some(if (0xD800..0xDC00).contains(&unit) {
                12
            } else {
                6
            })
        }
        _ => Some(2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// Pushes `text` a character at a time; the streamed text and the end.
    fn streamed(format: ToolFormat, text: &str) -> (String, String, Vec<ToolCall>) {
        let mut out = ToolOutput::new(format);
        let mut sent = String::new();
        for c in text.chars() {
            sent.push_str(&out.push(&c.to_string()));
        }
        let (rest, calls) = out.finish();
        (sent, rest, calls)
    }

    /// However the answer is cut into deltas, the text given out and the
    /// calls are those of the whole answer pushed at once, in every format.
    #[test]
    fn the_cut_into_deltas_changes_nothing() {
        use proptest::prelude::*;
        let answers = [
            "Let me look.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"Oslo é\"}}\n</tool_call>",
            "plain text with a < and <tool_ and \u{1F600}",
            "{\"name\": \"w\", \"parameters\": {\"c\": 1}}",
            r#"{"response":"Hi \"you\"\n\u00e9\ud83d\ude00"}"#,
            r#"{"tool_calls":[{"name":"a","arguments":{}},{"name":"b","arguments":{"x":1}}]}"#,
            r#"{"response":"cut sh"#,
        ];
        let whole = |format: ToolFormat, text: &str| {
            let mut out = ToolOutput::new(format);
            let sent = out.push(text);
            let (rest, calls) = out.finish();
            (format!("{sent}{rest}"), calls)
        };
        let formats = [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Generic,
        ];
        proptest!(|(answer in 0..answers.len(), format in 0..3usize, cuts in proptest::collection::vec(0..64usize, 0..12))| {
            let (text, format) = (answers[answer], formats[format]);
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
            bounds.extend([0, text.len()]);
            bounds.sort_unstable();
            let mut out = ToolOutput::new(format);
            let mut sent = String::new();
            for w in bounds.windows(2) {
                sent.push_str(&out.push(&text[w[0]..w[1]]));
            }
            let (rest, calls) = out.finish();
            prop_assert_eq!((format!("{sent}{rest}"), calls), whole(format, text));
        });
    }

    #[test]
    fn hermes_text_streams_and_calls_are_held_back() {
        let answer = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"clock\", \"arguments\": {}}\n</tool_call>";
        let (sent, rest, calls) = streamed(ToolFormat::Hermes, answer);
        assert_eq!(format!("{sent}{rest}"), "Let me look.\n");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0], call("weather", r#"{"city":"Paris"}"#));
        assert_eq!(calls[1].arguments, "{}");
    }

    #[test]
    fn hermes_text_with_a_lone_angle_bracket_is_all_text() {
        let (sent, rest, calls) = streamed(ToolFormat::Hermes, "a <tool b < c <tool_cal");
        assert_eq!(format!("{sent}{rest}"), "a <tool b < c <tool_cal");
        assert!(calls.is_empty());
        let (sent, rest, calls) = streamed(ToolFormat::Hermes, "x <tool_call>{broken");
        assert_eq!(format!("{sent}{rest}"), "x <tool_call>{broken");
        assert!(calls.is_empty());
    }

    #[test]
    fn a_llama_answer_is_a_call_when_it_opens_with_a_brace() {
        let answer = " {\"name\": \"weather\", \"parameters\": {\"unit\": \"c\"}}";
        let (sent, rest, calls) = streamed(ToolFormat::Llama3Json, answer);
        assert_eq!((sent.as_str(), rest.as_str()), ("", ""));
        assert_eq!(calls, vec![call("weather", r#"{"unit":"c"}"#)]);
        let tagged = format!("{LLAMA_PYTHON_TAG}{{\"name\": \"clock\", \"parameters\": {{}}}}");
        assert_eq!(streamed(ToolFormat::Llama3Json, &tagged).2[0].name, "clock");
        let (sent, rest, calls) = streamed(ToolFormat::Llama3Json, "<|pyth it is {sunny}");
        assert_eq!(format!("{sent}{rest}"), "<|pyth it is {sunny}");
        assert!(calls.is_empty());
        let (_, rest, calls) = streamed(ToolFormat::Llama3Json, "{\"name\": \"cut");
        assert_eq!((rest.as_str(), calls.len()), ("{\"name\": \"cut", 0));
    }

    #[test]
    fn a_generic_text_answer_streams_decoded() {
        let answer = r#"{"response":"Hi \"you\"\n\u00e9\ud83d\ude00 done"}"#;
        let (sent, rest, calls) = streamed(ToolFormat::Generic, answer);
        assert_eq!(sent, "Hi \"you\"\né😀 done");
        assert_eq!(rest, "");
        assert!(calls.is_empty());
    }

    #[test]
    fn a_generic_text_answer_spelt_with_spaces_comes_whole_at_the_end() {
        let (sent, rest, calls) = streamed(ToolFormat::Generic, r#"{ "response": "a\tb" }"#);
        assert_eq!((sent.as_str(), rest.as_str()), ("", "a\tb"));
        assert!(calls.is_empty());
    }

    #[test]
    fn generic_calls_come_at_the_end() {
        let one = r#"{"tool_call":{"name":"weather","arguments":{"city":"Oslo"}}}"#;
        let (sent, rest, calls) = streamed(ToolFormat::Generic, one);
        assert_eq!((sent.as_str(), rest.as_str()), ("", ""));
        assert_eq!(calls, vec![call("weather", r#"{"city":"Oslo"}"#)]);
        let two =
            r#"{"tool_calls":[{"name":"a","arguments":{}},{"name":"b","arguments":{"x":1}}]}"#;
        assert_eq!(streamed(ToolFormat::Generic, two).2.len(), 2);
    }

    #[test]
    fn a_cut_generic_answer_is_kept_as_text() {
        let (sent, rest, calls) = streamed(ToolFormat::Generic, r#"{"tool_call":{"name":"wea"#);
        assert_eq!(
            (sent.as_str(), rest.as_str()),
            ("", r#"{"tool_call":{"name":"wea"#)
        );
        assert!(calls.is_empty());
        let (sent, rest, _) = streamed(ToolFormat::Generic, r#"{"response":"Hello wor"#);
        assert_eq!((sent.as_str(), rest.as_str()), ("Hello wor", ""));
    }
}
