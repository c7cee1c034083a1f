//! Server-sent events framing: bytes in, events (name and `data:` payload) out.
//! Events end at a blank line (`\n\n` or `\r\n\r\n`); a payload spread over
//! several `data:` lines is joined with `\n`; the name is the `event:` field
//! ("message" without one); comments (`:`) and other fields are skipped. Used by
//! `pie bench` and by `pie-controller` for workers' KV event streams.

/// One event with data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    pub name: String,
    pub data: String,
}

/// Incremental parser: feed chunks as they arrive, take whole events.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Append `chunk`; return every event with data it completed.
    pub fn push_events(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some((end, sep)) = event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            if let Some(e) = parse_event(&String::from_utf8_lossy(&event)) {
                out.push(e);
            }
        }
        out
    }

    /// Append `chunk`; return the data of every event it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.push_events(chunk)
            .into_iter()
            .map(|e| e.data)
            .collect()
    }
}

/// Position and length of the first blank-line separator.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    (0..buf.len()).find_map(|i| {
        if buf[i..].starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else if buf[i..].starts_with(b"\n\n") {
            Some((i, 2))
        } else {
            None
        }
    })
}

fn parse_event(event: &str) -> Option<SseEvent> {
    let (mut name, mut data) = ("message", Vec::new());
    for line in event.lines() {
        if let Some(v) = line.strip_prefix("data:") {
            data.push(v.strip_prefix(' ').unwrap_or(v));
        } else if let Some(v) = line.strip_prefix("event:") {
            name = v.trim();
        }
    }
    (!data.is_empty()).then(|| SseEvent {
        name: name.to_string(),
        data: data.join("\n"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_and_separators() {
        let mut p = SseParser::default();
        assert!(
            p.push(b"data: {\"a\"").is_empty(),
            "no event before the blank line"
        );
        assert_eq!(
            p.push(b":1}\n\n: keep-alive\n\ndata: x\r\n"),
            vec!["{\"a\":1}"]
        );
        assert_eq!(p.push(b"\r\ndata: [DONE]\n\n"), vec!["x", "[DONE]"]);
    }

    #[test]
    fn multi_line_data_is_joined() {
        let mut p = SseParser::default();
        assert_eq!(
            p.push(b"event: text\ndata: one\ndata:two\n\n"),
            vec!["one\ntwo"]
        );
    }

    #[test]
    fn events_keep_their_names() {
        let mut p = SseParser::default();
        let events = p.push_events(b"event: kv\ndata: {}\n\ndata: plain\n\n");
        assert_eq!(events[0].name, "kv");
        assert_eq!(events[1].name, "message");
        assert_eq!(events[1].data, "plain");
    }
}
