//! What a relayed response says it cost, read as it streams through: the last
//! `usage` object (non-streamed responses, streams with
//! `stream_options.include_usage`, the `: pie-usage` comment a Pie worker ends
//! every other stream with, a native process's final status), else the number
//! of chunks with choices as its generated tokens. `queue_order = "fair"`
//! charges clients by it, and `[server] trace_file` records it.

/// How much of the body's end is kept to find the `usage` object in.
const TAIL_BYTES: usize = 512;

const CHOICE: &[u8] = b"\"choices\":[{";
const PROMPT_TOKENS: &str = "\"prompt_tokens\":";
const COMPLETION_TOKENS: &str = "\"completion_tokens\":";

/// A response's tail and its chunks with choices so far.
#[derive(Default)]
pub struct UsageMeter {
    tail: Vec<u8>,
    choice_chunks: usize,
}

impl UsageMeter {
    /// Look at the next piece of the response body; returns the chunks with
    /// choices in it (a streamed token each).
    pub fn observe(&mut self, bytes: &[u8]) -> usize {
        let choices = bytes.windows(CHOICE.len()).filter(|w| *w == CHOICE).count();
        self.choice_chunks += choices;
        self.tail.extend_from_slice(bytes);
        let excess = self.tail.len().saturating_sub(TAIL_BYTES);
        self.tail.drain(..excess);
        choices
    }

    /// Tokens generated, by the best evidence the response gave.
    pub fn output_length(&self) -> usize {
        self.last_number(COMPLETION_TOKENS)
            .unwrap_or(self.choice_chunks)
    }

    /// Prompt tokens, when the response said.
    pub fn prompt_length(&self) -> Option<usize> {
        self.last_number(PROMPT_TOKENS)
    }

    /// The number after the last `key` in the tail.
    fn last_number(&self, key: &str) -> Option<usize> {
        let tail = String::from_utf8_lossy(&self.tail);
        let at = tail.rfind(key)?;
        let digits: String = tail[at + key.len()..]
            .chars()
            .skip_while(|c| c.is_whitespace())
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_wins_over_counting_chunks() {
        let mut m = UsageMeter::default();
        let choices = m.observe(
            br#"{"choices":[{"text":"hi"}],"usage":{"completion_tokens": 17,"prompt_tokens":3}}"#,
        );
        assert_eq!(choices, 1);
        assert_eq!((m.output_length(), m.prompt_length()), (17, Some(3)));
    }

    #[test]
    fn a_stream_without_usage_counts_its_token_chunks() {
        let mut m = UsageMeter::default();
        for _ in 0..5 {
            m.observe(b"data: {\"choices\":[{\"text\":\"a\",\"index\":0}]}\n\n");
        }
        m.observe(b"data: [DONE]\n\n");
        assert_eq!((m.output_length(), m.prompt_length()), (5, None));
    }

    #[test]
    fn a_native_status_gives_its_usage() {
        let mut m = UsageMeter::default();
        m.observe(b"event: status\ndata: {\"state\":\"finished\",\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":9}}\n\n");
        assert_eq!((m.output_length(), m.prompt_length()), (9, Some(40)));
    }
}
