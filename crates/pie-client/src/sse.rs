//! Server-sent events framing: bytes in, `data:` payloads out. Events end at a
//! blank line (`\n\n` or `\r\n\r\n`); a payload spread over several `data:`
//! lines is joined with `\n`; comments (`:`) and other fields are skipped.

/// Incremental parser: feed chunks as they arrive, take whole events' data.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Append `chunk`; return the data of every event it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some((end, sep)) = event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            if let Some(data) = event_data(&String::from_utf8_lossy(&event)) {
                out.push(data);
            }
        }
        out
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

fn event_data(event: &str) -> Option<String> {
    let lines: Vec<&str> = event
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
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
}
