//! Server-sent events framing: bytes in, events (name and `data:` payload) out.
//! Lines end with `\n` or `\r\n`; a blank line ends an event; a payload spread
//! over several `data:` lines is joined with `\n`; the name is the `event:`
//! field ("message" without one); comments (`:`) and other fields are skipped.
//! Used by `pie bench` and by `pie-controller` for workers' KV event streams.
//! [`SseBlocks`] yields whole raw events instead (comments included, bytes as
//! sent, up to and including the blank line): the controller relays those and
//! reads its own comments (`: pie-process`, `: pie-handoff`) from them.
//!
//! Linear time: every byte is looked at once, whatever the chunking. An event
//! (its lines and comments up to the blank line) is capped at `max_event_bytes`
//! so that a stream without blank lines cannot grow the buffer without bound.

use std::fmt;

/// The default cap on one event: a worker's KV snapshot (every cached block
/// hash as a JSON number) is the largest event any Pie stream sends.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 64 << 20;

/// One event with data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    pub name: String,
    pub data: String,
}

/// An event grew past the parser's cap: the stream is not usable any more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseTooLarge {
    pub limit: usize,
}

impl fmt::Display for SseTooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SSE event over the {} byte limit (no blank line ends it)",
            self.limit
        )
    }
}

impl std::error::Error for SseTooLarge {}

/// Incremental parser: feed chunks as they arrive, take whole events.
pub struct SseParser {
    /// The current line, until its `\n`.
    line: Vec<u8>,
    /// The current event's `event:` name and joined `data:` lines.
    name: Option<String>,
    data: Option<String>,
    /// Bytes of the current event so far (complete lines).
    event_bytes: usize,
    max_event_bytes: usize,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::with_limit(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseParser {
    /// A parser refusing events of more than `max_event_bytes`.
    pub fn with_limit(max_event_bytes: usize) -> Self {
        Self {
            line: Vec::new(),
            name: None,
            data: None,
            event_bytes: 0,
            max_event_bytes,
        }
    }

    /// Append `chunk`; return every event with data it completed, or the
    /// error of an event over the cap (the parser then starts afresh).
    pub fn push_events(&mut self, mut chunk: &[u8]) -> Result<Vec<SseEvent>, SseTooLarge> {
        let mut out = Vec::new();
        while !chunk.is_empty() {
            let (piece, rest, ended) = match chunk.iter().position(|&b| b == b'\n') {
                Some(at) => (&chunk[..at], &chunk[at + 1..], true),
                None => (chunk, &[][..], false),
            };
            chunk = rest;
            if self.event_bytes + self.line.len() + piece.len() > self.max_event_bytes {
                *self = Self::with_limit(self.max_event_bytes);
                return Err(SseTooLarge {
                    limit: self.max_event_bytes,
                });
            }
            self.line.extend_from_slice(piece);
            if ended {
                let line = std::mem::take(&mut self.line);
                self.event_bytes += line.len() + 1;
                out.extend(self.end_line(&line));
            }
        }
        Ok(out)
    }

    /// Append `chunk`; return the data of every event it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<String>, SseTooLarge> {
        Ok(self
            .push_events(chunk)?
            .into_iter()
            .map(|e| e.data)
            .collect())
    }

    /// Take one complete line (without its `\n`); a blank one ends the event.
    fn end_line(&mut self, line: &[u8]) -> Option<SseEvent> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            self.event_bytes = 0;
            let name = self.name.take();
            return self.data.take().map(|data| SseEvent {
                name: name.unwrap_or_else(|| "message".into()),
                data,
            });
        }
        let line = String::from_utf8_lossy(line);
        if let Some(v) = line.strip_prefix("data:") {
            let v = v.strip_prefix(' ').unwrap_or(v);
            match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(v);
                }
                None => self.data = Some(v.to_string()),
            }
        } else if let Some(v) = line.strip_prefix("event:") {
            self.name = Some(v.trim().to_string());
        }
        None
    }
}

/// Incremental splitter into raw events, each up to and including the blank
/// line (`\n\n`) that ends it, under the same cap as [`SseParser`]. Bytes
/// already scanned are not scanned again, whatever the chunking.
pub struct SseBlocks {
    buf: Vec<u8>,
    /// Bytes of `buf` already scanned for a blank line.
    scanned: usize,
    max_event_bytes: usize,
}

impl Default for SseBlocks {
    fn default() -> Self {
        Self::with_limit(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseBlocks {
    /// A splitter refusing events of more than `max_event_bytes`.
    pub fn with_limit(max_event_bytes: usize) -> Self {
        Self {
            buf: Vec::new(),
            scanned: 0,
            max_event_bytes,
        }
    }

    /// Append `chunk`; return every event it completed, or the error of an
    /// event over the cap (the splitter then starts afresh).
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, SseTooLarge> {
        self.buf.extend_from_slice(chunk);
        let mut blocks = Vec::new();
        let mut start = 0;
        for end in self.scanned.max(1)..self.buf.len() {
            if end > start && self.buf[end] == b'\n' && self.buf[end - 1] == b'\n' {
                blocks.push(self.buf[start..=end].to_vec());
                start = end + 1;
            }
        }
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        if self.buf.len() > self.max_event_bytes {
            *self = Self::with_limit(self.max_event_bytes);
            return Err(SseTooLarge {
                limit: self.max_event_bytes,
            });
        }
        Ok(blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_and_separators() {
        let mut p = SseParser::default();
        assert!(
            p.push(b"data: {\"a\"").unwrap().is_empty(),
            "no event before the blank line"
        );
        assert_eq!(
            p.push(b":1}\n\n: keep-alive\n\ndata: x\r\n").unwrap(),
            vec!["{\"a\":1}"]
        );
        assert_eq!(
            p.push(b"\r\ndata: [DONE]\n\n").unwrap(),
            vec!["x", "[DONE]"]
        );
    }

    #[test]
    fn multi_line_data_is_joined() {
        let mut p = SseParser::default();
        assert_eq!(
            p.push(b"event: text\ndata: one\ndata:two\n\n").unwrap(),
            vec!["one\ntwo"]
        );
    }

    #[test]
    fn events_keep_their_names() {
        let mut p = SseParser::default();
        let events = p
            .push_events(b"event: kv\ndata: {}\n\ndata: plain\n\n")
            .unwrap();
        assert_eq!(events[0].name, "kv");
        assert_eq!(events[1].name, "message");
        assert_eq!(events[1].data, "plain");
    }

    const STREAM: &[u8] = "event: snapshot\r\ndata: {\"seq\":1}\r\n\r\n: keep-alive\n\ndata: é\ndata:  two\n\nevent: kv\ndata:\n\n".as_bytes();

    fn expected() -> Vec<SseEvent> {
        let e = |name: &str, data: &str| SseEvent {
            name: name.into(),
            data: data.into(),
        };
        vec![
            e("snapshot", "{\"seq\":1}"),
            e("message", "é\n two"),
            e("kv", ""),
        ]
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        for at in 0..=STREAM.len() {
            let mut p = SseParser::default();
            let mut events = p.push_events(&STREAM[..at]).unwrap();
            events.extend(p.push_events(&STREAM[at..]).unwrap());
            assert_eq!(events, expected(), "split at byte {at}");
        }
        let mut p = SseParser::default();
        let bytewise: Vec<SseEvent> = STREAM
            .iter()
            .flat_map(|b| p.push_events(std::slice::from_ref(b)).unwrap())
            .collect();
        assert_eq!(bytewise, expected(), "one byte at a time");
    }

    #[test]
    fn an_event_over_the_cap_is_an_error_naming_the_limit() {
        let mut p = SseParser::with_limit(64);
        assert!(p.push_events(&[b'x'; 40]).unwrap().is_empty());
        let err = p.push_events(&[b'x'; 40]).unwrap_err();
        assert_eq!(err, SseTooLarge { limit: 64 });
        assert!(err.to_string().contains("64 byte limit"), "{err}");
        // Lines of one event count together, whatever their length.
        let mut p = SseParser::with_limit(64);
        let err = p.push_events(&b"data: 0123456789\n".repeat(5)).unwrap_err();
        assert_eq!(err.limit, 64);
        // The parser starts afresh after the error; events under the cap pass.
        assert_eq!(p.push(b"data: ok\n\n").unwrap(), vec!["ok"]);
        let mut p = SseParser::with_limit(64);
        for _ in 0..100 {
            assert_eq!(p.push(b"data: 0123456789\n\n").unwrap().len(), 1);
        }
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// Bytes that are mostly SSE: fields, comments, line ends, and noise.
        fn sse_bytes() -> impl Strategy<Value = Vec<u8>> {
            let piece = prop_oneof![
                Just(b"data: ".to_vec()),
                Just(b"data:".to_vec()),
                Just(b"event: kv".to_vec()),
                Just(b": keep-alive".to_vec()),
                Just(b"\n".to_vec()),
                Just(b"\r\n".to_vec()),
                Just(b"\r".to_vec()),
                "[a-z{}\":, é]{0,8}".prop_map(String::into_bytes),
                proptest::collection::vec(any::<u8>(), 0..6),
            ];
            proptest::collection::vec(piece, 0..40).prop_map(|p| p.concat())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Any input, cut anywhere, parses to the same events as in one piece.
            #[test]
            fn chunking_never_changes_the_events(
                bytes in sse_bytes(),
                cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..5),
            ) {
                let whole = SseParser::default().push_events(&bytes).unwrap();
                let mut at: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
                at.sort_unstable();
                let mut p = SseParser::default();
                let mut pieces = Vec::new();
                let mut start = 0;
                for end in at.into_iter().chain([bytes.len()]) {
                    pieces.extend(p.push_events(&bytes[start..end]).unwrap());
                    start = end;
                }
                prop_assert_eq!(pieces, whole);
            }

            /// Under a small cap every input either parses or names the cap,
            /// and each event it returns fits under the cap.
            #[test]
            fn a_small_cap_errs_naming_the_limit(bytes in sse_bytes(), limit in 1usize..64) {
                let mut p = SseParser::with_limit(limit);
                match p.push_events(&bytes) {
                    Ok(events) => {
                        for e in events {
                            // The cap is on bytes as sent: an invalid byte
                            // reads as U+FFFD, three bytes in `data`.
                            let replaced = e.data.matches('\u{FFFD}').count();
                            let sent_at_least = e.data.len() - 2 * replaced;
                            prop_assert!(sent_at_least <= limit, "{:?} over {}", e, limit);
                        }
                    }
                    Err(e) => {
                        prop_assert_eq!(e.limit, limit);
                        let named = format!("{} byte limit", limit);
                        prop_assert!(e.to_string().contains(&named), "{}", e);
                    }
                }
            }
        }
    }

    #[test]
    fn blocks_split_at_blank_lines_whatever_the_chunking() {
        let stream = b": pie-process p1\n\ndata: {\"a\":1}\n\ndata: [DONE]\n\n";
        let expected = vec![
            b": pie-process p1\n\n".to_vec(),
            b"data: {\"a\":1}\n\n".to_vec(),
            b"data: [DONE]\n\n".to_vec(),
        ];
        for cut in 0..stream.len() {
            let mut blocks = SseBlocks::default();
            let mut out = blocks.push(&stream[..cut]).unwrap();
            out.extend(blocks.push(&stream[cut..]).unwrap());
            assert_eq!(out, expected, "cut at {cut}");
        }
        let mut blocks = SseBlocks::default();
        let bytewise: Vec<Vec<u8>> = stream
            .iter()
            .flat_map(|b| blocks.push(std::slice::from_ref(b)).unwrap())
            .collect();
        assert_eq!(bytewise, expected);
    }

    #[test]
    fn a_block_over_the_cap_is_refused_and_the_splitter_starts_afresh() {
        let mut blocks = SseBlocks::with_limit(8);
        assert_eq!(blocks.push(b"data: 1234").unwrap_err().limit, 8);
        assert_eq!(
            blocks.push(b"data: 1\n\n").unwrap(),
            vec![b"data: 1\n\n".to_vec()]
        );
    }
}
